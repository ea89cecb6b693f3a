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

// ---------------------------------------------------------------------------------------
// Staged reduce: the TMA path's alternative (csrc/cuda/mover_tma.cuh TmaMover::reduce_staged,
// sm_90+, run option reduce_path="tma").  A segment's body (16-B aligned in dst and every source,
// a multiple of 16 bytes) is cut into sub-tiles of `sub` bytes; the operands of a sub-tile -- dst,
// then src_0, src_1, ... -- are brought into shared memory one after the other by bulk copies,
// `per` operands to a ring stage (a "fill": operands f x per .. f x per + per - 1 of the segment's
// sequence, which may straddle sub-tiles; one mbarrier), and every thread folds each operand into
// its fp32 accumulators as it arrives: acc = Cvt(dst), then acc = acc + Cvt(src_s) for s = 0, 1,
// ..., each add rounded once -- reduce_hunk's operations in reduce_hunk's order, only the loads
// differ.  A thread owns U packs of a sub-tile, pack u at byte (u x threads + tid) x 16 (a warp
// reads 512 consecutive bytes: no bank conflict).  Buf reads a pack of the staged buffer
// (ld.shared on the device), Io global memory: the NaN slow path (hunk_pack_nan_rule) re-reads
// the operands there, as reduce_hunk's does (dst is written only after its sub-tile's last
// source).  The device drives the ring (mbarriers, refills); tests/cpp/reduce_hunk_check.cpp
// drives the same functions with memcpy for the bulk copies and a ring of its own, and checks
// the result against the host reduce bit for bit.

// Operand `op` (0: dst, s + 1: src_s) of sub-tile `tile`: a position in the segment's operand
// sequence, whose operand j is (j / ops, j % ops), ops = nsrc + 1.  Advanced one operand at a
// time, or n at once (one 32-bit division: n and ops are small).
struct StagedCursor {
  uint32_t tile = 0;
  int op = 0;
  UC_INLINE void next(int ops) {
    if (++op == ops) {
      op = 0;
      ++tile;
    }
  }
  UC_INLINE void advance(int n, int ops) {
    op += n;
    tile += static_cast<uint32_t>(op / ops);
    op %= ops;
  }
};

// One staged segment: `bytes` (a multiple of 16, under 2^32 sub-tiles) of dst and of each source,
// from byte `base` (< 2^32) of each, in `tiles` sub-tiles of `sub` bytes (the last one `last`),
// `ops` = nsrc + 1 operands each, `per` operands to a fill.  32-bit fields: the device keeps them
// in registers through the whole loop.
struct StagedSegment {
  uint32_t base;
  uint32_t tiles;
  uint32_t last;
  uint32_t sub;
  int ops;
  int per;
  UC_INLINE static StagedSegment make(uint32_t base, uint64_t bytes, uint32_t sub, int ops, int per) {
    const uint32_t tiles = static_cast<uint32_t>(bytes / sub + (bytes % sub != 0));
    return StagedSegment{base, tiles, static_cast<uint32_t>(bytes - static_cast<uint64_t>(tiles - 1) * sub),
                         sub,  ops,   per};
  }
  UC_INLINE uint64_t at(uint32_t tile) const { return base + static_cast<uint64_t>(tile) * sub; }
  UC_INLINE uint32_t len(uint32_t tile) const { return tile + 1 == tiles ? last : sub; }
};

// The issuing thread: the fill that starts at `c` (c.tile < g.tiles; `c` is left past it): its
// operands -- per, or the rest of the segment -- as expect(total bytes) first (the stage's
// completion counts them: mbarrier expect_tx), then load(h, global address, bytes) for each, the
// fill's operand h into slot h of the stage.
template <class Srcs, class Expect, class Load>
UC_INLINE void staged_issue_fill(const StagedSegment& g, StagedCursor& c, uintptr_t dst, const Srcs& srcs,
                                 Expect&& expect, Load&& load) {
  uint32_t total = 0;
  StagedCursor k = c;
  for (int h = 0; h < g.per && k.tile < g.tiles; ++h, k.next(g.ops)) total += g.len(k.tile);
  expect(total);
  for (int h = 0; h < g.per && c.tile < g.tiles; ++h, c.next(g.ops)) {
    const uintptr_t a = c.op == 0 ? dst : srcs[c.op - 1];
    load(h, a + g.at(c.tile), g.len(c.tile));
  }
}

