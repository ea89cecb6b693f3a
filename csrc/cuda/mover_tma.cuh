// TmaMover: the sm_90+ device mover.  A segment's 16-byte-aligned body is read ONCE from global
// memory into a shared-memory stage with a bulk load (cp.async.bulk, completion counted on
// the stage's mbarrier) and written to each destination with one bulk store per destination
// (read once, write N).  A ring of stages pipelines loads ahead of stores (mover_limits.h: 6 x
// 32 KB, 4 loads = 128 KB in flight; 3 stages where two CTAs share an SM); the ring runs on
// across segments and tasks.  The leader thread issues every bulk copy; the rest of the CTA
// moves the unaligned tail through the vector path meanwhile.  Reductions are the vector
// path's (fp32 in registers, one writer per element).
//
// Ordering (GPU_NOTES.md):
//   after_acquire:   fence.proxy.async.global by the leader, so its bulk loads see what the
//                    peer published under the flag it just acquired (relay forwarding).
//   before_release:  cp.async.bulk.wait_group 0 by the leader (stores complete) + __syncthreads
//                    (vector-path stores of the other threads), then the leader's release.
//   stage reuse:     per stage: a load refills a stage once the ONE bulk group that last read
//                    it is done reading (cp.async.bulk.wait_group.read N, N = the groups
//                    committed after it), not once the previous tile's stores are.
#pragma once
#include "mover_common.cuh"

namespace ultracomm::dev {

class TmaMover : public MoverBase {
 public:
  static constexpr uint32_t kTileBytes = gpu::kTmaTileBytes;
  static constexpr int kMaxStages = gpu::kTmaStages;
  // dynamic shared memory of the deep ring: stages (128-B aligned) then one mbarrier per stage;
  // a launch may give less (gpu::tma_smem_bytes(kTmaStagesShared)): the ring is what it gets.
  static constexpr uint32_t kSmemBytes = gpu::tma_smem_bytes(kMaxStages);

  // Group-collective (constructor runs in every thread): the stage count follows the launch's
  // dynamic shared memory (%dynamic_smem_size); the leader initialises the stage barriers; the
  // barrier makes them visible before any thread can reach a bulk copy.  Under two stages the
  // mover copies through the vector path only.
  __device__ TmaMover(const MoverEnv& env, GroupShared* sh, unsigned char* dyn_smem, bool force_vector)
      : MoverBase(env, sh), stage_(dyn_smem) {
    const uint32_t fit = dynamic_smem_bytes() / (kTileBytes + 8);
    stages_ = fit < static_cast<uint32_t>(kMaxStages) ? fit : static_cast<uint32_t>(kMaxStages);
    lag_ = stages_ > 2u * gpu::kTmaStoreGroups ? gpu::kTmaStoreGroups : 1u;
    full_ = reinterpret_cast<uint64_t*>(dyn_smem + stages_ * kTileBytes);
    use_bulk_ = !force_vector && stages_ >= 2;
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

  template <class D, class Srcs>
  __device__ void reduce(uintptr_t dst, const Srcs& srcs, int nsrc, uint64_t nelem) {
    vec_reduce<D>(dst, stage_srcs(srcs, nsrc), nsrc, nelem);
  }

 private:
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
  uint32_t phase_ = 0;    // leader: parity bit per stage of the phase to wait for next
  bool use_bulk_;
};

}  // namespace ultracomm::dev
