// Host reduction of one segment's element range [first, first + n):
//   dst[i] = D::store(D::load(dst[i]) + D::load(src_0[i]) + D::load(src_1[i]) + ...)
// in fp32, sources in list order; NaN results follow half.h's sum_rn (as the device kernel).  Blocks of 512 elements keep the accumulator in L1.
// fp16 uses F16C when the CPU has it (the instructions torch's CPU casts use; same bits as
// half.h, which the scalar tail and `portable` use).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ultracomm/records/half.h"
#include "ultracomm/impl/interp.h"

namespace ultracomm::host {

constexpr size_t kReduceBlock = 512;

// Elements of acc[0, m) whose plain sum came out NaN get the NaN rule (detail::sum_rn), summed
// again from their inputs (dst not yet written): NaN absorbs, so a sum with no NaN step is the
// plain one and the loops above stay plain (vectorised) adds.
template <class D, class Srcs>
void apply_nan_rule(float* acc, size_t m, const typename D::T* dst, const Srcs& srcs, int nsrc, uint64_t at) {
  using T = typename D::T;
  // one branch-free pass first (the compiler vectorises it): a block without a NaN costs a compare per
  // element, not a branch -- the branchy loop alone halved the fp32 reduction's speed (perf/README.md 6b)
  uint32_t any = 0;
  for (size_t i = 0; i < m; ++i) any |= static_cast<uint32_t>(detail::f32_is_nan(detail::f32_bits(acc[i])));
  if (__builtin_expect(any == 0, 1)) return;
  for (size_t i = 0; i < m; ++i) {
    if (__builtin_expect(!detail::f32_is_nan(detail::f32_bits(acc[i])), 1)) continue;
    float a = D::load(dst[i]);
    for (int s = 0; s < nsrc; ++s) a = detail::sum_rn(a, D::load(reinterpret_cast<const T*>(srcs[s])[at + i]));
    acc[i] = a;
  }
}

template <class D, class Srcs>
void reduce_scalar(uintptr_t dst_seg, const Srcs& srcs, int nsrc, uint64_t first, uint64_t n) {
  using T = typename D::T;
  alignas(64) float acc[kReduceBlock];
  T* dst = reinterpret_cast<T*>(dst_seg) + first;
  for (uint64_t i0 = 0; i0 < n; i0 += kReduceBlock) {
    const size_t m = static_cast<size_t>(std::min<uint64_t>(kReduceBlock, n - i0));
    for (size_t i = 0; i < m; ++i) acc[i] = D::load(dst[i0 + i]);
    for (int s = 0; s < nsrc; ++s) {
      const T* p = reinterpret_cast<const T*>(srcs[s]) + first + i0;
      for (size_t i = 0; i < m; ++i) acc[i] += D::load(p[i]);
    }
    apply_nan_rule<D>(acc, m, dst + i0, srcs, nsrc, first + i0);
    for (size_t i = 0; i < m; ++i) dst[i0 + i] = D::store(acc[i]);
  }
}

#if defined(__x86_64__)
template <class Srcs>
__attribute__((target("avx2,f16c"))) void reduce_f16c(uintptr_t dst_seg, const Srcs& srcs, int nsrc, uint64_t first,
                                                      uint64_t n) {
  alignas(64) float acc[kReduceBlock];
  uint16_t* dst = reinterpret_cast<uint16_t*>(dst_seg) + first;
  for (uint64_t i0 = 0; i0 < n; i0 += kReduceBlock) {
    const size_t m = static_cast<size_t>(std::min<uint64_t>(kReduceBlock, n - i0));
    const size_t mv = m & ~size_t(7);
    const uint16_t* self = dst + i0;
    for (size_t i = 0; i < mv; i += 8)
      _mm256_store_ps(acc + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(self + i))));
    for (size_t i = mv; i < m; ++i) acc[i] = detail::f16_to_f32(self[i]);
    for (int s = 0; s < nsrc; ++s) {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(srcs[s]) + first + i0;
      for (size_t i = 0; i < mv; i += 8)
        _mm256_store_ps(acc + i,
                        _mm256_add_ps(_mm256_load_ps(acc + i),
                                      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)))));
      for (size_t i = mv; i < m; ++i) acc[i] += detail::f16_to_f32(p[i]);
    }
    apply_nan_rule<interp::GradF16>(acc, m, self, srcs, nsrc, first + i0);  // F16C widens NaNs as half.h does
    uint16_t* out = dst + i0;
    for (size_t i = 0; i < mv; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_cvtps_ph(_mm256_load_ps(acc + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (size_t i = mv; i < m; ++i) out[i] = detail::f32_to_f16(acc[i]);
  }
}
inline bool have_f16c() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return ok;
}
#endif

template <class D, class Srcs>
void reduce_range(uintptr_t dst_seg, const Srcs& srcs, int nsrc, uint64_t first, uint64_t n, bool portable_f16) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<D, interp::GradF16>) {
    if (!portable_f16 && have_f16c()) return reduce_f16c(dst_seg, srcs, nsrc, first, n);
  }
#endif
  (void)portable_f16;
  reduce_scalar<D>(dst_seg, srcs, nsrc, first, n);
}

}  // namespace ultracomm::host
