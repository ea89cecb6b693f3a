// Argument checks of the host executor: everything that can be checked here is, before a
// flag or byte is written (std::invalid_argument "ultracomm.run_host: ...").
#include <algorithm>
#include <string>
#include <vector>

#include "ultracomm/impl/host_executor.h"

namespace ultracomm {
namespace {

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument("ultracomm.run_host: " + msg); }

size_t dtype_size(DType d) { return d == DType::kF32 ? 4 : 2; }

// Calls fn(m, lo, hi) for every member m whose bytes intersect [offset, offset + bytes).
template <class Fn>
void for_each_segment(uint64_t offset, uint64_t bytes, const std::vector<uint64_t>& member_off,
                      const std::vector<uint64_t>& member_bytes, Fn&& fn) {
  const uint64_t end = offset + bytes;
  for (size_t m = 0; m < member_off.size(); ++m) {
    const uint64_t lo = std::max(offset, member_off[m]);
    const uint64_t hi = std::min(end, member_off[m] + member_bytes[m]);
    if (lo < hi) fn(m, lo, hi);
  }
}

}  // namespace

void validate(const ExecArgs& a) {
  if (a.op != Op::kMulticast && a.op != Op::kReduce) bad("op must be 0 (multicast) or 1 (reduce)");
  if (a.world < 1) bad("world must be >= 1, got " + std::to_string(a.world));
  if (a.rank < 0 || a.rank >= a.world)
    bad("rank " + std::to_string(a.rank) + " out of range for world " + std::to_string(a.world));
  if (a.epoch < 1) bad("epoch must be >= 1 (flags start at 0)");
  if (a.num_workers < 1) bad("num_workers must be >= 1, got " + std::to_string(a.num_workers));
  if (!(a.timeout_s > 0)) bad("timeout_s must be > 0");
  if (a.mover != MoverKind::kHost && a.mover != MoverKind::kBlock) bad("mover must be host or block");
  if (a.mover == MoverKind::kBlock && (a.threads_per_worker < 1 || a.threads_per_worker > 64))
    bad("threads_per_worker must be in 1..64, got " + std::to_string(a.threads_per_worker));
  if (a.digest == kRejectedDigest) bad("digest 2^64-1 is reserved (it marks a rejected plan)");
  if (a.abort_word % 8) bad("abort_word must be an 8-byte aligned address (or 0)");
  // a.layout is WindowLayout::make(...) by contract; its inputs are bounded here so that no
  // offset or chunk count overflows 64 bits, and the chunk count must cover the slot.
  const WindowLayout& L = a.layout;
  if (const char* e = window_layout_error(L.slots, L.weight_slot_bytes, L.grad_slot_bytes, L.chunk_bytes)) bad(e);
  if (a.tile_bytes % 16 != 0)
    bad("tile_bytes must be a multiple of 16 (or 0: whole chunks), got " + std::to_string(a.tile_bytes));
  if (a.tile_bytes != 0 && ceil_div(L.chunk_bytes, a.tile_bytes) > 0x7fffffffu)
    bad("tile_bytes " + std::to_string(a.tile_bytes) + " splits a chunk of " + std::to_string(L.chunk_bytes) +
        " bytes into more than 2^31 - 1 tiles");
  if (!L.chunks_cover(a.op))
    bad("the layout's " + std::to_string(L.chunks(a.op)) + " chunks of " + std::to_string(L.chunk_bytes) +
        " bytes do not cover the slot's " + std::to_string(L.slot_bytes(a.op)) + " bytes");
  if (a.window_bases.size() != static_cast<size_t>(a.world))
    bad("window_bases has " + std::to_string(a.window_bases.size()) + " entries, world is " + std::to_string(a.world));
  for (size_t r = 0; r < a.window_bases.size(); ++r) {
    if (a.window_bases[r] == 0) bad("window_bases[" + std::to_string(r) + "] is null");
    if (a.window_bases[r] % 8) bad("window_bases[" + std::to_string(r) + "] is not 8-byte aligned");
  }
  const bool mc = a.op == Op::kMulticast;
  const uint64_t slot_bytes = mc ? L.weight_slot_bytes : L.grad_slot_bytes;
  const uint64_t nchunks = mc ? L.weight_chunks : L.grad_chunks;
  const uint64_t esize = mc ? 1 : dtype_size(a.grad_dtype);
  if (!mc && a.grad_dtype != DType::kF32 && a.grad_dtype != DType::kBF16 && a.grad_dtype != DType::kF16)
    bad("grad_dtype must be 0 (fp32), 1 (bf16) or 2 (fp16)");
  const size_t M = a.member_off.size();
  if (M == 0) bad("member_off is empty");
  if (M > static_cast<size_t>(kMaxMembers))
    bad(std::to_string(M) + " members; an expert has at most " + std::to_string(kMaxMembers));
  if (a.member_bytes.size() != M) bad("member_off and member_bytes differ in length");
  uint64_t prev_end = 0;
  for (size_t m = 0; m < M; ++m) {
    const std::string mm = "member " + std::to_string(m);
    if (a.member_off[m] < prev_end) bad(mm + " overlaps the previous member or is out of order");
    if (a.member_bytes[m] > slot_bytes || a.member_off[m] > slot_bytes - a.member_bytes[m])
      bad(mm + " [" + std::to_string(a.member_off[m]) + ", +" + std::to_string(a.member_bytes[m]) +
          ") exceeds the slot's " + std::to_string(slot_bytes) + " bytes");
    if (a.member_off[m] % esize || a.member_bytes[m] % esize)
      bad(mm + " offset/size not a multiple of the grad element size " + std::to_string(esize));
    prev_end = a.member_off[m] + a.member_bytes[m];
  }
  if (a.master_ptrs.size() % M) bad("master_ptrs size is not a multiple of the member count");
  const int64_t n_local = static_cast<int64_t>(a.master_ptrs.size() / M);
  for (size_t i = 0; i < a.master_ptrs.size(); ++i)
    if (a.master_ptrs[i] % esize) bad("master_ptrs[" + std::to_string(i) + "] not aligned to the grad dtype");
  for (size_t e = 0; e < a.local_index_of.size(); ++e)
    if (a.local_index_of[e] < -1 || a.local_index_of[e] >= n_local)
      bad("local_index_of[" + std::to_string(e) + "] = " + std::to_string(a.local_index_of[e]) + " out of range (" +
          std::to_string(n_local) + " local experts)");
  if (a.my_slots.size() != static_cast<size_t>(L.slots))
    bad("my_slots has " + std::to_string(a.my_slots.size()) + " entries, layout has " + std::to_string(L.slots) +
        " slots");
  for (size_t s = 0; s < a.my_slots.size(); ++s)
    if (a.my_slots[s] < -1) bad("my_slots[" + std::to_string(s) + "] < -1");
  if (!a.slot_parent.empty() && a.slot_parent.size() != static_cast<size_t>(L.slots))
    bad("slot_parent must be empty or have one entry per slot");
  if (a.num_tasks < 0 || a.num_refs < 0) bad("negative task or ref count");
  if (a.num_tasks > 0 && !a.tasks) bad("tasks is null");
  if (a.num_refs > 0 && !a.refs) bad("refs is null");
  const uint8_t want_kind = static_cast<uint8_t>(mc ? TaskKind::kCopy : TaskKind::kReduce);
  for (int64_t i = 0; i < a.num_tasks; ++i) {
    const Task& t = a.tasks[i];
    const auto ti = [i] { return "task " + std::to_string(i) + ": "; };  // built only on error
    if (t.kind != want_kind)
      bad(ti() + "kind " + std::to_string(t.kind) + " does not belong to " + (mc ? "multicast" : "reduce"));
    if (t.self.rank != a.rank)
      bad(ti() + "self.rank " + std::to_string(t.self.rank) + " != rank " + std::to_string(a.rank));
    if (t.expert < 0) bad(ti() + "negative expert");
    if (t.chunk < 0 || static_cast<uint64_t>(t.chunk) >= nchunks)
      bad(ti() + "chunk " + std::to_string(t.chunk) + " out of range (" + std::to_string(nchunks) + " chunks)");
    {  // the byte range is the chunk's: flags are per chunk, so a mismatch would move or wait on the wrong bytes
      const uint64_t want_off = static_cast<uint64_t>(t.chunk) * L.chunk_bytes;  // < slot_bytes: chunk < nchunks
      const uint64_t want_bytes = std::min(L.chunk_bytes, slot_bytes - want_off);
      if (t.offset != want_off || t.bytes != want_bytes)
        bad(ti() + "byte range [" + std::to_string(t.offset) + ", +" + std::to_string(t.bytes) + ") is not chunk " +
            std::to_string(t.chunk) + "'s [" + std::to_string(want_off) + ", +" + std::to_string(want_bytes) +
            ") (chunk_bytes " + std::to_string(L.chunk_bytes) + ", " + (mc ? "weight" : "grad") + " slot " +
            std::to_string(slot_bytes) + " bytes)");
    }
    if (t.self.slot == kMaster) {
      if (static_cast<size_t>(t.expert) >= a.local_index_of.size() || a.local_index_of[t.expert] < 0)
        bad(ti() + "master source of expert " + std::to_string(t.expert) + " but it is not local (local_index_of)");
      const size_t li = static_cast<size_t>(a.local_index_of[t.expert]);
      for (size_t m = 0; m < M; ++m)
        if (a.member_bytes[m] && !a.master_ptrs[li * M + m])
          bad(ti() + "null master pointer for expert " + std::to_string(t.expert));
    } else if (t.self.slot < 0 || t.self.slot >= L.slots) {
      bad(ti() + "self.slot " + std::to_string(t.self.slot) + " out of range");
    } else if (a.my_slots[t.self.slot] != t.expert) {
      bad(ti() + "self slot " + std::to_string(t.self.slot) + " holds expert " +
          std::to_string(a.my_slots[t.self.slot]) + ", not " + std::to_string(t.expert));
    }
    if (t.ref_begin < 0 || t.ref_count < 0 || static_cast<int64_t>(t.ref_begin) + t.ref_count > a.num_refs)
      bad(ti() + "refs [" + std::to_string(t.ref_begin) + ", +" + std::to_string(t.ref_count) + ") out of range (" +
          std::to_string(a.num_refs) + " refs)");
    for (int32_t k = 0; k < t.ref_count; ++k) {
      const Ref r = a.refs[t.ref_begin + k];
      if (r.rank < 0 || r.rank >= a.world) bad(ti() + "ref rank " + std::to_string(r.rank) + " out of range");
      if (r.slot < 0 || r.slot >= L.slots) bad(ti() + "ref slot " + std::to_string(r.slot) + " out of range");
      if (r.rank == a.rank && r.slot == t.self.slot) bad(ti() + "ref equals self");
    }
    if (!mc) {
      for_each_segment(t.offset, t.bytes, a.member_off, a.member_bytes, [&](size_t m, uint64_t lo, uint64_t hi) {
        if ((lo - a.member_off[m]) % esize || (hi - lo) % esize)
          bad(ti() + "chunk cuts a grad element of member " + std::to_string(m));
      });
    }
  }
}

}  // namespace ultracomm
