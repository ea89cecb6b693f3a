// What went wrong in one rank's operation, as plain data: written by the interpreter
// (interp.h) on the host or the device (first failure wins), turned into text by one host
// function, format_error (error_text.h), so host and device raise the same messages.
#pragma once
#include <cstdint>
#include "ultracomm/records/hd.h"

namespace ultracomm {

enum ErrorCode : uint32_t {
  kOk = 0,
  kTimeout = 1,         // a wait passed timeout_ns (UltracommTimeout / _core.TimeoutError)
  kDigestMismatch = 2,  // peer `peer` published another schedule digest for this op and epoch
  kRejected = 3,        // peer `peer` published kRejectedDigest: it rejected its plan
  kBadTask = 4,         // a task failed the interpreter's bounds guard (host validation missed it)
  kAborted = 5,         // stopped because another worker failed (never the first error)
};

enum FlagKind : uint32_t {
  kFlagNone = 0,
  kFlagReady = 1,      // peer's ready[op]
  kFlagArrival = 2,    // arrival[slot][chunk] (multicast data delivered)
  kFlagGradReady = 3,  // grad_ready[slot][chunk] (reduce source published)
  kFlagConsumed = 4,   // consumed[slot][chunk] (reduce source read by its parent)
  kFlagDigest = 5,     // peer's digest[op]
};

// Digest a rank publishes (with ready[op] = epoch) when it rejected its plan for this op:
// a peer that sees it raises kRejected instead of waiting for the timeout.
constexpr uint64_t kRejectedDigest = ~uint64_t(0);
constexpr uint64_t kNotRead = ~uint64_t(0);  // peer_ready / observed: not read

struct ErrorRecord {
  uint32_t code;  // ErrorCode
  int32_t rank;   // the rank that failed (this rank)
  uint8_t op;     // Op
  uint8_t reserved[3];
  uint32_t flag_kind;  // FlagKind of the flag awaited
  int64_t task;        // index in the rank's task list; -1 in join/drain
  int32_t expert;      // -1 if none
  int32_t chunk;       // -1 if none
  int32_t slot;        // slot of the flag awaited (on `peer` for ready/grad_ready, else own)
  int32_t peer;        // rank awaited / checked; -1 = unknown (no slot_parent given)
  uint64_t epoch;
  uint64_t observed;    // flag value seen at the timeout, or the peer's digest
  uint64_t expected;    // own digest (kDigestMismatch / kRejected)
  uint64_t peer_ready;  // peer's ready[op] at the failure (< epoch: it never started this op)
};
static_assert(sizeof(ErrorRecord) == 72, "ErrorRecord is copied raw from device memory");

UC_INLINE ErrorRecord make_error_record(uint32_t code, int32_t rank, uint8_t op, uint64_t epoch) {
  ErrorRecord r{};
  r.code = code;
  r.rank = rank;
  r.op = op;
  r.task = -1;
  r.expert = r.chunk = r.slot = r.peer = -1;
  r.epoch = epoch;
  r.observed = r.expected = r.peer_ready = kNotRead;
  return r;
}

}  // namespace ultracomm
