// Hunk reduction: the ordered fp32 sum of U 16-byte packs at once, the device reduce's hot path
// (csrc/cuda/mover_common.cuh vec_reduce), written once for g++ and nvcc so the CPU tests can
// check it against the host executor's reduce (csrc/movers/host_reduce.h) bit for bit
// (tests/cpp/reduce_hunk_check.cpp).
//
// Per element, as the host: acc = D::load(dst), then acc = acc + x for x = D::load(src_0),
// D::load(src_1), ... in the schedule's source order, each add rounded once (add_rn), then
// D::store(acc).  What is reordered is only loads: all U packs of dst and of a group of G
// sources are loaded before the first add (NCCL's reduceCopyPacks: bytes in flight per lane are
// (G + 1) x U x 16), which the order of the adds does not see.
//
// Cvt converts a pack in the hot path; it may be faster than D's conversions (hardware cvt on
// the device) but must give the same bits for every input and result that is not a NaN.  NaN
// absorbs (NaN + x is NaN), so a lane whose plain sum is not NaN never met one and its sum is
// sum_rn's; a hunk with a NaN lane is redone by the slow path: half.h's sum_rn at every step
// and D's conversions for every element (equal to Cvt's on the non-NaN lanes), re-reading the
// inputs (dst is written only at the end).  Io loads and stores a pack (global .cg on the
// device, memcpy on the host).
#pragma once
#include <cstdint>
#include <cstring>

#include "ultracomm/records/half.h"
#include "ultracomm/records/hd.h"

namespace ultracomm::detail {

struct alignas(16) Pack16 {
  uint32_t w[4];
};

// half.h's conversions (D::load / D::store): the host's, and the slow path's everywhere.
template <class D>
struct SoftCvt {
  using T = typename D::T;
  static constexpr int E = 16 / sizeof(T);
  UC_INLINE static void unpack(const Pack16& p, float (&f)[E]) {
    T e[E];
    memcpy(e, &p, 16);
    UC_UNROLL
    for (int k = 0; k < E; ++k) f[k] = D::load(e[k]);
  }
  UC_INLINE static Pack16 pack(const float (&f)[E]) {
    T e[E];
    UC_UNROLL
    for (int k = 0; k < E; ++k) e[k] = D::store(f[k]);
    Pack16 p;
    memcpy(&p, e, 16);
    return p;
  }
};

// acc[u][.] += sources s .. s + G - 1 of pack u, in that order; all G x U loads first.
template <class Cvt, class Io, int U, int G, class Srcs>
UC_INLINE void hunk_add_group(float (&acc)[U][Cvt::E], const Srcs& srcs, int s, const uint64_t (&off)[U]) {
  Pack16 r[G][U];
  UC_UNROLL
  for (int g = 0; g < G; ++g) {
    const uintptr_t base = srcs[s + g];
    UC_UNROLL
    for (int u = 0; u < U; ++u) r[g][u] = Io::load(base + off[u]);
  }
  UC_UNROLL
  for (int g = 0; g < G; ++g) {
    UC_UNROLL
    for (int u = 0; u < U; ++u) {
      float x[Cvt::E];
      Cvt::unpack(r[g][u], x);
      UC_UNROLL
      for (int k = 0; k < Cvt::E; ++k) acc[u][k] = add_rn(acc[u][k], x[k]);
    }
  }
}

// The slow path of one pack: sum_rn at every step, D's conversions (dst not yet written).
template <class D, class Io, class Srcs>
UC_HD void hunk_pack_nan_rule(uintptr_t dst, const Srcs& srcs, int nsrc, uint64_t off) {
  constexpr int E = SoftCvt<D>::E;
  float a[E], x[E];
  SoftCvt<D>::unpack(Io::load(dst + off), a);
  for (int s = 0; s < nsrc; ++s) {
    SoftCvt<D>::unpack(Io::load(srcs[s] + off), x);
    UC_UNROLL
    for (int k = 0; k < E; ++k) a[k] = sum_rn(a[k], x[k]);
  }
  Io::store(dst + off, SoftCvt<D>::pack(a));
}

// dst[off[u] .. + 16) = ordered sum of dst and srcs[0 .. nsrc) there, for u < U.  G: sources
// loaded together (groups of G, then of 2 and 1 for the rest).
template <class D, class Cvt, class Io, int U, int G, class Srcs>
UC_INLINE void reduce_hunk(uintptr_t dst, const Srcs& srcs, int nsrc, const uint64_t (&off)[U]) {
  static_assert(G == 1 || G == 2 || G == 4, "source groups of 1, 2 or 4");
  constexpr int E = Cvt::E;
  float acc[U][E];
  {
    Pack16 r[U];
    UC_UNROLL
    for (int u = 0; u < U; ++u) r[u] = Io::load(dst + off[u]);
    UC_UNROLL
    for (int u = 0; u < U; ++u) Cvt::unpack(r[u], acc[u]);
  }
  int s = 0;
  for (; s + G <= nsrc; s += G) hunk_add_group<Cvt, Io, U, G>(acc, srcs, s, off);
  if constexpr (G == 4) {
    if (s + 2 <= nsrc) {
      hunk_add_group<Cvt, Io, U, 2>(acc, srcs, s, off);
      s += 2;
    }
  }
  if constexpr (G >= 2) {
    if (s < nsrc) hunk_add_group<Cvt, Io, U, 1>(acc, srcs, s, off);
  }
  // one flag for the hunk: the hot path keeps no per-element branch
  uint32_t nan = 0;
  UC_UNROLL
  for (int u = 0; u < U; ++u) {
    UC_UNROLL
    for (int k = 0; k < E; ++k) nan |= static_cast<uint32_t>(f32_is_nan(f32_bits(acc[u][k])));
  }
  if (__builtin_expect(nan != 0, 0)) {
    UC_UNROLL
    for (int u = 0; u < U; ++u) hunk_pack_nan_rule<D, Io>(dst, srcs, nsrc, off[u]);
    return;
  }
  UC_UNROLL
  for (int u = 0; u < U; ++u) Io::store(dst + off[u], Cvt::pack(acc[u]));
}

}  // namespace ultracomm::detail
