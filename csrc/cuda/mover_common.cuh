// What TmaMover and VecMover share (the interp.h Mover policy minus how bytes move): group
// identity and barrier, task claiming, system-scope epoch flags, %globaltimer, failure and
// abort; plus the 16-byte vector copy and the ordered fp32 reduction (the sm_80 path, and
// the tails / unaligned segments of the TMA path).
//
// One mover object per thread; one CTA is one worker group; thread 0 is the leader (flags,
// claims, bulk copies).  Never `__restrict__` a pointer a peer writes: it turns plain loads
// into ld.global.nc, which may return stale data after the acquire.
#pragma once
#include <cuda/atomic>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "mover_limits.h"
#include "persistent_args.h"
#include "ptx_extra.cuh"
#include "ultracomm/impl/interp.h"
#include "ultracomm/impl/reduce_hunk.h"

namespace ultracomm::dev {

constexpr int kThreads = gpu::kThreadsPerCta;

constexpr int kSmemSrcs = 64;  // reduce sources whose addresses are staged in shared memory

// Static shared memory of one CTA: the broadcast word, and the addresses of the current copy's
// destinations / reduction's sources (computed once per segment, read by every thread).
struct GroupShared {
  alignas(16) unsigned char bcast[16];
  uintptr_t dsts[interp::kMaxCopyDsts];
  uintptr_t srcs[kSmemSrcs];
  uint32_t known[interp::kPeerCacheRanks / 32];  // leader: peers whose plan it verified this launch
  uint64_t scan_min[kThreads / 32];              // first_below: each warp's first flag not up
};

// What a launch gives each CTA's mover (device pointers).
struct MoverEnv {
  DeviceState* state;   // abort word (device memory, polled)
  ErrorSlot* err;       // first failure's record (mapped host memory, written once)
  uint64_t* next_task;  // this rank's claim counter (device memory, reset by the launch's last CTA)
  uint64_t epoch;       // the epoch this launch runs (abort and records are tagged with it)
};

class MoverBase {
 public:
  // Only the leader touches the peer cache: it clears it here, no barrier needed.
  __device__ MoverBase(const MoverEnv& env, GroupShared* sh) : env_(env), sh_(sh) {
    if (leader())
      for (int i = 0; i < interp::kPeerCacheRanks / 32; ++i) sh_->known[i] = 0;
  }

  __device__ bool leader() const { return threadIdx.x == 0; }
  __device__ void sync() { __syncthreads(); }

