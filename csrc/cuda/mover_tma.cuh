// TmaMover: the sm_90+ device mover.  A segment's 16-byte-aligned body is read ONCE from global
// memory into a shared-memory stage with a bulk load (cp.async.bulk, completion counted on
// the stage's mbarrier) and written to each destination with one bulk store per destination
// (read once, write N).  A ring of stages pipelines loads ahead of stores (mover_limits.h: 6 x
// 32 KB, 4 loads = 128 KB in flight; 3 stages where two CTAs share an SM); the ring runs on
// across segments and tasks.  The leader thread issues every bulk copy; the rest of the CTA
// moves the unaligned tail through the vector path meanwhile.  Reductions are the vector
// path's register hunks (fp32 in registers, one writer per element), or, in TmaMover<true>
// (the kernels a launch with kReduceStaged runs: run option reduce_path="tma"), TMA-staged: the
// operands of a segment's 16-B aligned body reach shared memory by bulk loads through the same
// ring (reduce_staged).  A template parameter, not a run-time flag: a flag held through the
// kernel's loop cost the register hunks of the default kernels their load grouping at the
// 128-register cap (fp16: 8 loads in flight before the first add instead of 12).
//
// Ordering (GPU_NOTES.md):
//   after_acquire:   fence.proxy.async.global by the leader, so its bulk loads see what the
//                    peer published under the flag it just acquired (relay forwarding).
//   before_release:  cp.async.bulk.wait_group 0 by the leader (stores complete) + __syncthreads
//                    (vector-path stores of the other threads), then the leader's release.
//   stage reuse:     per stage: a load refills a stage once the ONE bulk group that last read
//                    it is done reading (cp.async.bulk.wait_group.read N, N = the groups
//                    committed after it), not once the previous tile's stores are.
//   staged reduce:   every thread waits on the stage's mbarrier (the bulk load's complete_tx
//                    makes the bytes visible to the threads that observe the phase), reads it
//                    with ld.shared, and a __syncthreads after each stage frees it; the leader
//                    then fences (fence.proxy.async.shared::cta: the generic reads before the
//                    bulk write) and refills it.  Before a segment's first load the leader waits
//                    for earlier bulk stores to finish reading the ring and fences global memory
//                    (fence.proxy.async.global: generic writes it saw -- dst written by this CTA,
//                    peer data acquired -- before its bulk reads).  dst gets plain 16-B stores,
//                    complete at before_release's barrier as in the register path.
#pragma once
#include "mover_common.cuh"

namespace ultracomm::dev {

// The launch's dynamic shared memory (TmaMover's ring starts at its base), named through an
// extern __shared__ array of its own: every such declaration starts at the region's base.  Used
// where the staged reduce addresses the ring, so that nvcc knows the address space (LDS.128
// rather than a generic LD through an integer address) and keeps no pointer in a register.
__device__ __forceinline__ unsigned char* ring_base() {
  extern __shared__ __align__(128) unsigned char uc_dynamic_smem[];
  return uc_dynamic_smem;
}

// reduce_hunk.h Buf of the staged reduce: the 16-byte pack at byte `off` of the ring.
struct SharedIo {
  __device__ __forceinline__ static detail::Pack16 load(uintptr_t off) {
    const uint4 v = *reinterpret_cast<const uint4*>(ring_base() + off);
    detail::Pack16 p;
    memcpy(&p, &v, 16);
    return p;
  }
};

// Staged reduce geometry: a thread owns kStagedPacks 16-B packs of a sub-tile (fp32
// accumulators: 8 floats of fp32 grads, 16 of bf16/fp16; 4 packs spilled the sm_90 16-bit
// kernels at the 128-register cap), so a sub-tile is 256 x 2 x 16 = 8 KB and a 32 KB ring stage
// holds a fill of four operands (one mbarrier, four bulk loads).  Bytes in flight do not depend
// on it: they are the ring's.
constexpr int kStagedPacks = 2;
constexpr uint32_t kStagedSub = static_cast<uint32_t>(kThreads) * kStagedPacks * 16u;
constexpr int kStagedPerFill = static_cast<int>(gpu::kTmaTileBytes / kStagedSub);
static_assert(gpu::kTmaTileBytes % kStagedSub == 0 && kStagedPerFill >= 2, "a ring stage holds whole sub-tiles");

// Staged: reductions through the staged path (reduce_staged) where the segment allows it.
template <bool Staged = false>
class TmaMover : public MoverBase {
 public:
  static constexpr uint32_t kTileBytes = gpu::kTmaTileBytes;
  static constexpr int kMaxStages = gpu::kTmaStages;
  // dynamic shared memory of the deep ring: stages (128-B aligned) then one mbarrier per stage;
  // a launch may give less (gpu::tma_smem_bytes(kTmaStagesShared)): the ring is what it gets.
  static constexpr uint32_t kSmemBytes = gpu::tma_smem_bytes(kMaxStages);
  static_assert(kMaxStages <= 32, "one parity bit per stage in phase_");

