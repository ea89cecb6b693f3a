// Arguments of k_load_exchange (k_loads.cu): every rank's [E] int32 expert token counts
// all-gathered through a symmetric "load board" window (python/ultracomm/moe/board_layout.py
// describes it; the host-memory board of moe/loads.py runs the same protocol with memcpy and
// host atomics).
//
// Board layout, per receiving rank (identical on every rank, so a peer address is
// peer_base + offset):  record(e, q) at ((e * world + q) * record_bytes), e < entries, q < world:
//   +0   uint64 flag    exchange number n whose counts the record holds (release after them)
//   +8   uint64 tag     what sender q's exchange is for (board_layout.ExchangeTag: operation,
//                       layer, micro-batch slot), written with the counts
//   +16  int32  [E]     sender q's counts
// Exchange n (1, 2, ...; a device counter, so a replayed CUDA graph runs fresh numbers) uses
// entry e = n % entries: sender q writes its tag and counts into record(e, q) in every rank's
// board, then releases its flag = n; each rank waits until its own record(e, q).flag >= n for
// every q, then reads.  A sender whose tag differs from the reader's is out of step: the
// reader's status says so (kLoadStatusMismatch, the sender, its tag), and the device build
// refuses the loads, as after a timeout.
// With entries = 2 a record is rewritten (exchange n + 2) only after its reader posted n + 1,
// i.e. finished reading n.
#pragma once
#include <cstdint>
#include <type_traits>

#include "persistent_args.h"

namespace ultracomm {

// One rank's share of a launch (a one-GPU loopback launch runs several, CTA r = rank entry r).
struct LoadRankArgs {
  const int32_t* counts;     // device [E]: this rank's counts (read once)
  int32_t* out;              // device [world * E]: every rank's counts, rank order
  int32_t* status;           // device [4]: 0 ok | 1 timeout, awaited rank, flag seen (lo, hi)
                             //   | 2 mismatch, the rank whose tag differs, its tag (lo, hi)
  const uintptr_t* bases;    // device [world]: each rank's board base as this device addresses it
  uint64_t* seq;             // device: exchanges this rank ran (the launch runs *seq + 1)
  uint64_t tag;              // what this exchange is for (written beside the counts, compared with every sender's)
  int32_t rank;
  int32_t pad;
};

struct LoadExchangeArgs {
  LoadRankArgs ranks[kMaxLoopbackRanks];
  int32_t nranks;            // rank entries of this launch (grid = nranks CTAs)
  int32_t world;
  int32_t num_experts;       // E >= 1
  int32_t entries;           // >= 2
  uint64_t record_bytes;     // >= kLoadHeaderBytes + 4 E, multiple of 8
  uint64_t timeout_ns;       // per exchange; UINT64_MAX = never
};

constexpr int32_t kLoadStatusOk = 0;
constexpr int32_t kLoadStatusTimeout = 1;
constexpr int32_t kLoadStatusMismatch = 2;
constexpr uint64_t kLoadTagOffset = 8;       // record + 8: the sender's tag
constexpr uint64_t kLoadHeaderBytes = 16;    // flag and tag ahead of the counts

static_assert(std::is_trivially_copyable_v<LoadExchangeArgs> && sizeof(LoadExchangeArgs) <= 4096,
              "kernel arguments must be a small POD");

}  // namespace ultracomm
