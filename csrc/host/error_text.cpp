// format_error: ErrorRecord -> the text the host executor has always raised (tests pin it).
#include "ultracomm/impl/error_text.h"

#include <cinttypes>
#include <cstdio>

#include "ultracomm/records/task.h"

namespace ultracomm {
namespace {

std::string fmt_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", s);
  return buf;
}

std::string hex64(uint64_t x) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%016" PRIx64, x);
  return buf;
}

std::string rank_or_parent(int32_t peer) { return peer >= 0 ? "rank " + std::to_string(peer) : "its parent rank"; }

// "what this rank waited for", e.g. "rank 1 to deliver expert 0 chunk 2 into slot 0 (arrival flag)"
std::string awaited(const ErrorRecord& r) {
  const std::string ec = "expert " + std::to_string(r.expert) + " chunk " + std::to_string(r.chunk);
  const std::string slot = std::to_string(r.slot);
  switch (r.flag_kind) {
    case kFlagReady:
      return "rank " + std::to_string(r.peer) + " to join the operation (ready flag) before sending " + ec +
             " to its slot " + slot;
    case kFlagGradReady:
      return "rank " + std::to_string(r.peer) + "'s grad of " + ec + " in slot " + slot + " (grad_ready flag)";
    case kFlagArrival:
      return rank_or_parent(r.peer) + " to deliver " + ec + " into slot " + slot +
             (r.task >= 0 ? " (arrival flag; this rank relays it)" : " (arrival flag)");
    case kFlagConsumed:
      return rank_or_parent(r.peer) + " to consume " + ec + " of slot " + slot + " (consumed flag)";
    default:
      return "flag kind " + std::to_string(r.flag_kind);
  }
}

// where a digest check happened, e.g. "before sending expert 0 chunk 1 to its slot 2"
std::string checked_at(const ErrorRecord& r) {
  const std::string ec = "expert " + std::to_string(r.expert) + " chunk " + std::to_string(r.chunk);
  switch (r.flag_kind) {
    case kFlagReady:
      return "before sending " + ec + " to its slot " + std::to_string(r.slot);
    case kFlagGradReady:
      return "before reading its grad of " + ec + " in slot " + std::to_string(r.slot);
    case kFlagArrival:
      return "while waiting for " + ec + " in slot " + std::to_string(r.slot);
    case kFlagConsumed:
      return "while waiting for it to consume " + ec + " of slot " + std::to_string(r.slot);
    default:
      return "while checking its plan";
  }
}

}  // namespace

std::string format_error(const ErrorRecord& r, const char* op_name, double timeout_s) {
  const bool mc = r.op == static_cast<uint8_t>(Op::kMulticast);
  const std::string name = op_name && *op_name ? op_name : (mc ? "weight_sync" : "grad_reduce");
  // e.g. "ultracomm: rank 2 restore (multicast) epoch 7"
  const std::string head = "ultracomm: rank " + std::to_string(r.rank) + " " + name +
                           (mc ? " (multicast)" : " (reduce)") + " epoch " + std::to_string(r.epoch);
  const std::string peer = "rank " + std::to_string(r.peer);
  switch (r.code) {
    case kTimeout: {
      std::string s = head + " timed out after " + fmt_seconds(timeout_s) + " s waiting for " + awaited(r);
      if (r.peer >= 0 && r.peer_ready != kNotRead && r.peer_ready < r.epoch)
        s += "; " + peer + " has not started this operation (its ready flag is at epoch " +
             std::to_string(r.peer_ready) + "): it is likely the stalled or dead rank";
      return s;
    }
    case kDigestMismatch:
      return head + ": " + peer + " runs a different plan for this operation (schedule digest " + hex64(r.observed) +
             " in its window, " + hex64(r.expected) + " here; seen " + checked_at(r) +
             "); every rank must pass the same plan with the same configuration";
    case kRejected:
      return head + ": " + peer + " rejected its plan for this operation (its own error says why; seen " +
             checked_at(r) + "); every rank must pass the same valid plan";
    case kBadTask:
      return head + ": task " + std::to_string(r.task) + " (expert " + std::to_string(r.expert) + " chunk " +
             std::to_string(r.chunk) + ") lies outside its slot or the refs: the task list is corrupt";
    default:
      return head + ": stopped (error code " + std::to_string(r.code) + ")";
  }
}

void throw_error(const ErrorRecord& r, const char* op_name, double timeout_s) {
  const std::string msg = format_error(r, op_name, timeout_s);
  if (r.code == kTimeout) throw TimeoutError(msg);
  if (r.code == kDigestMismatch || r.code == kRejected) throw PlanMismatchError(msg);
  throw std::runtime_error(msg);
}

}  // namespace ultracomm