  // Group-collective (constructor runs in every thread): the stage count follows the launch's
  // dynamic shared memory (%dynamic_smem_size); the leader initialises the stage barriers; the
  // barrier makes them visible before any thread can reach a bulk copy.  Under two stages the
  // mover copies through the vector path only.
  // flags: persistent_args.h (kForceVector: no bulk copy at all, the staged reduce included).
  // dyn_smem is the dynamic region's base.
  __device__ TmaMover(const MoverEnv& env, GroupShared* sh, unsigned char* dyn_smem, uint32_t flags)
      : MoverBase(env, sh), stage_(dyn_smem) {
    stages_ = ring_stages();
    lag_ = stages_ > 2u * gpu::kTmaStoreGroups ? gpu::kTmaStoreGroups : 1u;
    full_ = reinterpret_cast<uint64_t*>(dyn_smem + stages_ * kTileBytes);
    use_bulk_ = (flags & kForceVector) == 0 && stages_ >= 2;
    if (leader() && use_bulk_)
      for (uint32_t s = 0; s < stages_; ++s) bar_init(&full_[s], 1);
    __syncthreads();
  }

  __device__ void after_acquire() {
    if (leader()) fence_async_global();
  }

  // Group-collective.  Bulk copies need 16-B aligned addresses and sizes: the body goes bulk
  // when the source and every destination are 16-B aligned; the rest (< 16 B, or everything
  // when misaligned) goes through the vector path.
  __device__ void copy(const uintptr_t* dsts, int ndst, uintptr_t src, uint64_t bytes) {
    if (ndst <= 0) return;
    dsts = stage_dsts(dsts, ndst);
    uintptr_t x = src;
    for (int d = 0; d < ndst; ++d) x |= dsts[d];
    const uint64_t body = (use_bulk_ && (x & 15) == 0) ? (bytes & ~uint64_t(15)) : 0;
    if (body && leader()) bulk_copy(dsts, ndst, src, body);
    vec_copy(dsts, ndst, src, bytes, body);
  }

  __device__ void before_release() {
    if (leader()) bulk_wait_all();
    __syncthreads();
  }

  // Group-collective.  The register hunks (vec_reduce), or, in TmaMover<true>, the staged path
  // where the segment allows it (the decision depends only on values every thread has).
  template <class D, class Srcs>
  __device__ void reduce(uintptr_t dst, const Srcs& srcs, int nsrc, uint64_t nelem) {
    const auto table = stage_srcs(srcs, nsrc);
    if constexpr (Staged) {
      if (use_bulk_ && reduce_staged<D>(dst, table, nsrc, nelem)) return;
    }
    vec_reduce<D>(dst, table, nsrc, nelem);
  }