  // Group-collective.  The first barrier keeps the previous broadcast's readers ahead of
  // this write; the second publishes it.
  template <class T>
  __device__ T broadcast(T v) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(GroupShared::bcast));
    __syncthreads();
    if (leader()) memcpy(sh_->bcast, &v, sizeof(T));
    __syncthreads();
    T out;
    memcpy(&out, sh_->bcast, sizeof(T));
    return out;
  }

  // Group-collective: the next task index of this rank (list order), -1 once the launch is
  // aborted.  Relaxed: the index only partitions work; data and flags are ordered by the
  // flags' acquire/release.
  __device__ int64_t claim() {
    int64_t i = -1;
    if (leader() && !aborted())
      i = static_cast<int64_t>(cuda::atomic_ref<uint64_t, cuda::thread_scope_device>(*env_.next_task)
                                   .fetch_add(1, cuda::memory_order_relaxed));
    return broadcast(i);
  }

  // Epoch flags live in windows that other GPUs (or, in loopback, other CTAs) write: system
  // scope.  SASS: LDG.E.64.STRONG.SYS + CCTL.IVALL (acquire: the L1 is invalidated, so the
  // whole CTA's later plain loads see the peer's data); MEMBAR.ALL.SYS + STG.E.64.STRONG.SYS.
  __device__ uint64_t load_acquire(uintptr_t flag) {
    return cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*reinterpret_cast<uint64_t*>(flag))
        .load(cuda::memory_order_acquire);
  }
  // A poll in a wait loop: ld.relaxed.sys (LDG.E.64.STRONG.SYS, no CCTL.IVALL); the wait
  // acquires once after it saw the epoch (interp.h leader_wait).
  __device__ uint64_t load_relaxed(uintptr_t flag) {
    return cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*reinterpret_cast<uint64_t*>(flag))
        .load(cuda::memory_order_relaxed);
  }
  __device__ void store_release(uintptr_t flag, uint64_t v) {
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*reinterpret_cast<uint64_t*>(flag))
        .store(v, cuda::memory_order_release);
  }

  // Publishing N flags: one fence.acq_rel.sys (MEMBAR.ALL.SYS) orders everything before it
  // (the copies, complete after before_release) ahead of the relaxed system-scope flag stores
  // that follow (GPU_NOTES: one fence for N flags, not a release store each).
  __device__ void fence_release() { cuda::atomic_thread_fence(cuda::memory_order_acq_rel, cuda::thread_scope_system); }
  __device__ void store_after_fence(uintptr_t flag, uint64_t v) {
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*reinterpret_cast<uint64_t*>(flag))
        .store(v, cuda::memory_order_relaxed);
  }

  __device__ bool peer_known(int32_t r) const {
    return r >= 0 && r < interp::kPeerCacheRanks && ((sh_->known[r >> 5] >> (r & 31)) & 1u);
  }
  __device__ void set_peer_known(int32_t r) {
    if (r >= 0 && r < interp::kPeerCacheRanks) sh_->known[r >> 5] |= 1u << (r & 31);
  }

  // Leader: one tile of a split task done (interp.h).  acq_rel at device scope: the CTAs that
  // retire a task's tiles are on this GPU; each one's copies were complete (before_release)
  // before its add, and the last one's fence.acq_rel.sys before the flags is cumulative, so a
  // peer that acquires a flag sees every tile.  The last one resets the counter for the next
  // launch (a failed launch's counters are reset by its last CTA, k_persistent).
  __device__ bool retire(uintptr_t counter, uint32_t tiles) {
    cuda::atomic_ref<uint32_t, cuda::thread_scope_device> c(*reinterpret_cast<uint32_t*>(counter));
    if (c.fetch_add(1u, cuda::memory_order_acq_rel) + 1u != tiles) return false;
    c.store(0u, cuda::memory_order_relaxed);
    return true;
  }

  // Group-collective (interp.h first_below): thread t polls flags t, t + blockDim, ... relaxed
  // (LD.E.64.STRONG.SYS, no CCTL.IVALL in the loop) up to its first one below the epoch.  A
  // thread that saw a flag up then acquires once: fence.acq_rel.sys after its polls (its reads
  // and the fence form an acquire; MEMBAR.ALL.SYS + CCTL.IVALL, once per warp, not per flag),
  // before the barrier that orders the whole CTA after it.  The barrier is a vote
  // (__syncthreads_or): every flag up, n, and done.  Else the smallest index: a warp minimum
  // per warp into shared memory, one more barrier, the minimum of those (the next call writes
  // them only after its vote, when every thread has read these).
  __device__ uint64_t first_below(uintptr_t flags, uint64_t n, uint64_t epoch) {
    uint64_t mine = n;
    uint64_t i = threadIdx.x;
    for (; i < n; i += blockDim.x)
      if (load_relaxed(flags + 8 * i) < epoch) {
        mine = i;
        break;
      }
    if (i > threadIdx.x) cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_system);
    if (!__syncthreads_or(mine < n)) return n;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      const uint64_t o = __shfl_xor_sync(0xffffffffu, mine, d);
      mine = o < mine ? o : mine;
    }
    if ((threadIdx.x & 31u) == 0) sh_->scan_min[threadIdx.x >> 5] = mine;
    __syncthreads();
    uint64_t first = n;
    for (uint32_t w = 0; w < (blockDim.x >> 5); ++w) first = sh_->scan_min[w] < first ? sh_->scan_min[w] : first;
    return first;
  }

  __device__ uint64_t now_ns() { return globaltimer_ns(); }
  __device__ uint64_t epoch() const { return env_.epoch; }

  // Backoff in a wait loop: spin hot first (latency of a flag that is about to flip), then
  // sleep a little so spinning CTAs leave issue slots and memory bandwidth to working ones.
  __device__ void relax(uint32_t spins) {
    if (spins >= 64) __nanosleep(spins >= 1024 ? 1000u : 100u);
  }

  // Another group of this launch failed (abort word tagged with this launch's epoch).
  __device__ bool aborted() {
    return cuda::atomic_ref<uint64_t, cuda::thread_scope_device>(env_.state->abort_epoch)
               .load(cuda::memory_order_relaxed) >= env_.epoch;
  }

  // First failure of this launch wins the CAS on the abort word (device memory: atomics on
  // mapped host memory are not atomic over PCIe), then writes the record to mapped host
  // memory; the record's epoch goes last, after a system fence, so a host that sees it sees
  // the fields.  Every other group stops at its next aborted() check.
  __device__ void fail(const ErrorRecord& rec) {
    cuda::atomic_ref<uint64_t, cuda::thread_scope_device> abort(env_.state->abort_epoch);
    uint64_t old = abort.load(cuda::memory_order_relaxed);
    while (old < env_.epoch) {
      if (abort.compare_exchange_weak(old, env_.epoch, cuda::memory_order_relaxed)) {
        env_.err->rec = rec;
        __threadfence_system();
        cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(env_.err->epoch)
            .store(env_.epoch, cuda::memory_order_relaxed);
        return;
      }
    }
  }

  // Group-collective: the segment's destinations, to shared memory (the interpreter's array
  // is per thread; unrolled constant indices keep it in registers).
  __device__ const uintptr_t* stage_dsts(const uintptr_t* dsts, int ndst) {
    __syncthreads();  // the previous copy's readers are done with the table
    if (leader()) {
#pragma unroll
      for (int j = 0; j < interp::kMaxCopyDsts; ++j)
        if (j < ndst) sh_->dsts[j] = dsts[j];
    }
    __syncthreads();
    return sh_->dsts;
  }

  // Group-collective: the first kSmemSrcs source addresses to shared memory, computed once
  // instead of once per element; the rest (a reduce with more sources) computed on use.
  template <class Srcs>
  struct SrcTable {
    const uintptr_t* staged;
    const Srcs& rest;
    __device__ uintptr_t operator[](int s) const { return s < kSmemSrcs ? staged[s] : rest[s]; }
  };
  template <class Srcs>
  __device__ SrcTable<Srcs> stage_srcs(const Srcs& srcs, int nsrc) {
    __syncthreads();
    for (int s = threadIdx.x; s < nsrc && s < kSmemSrcs; s += blockDim.x) sh_->srcs[s] = srcs[s];
    __syncthreads();
    return SrcTable<Srcs>{sh_->srcs, srcs};
  }

 protected:
  MoverEnv env_;
  GroupShared* sh_;
};

