// Error messages of the torch-facing files. FLASH_EXT_CHECK(cond, parts...) is TORCH_CHECK with
// the message concatenated here (std::string, std::to_string) and handed over as one C string.
// On the GPU machine's toolchain (g++ 13 extension, torch 2.11 wheel), TORCH_CHECK with several
// message arguments, which c10::str formats with a std::ostringstream inside the extension,
// crashed the process (SIGSEGV) instead of raising; a single C-string message raises normally.
#pragma once
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "error.h"

namespace flash_ext {

namespace detail {
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }
inline void append(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
}  // namespace detail

template <typename... Args>
std::string error_message(const Args&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

}  // namespace flash_ext

// TORCH_CHECK raises c10::Error, a RuntimeError in Python, as FlashAttention's errors are (its
// callers catch RuntimeError); TORCH_CHECK_VALUE / _TYPE would raise ValueError / TypeError
// (tests/test_errors.py keeps them out of csrc/).
#define FLASH_EXT_CHECK(cond, ...) TORCH_CHECK(cond, ::flash_ext::error_message(__VA_ARGS__).c_str())