 private:
  // Group-collective.  false, having done nothing, where bulk copies cannot carry the segment: dst
  // and a source not congruent mod 16 (bulk copies need 16-B aligned addresses and sizes), or no
  // whole 16-B pack between them.  Else the elements before the first aligned pack and after the
  // last go one by one with the NaN rule at every step (reduce_one, as vec_reduce's), the packs
  // between through the ring (staged_body).
  template <class D, class Table>
  __device__ bool reduce_staged(uintptr_t dst, const Table& srcs, int nsrc, uint64_t nelem) {
    using T = typename D::T;
    constexpr uint64_t E = 16 / sizeof(T);
    uintptr_t x = dst % sizeof(T);
    for (int s = 0; s < nsrc; ++s) x |= (srcs[s] ^ dst) & 15;
    if (x != 0) return false;
    const uint64_t head = min_u64(nelem, static_cast<uint64_t>(((0 - dst) & 15) / sizeof(T)));
    const uint64_t packs = (nelem - head) / E;
    if (packs == 0) return false;
    for (uint64_t i = threadIdx.x; i < head; i += blockDim.x) reduce_one<D>(dst, srcs, nsrc, i);
    staged_body<D>(dst, srcs,
                   detail::StagedSegment::make(static_cast<uint32_t>(head * sizeof(T)), packs * 16, kStagedSub,
                                               nsrc + 1, kStagedPerFill));
    for (uint64_t i = head + packs * E + threadIdx.x; i < nelem; i += blockDim.x) reduce_one<D>(dst, srcs, nsrc, i);
    return true;
  }

  // The ring's stages: as many as the launch's dynamic shared memory holds, <= kMaxStages.
  __device__ static uint32_t ring_stages() {
    const uint32_t fit = dynamic_smem_bytes() / (kTileBytes + 8);
    return fit < static_cast<uint32_t>(kMaxStages) ? fit : static_cast<uint32_t>(kMaxStages);
  }

  // Group-collective: the staged reduce of one segment body (reduce_hunk.h, "Staged reduce").
  // Fills of kStagedPerFill operands go through the ring in sequence, fill f in stage
  // f % stages; the leader keeps up to `stages` fills loaded (160 KB in flight behind the one
  // being added on the deep ring, 64 KB on the shared one); every thread adds a fill once its
  // mbarrier phase completed, and the barrier after it hands the stage back to the leader for
  // fill f + stages, which starts (stages - 1) fills past where the adds stand.  The stages'
  // parity bits are the leader's (the copy path's phase_), shared with every thread first and
  // kept by all of them meanwhile, so the ring stays consistent for whatever runs next.  The
  // ring and its mbarriers are addressed from ring_base() and the stage count re-read from
  // %dynamic_smem_size, not from the members the copy path keeps: in a reduce launch's loop
  // those would be registers held for nothing (the kernels sit at their 128-register cap).
  template <class D, class Table>
  __device__ void staged_body(uintptr_t dst, const Table& srcs, const detail::StagedSegment& g) {
    using Cvt = HwCvt<D>;
    const uint32_t stages = ring_stages();
    uint64_t* full = reinterpret_cast<uint64_t*>(ring_base() + stages * kTileBytes);
    uint32_t phase = broadcast(phase_);
    if (leader()) {
      bulk_wait_read<0>();   // earlier bulk stores are done reading the ring
      fence_async_shared();  // the last segment's ld.shared of the ring before these bulk writes
      fence_async_global();
      detail::StagedCursor at;
      for (uint32_t q = 0; q < stages && at.tile < g.tiles; ++q) issue_fill(g, at, q, full + q, dst, srcs);
    }
    float acc[kStagedPacks][Cvt::E];
    detail::StagedCursor take;  // the next operand to add
    for (uint32_t s = 0;; s = s + 1 == stages ? 0 : s + 1) {
      while (!bar_try_wait(full + s, (phase >> s) & 1u)) {
      }
      phase ^= 1u << s;
      detail::staged_consume_fill<D, Cvt, SharedIo, GlobalIo, kStagedPacks>(acc, g, take, s * kTileBytes, dst, srcs,
                                                                            threadIdx.x, kThreads);
      __syncthreads();  // every thread is done reading stage s
      if (take.tile >= g.tiles) break;
      if (leader()) {
        detail::StagedCursor at = take;
        at.advance(static_cast<int>(stages - 1) * kStagedPerFill, g.ops);
        if (at.tile < g.tiles) {
          fence_async_shared();
          issue_fill(g, at, s, full + s, dst, srcs);
        }
      }
    }
    phase_ = phase;
  }

