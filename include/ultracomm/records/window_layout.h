// Byte layout of one rank's window (symmetric memory): identical on every rank, so a peer
// address is `peer_base + offset`.  Flags are uint64 epochs: written with release, read
// with acquire, never reset (every operation uses a larger epoch).
#pragma once
#include <cstdint>
#include "ultracomm/records/hd.h"
#include "ultracomm/records/task.h"

namespace ultracomm {

constexpr uint64_t kWindowAlign = 256;  // slot and region alignment (covers TMA's 16 B)
static_assert(kWindowAlign % 16 == 0, "TMA needs 16-byte aligned slots");

// Size bounds that keep every offset computed from a layout (and every chunk count) inside
// 64-bit arithmetic with room to spare: 2^48 B = 256 TiB per slot or chunk, 2^20 slots.
constexpr uint64_t kMaxSlotBytes = uint64_t(1) << 48;
constexpr uint64_t kMaxChunkBytes = uint64_t(1) << 48;
constexpr int32_t kMaxSlots = 1 << 20;
constexpr uint64_t kMaxWindowBytes = uint64_t(1) << 62;

// x rounded up to a multiple of a; ceil(x / a) without the overflow of (x + a - 1) / a
UC_INLINE uint64_t ceil_div(uint64_t x, uint64_t a) { return x / a + (x % a != 0); }
UC_INLINE uint64_t align_up(uint64_t x, uint64_t a) { return ceil_div(x, a) * a; }

struct WindowLayout {
  int32_t slots = 0;
  uint64_t weight_slot_bytes = 0;  // bytes of one expert's weights (slot layout)
  uint64_t grad_slot_bytes = 0;    // bytes of one expert's grads (slot layout)
  uint64_t chunk_bytes = 0;
  // derived
  uint64_t weight_stride = 0, grad_stride = 0;
  uint64_t weight_chunks = 0, grad_chunks = 0;
  uint64_t weights_off = 0, grads_off = 0;
  uint64_t ready_off = 0;       // uint64 ready[kNumOps]
  uint64_t digest_off = 0;      // uint64 digest[kNumOps]: schedule digest of the op in ready[op]'s epoch
  uint64_t arrival_off = 0;     // uint64 arrival[slots][weight_chunks]
  uint64_t grad_ready_off = 0;  // uint64 grad_ready[slots][grad_chunks]
  uint64_t consumed_off = 0;    // uint64 consumed[slots][grad_chunks]
  uint64_t total_bytes = 0;

  // Callers check window_layout_error() first (sizes that overflow give a meaningless layout).
  UC_HD static WindowLayout make(int32_t slots, uint64_t weight_slot_bytes, uint64_t grad_slot_bytes,
                                 uint64_t chunk_bytes) {
    WindowLayout L;
    L.slots = slots;
    L.weight_slot_bytes = weight_slot_bytes;
    L.grad_slot_bytes = grad_slot_bytes;
    L.chunk_bytes = chunk_bytes;
    L.weight_stride = align_up(weight_slot_bytes ? weight_slot_bytes : 1, kWindowAlign);
    L.grad_stride = align_up(grad_slot_bytes ? grad_slot_bytes : 1, kWindowAlign);
    L.weight_chunks = ceil_div(weight_slot_bytes, chunk_bytes);
    L.grad_chunks = ceil_div(grad_slot_bytes, chunk_bytes);
    uint64_t off = 0;
    L.weights_off = off;
    off += L.weight_stride * slots;
    L.grads_off = off;
    off += L.grad_stride * slots;
    L.ready_off = off = align_up(off, kWindowAlign);
    off += 8 * kNumOps;
    L.digest_off = off;  // same 64-byte line as ready: published together
    off += 8 * kNumOps;
    L.arrival_off = off = align_up(off, 64);
    off += 8 * L.weight_chunks * slots;
    L.grad_ready_off = off = align_up(off, 64);
    off += 8 * L.grad_chunks * slots;
    L.consumed_off = off = align_up(off, 64);
    off += 8 * L.grad_chunks * slots;
    L.total_bytes = align_up(off, kWindowAlign);
    return L;
  }
  UC_HD uint64_t weight_slot(int32_t s) const { return weights_off + weight_stride * s; }
  UC_HD uint64_t grad_slot(int32_t s) const { return grads_off + grad_stride * s; }
  UC_HD uint64_t ready_flag(Op op) const { return ready_off + 8 * static_cast<uint64_t>(op); }
  UC_HD uint64_t digest_word(Op op) const { return digest_off + 8 * static_cast<uint64_t>(op); }
  UC_HD uint64_t arrival_flag(int32_t s, int64_t c) const { return arrival_off + 8 * (s * weight_chunks + c); }
  UC_HD uint64_t grad_ready_flag(int32_t s, int64_t c) const { return grad_ready_off + 8 * (s * grad_chunks + c); }
  UC_HD uint64_t consumed_flag(int32_t s, int64_t c) const { return consumed_off + 8 * (s * grad_chunks + c); }
  // bytes and chunks of one slot of `op` (weights for multicast, grads for reduce)
  UC_HD uint64_t slot_bytes(Op op) const { return op == Op::kMulticast ? weight_slot_bytes : grad_slot_bytes; }
  UC_HD uint64_t chunks(Op op) const { return op == Op::kMulticast ? weight_chunks : grad_chunks; }
  // The chunk count covers the slot and no chunk is empty: n * chunk_bytes >= bytes >
  // (n - 1) * chunk_bytes, i.e. n == ceil(bytes / chunk_bytes), evaluated without the
  // overflow of (bytes + chunk_bytes - 1) / chunk_bytes.  Asserted before anything moves.
  UC_HD bool chunks_cover(Op op) const {
    return chunk_bytes != 0 && chunks(op) == ceil_div(slot_bytes(op), chunk_bytes);
  }
};

// Host check of make()'s inputs: nullptr if the layout fits the bounds above, else what is
// wrong (a static string).  Not UC_HD: the host validates before any launch.
inline const char* window_layout_error(int32_t slots, uint64_t weight_slot_bytes, uint64_t grad_slot_bytes,
                                       uint64_t chunk_bytes) {
  if (slots < 0) return "slots must be >= 0";
  if (slots > kMaxSlots) return "slots must be <= 2^20";
  if (chunk_bytes == 0) return "chunk_bytes must be > 0";
  if (chunk_bytes > kMaxChunkBytes) return "chunk_bytes must be <= 2^48";
  if (weight_slot_bytes > kMaxSlotBytes || grad_slot_bytes > kMaxSlotBytes)
    return "an expert's weight or grad bytes must be <= 2^48";
  // slots * (strides + 8 B of flags per chunk) < 2^20 * (2 * 2^48 + 3 * 8 * 2^48) fits in
  // unsigned __int128; the window must fit kMaxWindowBytes.
  const unsigned __int128 per_slot = (unsigned __int128)align_up(weight_slot_bytes, kWindowAlign) +
                                     align_up(grad_slot_bytes, kWindowAlign) + 2 * kWindowAlign +
                                     8 * ((unsigned __int128)ceil_div(weight_slot_bytes, chunk_bytes) +
                                          2 * (unsigned __int128)ceil_div(grad_slot_bytes, chunk_bytes));
  if (per_slot * (unsigned __int128)slots + 4 * kWindowAlign > kMaxWindowBytes)
    return "the window would exceed 2^62 bytes (slots x slot and flag bytes)";
  return nullptr;
}

}  // namespace ultracomm
