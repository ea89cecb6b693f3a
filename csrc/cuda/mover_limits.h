// Sizes of the device movers that the host side also needs (launch config, bindings, bench),
// in a header g++ can read.
#pragma once
#include <cstdint>

namespace ultracomm::gpu {

constexpr int kThreadsPerCta = 256;        // threads per CTA (8 warps): enough 16-byte accesses in flight per SM
constexpr uint32_t kTmaTileBytes = 32768;  // bytes per bulk load / store (one shared-memory stage)
// Stage ring of the TMA copy (mover_tma.cuh).  A stage is refilled as soon as the stores that
// read IT are done reading (bulk-group accounting per stage), so loads run
// stages - kTmaStoreGroups tiles ahead: 6 x 32 KB stages = 4 loads (128 KB) in flight per CTA
// while 2 tiles' stores drain.  The deep ring (192 KB) allows one CTA per SM; a loopback
// launch that needs two per SM gets the shared ring (96 KB each: 2 loads in flight, 1 draining).
constexpr int kTmaStages = 6;                // deep ring: one CTA per SM (one rank per GPU, or a small loopback)
constexpr int kTmaStagesShared = 3;          // two CTAs per SM (loopback grids larger than the SM count)
constexpr int kTmaStoreGroups = 2;           // tiles whose stores may still be reading their stage at a refill (1 in
                                             // rings of <= 2 * kTmaStoreGroups stages)
constexpr uint32_t kSmemPerCtaMax = 232448;  // sm_90 / sm_100 opt-in dynamic + static per block (227 KB)
// Dynamic shared memory of a ring: the stages (128-B aligned for bulk copies) then one mbarrier each.
constexpr uint32_t tma_smem_bytes(int stages) { return static_cast<uint32_t>(stages) * (kTmaTileBytes + 8); }
static_assert(kTmaTileBytes % 128 == 0 && kTmaStoreGroups >= 1 && kTmaStagesShared > kTmaStoreGroups);
static_assert(kTmaStages > kTmaStoreGroups && kTmaStages <= 8);
static_assert(tma_smem_bytes(kTmaStages) + 4096 <= kSmemPerCtaMax, "deep ring + static smem must fit one CTA");
static_assert(2 * (tma_smem_bytes(kTmaStagesShared) + 4096) <= 233472, "two shared rings must fit one SM (228 KB)");

}  // namespace ultracomm::gpu
