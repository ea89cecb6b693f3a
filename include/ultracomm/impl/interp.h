// The task protocol (task.h), written once: compiled by g++ for the host movers and by nvcc
// for the persistent kernel.  Templated on a Mover (below): how a group of threads claims
// work, syncs, reads/writes a flag and moves bytes.  All protocol decisions live here; a
// mover decides none.  No exceptions, strings or allocation: a failure fills an ErrorRecord
// (mover.fail) and every function returns false so the caller unwinds.
//
// A driver runs, for one rank and one operation:
//   join(v, m)       one group, once, before or while the others claim tasks;
//   run_tasks(v, m)  every group, concurrently: claims tiles of tasks (list order) until none is left;
//   drain(v, m)      one group, once, after every group's run_tasks returned and only if no
//                    group failed (so a task's timeout is reported, not the drain's).
#pragma once
#include <concepts>
#include <cstdint>
#include "ultracomm/records/error_record.h"
#include "ultracomm/records/exec_view.h"
#include "ultracomm/records/half.h"
#include "ultracomm/records/hd.h"
#include "ultracomm/records/task.h"
#include "ultracomm/records/window_layout.h"

namespace ultracomm::interp {

// Grad element types of a reduction: fp32 accumulation, load/store convert.
struct GradF32 {
  using T = float;
  UC_INLINE static float load(float x) { return x; }
  UC_INLINE static float store(float x) { return x; }
};
struct GradBF16 {
  using T = uint16_t;
  UC_INLINE static float load(uint16_t x) { return detail::bf16_to_f32(x); }
  UC_INLINE static uint16_t store(float x) { return detail::f32_to_bf16(x); }
};
struct GradF16 {
  using T = uint16_t;
  UC_INLINE static float load(uint16_t x) { return detail::f16_to_f32(x); }
  UC_INLINE static uint16_t store(float x) { return detail::f32_to_f16(x); }
};

// Sources of one reduce segment, in summation order: srcs[i] is the address of source i's
// bytes at the segment (peer grad slot + segment offset).  Computed on use, so a mover
// needs no array of kMaxRefs addresses.
struct RefAddrs {
  const Ref* refs;
  const uintptr_t* bases;  // window bases
  uint64_t off;            // grads_off + segment offset within the slot
  uint64_t stride;         // grad_stride
  int32_t count;
  UC_INLINE uintptr_t operator[](int32_t i) const {
#if defined(ULTRACOMM_MUTATE_REVERSE_ORDER)  // mutation test: sum the sources backwards
    const Ref r = refs[count - 1 - i];
#else
    const Ref r = refs[i];
#endif
    return bases[r.rank] + off + stride * static_cast<uint64_t>(r.slot);
  }
};

// Ranks whose "joined with our digest" a group remembers for the rest of a launch (a bit each;
// higher ranks are checked every time).
constexpr int32_t kPeerCacheRanks = 1024;

// Destinations one copy call writes (the ready ones of a task, read once, written n times).
constexpr int kMaxCopyDsts = 8;

// The mover policy.  "group-collective": every thread of the group calls it, same order.
template <class M>
concept Mover =
    requires(M m, const M cm, uintptr_t a, uint64_t u, uint32_t s, ErrorRecord r, const uintptr_t* p, RefAddrs srcs) {
      { cm.leader() } -> std::same_as<bool>;                            // the thread that loads/stores flags
      { m.sync() };                                                     // group barrier
      { m.template broadcast<uint64_t>(u) } -> std::same_as<uint64_t>;  // leader's value to all
      { m.claim() } -> std::same_as<int64_t>;                           // next work unit (tile) index; -1 once aborted
      { m.retire(a, s) } -> std::same_as<bool>;                         // leader only: one tile of a task done (below)
      { m.load_acquire(a) } -> std::same_as<uint64_t>;                  // leader only, system scope
      { m.load_relaxed(a) } -> std::same_as<uint64_t>;                  // leader only, system scope: a poll
      { m.store_release(a, u) };                                        // leader only, system scope
      { m.peer_known(1) } -> std::same_as<bool>;                        // leader only: peer's plan verified this launch
      { m.set_peer_known(1) };                                          // leader only (ranks >= kPeerCacheRanks: no-op)
      { m.fence_release() };                                            // leader only: orders what came before ...
      { m.store_after_fence(a, u) };                                    // ... these flag stores (one fence, N flags)
      { m.now_ns() } -> std::same_as<uint64_t>;                         // leader only
      { m.relax(s) };                                                   // leader only: backoff in a spin
      { m.aborted() } -> std::same_as<bool>;                            // leader only: another group failed
      { m.fail(r) };                                                    // leader only: first failure wins
      { m.after_acquire() };                                            // before reading what a peer published
      { m.first_below(a, u, u) } -> std::same_as<uint64_t>;             // group-collective flag scan (below)
      { m.copy(p, 1, a, u) };                                           // one segment to n destinations
      { m.before_release() };                                           // copies complete+visible before release
      { m.template reduce<GradF32>(a, srcs, 1, u) };                    // dst = D(f32(dst) + srcs[0] + ...)
    };

// Mover::first_below(flags, n, epoch): the n consecutive 8-byte flags at `flags`, each read once
// by some thread of the group (strided shares, polls: no acquire per flag on the device); the
// smallest index whose flag is below `epoch` (not arrived, as leader_wait counts it), or n when
// every one is up.  Returning n, it has acquired every flag: what they publish is visible to
// every thread of the group (after after_acquire, as after a wait).  Flags only grow within an
// epoch, so an index it returns was below when read, and one it passed stays up.
//
// Mover::retire(counter, tiles): adds one to the uint32 at `counter` (acq_rel: every earlier
// tile's copies, complete at its before_release, happen before the last one's release); true in
// the worker that retired the task's last tile, which also stores 0 back (nobody else touches
// the counter again in this run, so the next run finds it zero).

// ---------------------------------------------------------------------------------------
// tiles: the unit a worker claims.  A task's chunk [offset, offset + bytes) is split into
// tiles of v.tile_bytes (the last one shorter); the claim counter numbers the tiles of the
// whole list in list order, tiles_per_chunk(v) units per task (unit u: tile u % T of task
// u / T; a short chunk's missing tiles are claimed and skipped), so any worker may take any
// tile and the chunk stays the unit a receiver waits for: the worker that retires a task's
// last tile (per-task counter v.tile_done[task]) releases it, as the task's one worker did
// when a task was one tile.  A reduce tile covers a byte range and adds every source for it,
// in list order: each element is still summed in the schedule's order by one worker.

// Every task is one tile: tiles off, or none shorter than a chunk (task bytes <= chunk_bytes).
UC_INLINE bool whole_chunks(const ExecView& v) {
  return v.tile_done == nullptr || v.tile_bytes == 0 || v.tile_bytes >= v.layout.chunk_bytes;
}
// Units per task (T): a whole chunk's tiles (task bytes <= chunk_bytes).
UC_INLINE uint64_t tiles_per_chunk(const ExecView& v) {
  return whole_chunks(v) ? 1 : ceil_div(v.layout.chunk_bytes, v.tile_bytes);
}
// Tiles that hold bytes of task t (<= T).
UC_INLINE uint64_t tiles_of(const ExecView& v, const Task& t) {
  return whole_chunks(v) || t.bytes <= v.tile_bytes ? 1 : ceil_div(t.bytes, v.tile_bytes);
}
// Work units of the list: what the claim counter hands out before it runs dry.
UC_INLINE uint64_t num_units(const ExecView& v) { return static_cast<uint64_t>(v.num_tasks) * tiles_per_chunk(v); }

// One claimed tile: bytes [offset, offset + bytes) of its task's chunk, one of `count`.
struct Tile {
  uint64_t offset;
  uint64_t bytes;
  uint64_t count;
};

// ---------------------------------------------------------------------------------------
// addresses

UC_INLINE uintptr_t slot_addr(const ExecView& v, int32_t rank, int32_t slot) {
  return v.window_bases[rank] + (v.op == Op::kMulticast ? v.layout.weight_slot(slot) : v.layout.grad_slot(slot));
}
UC_INLINE uintptr_t own_flag(const ExecView& v, uint64_t off) { return v.window_bases[v.rank] + off; }
UC_INLINE int32_t parent_of(const ExecView& v, int32_t slot) {
  return v.slot_parent != nullptr && v.slot_parent[slot] >= 0 ? v.slot_parent[slot] : -1;
}

// Address of the self operand (master member or own slot) at slot-layout offset lo in member m.
UC_INLINE uintptr_t self_addr(const ExecView& v, const Task& t, int32_t m, uint64_t lo) {
  if (t.self.slot == kMaster) {
    const int64_t li = v.local_index_of[t.expert];
    return v.master_ptrs[li * v.num_members + m] + (lo - v.member_off[m]);
  }
  return slot_addr(v, v.rank, t.self.slot) + lo;
}

// fn(m, lo, hi) for every member m intersecting [offset, offset + bytes), in member order.
template <class Fn>
UC_INLINE void for_each_segment(const ExecView& v, uint64_t offset, uint64_t bytes, Fn&& fn) {
  const uint64_t end = offset + bytes;
  for (int32_t m = 0; m < v.num_members; ++m) {
    const uint64_t lo = offset > v.member_off[m] ? offset : v.member_off[m];
    const uint64_t mend = v.member_off[m] + v.member_bytes[m];
    const uint64_t hi = end < mend ? end : mend;
    if (lo < hi) fn(m, lo, hi);
  }
}

UC_INLINE ErrorRecord what(const ExecView& v, uint32_t flag_kind, int64_t task, int32_t expert, int64_t chunk,
                           int32_t slot, int32_t peer) {
  ErrorRecord r = make_error_record(kOk, v.rank, static_cast<uint8_t>(v.op), v.epoch);
  r.flag_kind = flag_kind;
  r.task = task;
  r.expert = expert;
  r.chunk = static_cast<int32_t>(chunk);
  r.slot = slot;
  r.peer = peer;
  return r;
}

// ---------------------------------------------------------------------------------------
// waits (the leader spins, the group learns the outcome by broadcast)

// Leader: kOk, or (recorded with m.fail) kDigestMismatch / kRejected when `peer` published
// ready[op] == epoch with another digest than ours.  A peer still waiting on this rank cannot
// leave the epoch, so ready == epoch means the digest is this epoch's -- except where the
// peer raises `settled` (a flag of ours, nonzero) and then may start its next operation of this
// kind between our two loads: a digest seen after that is the next op's.  The peer released
// `settled` before writing it, so our acquire of the digest makes the raised flag visible.
template <class M, class What>
UC_HD uint32_t check_peer_plan(const ExecView& v, M& m, int32_t peer, uintptr_t settled, What&& describe) {
  const uintptr_t base = v.window_bases[peer];
  const uint64_t ready = m.load_acquire(base + v.layout.ready_flag(v.op));
  if (ready != v.epoch) return kOk;
  const uint64_t d = m.load_acquire(base + v.layout.digest_word(v.op));
  if (d == v.digest) return kOk;
  if (settled != 0 && m.load_acquire(settled) >= v.epoch) return kOk;
  ErrorRecord rec = describe();
  rec.code = d == kRejectedDigest ? kRejected : kDigestMismatch;
  rec.peer = peer;
  rec.observed = d;
  rec.expected = v.digest;
  rec.peer_ready = ready;
  m.fail(rec);
  return rec.code;
}

// Leader, inside a spin: does the peer's plan look like ours?  Relaxed loads (no acquire in a
// poll loop: on the GPU each one invalidates the whole L1), so a stale digest may look wrong;
// false only sends the caller to check_peer_plan, whose acquires decide.
template <class M>
UC_HD bool peer_plan_looks_ok(const ExecView& v, M& m, int32_t peer) {
  const uintptr_t base = v.window_bases[peer];
  return m.load_relaxed(base + v.layout.ready_flag(v.op)) != v.epoch ||
         m.load_relaxed(base + v.layout.digest_word(v.op)) == v.digest;
}

// Leader: spin until *flag >= epoch.  `watch` (>= 0) is the rank expected to raise the flag
// (or the flag's owner): while waiting its plan digest is checked, after a success too if
// check_after, and at a timeout its ready[op] is recorded (< epoch: it never started this op).
// check_after is for flags the peer raises at its join (ready, grad_ready): it then waits on this
// rank, so it cannot move on; without it the flag is one the peer raises for us (arrival,
// consumed) and may leave the epoch after, which check_peer_plan's `settled` accounts for.
// The first look is one acquire; the spin polls relaxed and, once the epoch is seen, acquires
// the flag once (the value cannot go back: one writer per epoch, epochs only grow).  The inner
// loop holds only relaxed loads; a suspect digest, an abort or the deadline leave it.
template <class M, class What>
UC_HD uint32_t leader_wait(const ExecView& v, M& m, uintptr_t flag, int32_t watch, bool check_after, What&& describe) {
  uint64_t seen = m.load_acquire(flag);
  if (seen < v.epoch) {
    const uint64_t t0 = m.now_ns();
    const uint64_t deadline = v.timeout_ns > ~uint64_t(0) - t0 ? ~uint64_t(0) : t0 + v.timeout_ns;
    uint32_t spin = 0;
    for (;;) {
      bool suspect = false;
      for (;; ++spin) {
        m.relax(spin);
        seen = m.load_relaxed(flag);
        if (seen >= v.epoch || m.aborted() || m.now_ns() >= deadline) break;
        if (watch >= 0 && !m.peer_known(watch) && !peer_plan_looks_ok(v, m, watch)) {
          suspect = true;
          break;
        }
      }
      if (seen >= v.epoch) {
        seen = m.load_acquire(flag);  // the one acquire: what the flag publishes is visible
        break;
      }
      if (m.aborted()) return kAborted;
      if (suspect) {
        const uint32_t st = check_peer_plan(v, m, watch, check_after ? 0 : flag, describe);
        if (st != kOk) return st;
        ++spin;
        continue;  // a stale digest, or a peer that settled this flag and moved on: keep polling
      }
      ErrorRecord rec = describe();
      rec.code = kTimeout;
      rec.observed = seen;
      if (watch >= 0) rec.peer_ready = m.load_acquire(v.window_bases[watch] + v.layout.ready_flag(v.op));
      m.fail(rec);
      return kTimeout;
    }
  }
  // Once per launch and peer: a flag raised at or after the peer's join (check_after) with the
  // peer's ready == epoch and our digest means the peer stays in this op while this rank has
  // work for it (it waits on this rank), so later waits of this group skip the check.
  if (!check_after || watch < 0 || m.peer_known(watch)) return kOk;
  const uint32_t st = check_peer_plan(v, m, watch, 0, describe);
  if (st == kOk) m.set_peer_known(watch);
  return st;
}

// Group-collective wait; true when the flag reached the epoch (and the group may read what it
// publishes), false when this group must stop (failure recorded, or another group failed).
template <class M, class What>
UC_HD bool wait_flag(const ExecView& v, M& m, uintptr_t flag, int32_t watch, bool check_after, What&& describe) {
  uint64_t st = kOk;
  if (m.leader()) st = leader_wait(v, m, flag, watch, check_after, describe);
  st = m.broadcast(st);
  if (st != kOk) return false;
  m.after_acquire();
  return true;
}

// ---------------------------------------------------------------------------------------
// tasks

// Cheap bounds guard (the host validated every task already): a task outside its slot
// must never move a byte, also where no host validation ran.
template <class M>
UC_HD bool task_in_bounds(const ExecView& v, M& m, const Task& t, int64_t ti) {
  const uint64_t sb = v.layout.slot_bytes(v.op);
  const bool ok = t.chunk >= 0 && static_cast<uint64_t>(t.chunk) < v.layout.chunks(v.op) && t.offset < sb &&
                  t.bytes <= sb - t.offset && t.bytes <= v.layout.chunk_bytes && t.ref_begin >= 0 && t.ref_count >= 0 &&
                  t.ref_begin <= v.num_refs - t.ref_count;
  if (!ok && m.leader()) {
    ErrorRecord rec = what(v, kFlagNone, ti, t.expert, t.chunk, t.self.slot, -1);
    rec.code = kBadTask;
    m.fail(rec);
  }
  return ok;
}

// Leader: wait until destination refs[0] joined (ready[kMulticast] == epoch, same digest), then
// take the following destinations that have joined already, up to kMaxCopyDsts.  Returns how
// many, 0 to stop.  Joined-only batching keeps today's progress rule: a destination that never
// joins does not hold back the ones before it.
template <class M>
UC_HD int32_t leader_gather_joined(const ExecView& v, M& m, const Task& t, int64_t ti, const Ref* refs, int32_t left) {
  const auto joined = [&](int32_t j) {
    const Ref d = refs[j];
    if (m.peer_known(d.rank)) return uint32_t(kOk);  // joined with our digest: checked once per launch
    return leader_wait(v, m, v.window_bases[d.rank] + v.layout.ready_flag(Op::kMulticast), d.rank, true,
                       [&] { return what(v, kFlagReady, ti, t.expert, t.chunk, d.slot, d.rank); });
  };
  if (joined(0) != kOk) return 0;
  int32_t n = 1;
  while (n < left && n < kMaxCopyDsts &&
         (m.peer_known(refs[n].rank) ||
          m.load_relaxed(v.window_bases[refs[n].rank] + v.layout.ready_flag(Op::kMulticast)) >= v.epoch)) {
    if (joined(n) != kOk) return 0;  // joined: one acquire, and only the digest check can fail here
    ++n;
  }
  return n;
}

template <class M>
UC_HD void copy_to(const ExecView& v, M& m, const Task& t, const Tile& tile, const Ref* dsts, int32_t n) {
  // constant-bound loops (UC_UNROLL): the arrays stay in registers on the device
  uintptr_t base[kMaxCopyDsts];
  UC_UNROLL for (int32_t j = 0; j < kMaxCopyDsts; ++j) base[j] = j < n ? slot_addr(v, dsts[j].rank, dsts[j].slot) : 0;
  for_each_segment(v, tile.offset, tile.bytes, [&](int32_t mem, uint64_t lo, uint64_t hi) {
    uintptr_t d[kMaxCopyDsts];
    UC_UNROLL for (int32_t j = 0; j < kMaxCopyDsts; ++j) d[j] = base[j] + lo;
    m.copy(d, n, self_addr(v, t, mem, lo), hi - lo);
  });
}

// One system fence, then the flag stores to every destination (not a release fence per flag).
template <class M>
UC_HD void release_arrivals(const ExecView& v, M& m, const Task& t, const Ref* dsts, int32_t n) {
  if (!m.leader()) return;
  m.fence_release();
  for (int32_t j = 0; j < n; ++j)
    m.store_after_fence(v.window_bases[dsts[j].rank] + v.layout.arrival_flag(dsts[j].slot, t.chunk), v.epoch);
}

#if defined(ULTRACOMM_MUTATE_RELEASE_BEFORE_COPY)  // mutation test: flag before the data
constexpr bool kMutReleaseBeforeCopy = true;
#else
constexpr bool kMutReleaseBeforeCopy = false;
#endif
#if defined(ULTRACOMM_MUTATE_RELEASE_EACH_TILE)  // mutation test: every tile's worker releases the chunk
constexpr bool kMutReleaseEachTile = true;
#else
constexpr bool kMutReleaseEachTile = false;
#endif

// Leader, after the group's before_release of a tile of a split task: true where this tile was
// the task's last (this worker then releases the chunk).
template <class M>
UC_HD bool retire_tile(const ExecView& v, M& m, int64_t ti, const Tile& tile) {
  const bool last = m.retire(reinterpret_cast<uintptr_t>(v.tile_done + ti), static_cast<uint32_t>(tile.count));
  return last || kMutReleaseEachTile;
}

// Copy tile: a relay first waits for its own chunk; then, per batch of joined destinations,
// copy every member segment of the tile.  A task of one tile releases each batch's arrival
// flags after that batch's copies (the joined-only progress rule); a split task's tiles each
// copy to every destination, and the worker retiring the last tile releases them all (one
// fence, then the flags).
template <class M>
UC_HD bool run_copy(const ExecView& v, M& m, const Task& t, int64_t ti, const Tile& tile) {
#if !defined(ULTRACOMM_MUTATE_RELAY_WAIT)  // mutation test: forward without waiting for the chunk
  if (t.self.slot >= 0) {
    const int32_t parent = parent_of(v, t.self.slot);
    if (!wait_flag(v, m, own_flag(v, v.layout.arrival_flag(t.self.slot, t.chunk)), parent, false,
                   [&] { return what(v, kFlagArrival, ti, t.expert, t.chunk, t.self.slot, parent); }))
      return false;
  }
#endif
  const Ref* refs = v.refs + t.ref_begin;
  const bool split = tile.count > 1;
  for (int32_t k = 0; k < t.ref_count;) {
    int32_t n = 0;
    if (m.leader()) n = leader_gather_joined(v, m, t, ti, refs + k, t.ref_count - k);
    n = static_cast<int32_t>(m.broadcast(static_cast<uint64_t>(n)));
    if (n == 0) return false;
    m.after_acquire();
    if constexpr (kMutReleaseBeforeCopy) release_arrivals(v, m, t, refs + k, n);
    copy_to(v, m, t, tile, refs + k, n);
    if (!split) {
      m.before_release();
      if constexpr (!kMutReleaseBeforeCopy) release_arrivals(v, m, t, refs + k, n);
    }
    k += n;
  }
  if (split) {
    m.before_release();
    if (m.leader() && retire_tile(v, m, ti, tile) && !kMutReleaseBeforeCopy)
      release_arrivals(v, m, t, refs, t.ref_count);
  }
  return true;
}

// Reduce tile: wait for every source's chunk (and check its plan), then, over the tile's bytes,
// self = D(f32(self) + src_0 + src_1 ...) in list order; then the worker of the task's last
// tile (its only one if it has one) releases consumed at each source and, for a relay's
// partial, grad_ready of its own slot.
template <class M, class D>
UC_HD bool run_reduce(const ExecView& v, M& m, const Task& t, int64_t ti, const Tile& tile) {
  const Ref* refs = v.refs + t.ref_begin;
  for (int32_t k = 0; k < t.ref_count; ++k) {
    const Ref s = refs[k];
    if (!wait_flag(v, m, v.window_bases[s.rank] + v.layout.grad_ready_flag(s.slot, t.chunk), s.rank, true,
                   [&] { return what(v, kFlagGradReady, ti, t.expert, t.chunk, s.slot, s.rank); }))
      return false;
  }
  for_each_segment(v, tile.offset, tile.bytes, [&](int32_t mem, uint64_t lo, uint64_t hi) {
    const RefAddrs srcs{refs, v.window_bases, v.layout.grads_off + lo, v.layout.grad_stride, t.ref_count};
    m.template reduce<D>(self_addr(v, t, mem, lo), srcs, t.ref_count, (hi - lo) / sizeof(typename D::T));
  });
  m.before_release();
  if (m.leader() && (tile.count == 1 || retire_tile(v, m, ti, tile))) {
    m.fence_release();
    for (int32_t k = 0; k < t.ref_count; ++k)
      m.store_after_fence(v.window_bases[refs[k].rank] + v.layout.consumed_flag(refs[k].slot, t.chunk), v.epoch);
    if (t.self.slot >= 0) m.store_after_fence(own_flag(v, v.layout.grad_ready_flag(t.self.slot, t.chunk)), v.epoch);
  }
  return true;
}

// Claims tiles in list order until none is left.  False if this group stopped on a failure.
template <class M, class D>
UC_HD bool run_tasks(const ExecView& v, M& m) {
  const uint64_t per = tiles_per_chunk(v);
  for (;;) {
    const int64_t u = m.claim();
    if (u < 0) return false;
    const int64_t ti = per == 1 ? u : static_cast<int64_t>(static_cast<uint64_t>(u) / per);
    if (ti >= v.num_tasks) return true;
    const Task& t = v.tasks[ti];
    if (!task_in_bounds(v, m, t, ti)) return false;
    const uint64_t k = static_cast<uint64_t>(u) - static_cast<uint64_t>(ti) * per;  // tile k of the task
    const uint64_t count = tiles_of(v, t);
    if (k >= count) continue;  // a short chunk has fewer tiles
    Tile tile{t.offset, t.bytes, count};
    if (count > 1) {
      tile.offset = t.offset + k * v.tile_bytes;
      tile.bytes = k + 1 < count ? v.tile_bytes : t.bytes - k * v.tile_bytes;
    }
    const bool ok = v.op == Op::kMulticast ? run_copy(v, m, t, ti, tile) : run_reduce<M, D>(v, m, t, ti, tile);
    if (!ok) return false;
  }
}

// The same, with the grad dtype taken from the view (one instantiation per dtype).
template <class M>
UC_HD bool run_tasks(const ExecView& v, M& m) {
  switch (v.grad_dtype) {
    case 1:
      return run_tasks<M, GradBF16>(v, m);
    case 2:
      return run_tasks<M, GradF16>(v, m);
    default:
      return run_tasks<M, GradF32>(v, m);
  }
}

// ---------------------------------------------------------------------------------------
// join and drain

// Leader: publish grad_ready (all chunks) of every own non-empty slot that is not a relay's
// (a relay's is raised by its reduce task, after its partial).  Slots are scanned 64 at a
// time against the task list (no per-slot storage).
template <class M>
UC_HD void publish_leaf_grads(const ExecView& v, M& m) {
  const int32_t slots = v.layout.slots;
  m.fence_release();  // once: the flags below publish nothing written after the join's stores
  for (int32_t s0 = 0; s0 < slots; s0 += 64) {
    uint64_t relay = 0;
    for (int64_t i = 0; i < v.num_tasks; ++i) {
      const int32_t s = v.tasks[i].self.slot;
      if (s >= s0 && s < s0 + 64) relay |= uint64_t(1) << (s - s0);
    }
    for (int32_t s = s0; s < slots && s < s0 + 64; ++s) {
      if (v.my_slots[s] < 0 || (relay >> (s - s0)) & 1) continue;
      for (uint64_t c = 0; c < v.layout.grad_chunks; ++c)
        m.store_after_fence(own_flag(v, v.layout.grad_ready_flag(s, static_cast<int64_t>(c))), v.epoch);
    }
  }
}

// Group-collective.  Publishes this op's digest, then ready[op] = epoch (release: a peer that
// sees the epoch sees the digest), then for reduce the leaves' grad_ready flags.
template <class M>
UC_HD void join(const ExecView& v, M& m) {
  if (m.leader()) {
    m.store_release(own_flag(v, v.layout.digest_word(v.op)), v.digest);
    m.store_release(own_flag(v, v.layout.ready_flag(v.op)), v.epoch);
    if (v.op == Op::kReduce) publish_leaf_grads(v, m);
  }
  m.sync();
}

// Group-collective.  Waits until every own non-empty slot has all chunks arrived (multicast)
// or consumed by its parent (reduce).  False on a failure.  A slot's chunk flags are
// consecutive words: the whole group scans them at once (first_below); only a chunk not yet up
// is waited for as a task waits (wait_flag: timeout, abort, plan checks and the same error
// record as a wait per chunk), then the scan goes on after it.  Every chunk up: one scan.
template <class M>
UC_HD bool drain(const ExecView& v, M& m) {
  const bool mc = v.op == Op::kMulticast;
  const uint64_t nchunks = v.layout.chunks(v.op);
  for (int32_t s = 0; s < v.layout.slots; ++s) {
    const int32_t e = v.my_slots[s];
    if (e < 0) continue;
    const int32_t parent = parent_of(v, s);
    const auto flag_off = [&](int64_t ci) { return mc ? v.layout.arrival_flag(s, ci) : v.layout.consumed_flag(s, ci); };
    for (uint64_t c = 0;;) {
      c += m.first_below(own_flag(v, flag_off(static_cast<int64_t>(c))), nchunks - c, v.epoch);
      if (c >= nchunks) break;
      const int64_t ci = static_cast<int64_t>(c);
      if (!wait_flag(v, m, own_flag(v, flag_off(ci)), parent, false,
                     [&] { return what(v, mc ? kFlagArrival : kFlagConsumed, -1, e, ci, s, parent); }))
        return false;
      ++c;
    }
    m.after_acquire();
  }
  return true;
}

// A rank that rejected its plan for this op: publish kRejectedDigest with ready[op] = epoch so
// that every peer touching this rank raises kRejected at once instead of timing out.
template <class M>
UC_HD void publish_rejection(const ExecView& v, M& m) {
  if (m.leader()) {
    m.store_release(own_flag(v, v.layout.digest_word(v.op)), kRejectedDigest);
    m.store_release(own_flag(v, v.layout.ready_flag(v.op)), v.epoch);
  }
  m.sync();
}

}  // namespace ultracomm::interp
