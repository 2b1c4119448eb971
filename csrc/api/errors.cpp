// raise_error (csrc/error.h) for the plain host code: a c10::Error, as FLASH_EXT_CHECK raises.
#include "api/errors.h"

namespace flash_ext {

void raise_error(const std::string& message) {
  TORCH_CHECK(false, message.c_str());
  __builtin_unreachable();  // TORCH_CHECK(false, ...) always throws
}

}  // namespace flash_ext
