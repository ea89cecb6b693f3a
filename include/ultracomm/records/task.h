// Task records and protocol constants shared by every executor (host C++ and CUDA).
//
// A schedule is, per operation and per rank, a flat array of `Task` records plus a flat
// array of `Ref`s that tasks index into.  Executors only interpret these records; all
// decisions (trees, chunking, summation order) are made by the schedule builder.
#pragma once
#include <cstdint>

namespace ultracomm {

// Slot index meaning "the home rank's master copy of the task's expert" (the registered
// weights or grads), as opposed to a replica slot in the window.
constexpr int32_t kMaster = -1;

enum class Op : uint8_t {
  kMulticast = 0,  // weight_sync / restore: home -> replicas (push)
  kReduce = 1,     // grad_reduce: replicas -> home (pull), fp32 accumulation
};
constexpr int kNumOps = 2;

enum class TaskKind : uint8_t {
  // Read chunk `chunk` of `self` (own rank; master or a replica slot) and write it into
  // every destination refs[ref_begin .. ref_begin+ref_count) (peer replica slots).
  // If self.slot >= 0 (a relay), first wait until own arrival flag [self.slot][chunk] >= epoch.
  // Before writing a destination rank, wait until that rank's ready[kMulticast] >= epoch.
  // After writing each destination, set its arrival flag [slot][chunk] = epoch (release).
  kCopy = 1,
  // acc = float(self chunk); for each source ref in order: wait for the source rank's
  // grad_ready[slot][chunk] >= epoch, acc += float(source chunk).  self chunk = acc (in
  // the grad dtype).  Then for each source set its consumed[slot][chunk] = epoch, and if
  // self.slot >= 0 (a relay's partial) set own grad_ready[self.slot][chunk] = epoch.
  kReduce = 2,
};

struct Ref {
  int32_t rank;
  int32_t slot;  // replica slot index on `rank`, or kMaster
};

struct Task {
  uint8_t kind;  // TaskKind
  uint8_t reserved0;
  uint16_t level;     // dependency level: a task only waits on tasks of lower (chunk, level)
  int32_t expert;     // logical expert id
  int32_t chunk;      // chunk index within the expert's byte range
  int32_t ref_begin;  // index into the rank's refs array
  int32_t ref_count;  // copy: destinations; reduce: sources in summation order (after self)
  int32_t reserved1;
  uint64_t offset;  // byte offset of the chunk within the expert (slot layout)
  uint64_t bytes;   // byte length of the chunk
  Ref self;         // copy: the source; reduce: the destination and first addend
};
static_assert(sizeof(Ref) == 8, "Ref must stay 8 bytes");
static_assert(sizeof(Task) == 48, "Task must stay 48 bytes (shared with CUDA and numpy)");

// Relay modes for the schedule builder.
enum class RelayMode : int32_t { kAuto = 0, kOff = 1, kForce = 2 };

}  // namespace ultracomm
