// The C++ argument checks' std::invalid_argument surfaces as ultracomm.errors.InputError (an
// UltracommError and a ValueError) instead of pybind11's builtin ValueError: errors.py promises that
// every error ultracomm detects is an UltracommError.  Module-local, so other pybind11 modules'
// exceptions keep pybind11's mapping; every other C++ exception goes on to the next translator.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <stdexcept>

namespace ultracomm {

inline void register_input_error(pybind11::module_& m) {
  namespace py = pybind11;
  // a reference held for the process's life (the translator has no other place to keep it)
  static PyObject* input_error = nullptr;
  if (input_error == nullptr)
    input_error = py::object(py::module_::import("ultracomm.errors").attr("InputError")).release().ptr();
  m.attr("InputError") = py::handle(input_error);
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(input_error, e.what());
    }
  });
}

}  // namespace ultracomm