// acc[u] = Cvt(pack u of the buffer) (first: dst) or acc[u] + Cvt(pack u), each add rounded once.
template <class Cvt, class Buf, int U>
UC_INLINE void staged_fold(float (&acc)[U][Cvt::E], uintptr_t buf, const uint32_t (&boff)[U], bool first) {
  Pack16 r[U];
  UC_UNROLL
  for (int u = 0; u < U; ++u) r[u] = Buf::load(buf + boff[u]);
  if (first) {
    UC_UNROLL
    for (int u = 0; u < U; ++u) Cvt::unpack(r[u], acc[u]);
    return;
  }
  UC_UNROLL
  for (int u = 0; u < U; ++u) {
    float x[Cvt::E];
    Cvt::unpack(r[u], x);
    UC_UNROLL
    for (int k = 0; k < Cvt::E; ++k) acc[u][k] = add_rn(acc[u][k], x[k]);
  }
}

// A finished sub-tile: this thread's packs u < n (those inside it) to dst at off[u], or, if a sum
// came out NaN, all of them again by the slow path (reduce_hunk's rule, over the valid packs).
template <class D, class Cvt, class Io, int U, class Srcs>
UC_INLINE void staged_store(const float (&acc)[U][Cvt::E], uintptr_t dst, const Srcs& srcs, int nsrc,
                            const uint64_t (&off)[U], int n) {
  uint32_t nan = 0;
  UC_UNROLL
  for (int u = 0; u < U; ++u) {
    UC_UNROLL
    for (int k = 0; k < Cvt::E; ++k) nan |= static_cast<uint32_t>(u < n && f32_is_nan(f32_bits(acc[u][k])));
  }
  if (__builtin_expect(nan != 0, 0)) {
    UC_UNROLL
    for (int u = 0; u < U; ++u)
      if (u < n) hunk_pack_nan_rule<D, Io>(dst, srcs, nsrc, off[u]);
    return;
  }
  UC_UNROLL
  for (int u = 0; u < U; ++u)
    if (u < n) Io::store(dst + off[u], Cvt::pack(acc[u]));
}

// Every thread, once the fill that starts at `c` is in its stage (slot h at stage + h x sub):
// folds its operands into acc (`c` is left past them) and, after a sub-tile's last source,
// stores the sub-tile's packs of this thread (tid of `threads`; sub = threads x U x 16).
template <class D, class Cvt, class Buf, class Io, int U, class Srcs>
UC_INLINE void staged_consume_fill(float (&acc)[U][Cvt::E], const StagedSegment& g, StagedCursor& c, uintptr_t stage,
                                   uintptr_t dst, const Srcs& srcs, uint32_t tid, uint32_t threads) {
  uint32_t boff[U];
  UC_UNROLL
  for (int u = 0; u < U; ++u) boff[u] = (static_cast<uint32_t>(u) * threads + tid) * 16u;
  for (int h = 0; h < g.per && c.tile < g.tiles; ++h, c.next(g.ops)) {
    staged_fold<Cvt, Buf, U>(acc, stage + static_cast<uint32_t>(h) * g.sub, boff, c.op == 0);
    if (c.op != g.ops - 1) continue;  // not yet the sub-tile's last source (or dst alone: no source)
    const uint32_t len = g.len(c.tile);
    uint64_t off[U];
    int valid = 0;
    UC_UNROLL
    for (int u = 0; u < U; ++u) {
      off[u] = g.at(c.tile) + boff[u];
      valid += boff[u] < len;
    }
    staged_store<D, Cvt, Io, U>(acc, dst, srcs, g.ops - 1, off, valid);
  }
}

}  // namespace ultracomm::detail
