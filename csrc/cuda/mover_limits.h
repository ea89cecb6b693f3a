// Sizes of the device movers that the host side also needs (launch config, bindings, bench),
// in a header g++ can read.
#pragma once
#include <cstdint>

namespace ultracomm::gpu {

constexpr int kThreadsPerCta = 256;       // threads per CTA (8 warps): enough 16-byte accesses in flight per SM
constexpr uint32_t kTmaTileBytes = 16384;  // bytes per bulk load / store (one shared-memory stage)
constexpr int kTmaStages = 4;              // stages in flight: loads run kTmaStages - 1 tiles ahead of stores

}  // namespace ultracomm::gpu
