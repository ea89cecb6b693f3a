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
//
// Ordering (GPU_NOTES.md): a CTA writes the counts (16-byte vector stores when E % 4 == 0) and
// tags into every board, __syncthreads(), then warp 0 issues ONE fence.acq_rel.sys and relaxed
// system-scope flag stores (not a release per board).  A reader polls relaxed (no L1
// invalidation per spin), then one acquire load of the flag; __syncthreads() hands that to the
// whole CTA, which copies the [world, E] counts out with every thread's loads in flight at once.
// A loopback launch's CTAs wait on each other: they are launched cooperatively (co-resident or
// the launch fails) after an occupancy check that names the numbers.
#pragma once
#include <cstdint>
#include <type_traits>

namespace ultracomm {

// One rank's share of a launch (a one-GPU loopback launch runs several, CTA r = rank entry r).
struct LoadRankArgs {
  const int32_t* counts;   // device [E]: this rank's counts (read once)
  int32_t* out;            // device [world * E]: every rank's counts, rank order
  int32_t* status;         // device [4]: 0 ok | 1 timeout, awaited rank, flag seen (lo, hi)
                           //   | 2 mismatch, the rank whose tag differs, its tag (lo, hi)
  const uintptr_t* bases;  // device [world]: each rank's board base as this device addresses it
  uint64_t* seq;           // device: exchanges this rank ran (the launch runs *seq + 1)
  uint64_t tag;            // what this exchange is for (written beside the counts, compared with every sender's)
  int32_t rank;
  int32_t pad;
};

// What every rank entry of a launch shares.
struct LoadExchangeShape {
  int32_t nranks;         // rank entries of this launch (grid = nranks CTAs)
  int32_t world;          // <= kMaxExchangeRanks
  int32_t num_experts;    // E >= 1
  int32_t entries;        // >= 2
  uint64_t record_bytes;  // >= kLoadHeaderBytes + 4 E, multiple of 64 (so the counts are 16-byte aligned)
  uint64_t timeout_ns;    // per exchange; UINT64_MAX = never
};

// A launch's kernel arguments for up to N rank entries.  The launcher (k_loads.cu) picks the
// smallest of kLoadCapacities that holds nranks: one rank per process (the multi-GPU case)
// passes 72 bytes, a 64-rank loopback 3.6 KB, an EP288 loopback 16 KB -- kernel parameters
// above 4 KB need CUDA 12.1+ on sm_70+ (limit 32764 bytes), which every build target meets.
template <int N>
struct LoadExchangeParams {
  LoadExchangeShape s;
  LoadRankArgs ranks[N];
};

constexpr int kMaxExchangeRanks = 288;                           // an EP288 world in one loopback launch
using LoadExchangeArgs = LoadExchangeParams<kMaxExchangeRanks>;  // what the bindings fill

constexpr int32_t kLoadStatusOk = 0;
constexpr int32_t kLoadStatusTimeout = 1;
constexpr int32_t kLoadStatusMismatch = 2;
constexpr uint64_t kLoadTagOffset = 8;     // record + 8: the sender's tag
constexpr uint64_t kLoadHeaderBytes = 16;  // flag and tag ahead of the counts
constexpr uint64_t kLoadRecordAlign = 64;  // board_layout.BoardLayout.record_bytes rounds to it

static_assert(sizeof(LoadRankArgs) == 56 && sizeof(LoadExchangeShape) == 32, "layout the bindings fill");
static_assert(std::is_trivially_copyable_v<LoadExchangeArgs> && sizeof(LoadExchangeArgs) <= 32764,
              "kernel arguments must be a POD within CUDA 12.1's 32764-byte parameter limit");
static_assert(sizeof(LoadExchangeParams<64>) <= 4096, "a 64-rank launch keeps the classic 4 KB limit");

namespace gpu {
// k_load_exchange CTAs the current device holds at once for a launch of `nranks` entries
// (occupancy x SMs); a loopback launch of more ranks is refused with a message saying so.
int load_exchange_max_coresident(int32_t nranks);
}  // namespace gpu

}  // namespace ultracomm