__device__ __forceinline__ uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

// ---------------------------------------------------------------------------------------
// Global memory access of the data paths.  The addresses come from the view as integers, so
// plain dereferences would be generic LD/ST; the .cg intrinsics are global loads/stores that
// cache in L2 only (ld.global.cg / st.global.cg: LDG/STG in SASS, never the .nc path), which
// also suits data that is read or written once and may live on a peer GPU.

template <class U>
__device__ __forceinline__ U load_g(uintptr_t p) {
  return __ldcg(reinterpret_cast<const U*>(p));
}
template <class U>
__device__ __forceinline__ void store_g(uintptr_t p, U v) {
  __stcg(reinterpret_cast<U*>(p), v);
}

// ---------------------------------------------------------------------------------------
// Vector copy: every thread loads a unit once and stores it to each destination.

// Units of U at byte `begin` of the segment: src + begin -> dsts[d] + begin.
template <class U>
__device__ __forceinline__ void copy_units(const uintptr_t* dsts, int ndst, uintptr_t src, uint64_t begin, uint64_t n) {
  const uintptr_t s = src + begin;
  const uint64_t stride = blockDim.x;
  uint64_t i = threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {  // four loads in flight per thread
    const U v0 = load_g<U>(s + i * sizeof(U)), v1 = load_g<U>(s + (i + stride) * sizeof(U));
    const U v2 = load_g<U>(s + (i + 2 * stride) * sizeof(U)), v3 = load_g<U>(s + (i + 3 * stride) * sizeof(U));
    for (int d = 0; d < ndst; ++d) {
      const uintptr_t p = dsts[d] + begin;
      store_g(p + i * sizeof(U), v0);
      store_g(p + (i + stride) * sizeof(U), v1);
      store_g(p + (i + 2 * stride) * sizeof(U), v2);
      store_g(p + (i + 3 * stride) * sizeof(U), v3);
    }
  }
  for (; i < n; i += stride) {
    const U v = load_g<U>(s + i * sizeof(U));
    for (int d = 0; d < ndst; ++d) store_g(dsts[d] + begin + i * sizeof(U), v);
  }
}

