#include "core/error.h"

#include <cstdlib>
#include <cstring>

namespace kcpp::detail {

namespace {

// Whether failures carry the source's details: always in a debug build, in a release build when the
// environment has KCPP_DEBUG=1 (read at each failure, so a process can switch it).
bool debug_details() {
#ifndef NDEBUG
  return true;
#else
  const char* v = std::getenv("KCPP_DEBUG");
  return v && std::strcmp(v, "1") == 0;
#endif
}

}  // namespace

void throw_check_failure(const char* expr, const std::string& message, const std::source_location& loc) {
  // The message is what a user acts on, so it must say on its own what was wrong and what to do;
  // the expression and the source location help whoever debugs kernels.cpp, and are added for them.
  if (!debug_details()) throw Error(message);
  const std::string where = fmt::format("{}:{} in {}", loc.file_name(), loc.line(), loc.function_name());
  if (!expr) throw Error(fmt::format("{} [at {}]", message, where));
  throw Error(fmt::format("{} [check '{}' failed at {}]", message, expr, where));
}

}  // namespace kcpp::detail
