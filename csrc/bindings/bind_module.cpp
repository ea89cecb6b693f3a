// ultracomm._core: the host C++ core (schedule builder and host executor).
#include <pybind11/pybind11.h>

#include "bindings/py_errors.h"

namespace py = pybind11;

namespace ultracomm {
void bind_schedule(py::module_& m);
void bind_host_executor(py::module_& m);
void bind_planners(py::module_& m);
void bind_flags(py::module_& m);
void bind_quota_device(py::module_& m);
void bind_token_split(py::module_& m);
void bind_sched_portable(py::module_& m);
}  // namespace ultracomm

PYBIND11_MODULE(_core, m) {
  m.doc() = "ultracomm host core: schedule builder and host executor";
  ultracomm::register_input_error(m);
  ultracomm::bind_schedule(m);
  ultracomm::bind_host_executor(m);
  ultracomm::bind_planners(m);
  ultracomm::bind_flags(m);
  ultracomm::bind_quota_device(m);
  ultracomm::bind_token_split(m);
  ultracomm::bind_sched_portable(m);
}
