// Schedule builder: validation, tree selection per operation, stats, task lists, digest.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "schedule/relay_tree.h"
#include "ultracomm/records/schedule.h"
#include "ultracomm/records/window_layout.h"

namespace ultracomm {

using detail::Tree;
using detail::TreeInput;

namespace {

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument("build_schedule: " + msg); }

void validate(const BuildInput& in, int32_t only_rank) {
  const int32_t W = in.world, S = in.slots_per_rank, E = in.num_experts;
  if (W < 1 || W > (1 << 20)) bad("world must be in [1, 2^20], got " + std::to_string(W));
  if (S < 0 || S > 100000) bad("slots_per_rank must be in [0, 100000], got " + std::to_string(S));
  if (E < 0) bad("num_experts must be >= 0, got " + std::to_string(E));
  const int64_t WS = int64_t(W) * S;
  if (int64_t(in.slot_src.size()) != WS)
    bad("slot_src has " + std::to_string(in.slot_src.size()) +
        " entries, expected world*slots_per_rank = " + std::to_string(WS));
  if (int64_t(in.home_of.size()) != E)
    bad("home_of has " + std::to_string(in.home_of.size()) + " entries, expected num_experts = " + std::to_string(E));
  if (!in.node_of.empty() && int64_t(in.node_of.size()) != W)
    bad("node_of has " + std::to_string(in.node_of.size()) + " entries, expected world = " + std::to_string(W));
  if (in.chunk_bytes == 0 || in.chunk_bytes % 16 != 0)
    bad("chunk_bytes must be a positive multiple of 16, got " + std::to_string(in.chunk_bytes));
  if (in.max_depth < 1 || in.max_depth > 65535)
    bad("max_depth must be in [1, 65535], got " + std::to_string(in.max_depth));
  if (in.relay_mode != RelayMode::kAuto && in.relay_mode != RelayMode::kOff && in.relay_mode != RelayMode::kForce)
    bad("relay_mode must be auto, off or force, got " + std::to_string(int(in.relay_mode)));
  if (!(in.intra_bw > 0) || !std::isfinite(in.intra_bw)) bad("intra_bw must be a positive finite number");
  if (!(in.inter_bw > 0) || !std::isfinite(in.inter_bw)) bad("inter_bw must be a positive finite number");
  if (!(in.intra_latency_s >= 0) || !std::isfinite(in.intra_latency_s))
    bad("intra_latency_s must be a finite number >= 0");
  if (!(in.inter_latency_s >= 0) || !std::isfinite(in.inter_latency_s))
    bad("inter_latency_s must be a finite number >= 0");
  if (only_rank < -1 || only_rank >= W)
    bad("only_rank must be -1 or a rank in [0, world), got " + std::to_string(only_rank));
  const uint64_t mx = std::max(in.weight_bytes, in.grad_bytes);
  if (ceil_div(mx, in.chunk_bytes) > uint64_t(std::numeric_limits<int32_t>::max()))
    bad("too many chunks per expert (bytes / chunk_bytes exceeds 2^31)");
  for (int32_t r = 0; r < W && !in.node_of.empty(); ++r)
    if (in.node_of[r] < 0 || in.node_of[r] >= W)
      bad("node_of[" + std::to_string(r) + "] = " + std::to_string(in.node_of[r]) + " is out of range [0, world)");
  for (int32_t e = 0; e < E; ++e)
    if (in.home_of[e] < 0 || in.home_of[e] >= W)
      bad("home_of[" + std::to_string(e) + "] = " + std::to_string(in.home_of[e]) + " is not a rank in [0, " +
          std::to_string(W) + ")");
  for (int32_t r = 0; r < W; ++r) {
    for (int32_t s = 0; s < S; ++s) {
      const int32_t e = in.slot_src[int64_t(r) * S + s];
      if (e == -1) continue;
      auto where = [&] {
        return "slot_src[" + std::to_string(r) + "][" + std::to_string(s) + "] = " + std::to_string(e);
      };
      if (e < -1 || e >= E) bad(where() + ": expert out of range [0, " + std::to_string(E) + ") (or -1 for empty)");
      if (in.home_of[e] == r) bad(where() + ": replica on its home rank " + std::to_string(r));
      for (int32_t s2 = 0; s2 < s; ++s2)
        if (in.slot_src[int64_t(r) * S + s2] == e)
          bad("expert " + std::to_string(e) + " appears twice on rank " + std::to_string(r) + " (slots " +
              std::to_string(s2) + " and " + std::to_string(s) + ")");
    }
  }
}

// Node ids of a tree: replica slots [0, WS) (rank * slots + slot), the homes' master copies
// WS + expert.  The node that filled slot `id` hangs from:
inline int64_t parent_node(const Tree& t, int64_t id, int64_t WS, int32_t S, const int32_t* slot_src) {
  return t.parent_slot[id] == kMaster ? WS + slot_src[id] : int64_t(t.parent_rank[id]) * S + t.parent_slot[id];
}

// The filled slots of `t` by depth (counting sort; slot id ascending within a depth).
void slots_by_depth(const Tree& t, int64_t WS, std::vector<int32_t>& by) {
  std::vector<int32_t> at(t.max_depth + 2, 0);
  for (int64_t id = 0; id < WS; ++id)
    if (t.parent_rank[id] >= 0) at[t.depth[id] + 1]++;
  for (int32_t d = 0; d <= t.max_depth; ++d) at[d + 1] += at[d];
  by.resize(at.back());
  for (int64_t id = 0; id < WS; ++id)
    if (t.parent_rank[id] >= 0) by[at[t.depth[id]]++] = static_cast<int32_t>(id);
}

// Per-rank tier split of the fixed side (every replica slot's incoming edge).
struct SideLoads {
  std::vector<int64_t> fi, fx;  // [world] count of replica slots fed intra / inter
};

void fixed_side(const TreeInput& ti, const Tree& t, SideLoads& out) {
  const int32_t W = ti.world, S = ti.slots;
  out.fi.assign(W, 0);
  out.fx.assign(W, 0);
  if (!ti.multi_node) {
    for (int32_t r = 0, id = 0; r < W; ++r)
      for (int32_t s = 0; s < S; ++s, ++id) out.fi[r] += t.parent_rank[id] >= 0;
    return;
  }
  for (int32_t r = 0, id = 0; r < W; ++r)
    for (int32_t s = 0; s < S; ++s, ++id) {
      const int32_t p = t.parent_rank[id];
      if (p < 0) continue;
      if (ti.node_of[r] == ti.node_of[p])
        out.fi[r]++;
      else
        out.fx[r]++;
    }
}

// Hop profile of a tree's paths: for every depth d present, the most inter-node hops on a
// path from the home to a slot at depth d (index d; -1 where no slot has depth d).
void hop_profile(const BuildInput& in, const TreeInput& ti, const Tree& t, std::vector<int32_t>& out) {
  out.assign(t.max_depth + 1, -1);
  const int64_t WS = int64_t(ti.world) * ti.slots;
  if (!ti.multi_node) {  // every depth 1..max_depth holds a slot (the ancestors of the deepest)
    std::fill(out.begin() + std::min<int32_t>(1, t.max_depth + 1), out.end(), 0);
    return;
  }
  // parents before children, then nx[id] = nx[parent] + crossing
  std::vector<int32_t> by, nx(WS, 0);
  slots_by_depth(t, WS, by);
  for (const int32_t id : by) {
    const int64_t pn = parent_node(t, id, WS, ti.slots, in.slot_src.data());
    nx[id] = (pn >= WS ? 0 : nx[pn]) + (ti.node_of[t.parent_rank[id]] != ti.node_of[ti.rank_of_id[id]]);
    out[t.depth[id]] = std::max(out[t.depth[id]], nx[id]);
  }
}

// A candidate tree with what predicted() needs, computed once per build.
struct Cand {
  const Tree* t = nullptr;
  const SideLoads* f = nullptr;
  int64_t link_intra = 0, link_inter = 0;  // max over ranks of max(parent side, fixed side) per tier
  std::vector<int32_t> hops;               // hop_profile()
};

void make_cand(const BuildInput& in, const TreeInput& ti, const Tree& t, const SideLoads& f, Cand& c) {
  c.t = &t;
  c.f = &f;
  c.link_intra = c.link_inter = 0;
  for (int32_t r = 0; r < ti.world; ++r) {
    c.link_intra = std::max(c.link_intra, std::max<int64_t>(t.load_intra[r], f.fi[r]));
    c.link_inter = std::max(c.link_inter, std::max<int64_t>(t.load_inter[r], f.fx[r]));
  }
  hop_profile(in, ti, t, c.hops);
}

// Link part: max over ranks and tiers of units * bytes / bw (max over ranks first: the same
// value, as x -> x * B / bw is monotone); plus the pipeline fill of the hop profile.
double predicted(const BuildInput& in, const TreeInput& ti, const Cand& c, uint64_t bytes) {
  if (bytes == 0) return 0;
  const double B = double(bytes);
  const double link = std::max(double(c.link_intra) * B / ti.intra_bw, double(c.link_inter) * B / ti.inter_bw);
  const double ch = double(std::min(in.chunk_bytes, bytes));
  const double hi = ch / ti.intra_bw + in.intra_latency_s, hx = ch / ti.inter_bw + in.inter_latency_s;
  double fill = 0;
  for (int32_t d = 1; d < int32_t(c.hops.size()); ++d)
    if (c.hops[d] >= 0) fill = std::max(fill, (d - c.hops[d]) * hi + c.hops[d] * hx);
  return link + fill;
}

// Lower bound on predicted() of any tree of this plan (same cost model).  Every tree has a
// replica one hop away: lower_bound_s + hop.  An expert with n >= 2 replicas whose busiest
// node sends f copies costs at least f*B/bw on that node's link and has depth >= d(f, n), the
// least d with f + f^2 + ... + f^d >= n, on its path fill: min over f of f*B/bw + d(f, n)*hop.
// (bw = intra_bw, or intra_bw + inter_bw with several nodes; hop = the cheaper tier's.)
double tree_bound(const BuildInput& in, const TreeInput& ti, uint64_t bytes, double lb_s) {
  if (bytes == 0 || ti.total_reps == 0) return 0;
  const double B = double(bytes), c = double(std::min(in.chunk_bytes, bytes));
  double hop = c / ti.intra_bw + in.intra_latency_s;
  double bw = ti.intra_bw;
  if (ti.multi_node) {
    hop = std::min(hop, c / ti.inter_bw + in.inter_latency_s);
    bw += ti.inter_bw;
  }
  double best = lb_s + hop;
  // the bound grows with n, so the expert with the most replicas (the first of multi) decides
  const int32_t n = ti.multi.empty() ? 0 : ti.rep_begin[ti.multi[0] + 1] - ti.rep_begin[ti.multi[0]];
  if (n >= 2) {
    double m = std::numeric_limits<double>::infinity();
    for (int64_t fo = 1; fo <= n; ++fo) {
      int64_t d = 0, sum = 0, p = 1;
      while (sum < n) {
        p *= fo;
        sum += p;
        ++d;
      }
      m = std::min(m, double(fo) * B / bw + double(d) * hop);
    }
    best = std::max(best, m);
  }
  return best;
}

// True if the direct tree sends every expert to each remote node at most once.
bool topology_ok(const TreeInput& ti) {
  for (int32_t e = 0; e < ti.num_experts; ++e)
    for (int32_t g = ti.grp_begin[e] + 1; g < ti.grp_begin[e + 1]; ++g)
      if (ti.grp_hi[g] - ti.grp_lo[g] > 1) return false;
  return true;
}

inline uint64_t fnv_word(uint64_t h, uint32_t w) { return (h ^ w) * 0x100000001b3ULL; }
uint64_t fnv_u64(uint64_t h, uint64_t v) { return fnv_word(fnv_word(h, uint32_t(v)), uint32_t(v >> 32)); }
uint64_t fnv_arr(uint64_t h, const int32_t* p, size_t n) {
  h = fnv_u64(h, n);
  for (size_t i = 0; i < n; ++i) h = fnv_word(h, uint32_t(p[i]));
  return h;
}

// What both ops share: the op-independent parts of the lower bound (in experts) and the
// experts homed on the ranks whose task lists are built.
struct Shared {
  int64_t max_fixed = 0;        // most filled slots on one rank (each has one incoming edge)
  int64_t max_once = 0;         // most experts with replicas homed on one rank (sent at least once)
  int64_t max_cross = 0;        // several nodes: max over nodes N of ceil(X_N / |N|) (see schedule.h)
  int32_t r0 = 0, r1 = 0;       // ranks [r0, r1) get task lists
  std::vector<int32_t> hb, hx;  // their experts: hx[hb[r - r0] .. hb[r - r0 + 1]), expert asc
};

void make_shared(const TreeInput& ti, int32_t only_rank, Shared& sh) {
  const int32_t W = ti.world, S = ti.slots, E = ti.num_experts;
  // filled slots per rank: every replica is in rep
  std::vector<int64_t> cnt(W, 0);
  for (int64_t i = 0; i < ti.total_reps; ++i) cnt[ti.rank_of_id[ti.rep[i]]]++;
  for (int32_t r = 0; r < W; ++r) sh.max_fixed = std::max(sh.max_fixed, cnt[r]);
  std::fill(cnt.begin(), cnt.end(), 0);
  for (int32_t e = 0; e < E; ++e)
    if (ti.rep_begin[e + 1] > ti.rep_begin[e]) cnt[ti.home_of[e]]++;
  for (int32_t r = 0; r < W; ++r) sh.max_once = std::max(sh.max_once, cnt[r]);
  if (ti.multi_node) {
    std::vector<int64_t> cin(ti.num_nodes, 0), cout_(ti.num_nodes, 0);
    std::vector<int32_t> mark(ti.num_nodes, -1);
    for (int32_t e = 0; e < E; ++e) {
      const int32_t hn = ti.node_of[ti.home_of[e]];
      for (int32_t i = ti.rep_begin[e]; i < ti.rep_begin[e + 1]; ++i) {
        const int32_t nd = ti.node_of[ti.rep[i] / S];
        if (nd == hn || mark[nd] == e) continue;
        mark[nd] = e;
        cin[nd]++;
        cout_[hn]++;
      }
    }
    for (int32_t n = 0; n < ti.num_nodes; ++n) {
      if (ti.node_size[n] == 0) continue;
      const int64_t x = std::max(cin[n], cout_[n]);
      sh.max_cross = std::max(sh.max_cross, (x + ti.node_size[n] - 1) / ti.node_size[n]);
    }
  }
  sh.r0 = only_rank >= 0 ? only_rank : 0;
  sh.r1 = only_rank >= 0 ? only_rank + 1 : W;
  const int32_t nr = sh.r1 - sh.r0;
  sh.hb.assign(nr + 1, 0);
  for (int32_t e = 0; e < E; ++e)
    if (ti.home_of[e] >= sh.r0 && ti.home_of[e] < sh.r1) sh.hb[ti.home_of[e] - sh.r0 + 1]++;
  for (int32_t r = 0; r < nr; ++r) sh.hb[r + 1] += sh.hb[r];
  sh.hx.resize(sh.hb[nr]);
  std::vector<int32_t> at(sh.hb.begin(), sh.hb.end() - 1);
  for (int32_t e = 0; e < E; ++e)
    if (ti.home_of[e] >= sh.r0 && ti.home_of[e] < sh.r1) sh.hx[at[ti.home_of[e] - sh.r0]++] = e;
}

// Children of every node of a tree (CSR, children by slot id = (rank, slot) order); built once
// per tree, shared by the ops that pick it.
struct Children {
  const Tree* of = nullptr;
  std::vector<int32_t> cb, ch;  // node n: ch[cb[n] .. cb[n + 1])
};

void children(const BuildInput& in, const TreeInput& ti, const Tree& t, Children& c) {
  if (c.of == &t) return;
  c.of = &t;
  const int64_t WS = int64_t(ti.world) * ti.slots, N = WS + ti.num_experts;
  const int32_t* src = in.slot_src.data();
  c.cb.assign(N + 1, 0);
  for (int64_t id = 0; id < WS; ++id)
    if (t.parent_rank[id] >= 0) c.cb[parent_node(t, id, WS, ti.slots, src) + 1]++;
  for (int64_t i = 0; i < N; ++i) c.cb[i + 1] += c.cb[i];
  c.ch.resize(c.cb[N]);
  std::vector<int32_t> at(c.cb.begin(), c.cb.end() - 1);
  for (int64_t id = 0; id < WS; ++id)
    if (t.parent_rank[id] >= 0) c.ch[at[parent_node(t, id, WS, ti.slots, src)]++] = static_cast<int32_t>(id);
}

// Fills one op from its tree: parents, stats, task lists.
void fill_op(const BuildInput& in, const TreeInput& ti, const Cand& cd, const Children& kids, const Shared& sh, Op op,
             uint64_t bytes, OpSchedule& o) {
  const Tree& t = *cd.t;
  const SideLoads& f = *cd.f;
  const int32_t W = ti.world, S = ti.slots, E = ti.num_experts;
  const int64_t WS = int64_t(W) * S;
  const bool mc = op == Op::kMulticast;
  o.parent_rank = t.parent_rank;
  o.parent_slot = t.parent_slot;
  o.depth = t.depth;
  o.bytes = bytes;
  o.chunks = ceil_div(bytes, in.chunk_bytes);
  o.max_depth = t.max_depth;
  o.relayed = t.relayed;
  // loads: the parent side is egress for multicast, ingress for reduce
  std::vector<uint64_t>& pside = mc ? o.egress : o.ingress;
  std::vector<uint64_t>& pinter = mc ? o.inter_egress : o.inter_ingress;
  std::vector<uint64_t>& fside = mc ? o.ingress : o.egress;
  std::vector<uint64_t>& finter = mc ? o.inter_ingress : o.inter_egress;
  pside.resize(W);
  pinter.resize(W);
  fside.resize(W);
  finter.resize(W);
  for (int32_t r = 0; r < W; ++r) {
    pside[r] = uint64_t(t.load_intra[r] + t.load_inter[r]) * bytes;
    pinter[r] = uint64_t(t.load_inter[r]) * bytes;
    fside[r] = uint64_t(f.fi[r] + f.fx[r]) * bytes;
    finter[r] = uint64_t(f.fx[r]) * bytes;
  }
  // lower bound
  uint64_t lb = std::max(uint64_t(sh.max_fixed) * bytes, uint64_t(sh.max_once) * bytes);
  lb = std::max(lb, ceil_div(uint64_t(ti.total_reps) * bytes, uint64_t(W)));
  o.lower_bound_bytes = lb;
  if (!ti.multi_node) {
    o.lower_bound_s = double(lb) / ti.intra_bw;
  } else {
    o.lower_bound_s =
        std::max(double(lb) / (ti.intra_bw + ti.inter_bw), double(sh.max_cross) * double(bytes) / ti.inter_bw);
  }
  o.predicted_s = predicted(in, ti, cd, bytes);
  o.tree_lower_bound_s = tree_bound(in, ti, bytes, o.lower_bound_s);

  const std::vector<int32_t>& cb = kids.cb;
  const std::vector<int32_t>& ch = kids.ch;
  // senders per rank
  o.num_tasks.assign(W, 0);
  for (int64_t id = 0; id < WS; ++id)
    if (cb[id + 1] > cb[id]) o.num_tasks[id / S] += int64_t(o.chunks);
  for (int32_t e = 0; e < E; ++e)
    if (cb[WS + e + 1] > cb[WS + e]) o.num_tasks[ti.home_of[e]] += int64_t(o.chunks);
  o.tasks.assign(W, {});
  o.refs.assign(W, {});
  if (o.chunks == 0) return;
  // levels: multicast = depth of the sender (homes 0); reduce = height (leaves 0)
  std::vector<int32_t> height;
  if (!mc) {
    height.assign(WS + E, 0);
    std::vector<int32_t> by;
    slots_by_depth(t, WS, by);
    for (auto it = by.rbegin(); it != by.rend(); ++it) {
      const int64_t pn = parent_node(t, *it, WS, S, in.slot_src.data());
      height[pn] = std::max(height[pn], height[*it] + 1);
    }
  }
  auto level = [&](int64_t node) -> uint64_t {
    if (!mc) return uint64_t(height[node]);
    return node < WS ? uint64_t(t.depth[node]) : 0;
  };
  const uint8_t kind = static_cast<uint8_t>(mc ? TaskKind::kCopy : TaskKind::kReduce);
  std::vector<uint64_t> keys;
  std::vector<Task> tmpl;
  for (int32_t r = sh.r0; r < sh.r1; ++r) {
    keys.clear();
    // key: level (16) | expert (31) | slot + 1 (17)
    for (int32_t i = sh.hb[r - sh.r0]; i < sh.hb[r - sh.r0 + 1]; ++i) {
      const int32_t e = sh.hx[i];
      if (cb[WS + e + 1] > cb[WS + e]) keys.push_back((level(WS + e) << 48) | (uint64_t(e) << 17));
    }
    for (int32_t s = 0; s < S; ++s) {
      const int64_t id = int64_t(r) * S + s;
      if (cb[id + 1] > cb[id]) keys.push_back((level(id) << 48) | (uint64_t(in.slot_src[id]) << 17) | uint64_t(s + 1));
    }
    std::sort(keys.begin(), keys.end());
    std::vector<Ref>& refs = o.refs[r];
    std::vector<Task>& tasks = o.tasks[r];
    tmpl.resize(keys.size());
    size_t nref = 0;
    for (size_t k = 0; k < keys.size(); ++k) {
      const int32_t slot = int32_t(keys[k] & 0x1ffff) - 1;
      const int32_t e = int32_t((keys[k] >> 17) & 0x7fffffff);
      const int64_t node = slot < 0 ? WS + e : int64_t(r) * S + slot;
      Task& tk = tmpl[k];
      tk = Task{};
      tk.kind = kind;
      tk.level = static_cast<uint16_t>(keys[k] >> 48);
      tk.expert = e;
      tk.ref_begin = static_cast<int32_t>(nref);
      tk.ref_count = cb[node + 1] - cb[node];
      tk.self = Ref{r, slot};
      nref += tk.ref_count;
    }
    refs.resize(nref);
    Ref* rp = refs.data();
    for (size_t k = 0; k < keys.size(); ++k) {
      const Task& tk = tmpl[k];
      const int64_t node = tk.self.slot < 0 ? WS + tk.expert : int64_t(r) * S + tk.self.slot;
      for (int32_t j = cb[node]; j < cb[node + 1]; ++j) *rp++ = Ref{ch[j] / S, ch[j] % S};
    }
    tasks.resize(keys.size() * o.chunks);
    Task* tp = tasks.data();
    for (uint64_t c = 0; c < o.chunks; ++c) {
      const uint64_t off = c * in.chunk_bytes;
      const uint64_t len = std::min(in.chunk_bytes, bytes - off);
      for (size_t k = 0; k < tmpl.size(); ++k, ++tp) {
        *tp = tmpl[k];
        tp->chunk = static_cast<int32_t>(c);
        tp->offset = off;
        tp->bytes = len;
      }
    }
  }
}

}  // namespace

