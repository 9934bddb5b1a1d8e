#include <gtest/gtest.h>

#include "package_util.h"


namespace kcpp::test {

::testing::AssertionResult refused(const nn::KernelStatus& s, kcpp_status expect, const std::string& needle) {
  if (s.status != expect)
    return ::testing::AssertionFailure() << "status " << nn::status_name(s.status) << " (expected "
                                         << nn::status_name(expect) << "), message: " << s.message;
  if (s.message.find(needle) == std::string::npos)
    return ::testing::AssertionFailure() << "message '" << s.message << "' does not contain '" << needle << "'";
  return ::testing::AssertionSuccess();
}

}  // namespace kcpp::test