// Group-collective: bytes [from, bytes) of src -> each dst.  The unit is the widest power of
// two <= 16 in which every destination is congruent to the source (16 B when all are 16-B
// aligned); bytes before the first aligned unit and after the last go one by one.
__device__ inline void vec_copy(const uintptr_t* dsts, int ndst, uintptr_t src, uint64_t bytes, uint64_t from = 0) {
  if (from >= bytes || ndst <= 0) return;
  uintptr_t x = 0;
  for (int d = 0; d < ndst; ++d) x |= dsts[d] ^ src;
  const uint32_t w = (x & 1) ? 1 : (x & 2) ? 2 : (x & 4) ? 4 : (x & 8) ? 8 : 16;
  const uint64_t n = bytes - from;
  const uint64_t head = min_u64(n, static_cast<uint64_t>((0 - (src + from)) & (w - 1)));
  const uint64_t units = (n - head) / w;
  const uint64_t body_end = from + head + units * w;
  for (uint64_t b = from + threadIdx.x; b < from + head; b += blockDim.x) {
    const uint8_t v = load_g<uint8_t>(src + b);
    for (int d = 0; d < ndst; ++d) store_g(dsts[d] + b, v);
  }
  // if-chain, not switch: a jump table (brx.idx) made ptxas spill around the indirect branch
  if (w == 16)
    copy_units<uint4>(dsts, ndst, src, from + head, units);
  else if (w == 8)
    copy_units<uint2>(dsts, ndst, src, from + head, units);
  else if (w == 4)
    copy_units<uint32_t>(dsts, ndst, src, from + head, units);
  else if (w == 2)
    copy_units<uint16_t>(dsts, ndst, src, from + head, units);
  else
    copy_units<uint8_t>(dsts, ndst, src, from + head, units);
  for (uint64_t b = body_end + threadIdx.x; b < bytes; b += blockDim.x) {
    const uint8_t v = load_g<uint8_t>(src + b);
    for (int d = 0; d < ndst; ++d) store_g(dsts[d] + b, v);
  }
}

// ---------------------------------------------------------------------------------------
// Ordered reduction: dst[i] = D(f32(dst[i]) + f32(src0[i]) + f32(src1[i]) + ...), left to right
// in fp32 registers, the same operations in the same order as the host executor (D's
// conversions and the add, sum_rn, are half.h's: bit-identical, NaNs too).  Element i belongs to one
// thread; no atomics.  The 16-byte path is reduce_hunk.h's (warp hunks, a group of sources loaded
// before the first add, hardware conversions): it adds plainly and redoes a hunk with the NaN rule
// only when a sum came out NaN (NaN absorbs: a sum with no NaN step is the plain one), re-reading
// its inputs; the single elements before and after use the rule at every step (reduce_elem).

// The element at byte offset off, summed with the NaN rule at every step (dst not yet written).
template <class D, class Srcs>
__device__ __forceinline__ float reduce_elem(uintptr_t dst, const Srcs& srcs, int nsrc, uint64_t off) {
  using T = typename D::T;
  float acc = D::load(load_g<T>(dst + off));
  for (int s = 0; s < nsrc; ++s) acc = detail::sum_rn(acc, D::load(load_g<T>(srcs[s] + off)));
  return acc;
}

template <class D, class Srcs>
__device__ __forceinline__ void reduce_one(uintptr_t dst, const Srcs& srcs, int nsrc, uint64_t i) {
  using T = typename D::T;
  const uint64_t off = i * sizeof(T);
  store_g(dst + off, D::store(reduce_elem<D, Srcs>(dst, srcs, nsrc, off)));
}

// The hot path's conversions (reduce_hunk.h Cvt): hardware, one instruction per pair of halves
// (cvt.f32.f16 / cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32), the same bits as half.h's integer
// routines for every input that is not a NaN -- exact widening (fp16 subnormals and infinities
// included), round-to-nearest-even narrowing with overflow to inf and results in the subnormal
// range rounded, not flushed (no -ftz).  Only NaNs differ (the hardware returns a canonical
// NaN; half.h keeps payloads as x86 does), and a NaN lane sends its hunk to the slow path.
template <class D>
struct HwCvt : detail::SoftCvt<D> {};  // fp32: no conversion; the add is the same __fadd_rn

