// Raising an error from plain (torch-free) host code: dispatch, heuristics, tuning overrides.
// Defined in csrc/api/errors.cpp, where it becomes a c10::Error (a RuntimeError in Python), like
// FLASH_EXT_CHECK in the torch-facing files.
#pragma once
#include <string>

namespace flash_ext {

[[noreturn]] void raise_error(const std::string& message);

}  // namespace flash_ext
