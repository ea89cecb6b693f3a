// Host executor: the reference implementation of the task protocol (task.h) with C++
// worker threads over windows mapped in this process (memcpy for data, acquire/release
// atomics on uint64 epoch flags).
#include "ultracomm/host_executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "half.h"

namespace ultracomm {
namespace {

using Clock = std::chrono::steady_clock;

struct Aborted {};  // internal: another worker failed, stop promptly

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

inline uint64_t load_acquire(uintptr_t addr) {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(addr), __ATOMIC_ACQUIRE);
}
inline void store_release(uintptr_t addr, uint64_t v) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(addr), v, __ATOMIC_RELEASE);
}

inline uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::string fmt_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", s);
  return buf;
}

size_t dtype_size(DType d) { return d == DType::kF32 ? 4 : 2; }

// Calls fn(m, lo, hi) for every member m whose bytes [member_off[m], +member_bytes[m])
// intersect [offset, offset + bytes), with [lo, hi) the non-empty intersection (slot-layout
// offsets).  Members are sorted and disjoint (validate), so segments come in order.
template <class Fn>
inline void for_each_segment(uint64_t offset, uint64_t bytes, const std::vector<uint64_t>& member_off,
                             const std::vector<uint64_t>& member_bytes, Fn&& fn) {
  const uint64_t end = offset + bytes;
  for (size_t m = 0; m < member_off.size(); ++m) {
    const uint64_t lo = std::max(offset, member_off[m]);
    const uint64_t hi = std::min(end, member_off[m] + member_bytes[m]);
    if (lo < hi) fn(m, lo, hi);
  }
}

const char* default_op_name(Op op) { return op == Op::kMulticast ? "weight_sync" : "grad_reduce"; }

// ---------------------------------------------------------------------------------------
// reduction kernels: acc(fp32) = self; acc += src_0; acc += src_1; ...; dst = cast(acc)

