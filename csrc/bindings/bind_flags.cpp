// Python bindings of single epoch-flag operations, for executors that are not the interpreter
// but take part in its protocol (the split transport's bridge): acquire loads, release stores
// and a bounded wait with the interpreter's backoff, on raw addresses of window words.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "movers/host_flags.h"

namespace py = pybind11;

namespace ultracomm {
namespace {

void check_addr(uintptr_t addr, const char* what) {
  if (addr == 0 || addr % 8)
    throw std::invalid_argument(std::string("ultracomm.") + what +
                                ": address must be a nonzero 8-byte aligned "
                                "address of a uint64 flag");
}

}  // namespace

void bind_flags(py::module_& m) {
  m.def(
      "load_acquire",
      [](uintptr_t addr) {
        check_addr(addr, "load_acquire");
        return host::load_acquire(addr);
      },
      py::arg("addr"), "The uint64 at addr, loaded with acquire semantics (system scope on the host).");
  m.def(
      "store_release",
      [](uintptr_t addr, uint64_t value) {
        check_addr(addr, "store_release");
        host::store_release(addr, value);
      },
      py::arg("addr"), py::arg("value"), "Store value at addr with release semantics.");
  m.def(
      "wait_flag",
      [](uintptr_t addr, uint64_t epoch, double timeout_s, uintptr_t abort_word) {
        check_addr(addr, "wait_flag");
        if (abort_word % 8) throw std::invalid_argument("ultracomm.wait_flag: abort_word must be 8-byte aligned or 0");
        if (!(timeout_s > 0)) throw std::invalid_argument("ultracomm.wait_flag: timeout_s must be > 0");
        int status = 0;
        uint64_t seen = 0;
        {
          py::gil_scoped_release nogil;
          const uint64_t t0 = host::now_ns();
          const uint64_t budget = timeout_s >= 1e9 ? ~uint64_t(0) : static_cast<uint64_t>(timeout_s * 1e9);
          for (uint32_t spin = 0;; ++spin) {
            seen = host::load_acquire(addr);
            if (seen >= epoch) break;
            if (abort_word != 0 && host::load_acquire(abort_word) != 0) {
              status = 2;
              break;
            }
            if (host::now_ns() - t0 >= budget) {
              status = 1;
              break;
            }
            host::relax(spin);
          }
        }
        return py::make_tuple(status, seen);
      },
      py::arg("addr"), py::arg("epoch"), py::arg("timeout_s"), py::arg("abort_word") = 0,
      R"doc(Wait until the uint64 at addr is >= epoch (acquire), with the host executor's backoff;
releases the GIL.  Returns (status, value seen): status 0 reached, 1 timed out after
timeout_s, 2 stopped because the uint64 at abort_word (if nonzero) became nonzero.)doc");
}

}  // namespace ultracomm
