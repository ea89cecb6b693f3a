// Byte layout of one rank's window (symmetric memory): identical on every rank, so a peer
// address is `peer_base + offset`.  Flags are uint64 epochs: written with release, read
// with acquire, never reset (every operation uses a larger epoch).
#pragma once
#include <cstdint>
#include "ultracomm/task.h"

namespace ultracomm {

constexpr uint64_t kWindowAlign = 256;  // slot and region alignment (covers TMA's 16 B)

inline uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
inline uint64_t ceil_div(uint64_t x, uint64_t a) { return (x + a - 1) / a; }

struct WindowLayout {
  int32_t slots = 0;
  uint64_t weight_slot_bytes = 0;  // bytes of one expert's weights (slot layout)
  uint64_t grad_slot_bytes = 0;    // bytes of one expert's grads (slot layout)
  uint64_t chunk_bytes = 0;
  // derived
  uint64_t weight_stride = 0, grad_stride = 0;
  uint64_t weight_chunks = 0, grad_chunks = 0;
  uint64_t weights_off = 0, grads_off = 0;
  uint64_t ready_off = 0;     // uint64 ready[kNumOps]
  uint64_t arrival_off = 0;   // uint64 arrival[slots][weight_chunks]
  uint64_t grad_ready_off = 0;  // uint64 grad_ready[slots][grad_chunks]
  uint64_t consumed_off = 0;    // uint64 consumed[slots][grad_chunks]
  uint64_t total_bytes = 0;

  static WindowLayout make(int32_t slots, uint64_t weight_slot_bytes, uint64_t grad_slot_bytes,
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
    L.arrival_off = off = align_up(off, 64);
    off += 8 * L.weight_chunks * slots;
    L.grad_ready_off = off = align_up(off, 64);
    off += 8 * L.grad_chunks * slots;
    L.consumed_off = off = align_up(off, 64);
    off += 8 * L.grad_chunks * slots;
    L.total_bytes = align_up(off, kWindowAlign);
    return L;
  }
  uint64_t weight_slot(int32_t s) const { return weights_off + weight_stride * s; }
  uint64_t grad_slot(int32_t s) const { return grads_off + grad_stride * s; }
  uint64_t ready_flag(Op op) const { return ready_off + 8 * static_cast<uint64_t>(op); }
  uint64_t arrival_flag(int32_t s, int64_t c) const { return arrival_off + 8 * (s * weight_chunks + c); }
  uint64_t grad_ready_flag(int32_t s, int64_t c) const { return grad_ready_off + 8 * (s * grad_chunks + c); }
  uint64_t consumed_flag(int32_t s, int64_t c) const { return consumed_off + 8 * (s * grad_chunks + c); }
};

}  // namespace ultracomm
