// The flash_ext library: the Python module flash_ext._C (importing it registers every op; the
// ops live in ops_fwd.cpp, ops_bwd.cpp and ops_dropout.cpp) and the ops that describe or steer
// the build: build_info, and the tuning overrides (csrc/tuning/overrides.h) that tests and A/B
// runs set at runtime, since the environment is read once per process.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "tuning/overrides.h"

#ifndef FLASH_EXT_BUILD_INFO
#define FLASH_EXT_BUILD_INFO "unknown"
#endif

// Importing flash_ext._C registers the ops; the module itself has no Python functions.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

namespace flash_ext {
namespace {

std::string build_info() { return FLASH_EXT_BUILD_INFO; }

void set_tuning_op(const std::string& name, const std::string& value) { set_tuning(name, value); }

std::string get_tuning_op(const std::string& name) { return get_tuning(name); }

}  // namespace
}  // namespace flash_ext

TORCH_LIBRARY(flash_ext, m) {
  m.def("build_info() -> str", &flash_ext::build_info);
  // name: a FLASH_EXT_* switch (README); value "" restores the environment's value.
  m.def("set_tuning(str name, str value) -> ()", &flash_ext::set_tuning_op);
  m.def("get_tuning(str name) -> str", &flash_ext::get_tuning_op);
}