struct F32 {
  using T = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
struct BF16 {
  using T = uint16_t;
  static float load(uint16_t x) { return detail::bf16_to_f32(x); }
  static uint16_t store(float x) { return detail::f32_to_bf16(x); }
};
struct F16 {
  using T = uint16_t;
  static float load(uint16_t x) { return detail::f16_to_f32(x); }
  static uint16_t store(float x) { return detail::f32_to_f16(x); }
};

template <class D>
void reduce_segment(uintptr_t dst_self, const uintptr_t* srcs, int nsrc, size_t n) {
  using T = typename D::T;
  constexpr size_t B = 512;
  alignas(64) float acc[B];
  T* dst = reinterpret_cast<T*>(dst_self);
  for (size_t i0 = 0; i0 < n; i0 += B) {
    const size_t m = std::min(B, n - i0);
    const T* self = dst + i0;
    for (size_t i = 0; i < m; ++i) acc[i] = D::load(self[i]);
    for (int s = 0; s < nsrc; ++s) {
      const T* p = reinterpret_cast<const T*>(srcs[s]) + i0;
      for (size_t i = 0; i < m; ++i) acc[i] += D::load(p[i]);
    }
    T* out = dst + i0;
    for (size_t i = 0; i < m; ++i) out[i] = D::store(acc[i]);
  }
}

#if defined(__x86_64__)
// fp16 with F16C conversions (the instructions torch's CPU casts use); the scalar tail uses
// half.h, which gives the same bits.
__attribute__((target("avx2,f16c"))) void reduce_f16_f16c(uintptr_t dst_self, const uintptr_t* srcs, int nsrc,
                                                            size_t n) {
  constexpr size_t B = 512;
  alignas(64) float acc[B];
  uint16_t* dst = reinterpret_cast<uint16_t*>(dst_self);
  for (size_t i0 = 0; i0 < n; i0 += B) {
    const size_t m = std::min(B, n - i0);
    const size_t mv = m & ~size_t(7);
    const uint16_t* self = dst + i0;
    for (size_t i = 0; i < mv; i += 8)
      _mm256_store_ps(acc + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(self + i))));
    for (size_t i = mv; i < m; ++i) acc[i] = detail::f16_to_f32(self[i]);
    for (int s = 0; s < nsrc; ++s) {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(srcs[s]) + i0;
      for (size_t i = 0; i < mv; i += 8)
        _mm256_store_ps(acc + i, _mm256_add_ps(_mm256_load_ps(acc + i),
                                               _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)))));
      for (size_t i = mv; i < m; ++i) acc[i] += detail::f16_to_f32(p[i]);
    }
    uint16_t* out = dst + i0;
    for (size_t i = 0; i < mv; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_cvtps_ph(_mm256_load_ps(acc + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (size_t i = mv; i < m; ++i) out[i] = detail::f32_to_f16(acc[i]);
  }
}
const bool kHaveF16C = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
constexpr bool kHaveF16C = false;
#endif

void reduce_dispatch(DType d, bool portable_f16, uintptr_t dst, const uintptr_t* srcs, int nsrc, size_t bytes) {
  switch (d) {
    case DType::kF32: reduce_segment<F32>(dst, srcs, nsrc, bytes / 4); break;
    case DType::kBF16: reduce_segment<BF16>(dst, srcs, nsrc, bytes / 2); break;
    case DType::kF16:
#if defined(__x86_64__)
      if (kHaveF16C && !portable_f16) {
        reduce_f16_f16c(dst, srcs, nsrc, bytes / 2);
        break;
      }
#endif
      reduce_segment<F16>(dst, srcs, nsrc, bytes / 2);
      break;
  }
}

// ---------------------------------------------------------------------------------------

struct Runner {
  const ExecArgs& a;
  const WindowLayout& L;
  const bool mc;
  const uint64_t nchunks;
  const size_t M;
  std::vector<uint8_t> is_relay;  // [slots], reduce only
  std::atomic<int64_t> next{0};
  std::atomic<bool> abort{false};
  std::mutex err_mu;
  std::exception_ptr first_error;
  std::string prefix;

  explicit Runner(const ExecArgs& args)
      : a(args),
        L(args.layout),
        mc(args.op == Op::kMulticast),
        nchunks(mc ? args.layout.weight_chunks : args.layout.grad_chunks),
        M(args.member_off.size()) {
    // e.g. "ultracomm: rank 2 restore (multicast) epoch 7 timed out after 100 s waiting for ..."
    const std::string name = a.op_name.empty() ? default_op_name(a.op) : a.op_name;
    prefix = "ultracomm: rank " + std::to_string(a.rank) + " " + name + (mc ? " (multicast)" : " (reduce)") +
             " epoch " + std::to_string(a.epoch) + " timed out after " + fmt_seconds(a.timeout_s) +
             " s waiting for ";
  }

  std::string parent_of(int32_t slot) const {
    if (!a.slot_parent.empty() && slot >= 0 && a.slot_parent[slot] >= 0)
      return "rank " + std::to_string(a.slot_parent[slot]);
    return "its parent rank";
  }

  uintptr_t slot_addr(int32_t rank, int32_t slot) const {
    return a.window_bases[rank] + (mc ? L.weight_slot(slot) : L.grad_slot(slot));
  }

  // now + timeout_s; timeouts beyond ~30 years (inf included) never expire rather than overflow
  Clock::time_point wait_deadline() const {
    if (a.timeout_s >= 1e9) return Clock::time_point::max();
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(a.timeout_s));
  }

  template <class Describe>
  void wait_flag(uintptr_t addr, Describe&& describe) {
    const uint64_t epoch = a.epoch;
    if (load_acquire(addr) >= epoch) return;
    for (int i = 0; i < 128; ++i) {
      cpu_relax();
      if (load_acquire(addr) >= epoch) return;
    }
    const auto deadline = wait_deadline();
    int yields = 0;
    int64_t sleep_us = 2;
    for (;;) {
      if (load_acquire(addr) >= epoch) return;
      if (abort.load(std::memory_order_relaxed)) throw Aborted{};
      if (Clock::now() >= deadline) throw TimeoutError(prefix + describe());
      if (yields < 32) {
        ++yields;
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
        sleep_us = std::min<int64_t>(sleep_us * 2, 200);
      }
    }
  }

  // Address of the self operand for the byte range starting at slot-layout offset `lo`
  // inside member m.
  uintptr_t self_addr(const Task& t, size_t m, uint64_t lo) const {
    if (t.self.slot == kMaster) {
      const int32_t li = a.local_index_of[t.expert];
      return a.master_ptrs[static_cast<size_t>(li) * M + m] + (lo - a.member_off[m]);
    }
    return slot_addr(a.rank, t.self.slot) + lo;
  }

  void run_copy(const Task& t) {
    if (t.self.slot >= 0) {
      wait_flag(a.window_bases[a.rank] + L.arrival_flag(t.self.slot, t.chunk), [&] {
        return parent_of(t.self.slot) + " to deliver expert " + std::to_string(t.expert) + " chunk " +
               std::to_string(t.chunk) + " into slot " + std::to_string(t.self.slot) +
               " (arrival flag; this rank relays it)";
      });
    }
    for (int32_t i = 0; i < t.ref_count; ++i) {
      const Ref d = a.refs[t.ref_begin + i];
      wait_flag(a.window_bases[d.rank] + L.ready_flag(Op::kMulticast), [&] {
        return "rank " + std::to_string(d.rank) + " to join the operation (ready flag) before sending expert " +
               std::to_string(t.expert) + " chunk " + std::to_string(t.chunk) + " to its slot " +
               std::to_string(d.slot);
      });
      const uintptr_t dst = slot_addr(d.rank, d.slot);
      for_each_segment(t.offset, t.bytes, a.member_off, a.member_bytes, [&](size_t m, uint64_t lo, uint64_t hi) {
        std::memcpy(reinterpret_cast<void*>(dst + lo), reinterpret_cast<const void*>(self_addr(t, m, lo)),
                    hi - lo);
      });
      store_release(a.window_bases[d.rank] + L.arrival_flag(d.slot, t.chunk), a.epoch);
    }
  }

  void run_reduce(const Task& t) {
    for (int32_t i = 0; i < t.ref_count; ++i) {
      const Ref s = a.refs[t.ref_begin + i];
      wait_flag(a.window_bases[s.rank] + L.grad_ready_flag(s.slot, t.chunk), [&] {
        return "rank " + std::to_string(s.rank) + "'s grad of expert " + std::to_string(t.expert) + " chunk " +
               std::to_string(t.chunk) + " in slot " + std::to_string(s.slot) + " (grad_ready flag)";
      });
    }
    uintptr_t small[16];
    std::vector<uintptr_t> big;
    uintptr_t* srcs = small;
    if (t.ref_count > 16) {
      big.resize(t.ref_count);
      srcs = big.data();
    }
    for_each_segment(t.offset, t.bytes, a.member_off, a.member_bytes, [&](size_t m, uint64_t lo, uint64_t hi) {
      for (int32_t i = 0; i < t.ref_count; ++i) {
        const Ref s = a.refs[t.ref_begin + i];
        srcs[i] = slot_addr(s.rank, s.slot) + lo;
      }
      reduce_dispatch(a.grad_dtype, a.portable_f16, self_addr(t, m, lo), srcs, t.ref_count, hi - lo);
    });
    for (int32_t i = 0; i < t.ref_count; ++i) {
      const Ref s = a.refs[t.ref_begin + i];
      store_release(a.window_bases[s.rank] + L.consumed_flag(s.slot, t.chunk), a.epoch);
    }
    if (t.self.slot >= 0)
      store_release(a.window_bases[a.rank] + L.grad_ready_flag(t.self.slot, t.chunk), a.epoch);
  }

  void worker(int w) {
    try {
      uint64_t rng = a.jitter_seed + static_cast<uint64_t>(w);
      for (;;) {
        if (abort.load(std::memory_order_relaxed)) return;
        const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
        if (i >= a.num_tasks) return;
        if (a.jitter_us > 0) {
          const uint64_t us = splitmix64(rng) % (static_cast<uint64_t>(a.jitter_us) + 1);
          if (us) std::this_thread::sleep_for(std::chrono::microseconds(us));
        }
        const Task& t = a.tasks[i];
        if (mc)
          run_copy(t);
        else
          run_reduce(t);
      }
    } catch (const Aborted&) {
    } catch (...) {
      fail(std::current_exception());
    }
  }

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> g(err_mu);
    if (!first_error) first_error = e;
    abort.store(true);
  }
};

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument("ultracomm.run_host: " + msg); }

