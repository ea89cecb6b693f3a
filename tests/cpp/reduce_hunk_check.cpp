// The device reduce's hot path (include/ultracomm/impl/reduce_hunk.h, as csrc/cuda/mover_common.cuh
// vec_reduce drives it: warp hunks of U packs per lane, sources in groups of G, then one pack per
// thread) against the host executor's reduce (csrc/movers/host_reduce.h, scalar and F16C), bit
// for bit, on random fp32 / bf16 / fp16 inputs with NaNs (random payloads and signs), infinities,
// subnormals, values that overflow when summed, and k = 1 .. 11 sources.  Cvt is half.h's, and
// a GPU-like one whose NaNs are canonical (what cvt.f32.f16 / cvt.rn.f16x2.f32 /
// cvt.rn.bf16x2.f32 return): the NaN slow path must make it invisible.  Exit 0 when all match.
//
//   reduce_hunk_check [--seed N] [--rounds N]
// Built with -DUC_MUTATE_FTZ, the GPU-like conversion flushes subnormal results to zero (as
// cvt.ftz would): the check must then fail (tests/transports/test_reduce_hunk.py).
//
// The staged reduce (reduce_hunk.h "Staged reduce", csrc/cuda/mover_tma.cuh staged_body) runs
// here too, as the device drives it but sequentially: a ring of S stages of `per` sub-tiles,
// fills issued by memcpy (the bulk loads) through staged_issue_fill up to S ahead, every thread
// folding a fill (staged_consume_fill) before its stage is refilled (the device's barrier), the
// refill's start derived from the adds' cursor as the device derives it; stages are poisoned
// with finite garbage (0x5A bytes) before each refill so that a slot read before, after or
// instead of its operand changes a sum.  Built with -DUC_MUTATE_STAGED_EARLY_REFILL, a stage is
// refilled before its fill was added: the check must then fail.
#include <array>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "movers/host_reduce.h"
#include "ultracomm/impl/reduce_hunk.h"

using namespace ultracomm;
using detail::Pack16;

