// The messages of the extension's failing checks, built as one std::string without std::ostream.
// c10::str streams every message of more than one piece through a std::ostringstream made in this
// library. A compiler that links its own copy of libstdc++ into the library (the CUDA machines'
// JIT build did) gives that stream a locale whose number formatting crashed the process
// (NOTES.md's run log). c10::str returns a lone string as it is, so each TORCH_CHECK here gets
// exactly one: a literal, a string, or message(...) (tests/test_check_messages.py).
#pragma once

#include <ATen/ATen.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace edgedot {
namespace check_message {

inline std::string piece(const char* text) { return text; }
inline std::string piece(const std::string& text) { return text; }
inline std::string piece(at::ScalarType dtype) { return c10::toString(dtype); }
inline std::string piece(const c10::Device& device) { return device.str(); }

template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
std::string piece(T value) {
  if constexpr (std::is_floating_point_v<T>) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", static_cast<double>(value));
    return text;
  } else {
    return std::to_string(value);
  }
}

// A shape as PyTorch prints one: [2, 3].
inline std::string piece(at::IntArrayRef shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

}  // namespace check_message

// The pieces (literals, strings, numbers, dtypes, devices, shapes) joined into one message.
template <typename... Pieces>
std::string message(const Pieces&... pieces) {
  std::string text;
  (text += ... += check_message::piece(pieces));
  return text;
}

}  // namespace edgedot
