#include <cstdlib>
#include "test_util.h"

#include <fmt/format.h>

#include <limits>

namespace kcpp::test {

uint64_t run_seed() {
  static const uint64_t seed = default_seed();
  return seed;
}

Generator test_generator() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "none";
  return Generator(run_seed() ^ std::hash<std::string>{}(name));
}

std::vector<DType> float_dtypes(Device d) {
  if (d.is_cpu()) return {DType::f64, DType::f32, DType::bf16, DType::f16};
  return {DType::f32, DType::bf16, DType::f16};
}

ErrorStats error_stats(const std::vector<double>& out, const std::vector<double>& ref) {
  ErrorStats s;
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (std::isnan(out[i]) != std::isnan(ref[i])) {
      if (s.nan_at < 0) s.nan_at = static_cast<int64_t>(i);
      continue;
    }
    if (std::isnan(ref[i]) || (std::isinf(ref[i]) && out[i] == ref[i])) continue;
    const double e = std::fabs(out[i] - ref[i]);
    num += e * e;
    den += ref[i] * ref[i];
    if (!(e <= s.max_abs)) {
      s.max_abs = e;
      s.worst = static_cast<int64_t>(i);
    }
  }
  s.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return s;
}

static ::testing::AssertionResult size_mismatch(const Tensor& out, const std::vector<double>& ref) {
  return ::testing::AssertionFailure() << "output has " << out.numel() << " elements, oracle " << ref.size()
                                       << " (seed " << run_seed() << ")";
}

::testing::AssertionResult close_l2(const Tensor& out, const std::vector<double>& ref, double tol) {
  if (static_cast<size_t>(out.numel()) != ref.size()) return size_mismatch(out, ref);
  const auto o = out.to_f64_vector();
  const ErrorStats s = error_stats(o, ref);
  if (s.nan_at >= 0)
    return ::testing::AssertionFailure() << "NaN mismatch at " << s.nan_at << ": out " << o[s.nan_at] << ", oracle "
                                         << ref[s.nan_at] << " (seed " << run_seed() << ")";
  if (!(s.rel_l2 <= tol))
    return ::testing::AssertionFailure() << "relative L2 error " << s.rel_l2 << " > " << tol << "; worst at "
                                         << s.worst << ": out " << o[s.worst] << ", oracle " << ref[s.worst]
                                         << " (seed " << run_seed() << ")";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult close_l2_mag(const Tensor& out, const std::vector<double>& ref,
                                        const std::vector<double>& magnitude, double tol) {
  if (static_cast<size_t>(out.numel()) != ref.size() || magnitude.size() != ref.size()) return size_mismatch(out, ref);
  const auto o = out.to_f64_vector();
  const ErrorStats s = error_stats(o, ref);
  if (s.nan_at >= 0)
    return ::testing::AssertionFailure() << "NaN mismatch at " << s.nan_at << ": out " << o[s.nan_at] << ", oracle "
                                         << ref[s.nan_at] << " (seed " << run_seed() << ")";
  double num = 0, den = 0;
  for (size_t i = 0; i < o.size(); ++i) num += (o[i] - ref[i]) * (o[i] - ref[i]), den += magnitude[i] * magnitude[i];
  const double err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (!(err <= tol))
    return ::testing::AssertionFailure() << "error relative to the terms' magnitude " << err << " > " << tol
                                         << "; worst at " << s.worst << ": out " << o[s.worst] << ", oracle "
                                         << ref[s.worst] << " (seed " << run_seed() << ")";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult close_elementwise(const Tensor& out, const std::vector<double>& ref, double rtol,
                                             double atol_scale) {
  if (static_cast<size_t>(out.numel()) != ref.size()) return size_mismatch(out, ref);
  const auto o = out.to_f64_vector();
  for (size_t i = 0; i < o.size(); ++i) {
    const bool nan_o = std::isnan(o[i]), nan_r = std::isnan(ref[i]);
    if (nan_o || nan_r) {
      if (nan_o != nan_r)
        return ::testing::AssertionFailure() << "NaN mismatch at " << i << ": out " << o[i] << ", oracle " << ref[i]
                                             << " (seed " << run_seed() << ")";
      continue;
    }
    if (std::isinf(ref[i]) && o[i] == ref[i]) continue;
    const double bound = rtol * (std::fabs(ref[i]) + atol_scale);
    if (!(std::fabs(o[i] - ref[i]) <= bound))
      return ::testing::AssertionFailure() << "element " << i << ": out " << o[i] << ", oracle " << ref[i]
                                           << ", |error| " << std::fabs(o[i] - ref[i]) << " > " << bound << " (seed "
                                           << run_seed() << ")";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult kernel_error_contains(const char* error, const std::string& needle) {
  if (!error) return ::testing::AssertionFailure() << "no error; expected one containing: " << needle;
  if (std::string(error).find(needle) == std::string::npos)
    return ::testing::AssertionFailure() << "error '" << error << "' does not contain '" << needle << "'";
  return ::testing::AssertionSuccess();
}

double rel_l2_error(const Tensor& out, const std::vector<double>& ref) {
  const ErrorStats s = error_stats(out.to_f64_vector(), ref);
  return s.nan_at >= 0 ? std::numeric_limits<double>::infinity() : s.rel_l2;
}

double mag_error(const Tensor& out, const std::vector<double>& ref, const std::vector<double>& magnitude) {
  const auto o = out.to_f64_vector();
  double num = 0, den = 0;
  for (size_t i = 0; i < o.size(); ++i) {
    if (std::isnan(o[i]) != std::isnan(ref[i])) return std::numeric_limits<double>::infinity();
    if (std::isnan(o[i])) continue;
    num += (o[i] - ref[i]) * (o[i] - ref[i]);
    den += magnitude[i] * magnitude[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double underflow_allowance(DType t, const std::vector<double>& magnitude) {
  double eta = 0;  // half the spacing of the dtype's subnormals
  switch (t) {
    case DType::f16: eta = 0x1p-25; break;
    case DType::bf16: eta = 0x1p-134; break;
    case DType::f32: eta = 0x1p-150; break;
    default: return 0;
  }
  double den = 0;
  for (double m : magnitude) den += m * m;
  const double n = static_cast<double>(magnitude.size());
  return den > 0 ? eta * std::sqrt(n / den) : eta * std::sqrt(n);
}

std::string fixtures_dir() {
  const char* env = std::getenv("KCPP_FIXTURES_DIR");
  return env && *env ? std::string(env) : std::string(KCPP_FIXTURES_DIR_DEFAULT);
}

std::string config_name(Device d, DType t) { return fmt::format("{} {}", d.str(), dtype_name(t)); }

}  // namespace kcpp::test