  // Leader: the fill that starts at `c` into stage s (its operand h in slot h), counted on the
  // stage's mbarrier `bar`.
  template <class Table>
  __device__ void issue_fill(const detail::StagedSegment& g, detail::StagedCursor& c, uint32_t s, uint64_t* bar,
                             uintptr_t dst, const Table& srcs) {
    unsigned char* stage = ring_base() + s * kTileBytes;
    detail::staged_issue_fill(
        g, c, dst, srcs, [&](uint32_t bytes) { bar_expect_tx(bar, bytes); },
        [&](int h, uintptr_t src, uint32_t bytes) {
          bulk_load(stage + h * kStagedSub, reinterpret_cast<const void*>(src), bytes, bar);
        });
  }

  __device__ uint32_t tile_len(uint64_t bytes, uint64_t t) const {
    return static_cast<uint32_t>(min_u64(kTileBytes, bytes - t * kTileBytes));
  }
  __device__ uint32_t stage_of(uint64_t k) const { return static_cast<uint32_t>(k % stages_); }

  // Leader only.  Tiles are numbered across segments (k); tile k lives in stage k % stages_
  // and its stores form bulk group k (stored_ groups committed so far).  Loading tile k refills
  // the stage of tile k - stages_: wait until THAT group is done reading, i.e. until at most
  // the stored_ - 1 - (k - stages_) groups committed after it are pending.  The loads run
  // stages_ - lag_ tiles ahead of the stores, so in steady state that is lag_ groups and a
  // slow store holds up only the refill of its own stage.
  __device__ void load_tile(uintptr_t src, uint64_t bytes, uint64_t t, uint64_t k) {
    if (k >= stages_) bulk_wait_read_newer<kMaxStages - 1>(static_cast<uint32_t>(stored_ + stages_ - 1 - k));
    const uint32_t s = stage_of(k);
    const uint32_t len = tile_len(bytes, t);
    bar_expect_tx(&full_[s], len);
    bulk_load(stage_ + s * kTileBytes, reinterpret_cast<const void*>(src + t * kTileBytes), len, &full_[s]);
  }

  // Leader only: bytes of src -> every dst, tile by tile through the ring.  The first loads of a
  // segment go out while the previous segment's last stores still drain.
  __device__ void bulk_copy(const uintptr_t* dsts, int ndst, uintptr_t src, uint64_t bytes) {
    const uint64_t n = (bytes + kTileBytes - 1) / kTileBytes;
    const uint64_t base = stored_;  // tile number of this segment's tile 0
    const uint64_t ahead = stages_ - lag_;
    for (uint64_t t = 0; t < n && t < ahead; ++t) load_tile(src, bytes, t, base + t);
    for (uint64_t i = 0; i < n; ++i) {
      const uint32_t s = stage_of(base + i);
      while (!bar_try_wait(&full_[s], (phase_ >> s) & 1u)) {
      }
      phase_ ^= 1u << s;
      const uint32_t len = tile_len(bytes, i);
      for (int d = 0; d < ndst; ++d)
        bulk_store(reinterpret_cast<void*>(dsts[d] + i * kTileBytes), stage_ + s * kTileBytes, len);
      bulk_commit();
      ++stored_;
      if (i + ahead < n) load_tile(src, bytes, i + ahead, base + i + ahead);
    }
  }

  unsigned char* stage_;  // [stages_][kTileBytes]
  uint64_t* full_;        // [stages_] mbarriers: "stage holds its tile"
  uint64_t stored_ = 0;   // leader: bulk store groups committed (= tiles stored) this launch
  uint32_t stages_;       // ring size: what the launch's dynamic shared memory holds, <= kMaxStages
  uint32_t lag_;          // store groups left draining when a stage is refilled
  uint32_t phase_ = 0;    // leader (every thread during a staged reduce): parity bit per stage of the phase to
                          // wait for next
  bool use_bulk_;
};

}  // namespace ultracomm::dev
