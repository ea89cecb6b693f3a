// The one place failure text comes from: an ErrorRecord (error_record.h), filled by the
// interpreter on the host or the device, becomes the message and exception the host executor
// raises.  Host only.
#pragma once
#include <stdexcept>
#include <string>
#include "ultracomm/records/error_record.h"

namespace ultracomm {

// Raised when a wait exceeds the timeout; the message names rank, op, expert, chunk, peer.
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Raised when a peer runs another plan for this operation (its published schedule digest
// differs) or published that it rejected its plan.
struct PlanMismatchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// op_name: the operation as the user called it ("weight_sync", "restore", "grad_reduce");
// null or empty means "weight_sync" for multicast, "grad_reduce" for reduce.
std::string format_error(const ErrorRecord& r, const char* op_name, double timeout_s);

// Throws what format_error describes: TimeoutError (kTimeout), PlanMismatchError
// (kDigestMismatch, kRejected), std::runtime_error (anything else).
[[noreturn]] void throw_error(const ErrorRecord& r, const char* op_name, double timeout_s);

}  // namespace ultracomm