void validate(const ExecArgs& a) {
  if (a.op != Op::kMulticast && a.op != Op::kReduce) bad("op must be 0 (multicast) or 1 (reduce)");
  if (a.world < 1) bad("world must be >= 1, got " + std::to_string(a.world));
  if (a.rank < 0 || a.rank >= a.world)
    bad("rank " + std::to_string(a.rank) + " out of range for world " + std::to_string(a.world));
  if (a.epoch < 1) bad("epoch must be >= 1 (flags start at 0)");
  if (a.num_workers < 1) bad("num_workers must be >= 1, got " + std::to_string(a.num_workers));
  if (!(a.timeout_s > 0)) bad("timeout_s must be > 0");
  // a.layout is WindowLayout::make(...) by contract (the binding builds it so, after checking
  // slots >= 0 and chunk_bytes > 0); it is not re-derived here.
  const WindowLayout& L = a.layout;
  if (a.window_bases.size() != static_cast<size_t>(a.world))
    bad("window_bases has " + std::to_string(a.window_bases.size()) + " entries, world is " +
        std::to_string(a.world));
  for (size_t r = 0; r < a.window_bases.size(); ++r) {
    if (a.window_bases[r] == 0) bad("window_bases[" + std::to_string(r) + "] is null");
    if (a.window_bases[r] % 8) bad("window_bases[" + std::to_string(r) + "] is not 8-byte aligned");
  }
  const bool mc = a.op == Op::kMulticast;
  const uint64_t slot_bytes = mc ? L.weight_slot_bytes : L.grad_slot_bytes;
  const uint64_t nchunks = mc ? L.weight_chunks : L.grad_chunks;
  const uint64_t esize = mc ? 1 : dtype_size(a.grad_dtype);
  if (!mc && a.grad_dtype != DType::kF32 && a.grad_dtype != DType::kBF16 && a.grad_dtype != DType::kF16)
    bad("grad_dtype must be 0 (fp32), 1 (bf16) or 2 (fp16)");
  const size_t M = a.member_off.size();
  if (M == 0) bad("member_off is empty");
  if (a.member_bytes.size() != M) bad("member_off and member_bytes differ in length");
  uint64_t prev_end = 0;
  for (size_t m = 0; m < M; ++m) {
    const std::string mm = "member " + std::to_string(m);
    if (a.member_off[m] < prev_end) bad(mm + " overlaps the previous member or is out of order");
    if (a.member_bytes[m] > slot_bytes || a.member_off[m] > slot_bytes - a.member_bytes[m])
      bad(mm + " [" + std::to_string(a.member_off[m]) + ", +" + std::to_string(a.member_bytes[m]) +
          ") exceeds the slot's " + std::to_string(slot_bytes) + " bytes");
    if (a.member_off[m] % esize || a.member_bytes[m] % esize)
      bad(mm + " offset/size not a multiple of the grad element size " + std::to_string(esize));
    prev_end = a.member_off[m] + a.member_bytes[m];
  }
  if (a.master_ptrs.size() % M) bad("master_ptrs size is not a multiple of the member count");
  const int64_t n_local = static_cast<int64_t>(a.master_ptrs.size() / M);
  for (size_t i = 0; i < a.master_ptrs.size(); ++i)
    if (a.master_ptrs[i] % esize) bad("master_ptrs[" + std::to_string(i) + "] not aligned to the grad dtype");
  for (size_t e = 0; e < a.local_index_of.size(); ++e)
    if (a.local_index_of[e] < -1 || a.local_index_of[e] >= n_local)
      bad("local_index_of[" + std::to_string(e) + "] = " + std::to_string(a.local_index_of[e]) +
          " out of range (" + std::to_string(n_local) + " local experts)");
  if (a.my_slots.size() != static_cast<size_t>(L.slots))
    bad("my_slots has " + std::to_string(a.my_slots.size()) + " entries, layout has " +
        std::to_string(L.slots) + " slots");
  for (size_t s = 0; s < a.my_slots.size(); ++s)
    if (a.my_slots[s] < -1) bad("my_slots[" + std::to_string(s) + "] < -1");
  if (!a.slot_parent.empty() && a.slot_parent.size() != static_cast<size_t>(L.slots))
    bad("slot_parent must be empty or have one entry per slot");
  if (a.num_tasks < 0 || a.num_refs < 0) bad("negative task or ref count");
  if (a.num_tasks > 0 && !a.tasks) bad("tasks is null");
  if (a.num_refs > 0 && !a.refs) bad("refs is null");
  const uint8_t want_kind = static_cast<uint8_t>(mc ? TaskKind::kCopy : TaskKind::kReduce);
  for (int64_t i = 0; i < a.num_tasks; ++i) {
    const Task& t = a.tasks[i];
    const auto ti = [i] { return "task " + std::to_string(i) + ": "; };  // built only on error
    if (t.kind != want_kind)
      bad(ti() + "kind " + std::to_string(t.kind) + " does not belong to " + (mc ? "multicast" : "reduce"));
    if (t.self.rank != a.rank) bad(ti() + "self.rank " + std::to_string(t.self.rank) + " != rank " + std::to_string(a.rank));
    if (t.expert < 0) bad(ti() + "negative expert");
    if (t.chunk < 0 || static_cast<uint64_t>(t.chunk) >= nchunks)
      bad(ti() + "chunk " + std::to_string(t.chunk) + " out of range (" + std::to_string(nchunks) + " chunks)");
    {  // the byte range is the chunk's: flags are per chunk, so a mismatch would move or wait on the wrong bytes
      const uint64_t want_off = static_cast<uint64_t>(t.chunk) * L.chunk_bytes;  // < slot_bytes: chunk < nchunks
      const uint64_t want_bytes = std::min(L.chunk_bytes, slot_bytes - want_off);
      if (t.offset != want_off || t.bytes != want_bytes)
        bad(ti() + "byte range [" + std::to_string(t.offset) + ", +" + std::to_string(t.bytes) + ") is not chunk " +
            std::to_string(t.chunk) + "'s [" + std::to_string(want_off) + ", +" + std::to_string(want_bytes) +
            ") (chunk_bytes " + std::to_string(L.chunk_bytes) + ", " + (mc ? "weight" : "grad") + " slot " +
            std::to_string(slot_bytes) + " bytes)");
    }
    if (t.self.slot == kMaster) {
      if (static_cast<size_t>(t.expert) >= a.local_index_of.size() || a.local_index_of[t.expert] < 0)
        bad(ti() + "master source of expert " + std::to_string(t.expert) + " but it is not local (local_index_of)");
      const size_t li = static_cast<size_t>(a.local_index_of[t.expert]);
      for (size_t m = 0; m < M; ++m)
        if (a.member_bytes[m] && !a.master_ptrs[li * M + m])
          bad(ti() + "null master pointer for expert " + std::to_string(t.expert));
    } else if (t.self.slot < 0 || t.self.slot >= L.slots) {
      bad(ti() + "self.slot " + std::to_string(t.self.slot) + " out of range");
    } else if (a.my_slots[t.self.slot] != t.expert) {
      bad(ti() + "self slot " + std::to_string(t.self.slot) + " holds expert " + std::to_string(a.my_slots[t.self.slot]) +
          ", not " + std::to_string(t.expert));
    }
    if (t.ref_begin < 0 || t.ref_count < 0 || static_cast<int64_t>(t.ref_begin) + t.ref_count > a.num_refs)
      bad(ti() + "refs [" + std::to_string(t.ref_begin) + ", +" + std::to_string(t.ref_count) + ") out of range (" +
          std::to_string(a.num_refs) + " refs)");
    for (int32_t k = 0; k < t.ref_count; ++k) {
      const Ref r = a.refs[t.ref_begin + k];
      if (r.rank < 0 || r.rank >= a.world) bad(ti() + "ref rank " + std::to_string(r.rank) + " out of range");
      if (r.slot < 0 || r.slot >= L.slots) bad(ti() + "ref slot " + std::to_string(r.slot) + " out of range");
      if (r.rank == a.rank && r.slot == t.self.slot) bad(ti() + "ref equals self");
    }
    if (!mc) {
      for_each_segment(t.offset, t.bytes, a.member_off, a.member_bytes, [&](size_t m, uint64_t lo, uint64_t hi) {
        if ((lo - a.member_off[m]) % esize || (hi - lo) % esize)
          bad(ti() + "chunk cuts a grad element of member " + std::to_string(m));
      });
    }
  }
}

}  // namespace