template <>
struct HwCvt<interp::GradF16> {
  static constexpr int E = 8;
  __device__ __forceinline__ static void unpack(const detail::Pack16& p, float (&f)[E]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &p.w[i], 4);
      const float2 v = __half22float2(h);  // element 2i is the low half
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
  __device__ __forceinline__ static detail::Pack16 pack(const float (&f)[E]) {
    detail::Pack16 p;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 h = __float22half2_rn(make_float2(f[2 * i], f[2 * i + 1]));
      memcpy(&p.w[i], &h, 4);
    }
    return p;
  }
};

template <>
struct HwCvt<interp::GradBF16> {
  static constexpr int E = 8;
  // bf16 -> fp32 is a shift: half.h's (exact, NaNs included)
  __device__ __forceinline__ static void unpack(const detail::Pack16& p, float (&f)[E]) {
    detail::SoftCvt<interp::GradBF16>::unpack(p, f);
  }
  __device__ __forceinline__ static detail::Pack16 pack(const float (&f)[E]) {
    detail::Pack16 p;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 h = __float22bfloat162_rn(make_float2(f[2 * i], f[2 * i + 1]));
      memcpy(&p.w[i], &h, 4);
    }
    return p;
  }
};

// reduce_hunk.h Io: 16-byte global .cg loads and stores (LDG.E.128 / STG.E.128).
struct GlobalIo {
  __device__ __forceinline__ static detail::Pack16 load(uintptr_t a) {
    const uint4 v = load_g<uint4>(a);
    detail::Pack16 p;
    memcpy(&p, &v, 16);
    return p;
  }
  __device__ __forceinline__ static void store(uintptr_t a, const detail::Pack16& p) {
    uint4 v;
    memcpy(&v, &p, 16);
    store_g(a, v);
  }
};

// Packs per lane of a warp's hunk, and sources loaded together (reduce_hunk.h): dst's and a
// group's packs, (G + 1) x U x 16 B = 192 B per thread in flight (48 KB per CTA; the old loop had
// one or two 16-B loads).  G = 4 took the kernels from ~110 to 140-156 registers (one CTA per SM
// instead of two: loopback grids and co-resident compute lose half); G = 2 stays <= 128.
constexpr int kReduceUnroll = 4;
constexpr int kReduceGroup = 2;
static_assert(kThreads % 32 == 0, "hunks are per warp");

// Group-collective.  16-byte packs where dst and every source share their alignment mod 16,
// single elements before and after (and everywhere otherwise).  A warp owns a hunk of
// 32 x kReduceUnroll consecutive packs (lane l: packs l, l + 32, ...: each load instruction is
// 512 coalesced bytes); the packs after the last whole hunk go one per thread.
template <class D, class Srcs>
__device__ inline void vec_reduce(uintptr_t dst, const Srcs& srcs, int nsrc, uint64_t nelem) {
  using T = typename D::T;
  constexpr uint64_t E = 16 / sizeof(T);
  constexpr int U = kReduceUnroll;
  uintptr_t x = 0;
  for (int s = 0; s < nsrc; ++s) x |= srcs[s] ^ dst;
  uint64_t head = nelem, packs = 0;
  if ((x & 15) == 0) {
    head = min_u64(nelem, static_cast<uint64_t>(((0 - dst) & 15) / sizeof(T)));
    packs = (nelem - head) / E;
  }
  for (uint64_t i = threadIdx.x; i < head; i += blockDim.x) reduce_one<D, Srcs>(dst, srcs, nsrc, i);
  const uint64_t body = head * sizeof(T);  // byte offset of pack 0
  const uint64_t hunks = packs / (32 * U);
  const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (uint64_t h = warp; h < hunks; h += warps) {
    uint64_t off[U];
#pragma unroll
    for (int u = 0; u < U; ++u) off[u] = body + ((h * U + u) * 32 + lane) * 16;
    detail::reduce_hunk<D, HwCvt<D>, GlobalIo, U, kReduceGroup>(dst, srcs, nsrc, off);
  }
  for (uint64_t p = hunks * 32 * U + threadIdx.x; p < packs; p += blockDim.x) {
    const uint64_t off[1] = {body + p * 16};
    detail::reduce_hunk<D, HwCvt<D>, GlobalIo, 1, kReduceGroup>(dst, srcs, nsrc, off);
  }
  for (uint64_t i = head + packs * E + threadIdx.x; i < nelem; i += blockDim.x) reduce_one<D, Srcs>(dst, srcs, nsrc, i);
}

}  // namespace ultracomm::dev
