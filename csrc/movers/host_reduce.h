// Host reduction of one segment's element range [first, first + n):
//   dst[i] = D::store(D::load(dst[i]) + D::load(src_0[i]) + D::load(src_1[i]) + ...)
// in fp32, sources in list order, each + being half.h's sum_rn (NaNs as the device kernel).  Blocks of 512 elements keep the accumulator in L1.
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

#include "ultracomm/half.h"
#include "ultracomm/interp.h"

namespace ultracomm::host {

constexpr size_t kReduceBlock = 512;

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
      for (size_t i = 0; i < m; ++i) acc[i] = detail::sum_rn(acc[i], D::load(p[i]));
    }
    for (size_t i = 0; i < m; ++i) dst[i0 + i] = D::store(acc[i]);
  }
}

#if defined(__x86_64__)
// detail::sum_rn on 8 lanes: NaN lanes chosen explicitly (acc's first, quieted), whatever
// operand order the compiler gives vaddps; inf + -inf is vaddps's own default NaN
__attribute__((target("avx2,f16c"))) inline __m256 sum8(__m256 a, __m256 b) {
  const __m256 quiet = _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000));
  __m256 r = _mm256_add_ps(a, b);
  r = _mm256_blendv_ps(r, _mm256_or_ps(b, quiet), _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
  return _mm256_blendv_ps(r, _mm256_or_ps(a, quiet), _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}

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
        _mm256_store_ps(acc + i, sum8(_mm256_load_ps(acc + i),
                                      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)))));
      for (size_t i = mv; i < m; ++i) acc[i] = detail::sum_rn(acc[i], detail::f16_to_f32(p[i]));
    }
    uint16_t* out = dst + i0;
    for (size_t i = 0; i < mv; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_cvtps_ph(_mm256_load_ps(acc + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (size_t i = mv; i < m; ++i) out[i] = detail::f32_to_f16(acc[i]);
  }
}
// fp32 and bf16 on 8 lanes: sum8 per source, the bits of reduce_scalar's sum_rn.  The scalar
// loop's NaN branches keep the compiler from vectorising it (fp32, 2 sources: 2-5x slower than
// a plain +=, which made split's grad_reduce lose to naive point-to-point: perf/README.md 6b).
template <class D>
__attribute__((target("avx2,f16c"))) inline __m256 load8(const typename D::T* p) {
  if constexpr (std::is_same_v<D, interp::GradF32>) {
    return _mm256_loadu_ps(p);
  } else {  // bf16: the high half of an fp32
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
}

template <class D, class Srcs>
__attribute__((target("avx2,f16c"))) void reduce_avx2(uintptr_t dst_seg, const Srcs& srcs, int nsrc, uint64_t first,
                                                       uint64_t n) {
  using T = typename D::T;
  alignas(64) float acc[kReduceBlock];
  T* dst = reinterpret_cast<T*>(dst_seg) + first;
  for (uint64_t i0 = 0; i0 < n; i0 += kReduceBlock) {
    const size_t m = static_cast<size_t>(std::min<uint64_t>(kReduceBlock, n - i0));
    const size_t mv = m & ~size_t(7);
    for (size_t i = 0; i < m; ++i) acc[i] = D::load(dst[i0 + i]);
    for (int s = 0; s < nsrc; ++s) {
      const T* p = reinterpret_cast<const T*>(srcs[s]) + first + i0;
      for (size_t i = 0; i < mv; i += 8) _mm256_store_ps(acc + i, sum8(_mm256_load_ps(acc + i), load8<D>(p + i)));
      for (size_t i = mv; i < m; ++i) acc[i] = detail::sum_rn(acc[i], D::load(p[i]));
    }
    for (size_t i = 0; i < m; ++i) dst[i0 + i] = D::store(acc[i]);
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
  } else {
    if (have_f16c()) return reduce_avx2<D>(dst_seg, srcs, nsrc, first, n);
  }
#endif
  (void)portable_f16;
  reduce_scalar<D>(dst_seg, srcs, nsrc, first, n);
}

}  // namespace ultracomm::host
