// UTF-8 writing shared by the tokenizer and the chat template; utf8proc does the encoding.
#pragma once

#include <utf8proc.h>

#include <cstdint>
#include <string>

namespace kcpp::models {

// Appends the code point cp in UTF-8 (nothing for a value above U+10FFFF).
inline void append_utf8(std::string& out, uint32_t cp) {
  utf8proc_uint8_t buf[4];
  const utf8proc_ssize_t n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buf);
  out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

}  // namespace kcpp::models
