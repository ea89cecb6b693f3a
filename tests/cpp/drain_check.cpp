// Drain check: rank 0 runs run_host with no task (join, then drain) while threads playing its
// parent, rank 1, deliver: for every (slot, chunk), in a shuffled order dealt to W writers, a
// writer writes the chunk's bytes into rank 0's weight slot and raises the arrival flag
// (multicast), or reads rank 0's grad chunk and raises the consumed flag (reduce), writer 0
// at once, the others pausing.  Rank 0's drain scans a slot's chunk flags with the whole group (interp.h
// first_below) and waits only for the ones not up yet.  Built by
// tests/transports/test_drain_scan.py with -fsanitize=thread: the receiver's reads (multicast)
// and writes (reduce) right after run_host returned must be ordered after every writer's, flag
// by flag (with one writer, the drain's wait for the last flag raised would order them all).
//
//   drain_check [--mover host|block] [--threads T] [--op mc|reduce] [--slots S] [--chunks C]
//               [--chunk-bytes B] [--epochs N] [--gap-us US] [--seed N] [--timeout-ms MS]
//               [--missing SLOT:CHUNK ...]   (these flags are never raised: rank 0 must time out)
//               [--writers W]                (the parent's threads raising flags, default 2)
//               [--parent-absent]            (the parent never joins and raises nothing)
// Prints "OK drain: ..." or "FAIL ..." lines, and "ERROR <message>" for the error run_host
// raised (its type after the message: [timeout] / [other]).  Exit 0 when every check passed.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ultracomm/impl/host_executor.h"

using namespace ultracomm;

