#include "core/error.h"

namespace kcpp::detail {

void throw_check_failure(const char* expr, const std::string& message, const std::source_location& loc) {
  // The message comes first: it is what a user acts on.  The location helps the developer.
  std::string where = fmt::format("{}:{} in {}", loc.file_name(), loc.line(), loc.function_name());
  if (expr) throw Error(fmt::format("{} [check '{}' failed at {}]", message, expr, where));
  throw Error(fmt::format("{} [at {}]", message, where));
}

}  // namespace kcpp::detail