void run_host(const ExecArgs& args) {
  validate(args);
  Runner R(args);
  const WindowLayout& L = args.layout;
  const uintptr_t own = args.window_bases[args.rank];

  // 1. join: raise ready[op]; for reduce publish every own non-relay replica grad.
  if (!R.mc) {
    R.is_relay.assign(L.slots, 0);
    for (int64_t i = 0; i < args.num_tasks; ++i)
      if (args.tasks[i].self.slot >= 0) R.is_relay[args.tasks[i].self.slot] = 1;
  }
  store_release(own + L.ready_flag(args.op), args.epoch);
  if (!R.mc) {
    for (int32_t s = 0; s < L.slots; ++s) {
      if (args.my_slots[s] < 0 || R.is_relay[s]) continue;
      for (uint64_t c = 0; c < L.grad_chunks; ++c) store_release(own + L.grad_ready_flag(s, c), args.epoch);
    }
  }

  // 2. workers claim tasks in list order.
  const int nw = static_cast<int>(std::min<int64_t>(args.num_workers, args.num_tasks));
  if (nw > 0) {
    std::vector<std::thread> threads;
    threads.reserve(nw - 1);
    try {
      for (int w = 1; w < nw; ++w) threads.emplace_back([&R, w] { R.worker(w); });
    } catch (...) {
      R.fail(std::current_exception());
    }
    R.worker(0);
    for (auto& t : threads) t.join();
    if (R.first_error) std::rethrow_exception(R.first_error);
  }

  // 3. wait until own slots are complete (multicast) or consumed by their parents (reduce).
  for (int32_t s = 0; s < L.slots; ++s) {
    const int32_t e = args.my_slots[s];
    if (e < 0) continue;
    for (uint64_t c = 0; c < R.nchunks; ++c) {
      if (R.mc) {
        R.wait_flag(own + L.arrival_flag(s, c), [&] {
          return R.parent_of(s) + " to deliver expert " + std::to_string(e) + " chunk " + std::to_string(c) +
                 " into slot " + std::to_string(s) + " (arrival flag)";
        });
      } else {
        R.wait_flag(own + L.consumed_flag(s, c), [&] {
          return R.parent_of(s) + " to consume expert " + std::to_string(e) + " chunk " + std::to_string(c) +
                 " of slot " + std::to_string(s) + " (consumed flag)";
        });
      }
    }
  }
}

}  // namespace ultracomm