namespace {

struct Options {
  MoverKind mover = MoverKind::kBlock;
  int threads = 4;
  Op op = Op::kMulticast;
  int32_t slots = 3;
  uint64_t chunks = 64, chunk_bytes = 64;
  int epochs = 2;
  uint32_t gap_us = 20;
  uint64_t seed = 1;
  uint64_t timeout_ms = 20000;
  std::vector<std::pair<int32_t, uint64_t>> missing;
  bool parent_absent = false;
  int writers = 2;
};

uint8_t pattern(int32_t slot, uint64_t epoch, uint64_t i) {
  return static_cast<uint8_t>((i * 37u + slot * 101u + epoch * 59u) ^ (i >> 8));
}

int run(const Options& o) {
  const uint64_t slot_bytes = o.chunks * o.chunk_bytes;
  const WindowLayout L = WindowLayout::make(o.slots, slot_bytes, slot_bytes, o.chunk_bytes);
  const bool mc = o.op == Op::kMulticast;
  std::vector<uint8_t*> win;
  for (int r = 0; r < 2; ++r) {
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(kWindowAlign, L.total_bytes));
    std::memset(p, 0, L.total_bytes);
    win.push_back(p);
  }
  const auto flag_of = [&](int32_t s, uint64_t c) {
    const int64_t ci = static_cast<int64_t>(c);
    return reinterpret_cast<uint64_t*>(win[0] + (mc ? L.arrival_flag(s, ci) : L.consumed_flag(s, ci)));
  };
  const uint64_t digest = 0x5eed0000u + static_cast<uint32_t>(o.op);
  int failures = 0;
  for (uint64_t epoch = 1; epoch <= static_cast<uint64_t>(o.epochs); ++epoch) {
    ExecArgs a;
    a.op = o.op;
    a.rank = 0;
    a.world = 2;
    a.epoch = epoch;
    a.layout = L;
    for (auto* p : win) a.window_bases.push_back(reinterpret_cast<uintptr_t>(p));
    a.member_off = {0};
    a.member_bytes = {slot_bytes};
    a.local_index_of.assign(o.slots, -1);  // expert s in slot s, its home elsewhere
    for (int32_t s = 0; s < o.slots; ++s) a.my_slots.push_back(s);
    a.slot_parent.assign(o.slots, 1);
    a.num_workers = 2;
    a.timeout_s = static_cast<double>(o.timeout_ms) / 1000.0;
    a.digest = digest;
    a.mover = o.mover;
    a.threads_per_worker = o.threads;
    if (!mc)  // rank 0's grads, which its parent reads before raising consumed
      for (int32_t s = 0; s < o.slots; ++s)
        for (uint64_t i = 0; i < slot_bytes; ++i) win[0][L.grad_slot(s) + i] = pattern(s, epoch, i);

    // the parent: joined (ready + digest of this op), then the flags in a shuffled order
    std::vector<std::pair<int32_t, uint64_t>> order;
    for (int32_t s = 0; s < o.slots; ++s)
      for (uint64_t c = 0; c < o.chunks; ++c)
        if (!o.parent_absent && std::find(o.missing.begin(), o.missing.end(), std::make_pair(s, c)) == o.missing.end())
          order.emplace_back(s, c);
    std::mt19937_64 rng(o.seed * 1000 + epoch);
    std::shuffle(order.begin(), order.end(), rng);
    std::atomic<int> parent_bad{0};
    // the parent's workers: writer w raises flags w, w + W, ... of the order (several writers, as
    // a parent's tiles are), writer 0 at once, writer w > 0 pausing w x gap_us every 4th flag: the
    // drain waits for the slow ones while it finds writer 0's up (acquiring a flag of one writer
    // orders nothing of another's)
    if (!o.parent_absent) {
      __atomic_store_n(reinterpret_cast<uint64_t*>(win[1] + L.digest_word(o.op)), digest, __ATOMIC_RELEASE);
      __atomic_store_n(reinterpret_cast<uint64_t*>(win[1] + L.ready_flag(o.op)), epoch, __ATOMIC_RELEASE);
    }
    // Window bytes move with memcpy / memset (ranged accesses: this libtsan missed races on
    // byte-by-byte loops over heap memory, and one ranged access each is cheaper).
    const auto expect = [&](int32_t s, uint64_t from, uint64_t n) {
      std::vector<uint8_t> v(n);
      for (uint64_t i = 0; i < n; ++i) v[i] = pattern(s, epoch, from + i);
      return v;
    };
    const auto writer = [&](size_t w) {
      std::vector<uint8_t> got(o.chunk_bytes);
      for (size_t k = w; k < order.size(); k += static_cast<size_t>(o.writers)) {
        const auto [s, c] = order[k];
        if (o.gap_us && w > 0 && (k / o.writers) % 4 == 0)
          std::this_thread::sleep_for(std::chrono::microseconds(o.gap_us * w));
        uint8_t* chunk = win[0] + (mc ? L.weight_slot(s) : L.grad_slot(s)) + c * o.chunk_bytes;
        const std::vector<uint8_t> want = expect(s, c * o.chunk_bytes, o.chunk_bytes);
        if (mc) {
          std::memcpy(chunk, want.data(), o.chunk_bytes);
        } else {
          std::memcpy(got.data(), chunk, o.chunk_bytes);  // what a reduce parent sums
          parent_bad += got != want;
        }
        __atomic_store_n(flag_of(s, c), epoch, __ATOMIC_RELEASE);
      }
    };
    std::vector<std::thread> parent;
    for (int w = 0; w < o.writers; ++w) parent.emplace_back(writer, static_cast<size_t>(w));

    // rank 0: join + drain; what it does right after the drain returned is ordered only by it
    const auto t0 = std::chrono::steady_clock::now();
    std::string err;
    bool timeout = false;
    try {
      run_host(a);
    } catch (const TimeoutError& e) {
      err = e.what();
      timeout = true;
    } catch (const std::exception& e) {
      err = e.what();
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    int below = 0, bad = 0;
    if (err.empty()) {
      for (int32_t s = 0; s < o.slots; ++s)
        for (uint64_t c = 0; c < o.chunks; ++c) below += __atomic_load_n(flag_of(s, c), __ATOMIC_RELAXED) < epoch;
      for (int32_t s = 0; s < o.slots; ++s) {
        uint8_t* p = win[0] + (mc ? L.weight_slot(s) : L.grad_slot(s));
        if (mc) {
          std::vector<uint8_t> got(slot_bytes);
          std::memcpy(got.data(), p, slot_bytes);
          const std::vector<uint8_t> want = expect(s, 0, slot_bytes);
          for (uint64_t i = 0; i < slot_bytes; ++i) bad += got[i] != want[i];
        } else {
          std::memset(p, 0xEE, slot_bytes);  // the slot is free again once every chunk was consumed
        }
      }
    }
    for (auto& t : parent) t.join();
    if (!err.empty()) {
      std::printf("ERROR %s [%s] after %.0f ms\n", err.c_str(), timeout ? "timeout" : "other", ms);
      ++failures;
      break;
    }
    if (below || bad || parent_bad) {
      std::printf("FAIL epoch %" PRIu64
                  ": drain returned with %d flags below the epoch, %d wrong bytes, "
                  "%d chunks the parent read changed\n",
                  epoch, below, bad, parent_bad.load());
      ++failures;
    } else {
      std::printf("OK drain: epoch %" PRIu64 ", %d slots x %" PRIu64 " chunks in %.1f ms\n", epoch, o.slots, o.chunks,
                  ms);
    }
  }
  for (auto* p : win) std::free(p);
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const auto next = [&] {
        if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
        return std::string(argv[++i]);
      };
      if (a == "--mover")
        o.mover = next() == "host" ? MoverKind::kHost : MoverKind::kBlock;
      else if (a == "--threads")
        o.threads = std::stoi(next());
      else if (a == "--op")
        o.op = next() == "reduce" ? Op::kReduce : Op::kMulticast;
      else if (a == "--slots")
        o.slots = std::stoi(next());
      else if (a == "--chunks")
        o.chunks = std::stoull(next());
      else if (a == "--chunk-bytes")
        o.chunk_bytes = std::stoull(next());
      else if (a == "--epochs")
        o.epochs = std::stoi(next());
      else if (a == "--gap-us")
        o.gap_us = static_cast<uint32_t>(std::stoul(next()));
      else if (a == "--seed")
        o.seed = std::stoull(next());
      else if (a == "--timeout-ms")
        o.timeout_ms = std::stoull(next());
      else if (a == "--missing") {
        const std::string v = next();
        const size_t colon = v.find(':');
        if (colon == std::string::npos) throw std::runtime_error("--missing wants SLOT:CHUNK");
        o.missing.emplace_back(std::stoi(v.substr(0, colon)), std::stoull(v.substr(colon + 1)));
      } else if (a == "--writers")
        o.writers = std::max(1, std::stoi(next()));
      else if (a == "--parent-absent")
        o.parent_absent = true;
      else
        return std::fprintf(stderr, "unknown option %s\n", a.c_str()), 2;
    }
    return run(o);
  } catch (const std::exception& e) {
    std::printf("ERROR %s\n", e.what());
    return 1;
  }
}
