// TmaMover: the sm_90+ device mover.  A segment's 16-byte-aligned body is read ONCE from global
// memory into a shared-memory stage with a bulk load (cp.async.bulk, completion counted on
// the stage's mbarrier) and written to each destination with one bulk store per destination
// (read once, write N).  kStages stages pipeline loads ahead of stores.  The leader thread
// issues every bulk copy; the rest of the CTA moves the unaligned tail through the vector path
// meanwhile.  Reductions are the vector path's (fp32 in registers, one writer per element).
//
// Ordering (GPU_NOTES.md):
//   after_acquire:   fence.proxy.async.global by the leader, so its bulk loads see what the
//                    peer published under the flag it just acquired (relay forwarding).
//   before_release:  cp.async.bulk.wait_group 0 by the leader (stores complete) + __syncthreads
//                    (vector-path stores of the other threads), then the leader's st.release.sys.
//   stage reuse:     cp.async.bulk.wait_group.read: the stores that read a stage are done
//                    reading before a load refills it.
#pragma once
#include "mover_common.cuh"

namespace ultracomm::dev {

class TmaMover : public MoverBase {
 public:
  static constexpr uint32_t kTileBytes = gpu::kTmaTileBytes;
  static constexpr int kStages = gpu::kTmaStages;
  // dynamic shared memory: stages (128-B aligned for bulk copies) then one mbarrier per stage
  static constexpr uint32_t kSmemBytes = kStages * kTileBytes + kStages * sizeof(uint64_t);

  // Group-collective (constructor runs in every thread): the leader initialises the stage
  // barriers; the barrier makes them visible before any thread can reach a bulk copy.
  __device__ TmaMover(const MoverEnv& env, GroupShared* sh, unsigned char* dyn_smem, bool force_vector)
      : MoverBase(env, sh),
        stage_(dyn_smem),
        full_(reinterpret_cast<uint64_t*>(dyn_smem + kStages * kTileBytes)),
        use_bulk_(!force_vector) {
    if (leader())
      for (int s = 0; s < kStages; ++s) bar_init(&full_[s], 1);
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

  __device__ void load_tile(uintptr_t src, uint64_t bytes, uint64_t t) {
    const int s = static_cast<int>(t % kStages);
    const uint32_t len = tile_len(bytes, t);
    bar_expect_tx(&full_[s], len);
    bulk_load(stage_ + s * kTileBytes, reinterpret_cast<const void*>(src + t * kTileBytes), len, &full_[s]);
  }

  // Leader only.  Tile i lives in stage i % kStages.  After tile i's stores are issued, the
  // stage of tile i-1 is refilled with tile i-1+kStages once tile i-1's stores have read it
  // (wait_group.read 1: all groups but the newest), so loads run kStages-1 tiles ahead.
  __device__ void bulk_copy(const uintptr_t* dsts, int ndst, uintptr_t src, uint64_t bytes) {
    bulk_wait_read<0>();  // the previous segment's stores are done reading every stage
    const uint64_t n = (bytes + kTileBytes - 1) / kTileBytes;
    for (uint64_t t = 0; t < n && t < kStages; ++t) load_tile(src, bytes, t);
    for (uint64_t i = 0; i < n; ++i) {
      const int s = static_cast<int>(i % kStages);
      while (!bar_try_wait(&full_[s], (phase_ >> s) & 1u)) {
      }
      phase_ ^= 1u << s;
      const uint32_t len = tile_len(bytes, i);
      for (int d = 0; d < ndst; ++d)
        bulk_store(reinterpret_cast<void*>(dsts[d] + i * kTileBytes), stage_ + s * kTileBytes, len);
      bulk_commit();
      if (i >= 1 && i - 1 + kStages < n) {
        bulk_wait_read<1>();
        load_tile(src, bytes, i - 1 + kStages);
      }
    }
  }

  unsigned char* stage_;  // [kStages][kTileBytes]
  uint64_t* full_;        // [kStages] mbarriers: "stage holds its tile"
  uint32_t phase_ = 0;    // leader: parity bit per stage of the phase to wait for next
  bool use_bulk_;
};

}  // namespace ultracomm::dev
