// ultracomm._cuda.load_exchange: validates one launch of k_load_exchange (load_exchange.h)
// and enqueues it.  Pointers cross as integers (tensor.data_ptr()), the stream as its handle.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "launch.h"
#include "load_exchange.h"

namespace py = pybind11;

namespace ultracomm::gpu {
namespace {

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument("ultracomm._cuda.load_exchange: " + msg); }

uintptr_t ptr(const py::dict& d, const char* key, uintptr_t align, size_t i) {
  if (!d.contains(key)) bad("rank entry " + std::to_string(i) + " lacks '" + key + "'");
  const auto p = d[key].cast<uintptr_t>();
  if (p == 0 || p % align)
    bad("rank entry " + std::to_string(i) + ": '" + key + "' must be a " + std::to_string(align) +
        "-byte aligned device address");
  return p;
}

// Filled in place: LoadExchangeArgs holds kMaxExchangeRanks entries (16 KB), too large to return by value cheaply.
void make_args(LoadExchangeArgs& a, const py::list& ranks, int32_t world, int32_t num_experts, int32_t entries,
               uint64_t record_bytes, double timeout_s) {
  a.s = LoadExchangeShape{};
  if (ranks.empty() || ranks.size() > static_cast<size_t>(kMaxExchangeRanks))
    bad("one launch runs 1 to " + std::to_string(kMaxExchangeRanks) + " rank entries, got " +
        std::to_string(ranks.size()));
  if (world < 1) bad("world must be >= 1");
  if (num_experts < 1) bad("num_experts must be >= 1");
  if (entries < 2) bad("entries must be >= 2 (a record is rewritten only after its reader posted the next)");
  if (record_bytes % 8 || record_bytes < kLoadHeaderBytes + 4 * static_cast<uint64_t>(num_experts))
    bad("record_bytes must be a multiple of 8 holding the flag, the tag and num_experts int32 counts (>= " +
        std::to_string(kLoadHeaderBytes + 4 * static_cast<uint64_t>(num_experts)) + ")");
  if (!(timeout_s > 0)) bad("timeout_s must be > 0");
  a.s.nranks = static_cast<int32_t>(ranks.size());
  a.s.world = world;
  a.s.num_experts = num_experts;
  a.s.entries = entries;
  a.s.record_bytes = record_bytes;
  a.s.timeout_ns = timeout_s >= 1e9 ? std::numeric_limits<uint64_t>::max() : static_cast<uint64_t>(timeout_s * 1e9);
  std::vector<char> seen(static_cast<size_t>(world), 0);  // ranks of this launch
  for (size_t i = 0; i < ranks.size(); ++i) {
    const auto d = ranks[i].cast<py::dict>();
    LoadRankArgs& r = a.ranks[i];
    r.counts = reinterpret_cast<const int32_t*>(ptr(d, "counts", 4, i));
    r.out = reinterpret_cast<int32_t*>(ptr(d, "out", 4, i));
    r.status = reinterpret_cast<int32_t*>(ptr(d, "status", 4, i));
    r.bases = reinterpret_cast<const uintptr_t*>(ptr(d, "bases", 8, i));
    r.seq = reinterpret_cast<uint64_t*>(ptr(d, "seq", 8, i));
    r.tag = d.contains("tag") ? d["tag"].cast<uint64_t>() : 0;
    r.pad = 0;
    if (!d.contains("rank")) bad("rank entry " + std::to_string(i) + " lacks 'rank'");
    r.rank = d["rank"].cast<int32_t>();
    if (r.rank < 0 || r.rank >= world)
      bad("rank entry " + std::to_string(i) + ": rank " + std::to_string(r.rank) + " is out of range 0.." +
          std::to_string(world - 1));
    if (seen[static_cast<size_t>(r.rank)]) bad("rank " + std::to_string(r.rank) + " appears twice in one launch");
    seen[static_cast<size_t>(r.rank)] = 1;
  }
}

}  // namespace

void bind_loads(py::module_& m) {
  m.attr("LOAD_STATUS_TIMEOUT") = kLoadStatusTimeout;
  m.attr("LOAD_STATUS_MISMATCH") = kLoadStatusMismatch;
  m.def(
      "load_exchange",
      [](const py::list& ranks, int32_t world, int32_t num_experts, int32_t entries, uint64_t record_bytes,
         double timeout_s, uintptr_t stream) {
        static thread_local LoadExchangeArgs a;  // 16 KB: not on the stack; one per calling thread
        make_args(a, ranks, world, num_experts, entries, record_bytes, timeout_s);
        launch_load_exchange(a, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("ranks"), py::arg("world"), py::arg("num_experts"), py::arg("entries"), py::arg("record_bytes"),
      py::arg("timeout_s"), py::arg("stream"),
      R"doc(Enqueue one expert-load exchange on `stream` (csrc/cuda/load_exchange.h).

ranks: one dict per rank this launch runs (one, or every rank of a one-GPU loopback domain)
with device addresses counts (int32 [E]), out (int32 [world, E]), status (int32 [4]: 0 ok or
LOAD_STATUS_TIMEOUT, awaited rank, flag seen lo/hi; or LOAD_STATUS_MISMATCH, the rank whose
tag differs, its tag lo/hi), bases (uint64 [world]: board bases), seq (uint64, zero before
the first exchange), rank and optionally tag (uint64, default 0: what the exchange is for,
compared with every sender's).  Validated before anything is
enqueued (ValueError); no allocation, no synchronisation (capturable).  One launch runs 1 to
LOAD_EXCHANGE_MAX_RANKS entries; a launch of several (a loopback domain) is cooperative and is
refused (ValueError) when the GPU cannot hold every entry's CTA at once
(load_exchange_max_coresident).)doc");
  m.attr("LOAD_EXCHANGE_MAX_RANKS") = kMaxExchangeRanks;
  m.def(
      "load_exchange_max_coresident", [](int32_t nranks) { return load_exchange_max_coresident(nranks); },
      py::arg("nranks"),
      "k_load_exchange CTAs the current device holds at once for a launch of `nranks` rank entries "
      "(occupancy per SM x SMs); a loopback exchange needs nranks <= this.");
}

}  // namespace ultracomm::gpu
