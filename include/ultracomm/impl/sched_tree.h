// One candidate tree of the schedule builder on one warp (sched_build.h includes this after the
// layout; see its comment for the tree rule).  The warp's lanes initialise the tree and sort each
// expert's targets (rank by counting under a total order); lane 0 walks the breadth-first hang,
// a short pointer walk over the warp's own area, between warp barriers.
#pragma once
#include <cstdint>

#include "ultracomm/impl/sched_build.h"

namespace ultracomm::psched {

// Hangs targets[0, n) (sorted by the caller) under senders[0, ns) breadth first; a sender is a
// slot id (or -1 - home for a master).  Targets become senders themselves, except those in
// [gw_lo, gw_hi) (gateways: they must not feed their home's node).  Returns the new sender
// count, or -1 if some target finds no sender with capacity within depth D.  One lane.
UC_INLINE int32_t hang(const Problem& p, const Work& w, int64_t WS, int32_t ns, int32_t n, int32_t gw_lo, int32_t gw_hi,
                       int32_t D) {
  const int32_t S = p.slots;
  int32_t* t = w.tree;
  int32_t at = 0;  // the shallowest sender that may still have capacity (senders only fill up)
  for (int32_t i = 0; i < n; ++i) {
    const int32_t id = w.targets[i];
    bool found = false;
    int32_t snd = 0, srank = 0, sdepth = 0;
    while (at < ns) {
      snd = w.senders[at];
      srank = snd < 0 ? -1 - snd : snd / S;
      sdepth = snd < 0 ? 0 : t[2 * WS + snd];
      if (w.rem[srank] > 0) {
        found = true;
        break;
      }
      ++at;
    }
    if (!found || sdepth + 1 > D) return -1;
    w.rem[srank]--;
    t[id] = srank;
    t[WS + id] = snd < 0 ? kMaster : snd % S;
    t[2 * WS + id] = sdepth + 1;
    if (i < gw_lo || i >= gw_hi) w.senders[ns++] = id;
  }
  return ns;
}

// Sorts targets[first, n) by (spare capacity of the rank desc, slot id asc) on the warp: each
// target's position is the number of targets before it in that total order.
template <class Sub>
UC_INLINE void sort_targets(const Problem& p, const Work& w, int32_t first, int32_t n, const Sub& s) {
  if (n - first <= 1) return;
  const int32_t S = p.slots;
  for (int32_t i = first + s.lane(); i < n; i += s.width()) {
    const int32_t x = w.targets[i], rx = w.rem[x / S];
    int32_t pos = first;
    for (int32_t j = first; j < n; ++j) {
      const int32_t y = w.targets[j], ry = w.rem[y / S];
      pos += (ry > rx || (ry == rx && y < x)) ? 1 : 0;
    }
    w.tmp[pos] = x;
  }
  s.sync();
  for (int32_t i = first + s.lane(); i < n; i += s.width()) w.targets[i] = w.tmp[i];
  s.sync();
}

// One expert without topology: its replicas under the home's master.
template <class Sub>
UC_INLINE bool hang_flat(const Problem& p, const View& v, const Work& w, int32_t e, int32_t D, const Sub& s) {
  const int64_t WS = int64_t(p.world) * p.slots;
  const int32_t b = v.rep_begin[e], n = v.rep_begin[e + 1] - b, h = p.home_of[e];
  if (s.lane() == 0) {
    w.rem[h]++;  // the duty kept for this expert
    w.senders[0] = -1 - h;
  }
  for (int32_t i = s.lane(); i < n; i += s.width()) w.targets[i] = v.rep[b + i];
  s.sync();
  sort_targets(p, w, 0, n, s);
  if (s.lane() == 0) w.words[0] = hang(p, w, WS, 1, n, 0, 0, D) >= 0 ? 1 : 0;
  s.sync();
  return w.words[0] != 0;  // lane 0 writes it again only after the next expert's barriers
}

// One expert with topology: gateways per remote node, then each node under its gateway.
template <class Sub>
UC_INLINE bool hang_topo(const Problem& p, const View& v, const Work& w, int32_t e, int32_t D, const Sub& s) {
  const int32_t S = p.slots;
  const int64_t WS = int64_t(p.world) * S;
  const int32_t b = v.rep_begin[e], n = v.rep_begin[e + 1] - b, h = p.home_of[e];
  if (s.lane() == 0) {
    w.rem[h]++;
    w.senders[0] = -1 - h;
    // gateways: per remote node its replica with the most spare capacity, then lowest id
    const int32_t hn = p.node_of[h];
    int32_t m = 0;
    for (int32_t i = 0; i < n; ++i) {
      const int32_t id = v.rep[b + i], nd = p.node_of[id / S];
      if (nd == hn) {
        w.targets[m++] = id;
        continue;
      }
      const int32_t g = w.gateway[nd];
      if (g < 0 || w.rem[id / S] > w.rem[g / S] || (w.rem[id / S] == w.rem[g / S] && id < g)) w.gateway[nd] = id;
    }
    // gateways first (they lead deeper subtrees); each group is sorted below
    int32_t ng = 0;
    for (int32_t i = 0; i < n; ++i) {
      const int32_t id = v.rep[b + i];
      if (w.gateway[p.node_of[id / S]] == id) {
        for (int32_t j = m + ng; j > ng; --j) w.targets[j] = w.targets[j - 1];
        w.targets[ng++] = id;
      }
    }
    w.words[1] = m;
    w.words[2] = ng;
  }
  s.sync();
  const int32_t m = w.words[1], ng = w.words[2];
  sort_targets(p, w, 0, ng, s);
  sort_targets(p, w, ng, m + ng, s);
  if (s.lane() == 0) {
    // gateways first; if that fails, the home node's replicas first (gateways may then hang below them)
    bool ok = hang(p, w, WS, 1, m + ng, 0, ng, D) >= 0;
    if (!ok && ng > 0 && m > 0) {
      int32_t* t = w.tree;
      for (int32_t i = 0; i < m + ng; ++i) {  // undo: free the capacity the edges took
        const int32_t id = w.targets[i];
        if (t[id] >= 0) w.rem[t[id]]++;
        t[id] = -1;
        t[WS + id] = -1;
        t[2 * WS + id] = 0;
      }
      for (int32_t i = 0; i < m + ng; ++i) w.senders[i] = w.targets[i];  // rotate gateways to the end
      for (int32_t i = 0; i < m + ng; ++i) w.targets[i] = w.senders[i < m ? ng + i : i - m];
      w.senders[0] = -1 - h;
      ok = hang(p, w, WS, 1, m + ng, m, m + ng, D) >= 0;
    }
    w.words[0] = ok ? 1 : 0;
  }
  s.sync();
  if (w.words[0] == 0) return false;
  // each remote node: the rest of its replicas under its gateway's subtree (nodes touch disjoint
  // ranks, so the order nodes are taken in does not matter)
  for (int32_t i = 0; i < n; ++i) {
    const int32_t gid = v.rep[b + i], nd = p.node_of[gid / S];
    if (w.gateway[nd] != gid) continue;  // the same on every lane: nobody writes gateway here
    if (s.lane() == 0) {
      int32_t c = 0;
      for (int32_t j = 0; j < n; ++j) {
        const int32_t id = v.rep[b + j];
        if (id != gid && p.node_of[id / S] == nd) w.targets[c++] = id;
      }
      w.words[3] = c;
    }
    s.sync();
    sort_targets(p, w, 0, w.words[3], s);
    if (s.lane() == 0) {
      w.senders[0] = gid;
      w.words[0] = hang(p, w, WS, 1, w.words[3], 0, 0, D) >= 0 ? 1 : 0;
    }
    s.sync();
    if (w.words[0] == 0) return false;
  }
  s.sync();  // every lane has read gateway[] before lane 0 clears it
  if (s.lane() == 0)
    for (int32_t i = 0; i < n; ++i) w.gateway[p.node_of[v.rep[b + i] / S]] = -1;
  return true;
}

// Builds the tree of capacity L, depth limit D into w.tree on the warp; false (on every lane) if
// it does not exist this way.
template <class Sub>
UC_INLINE bool build_tree(const Problem& p, const View& v, const Work& w, int32_t L, int32_t D, bool topo, int32_t nx,
                          const Sub& s) {
  const int32_t W = p.world;
  const int64_t WS = int64_t(W) * p.slots;
  int32_t* t = w.tree;
  for (int64_t id = s.lane(); id < WS; id += s.width()) {
    t[id] = -1;
    t[WS + id] = -1;
    t[2 * WS + id] = 0;
  }
  int64_t neg = 0;
  for (int32_t r = s.lane(); r < W; r += s.width()) {
    w.rem[r] = L - v.duty[r];
    neg |= w.rem[r] < 0 ? 1 : 0;
    w.gateway[r] = -1;
  }
  if (s.max(neg)) return false;  // a barrier: the tree and rem are initialised
  for (int32_t k = 0; k < nx; ++k) {
    const int32_t e = v.order[k];
    const bool ok = topo ? hang_topo(p, v, w, e, D, s) : hang_flat(p, v, w, e, D, s);
    if (!ok) return false;
  }
  return true;
}

}  // namespace ultracomm::psched
