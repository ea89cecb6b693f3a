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
  int bad = 0;
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
