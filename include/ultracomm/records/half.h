// fp32 <-> bf16 / fp16 conversions, bit-exact with torch's CPU `.to(torch.bfloat16)` /
// `.to(torch.float16)` on x86 (ATen's vectorised cvtfp32_bf16 and F16C vcvtps2ph):
// round-to-nearest-even, overflow -> inf, subnormals kept, and NaN -> bf16 0xFFFF /
// fp16 sign | 0x7E00 | (fp32 mantissa >> 13) (quieted, payload truncated).
// Needs IEEE float arithmetic in the default rounding mode: do not build with -ffast-math.
// UC_HD: the device kernel uses the same integer rounding (not __float2bfloat16_rn, which
// returns a canonical NaN); its float steps use __fmul_rn / __fadd_rn so that nvcc cannot
// contract them into an FMA (one rounding instead of two would change the bits), and NaNs are
// handled in integers (a GPU's float operations return a canonical NaN, x86's the operand's).
#pragma once
#include <cstdint>
#include <cstring>
#include "ultracomm/records/hd.h"

namespace ultracomm::detail {

UC_INLINE uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
UC_INLINE float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
// a * b and a + b, each rounded once (no FMA contraction on the device)
UC_INLINE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
UC_INLINE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

UC_INLINE bool f32_is_nan(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// acc + x of a reduction, rounded once, with NaNs defined as x86's addss/vaddps with acc first:
// a NaN operand comes back quieted, acc's when both are NaN, and inf + -inf is the default NaN
// 0xFFC00000.  Written out because a GPU add returns the canonical 0x7FFFFFFF instead, and a
// compiler may swap the operands of a host add (the payload would follow the swap).
// The add runs first and the rule only where it gave a NaN (a NaN sum has a NaN operand or is
// inf + -inf): one compare per element on the hot path.
UC_INLINE float sum_nan_rule(float acc, float x) {
  const uint32_t a = f32_bits(acc), b = f32_bits(x);
  if (f32_is_nan(a)) return f32_from_bits(a | 0x00400000u);
  if (f32_is_nan(b)) return f32_from_bits(b | 0x00400000u);
  return f32_from_bits(0xFFC00000u);
}
UC_INLINE float sum_rn(float acc, float x) {
  const float r = add_rn(acc, x);
  if (__builtin_expect(f32_is_nan(f32_bits(r)), 0)) return sum_nan_rule(acc, x);
  return r;
}

UC_INLINE float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

UC_INLINE uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0xFFFF;  // NaN, as ATen's vector path
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

UC_INLINE float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  // NaN: quieted, payload kept (vcvtph2ps); spelled out: a GPU multiply would return its canonical NaN
  if ((h & 0x7C00u) == 0x7C00u && (h & 0x03FFu)) return f32_from_bits(sign | 0x7FC00000u | ((h & 0x03FFu) << 13));
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = 0x1.0p-112f;
  const float normalized = mul_rn(f32_from_bits((two_w >> 4) + exp_offset), exp_scale);
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = add_rn(f32_from_bits((two_w >> 17) | magic_mask), -magic_bias);
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result = sign | (two_w < denormalized_cutoff ? f32_bits(denormalized) : f32_bits(normalized));
  return f32_from_bits(result);
}

UC_INLINE uint16_t f32_to_f16(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  const uint32_t w = f32_bits(f);
  float base = mul_rn(mul_rn(f32_from_bits(w & 0x7fffffffu), scale_to_inf), scale_to_zero);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = add_rn(f32_from_bits((bias >> 1) + 0x07800000u), base);
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  const uint32_t nan = 0x7E00u | ((w >> 13) & 0x3FFu);  // quiet, payload truncated (vcvtps2ph)
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? nan : nonsign));
}

}  // namespace ultracomm::detail
