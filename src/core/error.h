// kcpp::Error and the check macros.
//
// Every failure in kernels.cpp becomes a kcpp::Error whose message says what was wrong and where
// ("op rms_norm: argument 'weight': expected shape [4096], got [4095]"), complete on its own: the
// failed expression and the source location are appended only in a debug build or with the
// environment's KCPP_DEBUG=1.  Nothing in the library aborts the process.
#pragma once

#include <source_location>
#include <stdexcept>
#include <string>

// fmt 9 does not compile under nvcc in C++20 mode, so CUDA translation units format their error
// messages with the small runtime formatter below; every other file uses fmt.
#if defined(__CUDACC__)
#include <sstream>
#include <string_view>
#else
#include <fmt/format.h>
#include <fmt/ranges.h>
#endif

namespace kcpp {

class Error : public std::runtime_error {
 public:
  explicit Error(std::string message) : std::runtime_error(std::move(message)) {}
};

// Thrown when an allocation fails (host or device); carries the request for the caller to report.
class OutOfMemory : public Error {
 public:
  explicit OutOfMemory(std::string message) : Error(std::move(message)) {}
};

namespace detail {
[[noreturn]] void throw_check_failure(const char* expr, const std::string& message,
                                      const std::source_location& loc);

#if defined(__CUDACC__)
// Replaces each "{...}" of `f` with the next argument, printed by operator<<.  Error messages only.
inline void format_runtime_rest(std::ostringstream& os, std::string_view f) { os << f; }
template <typename A, typename... Rest>
void format_runtime_rest(std::ostringstream& os, std::string_view f, const A& a, const Rest&... rest) {
  const size_t open = f.find('{'), close = f.find('}', open);
  if (open == std::string_view::npos || close == std::string_view::npos) {
    os << f;
    return;
  }
  os << f.substr(0, open) << a;
  format_runtime_rest(os, f.substr(close + 1), rest...);
}
template <typename... Args> std::string format_runtime(std::string_view f, const Args&... args) {
  std::ostringstream os;
  format_runtime_rest(os, f, args...);
  return os.str();
}
#endif
}  // namespace detail

}  // namespace kcpp

#if defined(__CUDACC__)
#define KCPP_FORMAT(...) ::kcpp::detail::format_runtime(__VA_ARGS__)
#else
#define KCPP_FORMAT(...) ::fmt::format(__VA_ARGS__)
#endif

// KCPP_CHECK(cond, "format {}", args...): evaluates cond once; on failure throws kcpp::Error with
// the formatted message (and, in a debug build or with KCPP_DEBUG=1, the expression and the source
// location).
#define KCPP_CHECK(cond, ...)                                                                   \
  do {                                                                                          \
    if (!(cond)) [[unlikely]] {                                                                 \
      ::kcpp::detail::throw_check_failure(#cond, KCPP_FORMAT(__VA_ARGS__),                    \
                                          ::std::source_location::current());                  \
    }                                                                                           \
  } while (0)

// KCPP_FAIL("format {}", args...): unconditional failure with a formatted message (and the source
// location as KCPP_CHECK adds it).
#define KCPP_FAIL(...) \
  ::kcpp::detail::throw_check_failure(nullptr, KCPP_FORMAT(__VA_ARGS__), ::std::source_location::current())