Schedule build_schedule(const BuildInput& in, int32_t only_rank) {
  validate(in, only_rank);
  const int32_t W = in.world;
  std::vector<int32_t> zeros;
  const int32_t* node_of = in.node_of.data();
  if (in.node_of.empty()) {
    zeros.assign(W, 0);
    node_of = zeros.data();
  }
  // per-thread buffers, reused build after build (prepare() and direct_tree() reset them)
  static thread_local TreeInput ti;
  detail::prepare(W, in.slots_per_rank, in.num_experts, in.slot_src.data(), in.home_of.data(), node_of, in.intra_bw,
                  in.inter_bw, ti);
  static thread_local Tree direct;
  detail::direct_tree(ti, direct);
  Shared sh;
  make_shared(ti, only_rank, sh);
  // one node: predicted() of a tree is max(k, fixed) * B / bw + depth * hop, which lets the
  // search skip depth limits that cannot beat the trees it has
  detail::Pick pick;
  pick.ops = kNumOps;
  pick.fixed = sh.max_fixed;
  for (int op = 0; op < kNumOps; ++op) {
    const uint64_t bytes = op == 0 ? in.weight_bytes : in.grad_bytes;
    if (bytes == 0) continue;
    pick.unit[op] = double(bytes) / ti.intra_bw;
    pick.hop[op] = double(std::min(in.chunk_bytes, bytes)) / ti.intra_bw + in.intra_latency_s;
  }
  std::vector<Tree> cands;
  const bool force = in.relay_mode == RelayMode::kForce;
  // force mode raises max_depth 1 to 2 (a relay tree needs depth 2; documented in schedule.h)
  if (force)
    cands = detail::relay_candidates(ti, std::max(2, in.max_depth), true, direct, &pick);
  else if (in.relay_mode == RelayMode::kAuto)
    cands = detail::relay_candidates(ti, in.max_depth, false, direct, &pick);

  // candidate list in depth order: direct first (auto/off), then relay trees shallowest first
  // With several nodes, direct competes in auto only if it already crosses to each remote node
  // at most once per expert (else it is the fallback when no relay tree qualifies).
  std::vector<const Tree*> pool;
  for (const Tree& c : cands)
    if (force || (ti.multi_node ? c.t <= direct.t : c.max_load <= direct.max_load)) pool.push_back(&c);
  if (pool.empty() || (!force && !(ti.multi_node && in.relay_mode == RelayMode::kAuto && !topology_ok(ti))))
    pool.insert(pool.begin(), &direct);
  // fixed side: on one node every filled slot is fed intra, the same for every tree
  std::vector<SideLoads> fl(ti.multi_node ? pool.size() : 1);
  std::vector<Cand> cd(pool.size());
  for (size_t i = 0; i < pool.size(); ++i) {
    if (ti.multi_node || i == 0) fixed_side(ti, *pool[i], fl[ti.multi_node ? i : 0]);
    make_cand(in, ti, *pool[i], fl[ti.multi_node ? i : 0], cd[i]);
  }

  Schedule out;
  out.input = in;
  if (out.input.node_of.empty()) out.input.node_of = zeros;
  out.built_for = only_rank;
  Children kids;
  for (int op = 0; op < kNumOps; ++op) {
    const uint64_t bytes = op == 0 ? in.weight_bytes : in.grad_bytes;
    size_t best = 0;
    double best_t = predicted(in, ti, cd[0], bytes);
    for (size_t i = 1; i < pool.size(); ++i) {
      const double p = predicted(in, ti, cd[i], bytes);
      if (p < best_t) {
        best_t = p;
        best = i;
      }
    }
    children(in, ti, *pool[best], kids);
    fill_op(in, ti, cd[best], kids, sh, static_cast<Op>(op), bytes, op == 0 ? out.multicast : out.reduce);
  }

  uint64_t h = 0xcbf29ce484222325ULL;
  h = fnv_u64(h, uint64_t(W));
  h = fnv_u64(h, uint64_t(in.slots_per_rank));
  h = fnv_u64(h, uint64_t(in.num_experts));
  h = fnv_u64(h, in.weight_bytes);
  h = fnv_u64(h, in.grad_bytes);
  h = fnv_u64(h, in.chunk_bytes);
  h = fnv_u64(h, uint64_t(int64_t(in.relay_mode)));
  h = fnv_u64(h, uint64_t(int64_t(in.max_depth)));
  uint64_t bw;
  static_assert(sizeof(double) == 8);
  std::memcpy(&bw, &in.intra_bw, 8);
  h = fnv_u64(h, bw);
  std::memcpy(&bw, &in.inter_bw, 8);
  h = fnv_u64(h, bw);
  std::memcpy(&bw, &in.intra_latency_s, 8);
  h = fnv_u64(h, bw);
  std::memcpy(&bw, &in.inter_latency_s, 8);
  h = fnv_u64(h, bw);
  h = fnv_arr(h, in.slot_src.data(), in.slot_src.size());
  h = fnv_arr(h, in.home_of.data(), in.home_of.size());
  h = fnv_arr(h, out.input.node_of.data(), out.input.node_of.size());
  for (const OpSchedule* o : {&out.multicast, &out.reduce}) {
    h = fnv_arr(h, o->parent_rank.data(), o->parent_rank.size());
    h = fnv_arr(h, o->parent_slot.data(), o->parent_slot.size());
  }
  out.digest = h;
  return out;
}

}  // namespace ultracomm
