// k_persistent: one persistent kernel per operation launch.  CTA = one worker group; the grid
// is every rank's CTAs in rank order (persistent_args.h cta_rank: rank r runs blocks
// [cta_end[r - 1], cta_end[r]); ctas_per_rank each when uniform, one for a rank with no task
// when the host knows the counts), so a one-GPU loopback domain runs all its ranks in ONE launch
// with co-resident CTAs, and a process that owns one rank of a multi-GPU domain launches
// nranks = 1.  All protocol logic is interp.h's; this file is the prologue (view, epoch, mover),
// the loop (join / run_tasks / drain), the epilogue (the launch's last CTA resets the shared
// state), the launcher and the instantiations.
#include <cuda/atomic>

#include <type_traits>

#include "cuda_check.h"
#include "launch.h"
#include "mover_tma.cuh"
#include "mover_vec.cuh"

namespace ultracomm {
namespace {

static_assert(interp::Mover<dev::TmaMover<>> && interp::Mover<dev::TmaMover<true>> && interp::Mover<dev::VecMover>);

// The mover is chosen per compiled architecture: bulk copies from sm_90 on.  Staged: the
// kernels of reduce_path="tma" (TMA-staged reductions, sm_90+ only).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <bool Staged>
using DeviceMover = dev::TmaMover<Staged>;
#else
template <bool Staged>
using DeviceMover = dev::VecMover;
#endif

// Group-collective: this rank's view into shared memory (read by every thread for every
// task), with the launch's epoch, one for all its ranks (persistent_args.h launch_epoch).
__device__ void load_view(ExecView& view, const PersistentArgs& a, int rank, uint64_t& epoch) {
  static_assert(sizeof(ExecView) % 8 == 0);
  const uint64_t* src = reinterpret_cast<const uint64_t*>(a.views + rank);
  uint64_t* dst = reinterpret_cast<uint64_t*>(&view);
  for (int i = threadIdx.x; i < static_cast<int>(sizeof(ExecView) / 8); i += blockDim.x) dst[i] = src[i];
  epoch = launch_epoch(*a.state, a.epoch, a.nranks);
  __syncthreads();
  if (threadIdx.x == 0) view.epoch = epoch;
  __syncthreads();
}

// Group-collective: true in the CTA that is the last of `count` to arrive on `counter`.
// acq_rel: the last one's later work is ordered after everything the others did before.
__device__ bool last_to_arrive(uint32_t* counter, uint32_t count, dev::MoverBase& m) {
  __syncthreads();
  uint32_t last = 0;
  if (m.leader())
    last = cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(*counter).fetch_add(1, cuda::memory_order_acq_rel) ==
           count - 1;
  return m.broadcast(last) != 0;
}

// Group-collective: true in the first CTA to take a ticket from `counter` (relaxed: the ticket
// only elects, it publishes nothing).
__device__ bool first_ticket(uint32_t* counter, dev::MoverBase& m) {
  uint32_t first = 0;
  if (m.leader())
    first =
        cuda::atomic_ref<uint32_t, cuda::thread_scope_device>(*counter).fetch_add(1, cuda::memory_order_relaxed) == 0;
  return m.broadcast(first) != 0;
}

// Two CTAs per SM (<= 128 registers): what loopback grids on the shared ring and co-resident
// compute need (tests/transports/test_reduce_hunk.py); the tile claims of issue 34 took sm_100 past 128.
// One kernel per grad dtype and reduce path (Staged: reduce_path="tma").  Before sm_90 both are
// VecMover's (no bulk copies, no staged path), the same code: the runner refuses reduce_path="tma"
// there, and every kernel keeps the protocol the SASS tests check.
// __grid_constant__: the CTA layout (a.cta_end, indexed by a runtime rank) is read in place from
// the parameter space (LDC with a register index), never from a local copy of the struct.  nvcc 13
// already does so for this const parameter; the qualifier makes it a guarantee (any write to `a` is
// a compile error) and tests/cuda/test_cuda_build.py checks the SASS.
template <class D, bool Staged>
__global__ void __launch_bounds__(dev::kThreads, 2) k_persistent(const __grid_constant__ PersistentArgs a) {
#if defined(__CUDA_ARCH__)
  using Mover = DeviceMover<Staged>;
  __shared__ dev::GroupShared sh;
  __shared__ ExecView view;
  extern __shared__ __align__(128) unsigned char dyn_smem[];
  const int rank = cta_rank(a, static_cast<int32_t>(blockIdx.x)).rank;
  RankState& rs = a.state->ranks[rank];
  uint64_t epoch = 0;
  load_view(view, a, rank, epoch);
  Mover m(dev::MoverEnv{a.state, a.err, &rs.next_task, epoch}, &sh, dyn_smem, a.flags);

  // join by the rank's first CTA to start (ticket 0), not by worker 0: CTAs of one launch need
  // not all be resident at once (a one-rank launch is not cooperative), and peers wait on this
  // rank's ready flag while its started CTAs spin on theirs; a join left to a CTA still queued
  // behind them would never come.  It overlaps the other workers' first claims.
  if (first_ticket(&rs.join_ticket, m)) interp::join(view, m);
  interp::run_tasks<Mover, D>(view, m);
  // drain once per rank, by its last CTA out of run_tasks, unless the launch failed.
  // (the rank's CTA count looked up again here, not held in a register through run_tasks)
  const int32_t rank_ctas = cta_rank(a, static_cast<int32_t>(blockIdx.x)).ctas;
  if (last_to_arrive(&rs.done_workers, static_cast<uint32_t>(rank_ctas), m)) {
    bool ok = false;
    if (m.leader()) ok = !m.aborted();
    if (m.broadcast(ok)) interp::drain(view, m);
  }
  // The launch's last CTA resets what the next launch must find zero (also the tile counters a
  // failed launch left; a completed one's are zero again) and records each rank's epoch; the
  // next launch on this stream starts after this kernel completed.
  if (last_to_arrive(&a.state->done_ctas, gridDim.x, m) && m.leader()) {
    const bool failed = m.aborted();  // tiles of a failed launch may have left counts behind
    for (int r = 0; r < a.nranks; ++r) {
      if (failed && a.views[r].tile_done != nullptr)
        for (int64_t i = 0; i < a.views[r].num_tasks; ++i) a.views[r].tile_done[i] = 0;
      RankState& s = a.state->ranks[r];
      s.last_epoch = epoch;
      s.next_task = 0;
      s.done_workers = 0;
      s.join_ticket = 0;
    }
    a.state->done_ctas = 0;
  }
#endif
}

// Runs fn on the kernel of grad_dtype (0 fp32, 1 bf16, 2 fp16) and reduce path (staged: the
// TMA-staged reduce).
template <class Fn>
void for_kernel(int grad_dtype, bool staged, Fn&& fn) {
  const auto pick = [&](auto stage) {
    constexpr bool S = decltype(stage)::value;
    switch (grad_dtype) {
      case 1:
        fn(k_persistent<interp::GradBF16, S>);
        break;
      case 2:
        fn(k_persistent<interp::GradF16, S>);
        break;
      default:
        fn(k_persistent<interp::GradF32, S>);
        break;
    }
  };
  if (staged)
    pick(std::true_type{});
  else
    pick(std::false_type{});
}

}  // namespace

namespace gpu {

// Both reduce paths use the same ring: the staged reduce adds no shared memory.
static_assert(dev::TmaMover<true>::kSmemBytes == dev::TmaMover<>::kSmemBytes);

namespace {

// The most static shared memory of the persistent kernels (GroupShared, the view): every ring
// sits beside it.
int64_t persistent_static_smem() {
  int64_t most = 0;
  for (int d = 0; d < 3; ++d)
    for (const bool staged : {false, true})
      for_kernel(d, staged, [&](auto k) {
        cudaFuncAttributes fa{};
        UC_CUDA_CHECK(cudaFuncGetAttributes(&fa, k));
        if (static_cast<int64_t>(fa.sharedSizeBytes) > most) most = static_cast<int64_t>(fa.sharedSizeBytes);
      });
  return most;
}

// Bytes of the largest ring of <= cap stages within `room` bytes; 0 under two stages (the mover
// then copies through the vector path, mover_tma.cuh).
uint32_t ring_within(int64_t room, int cap) {
  int s = cap;
  while (s >= 2 && static_cast<int64_t>(tma_smem_bytes(s)) > room) --s;
  return s >= 2 ? tma_smem_bytes(s) : 0;
}

}  // namespace

// The rings follow the device, not its architecture alone: an sm_120 part (RTX Blackwell) runs
// the sm_100 code with 99 KB per block and 100 KB per SM, where the 6-stage ring (192 KB) would
// make cudaFuncSetAttribute fail and no Runner could be made.
PersistentRings setup_persistent(int device, int cc_major) {
  PersistentRings r;
  UC_CUDA_CHECK(cudaDeviceGetAttribute(&r.sms, cudaDevAttrMultiProcessorCount, device));
  if (cc_major >= 9) {  // before sm_90 the kernels run VecMover: no ring
    int optin = 0, per_sm = 0, reserved = 0;
    UC_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    UC_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    UC_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
    const int64_t fixed = persistent_static_smem();
    r.deep = ring_within(optin - fixed, kTmaStages);
    // two CTAs per SM: each gets half the SM's shared memory, less the block's reserve
    const int64_t half = per_sm / 2 - reserved < optin ? per_sm / 2 - reserved : optin;
    r.shared = ring_within(half - fixed, kTmaStagesShared);
  }
  for (int d = 0; d < 3; ++d)
    for (const bool staged : {false, true})
      for_kernel(d, staged, [&](auto k) {
        UC_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(r.deep)));
      });
  return r;
}

// The lower of the two reduce paths' kernels (the loopback check does not know which will run).
int persistent_max_coresident(const PersistentRings& rings, int grad_dtype) {
  int per_sm = 1 << 30;
  for (const bool staged : {false, true})
    for_kernel(grad_dtype, staged, [&](auto k) {
      // a loopback grid above the SM count runs the shared ring (PersistentRings::pick)
      int n = 0;
      UC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, dev::kThreads, rings.shared));
      per_sm = n < per_sm ? n : per_sm;
    });
  return per_sm * rings.sms;
}

// smem: the ring the caller picked (PersistentRings::pick).
void launch_persistent(const PersistentArgs& a, int grad_dtype, uint32_t smem, bool cooperative, cudaStream_t stream) {
  const bool staged = (a.flags & kReduceStaged) != 0;  // the runner allows it from sm_90 on
  for_kernel(grad_dtype, staged, [&](auto k) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(launch_grid(a)));
    cfg.blockDim = dim3(dev::kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
    cfg.attrs = attr;
    cfg.numAttrs = cooperative ? 1 : 0;
    UC_CUDA_CHECK(cudaLaunchKernelEx(&cfg, k, a));
  });
}

}  // namespace gpu
}  // namespace ultracomm
