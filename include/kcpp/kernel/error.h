// Formatting an entry point's error message into a thread-local buffer (see types.h).
#pragma once

#include <cstdarg>
#include <cstdio>

namespace kcpp::kernel {

// printf-style; returns the thread-local buffer, valid until the next call on this thread.
inline const char* errorf(const char* fmt, ...) {
  thread_local char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

}  // namespace kcpp::kernel

// Returns an error message from the enclosing entry point when `cond` fails.
#define KCPP_KERNEL_REQUIRE(cond, ...)                       \
  do {                                                       \
    if (!(cond)) return ::kcpp::kernel::errorf(__VA_ARGS__); \
  } while (0)
