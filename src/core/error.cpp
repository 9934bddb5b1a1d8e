#include "core/error.h"

namespace kcpp::detail {

void throw_check_failure(const char* expr, const std::string& message, const std::source_location& loc) {
  // The message comes first: it is what a user acts on.  A failed check is a broken invariant, so
  // its location helps the developer; a KCPP_FAIL is a deliberate, complete message for the user
  // (bad input, a refused package), and a source path would only be noise in it.
  if (!expr) throw Error(message);
  std::string where = fmt::format("{}:{} in {}", loc.file_name(), loc.line(), loc.function_name());
  throw Error(fmt::format("{} [check '{}' failed at {}]", message, expr, where));
}

}  // namespace kcpp::detail