namespace {

struct HostIo {
  static Pack16 load(uintptr_t a) {
    Pack16 p;
    std::memcpy(&p, reinterpret_cast<const void*>(a), 16);
    return p;
  }
  static void store(uintptr_t a, const Pack16& p) { std::memcpy(reinterpret_cast<void*>(a), &p, 16); }
};

// What the device's hardware conversions return: half.h's bits except on NaNs, which come back
// canonical (0x7FFFFFFF widened, 0x7FFF narrowed).
template <class D>
struct GpuLikeCvt {
  using T = typename D::T;
  static constexpr int E = 16 / sizeof(T);
  static void unpack(const Pack16& p, float (&f)[E]) {
    detail::SoftCvt<D>::unpack(p, f);
    if constexpr (std::is_same_v<D, interp::GradF16>)
      for (int k = 0; k < E; ++k)
        if (detail::f32_is_nan(detail::f32_bits(f[k]))) f[k] = detail::f32_from_bits(0x7FFFFFFFu);
  }
  static Pack16 pack(const float (&f)[E]) {
#if defined(UC_MUTATE_FTZ)
    float z[E];
    for (int k = 0; k < E; ++k) z[k] = std::fpclassify(f[k]) == FP_SUBNORMAL ? 0.0f * f[k] : f[k];
    Pack16 p = detail::SoftCvt<D>::pack(z);
#else
    Pack16 p = detail::SoftCvt<D>::pack(f);
#endif
    if constexpr (sizeof(T) == 2) {
      uint16_t e[E];
      std::memcpy(e, &p, 16);
      for (int k = 0; k < E; ++k)
        if (detail::f32_is_nan(detail::f32_bits(f[k]))) e[k] = 0x7FFF;
      std::memcpy(&p, e, 16);
    }
    return p;
  }
};

// The device's distribution of packs (vec_reduce): warp hunks of 32 x U packs, lane l of hunk h
// at packs (h U + u) 32 + l; the rest one pack at a time.  Order between packs does not matter
// (each element has one writer); what it exercises is the offsets and the grouping.
template <class D, class Cvt, int U, int G>
void device_like(uintptr_t dst, const std::vector<uintptr_t>& srcs, uint64_t packs) {
  const int nsrc = static_cast<int>(srcs.size());
  const uint64_t hunks = packs / (32 * U);
  for (uint64_t h = 0; h < hunks; ++h)
    for (uint64_t lane = 0; lane < 32; ++lane) {
      uint64_t off[U];
      for (int u = 0; u < U; ++u) off[u] = ((h * U + u) * 32 + lane) * 16;
      detail::reduce_hunk<D, Cvt, HostIo, U, G>(dst, srcs, nsrc, off);
    }
  for (uint64_t p = hunks * 32 * U; p < packs; ++p) {
    const uint64_t off[1] = {p * 16};
    detail::reduce_hunk<D, Cvt, HostIo, 1, G>(dst, srcs, nsrc, off);
  }
}

// The device's staged reduce, sequentially (see the top).  threads x U x 16 = sub-tile bytes;
// `head` packs before the staged body go through reduce_hunk (the device's reduce_one elements
// before the first aligned pack; here a 16-byte offset of every operand's body).
template <class D, class Cvt, int U>
bool staged_like(uintptr_t dst, const std::vector<uintptr_t>& srcs, uint64_t packs, uint32_t threads, uint32_t stages,
                 int per, uint64_t head) {
  const int nsrc = static_cast<int>(srcs.size());
  if (head > packs) head = packs;
  for (uint64_t p = 0; p < head; ++p) {
    const uint64_t off[1] = {p * 16};
    detail::reduce_hunk<D, Cvt, HostIo, 1, 2>(dst, srcs, nsrc, off);
  }
  if (head == packs) return true;
  const uint32_t sub = threads * U * 16;
  const detail::StagedSegment g =
      detail::StagedSegment::make(static_cast<uint32_t>(head * 16), (packs - head) * 16, sub, nsrc + 1, per);
  const size_t stage_bytes = static_cast<size_t>(per) * sub;
  std::vector<unsigned char> ring(stages * stage_bytes, 0x5A);
  bool ok = true;
  detail::StagedCursor running;  // where the next fill starts, kept fill by fill
  auto issue = [&](detail::StagedCursor at, uint32_t s) {
    if (at.tile != running.tile || at.op != running.op) ok = false;  // the device derives it from the adds
    unsigned char* stage = ring.data() + s * stage_bytes;
    std::memset(stage, 0x5A, stage_bytes);
    uint32_t expected = 0, got = 0;
    detail::staged_issue_fill(
        g, at, dst, srcs, [&](uint32_t bytes) { expected = bytes; },
        [&](int h, uintptr_t src, uint32_t bytes) {
          if (h >= per || bytes == 0 || bytes > sub || bytes % 16) ok = false;
          std::memcpy(stage + static_cast<size_t>(h) * sub, reinterpret_cast<const void*>(src), bytes);
          got += bytes;
        });
    if (expected != got) ok = false;  // the mbarrier's expect_tx must match the bytes loaded
    running = at;
  };
  detail::StagedCursor at;
  for (uint32_t q = 0; q < stages && at.tile < g.tiles; ++q) {
    issue(at, q);
    at = running;
  }
  std::vector<std::array<std::array<float, Cvt::E>, U>> accs(threads);
  std::vector<detail::StagedCursor> take(threads);
  for (uint32_t s = 0;; s = s + 1 == stages ? 0 : s + 1) {
    detail::StagedCursor next = take[0];
    next.advance(static_cast<int>(stages) * per, g.ops);  // start of the fill after this stage's
#if defined(UC_MUTATE_STAGED_EARLY_REFILL)
    if (next.tile < g.tiles) issue(next, s);
#endif
    const uintptr_t stage = reinterpret_cast<uintptr_t>(ring.data() + s * stage_bytes);
    for (uint32_t t = 0; t < threads; ++t) {
      float (&acc)[U][Cvt::E] = *reinterpret_cast<float (*)[U][Cvt::E]>(accs[t].data());
      detail::staged_consume_fill<D, Cvt, HostIo, HostIo, U>(acc, g, take[t], stage, dst, srcs, t, threads);
    }
    for (uint32_t t = 1; t < threads; ++t)
      if (take[t].tile != take[0].tile || take[t].op != take[0].op) ok = false;
    if (take[0].tile >= g.tiles) break;
#if !defined(UC_MUTATE_STAGED_EARLY_REFILL)
    detail::StagedCursor from = take[0];  // as the device: (stages - 1) fills past the adds
    from.advance(static_cast<int>(stages - 1) * per, g.ops);
    if (from.tile < g.tiles) issue(from, s);
#endif
  }
  return ok;
}

struct Gen {
  std::mt19937_64 rng;
  int special_per_1000;  // share of NaN / inf / subnormal / huge values
  uint32_t f32() {
    const uint32_t r = static_cast<uint32_t>(rng());
    if (static_cast<int>(rng() % 1000) < special_per_1000) {
      switch (rng() % 6) {
        case 0:
          return 0x7F800000u | (r & 0x80000000u) | (1u + (r % 0x7FFFFFu));  // NaN, any payload
        case 1:
          return 0x7F800000u | (r & 0x80000000u);  // +-inf
        case 2:
          return (r & 0x80000000u) | (r & 0x7FFFFFu);  // subnormal
        case 3:
          return (r & 0x80000000u) | 0x7F000000u | (r & 0x7FFFFFu);  // huge
        case 4:
          return (r & 0x80000000u) | 0x00800000u | (r & 0xFFFFu);  // tiny normal
        default:
          return r & 0x80000000u;  // +-0
      }
    }
    const float f =
        std::ldexp(static_cast<float>(static_cast<int32_t>(r)) / 2147483648.0f, static_cast<int>(rng() % 40) - 20);
    return detail::f32_bits(f);
  }
  uint16_t half(bool bf) {
    const uint16_t r = static_cast<uint16_t>(rng());
    if (static_cast<int>(rng() % 1000) < special_per_1000) {
      const uint16_t s = r & 0x8000u;
      const uint16_t exp = bf ? 0x7F80u : 0x7C00u, man = bf ? 0x7Fu : 0x3FFu;
      switch (rng() % 5) {
        case 0:
          return s | exp | static_cast<uint16_t>(1u + (r % man));  // NaN
        case 1:
          return s | exp;  // inf
        case 2:
          return s | (r & man);  // subnormal
        case 3:
          return static_cast<uint16_t>(s | (exp - (bf ? 0x80u : 0x400u)) | (r & man));  // largest binade
        default:
          return s;
      }
    }
    if (bf) return static_cast<uint16_t>(f32() >> 16);
    return detail::f32_to_f16(detail::f32_from_bits(f32()));
  }
};

template <class D>
int run_one(Gen& g, int nsrc, uint64_t packs, const char* name, bool verbose) {
  using T = typename D::T;
  constexpr uint64_t E = 16 / sizeof(T);
  const uint64_t n = packs * E;
  std::vector<std::vector<T>> src(nsrc, std::vector<T>(n));
  std::vector<T> dst0(n);
  auto fill = [&](std::vector<T>& v) {
    for (auto& x : v) {
      if constexpr (sizeof(T) == 4) {
        x = detail::f32_from_bits(g.f32());
      } else {
        x = g.half(std::is_same_v<D, interp::GradBF16>);
      }
    }
  };
  fill(dst0);
  for (auto& s : src) fill(s);
  std::vector<uintptr_t> srcs;
  for (auto& s : src) srcs.push_back(reinterpret_cast<uintptr_t>(s.data()));

  std::vector<std::vector<T>> got;
  std::vector<std::string> what;
  auto ref = dst0;
  host::reduce_range<D>(reinterpret_cast<uintptr_t>(ref.data()), srcs, nsrc, 0, n, /*portable_f16=*/true);
  auto ref_f16c = dst0;
  host::reduce_range<D>(reinterpret_cast<uintptr_t>(ref_f16c.data()), srcs, nsrc, 0, n, /*portable_f16=*/false);
  got.push_back(ref_f16c), what.push_back("host F16C/vector path");
#define UC_VARIANT(CVT, U, G)                                                         \
  do {                                                                                \
    auto d = dst0;                                                                    \
    device_like<D, CVT<D>, U, G>(reinterpret_cast<uintptr_t>(d.data()), srcs, packs); \
    got.push_back(d), what.push_back(#CVT " U=" #U " G=" #G);                         \
  } while (0)
  UC_VARIANT(detail::SoftCvt, 4, 4);
  UC_VARIANT(detail::SoftCvt, 4, 2);
  UC_VARIANT(detail::SoftCvt, 2, 1);
  UC_VARIANT(GpuLikeCvt, 4, 4);
  UC_VARIANT(GpuLikeCvt, 1, 2);
#undef UC_VARIANT
  // the staged reduce: the device's geometry (256 threads x 2 packs, 4 sub-tiles a stage, the deep
  // and the shared ring), and small ones whose sub-tiles, fills and ring wrap many times here
#define UC_STAGED(CVT, U, T, S, PER, HEAD)                                                                          \
  do {                                                                                                              \
    auto d = dst0;                                                                                                  \
    const bool ok = staged_like<D, CVT<D>, U>(reinterpret_cast<uintptr_t>(d.data()), srcs, packs, T, S, PER, HEAD); \
    got.push_back(d),                                                                                               \
        what.push_back("staged " #CVT " U=" #U " threads=" #T " stages=" #S " per=" #PER " head=" #HEAD);           \
    if (!ok) {                                                                                                      \
      ++bad;                                                                                                        \
      std::printf("MISMATCH %s k=%d packs=%" PRIu64 " %s: ring bookkeeping\n", name, nsrc, packs,                   \
                  what.back().c_str());                                                                             \
    }                                                                                                               \
  } while (0)
  int bad = 0;
  UC_STAGED(GpuLikeCvt, 2, 256, 6, 4, 0);
  UC_STAGED(GpuLikeCvt, 2, 256, 3, 4, 1);
  UC_STAGED(GpuLikeCvt, 2, 4, 3, 4, 0);
  UC_STAGED(detail::SoftCvt, 2, 4, 6, 4, 3);
  UC_STAGED(GpuLikeCvt, 1, 2, 2, 2, 0);
  UC_STAGED(detail::SoftCvt, 2, 3, 5, 3, 1);
#undef UC_STAGED
  for (size_t v = 0; v < got.size(); ++v) {
    if (std::memcmp(got[v].data(), ref.data(), n * sizeof(T)) == 0) continue;
    ++bad;
    for (uint64_t i = 0; i < n; ++i) {
      uint32_t a = 0, b = 0;
      std::memcpy(&a, &got[v][i], sizeof(T));
      std::memcpy(&b, &ref[i], sizeof(T));
      if (a != b) {
        std::printf("MISMATCH %s k=%d packs=%" PRIu64 " %s elem %" PRIu64 ": got %08x want %08x\n", name, nsrc, packs,
                    what[v].c_str(), i, a, b);
        break;
      }
    }
  }
  if (verbose) std::printf("%s k=%d packs=%" PRIu64 ": %s\n", name, nsrc, packs, bad ? "FAIL" : "ok");
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t seed = 1;
  int rounds = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--seed")) seed = std::strtoull(argv[i + 1], nullptr, 10);
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::atoi(argv[i + 1]);
  }
  Gen g{std::mt19937_64(seed), 0};
  int bad = 0, cases = 0;
  const uint64_t sizes[] = {1, 31, 128, 128 * 2 + 77};  // < a hunk, whole hunks (U = 4) and a rest
  for (int r = 0; r < rounds; ++r)
    for (int special : {0, 3, 60, 400})
      for (int k = 1; k <= 11; ++k)
        for (uint64_t packs : sizes) {
          g.special_per_1000 = special;
          bad += run_one<interp::GradF32>(g, k, packs, "f32", false);
          bad += run_one<interp::GradBF16>(g, k, packs, "bf16", false);
          bad += run_one<interp::GradF16>(g, k, packs, "f16", false);
          cases += 3;
        }
  std::printf("%d cases, %d mismatching\n", cases, bad);
  return bad ? 1 : 0;
}
