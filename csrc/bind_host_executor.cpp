#include <pybind11/pybind11.h>
namespace py = pybind11;
namespace ultracomm { void bind_host_executor(py::module_& m) { (void)m; } }
