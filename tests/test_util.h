// Shared test helpers: the run's seed, the devices to test, error metrics against the oracle.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <ostream>
#include <string>
#include <vector>

#include "core/random.h"
#include "core/tensor.h"
#include "tolerances.h"

namespace kcpp::test {

// The seed of this run (KCPP_SEED or fresh), printed at start-up and in every failure.
uint64_t run_seed();

// A generator unique to the current test, derived from the run seed.
Generator test_generator();

// Skips the current test with the message docs/DESIGN.md names when no GPU is present.
#define KCPP_REQUIRE_DEVICE(dev)                                                       \
  do {                                                                                 \
    if ((dev).is_cuda() && ::kcpp::cuda_device_count() == 0) GTEST_SKIP() << "skipped: no CUDA device"; \
  } while (0)

// Floating dtypes an op supports on this device.
std::vector<DType> float_dtypes(Device d);

struct ErrorStats {
  double rel_l2 = 0;    // ||out - ref|| / ||ref||
  double max_abs = 0;
  int64_t worst = -1;   // index of the largest error
  int64_t nan_at = -1;  // first index where out is NaN and ref is not (or the reverse)
};
ErrorStats error_stats(const std::vector<double>& out, const std::vector<double>& ref);

// out against ref by relative L2 error (composites).
::testing::AssertionResult close_l2(const Tensor& out, const std::vector<double>& ref, double tol);
// out against ref with the error measured against the magnitude of the terms that formed ref:
// ||out - ref|| <= tol * ||magnitude|| (see oracle::NormGrad).
::testing::AssertionResult close_l2_mag(const Tensor& out, const std::vector<double>& ref,
                                        const std::vector<double>& magnitude, double tol);
// out against ref elementwise: |out - ref| <= rtol * (|ref| + atol_scale) (primitives).
::testing::AssertionResult close_elementwise(const Tensor& out, const std::vector<double>& ref, double rtol,
                                             double atol_scale);

// A kernel entry point's result is an error whose message contains `needle` (kernels report errors as
// strings, never by throwing).
::testing::AssertionResult kernel_error_contains(const char* error, const std::string& needle);

// The error figures themselves, for bounds that compare two implementations (kernel_bound).
double rel_l2_error(const Tensor& out, const std::vector<double>& ref);
double mag_error(const Tensor& out, const std::vector<double>& ref, const std::vector<double>& magnitude);

// The part of mag_error that underflow alone can cause: a result in the dtype's subnormal range is
// off by up to half the subnormal spacing eta whatever its magnitude (the standard model
// |fl(x) - x| <= u |x| + eta), so sqrt(n) eta / ||magnitude||.  Add it to a bound on mag_error where
// a few tiny results are possible (one-element rows of f16).
double underflow_allowance(DType t, const std::vector<double>& magnitude);

std::string config_name(Device d, DType t);

// The message of the kcpp::Error fn() throws, or "" when it throws none.
template <typename F> std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// tests/fixtures (the Transformers fixtures): $KCPP_FIXTURES_DIR when set (a build moved to another
// machine), else the source tree's.
std::string fixtures_dir();

// Activation checkpointing recomputes each layer in the backward: the same loss and gradients bit for
// bit as keeping the activations (a model with checkpoint_layers and loss_and_gradients).
template <typename Model> void expect_checkpointing_changes_nothing(Model& model, const Tensor& ids, const Tensor& labels) {
  model.checkpoint_layers = false;
  const auto kept = model.loss_and_gradients(ids, labels);
  model.checkpoint_layers = true;
  const auto again = model.loss_and_gradients(ids, labels);
  model.checkpoint_layers = false;
  EXPECT_EQ(again.loss.to_f64_vector(), kept.loss.to_f64_vector());
  ASSERT_EQ(again.grads.size(), kept.grads.size());
  for (const auto& [name, g] : kept.grads) EXPECT_EQ(again.grads.at(name).to_f64_vector(), g.to_f64_vector()) << name;
}

// Sets (or, value null, unsets) an environment variable for a scope (for the switches the library and
// packages read at each call), restoring what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    value ? ::setenv(name, value, 1) : ::unsetenv(name);
  }
  ~ScopedEnv() { had_ ? ::setenv(name_, old_.c_str(), 1) : ::unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

}  // namespace kcpp::test

namespace kcpp {
// How gtest prints a Device parameter ("cuda:0", not the struct's bytes).
inline void PrintTo(const Device& d, std::ostream* os) { *os << d.str(); }
}  // namespace kcpp

// EXPECT_ERROR(expr, needle): expr throws a kcpp::Error whose message contains needle.
#define EXPECT_ERROR(expr, needle)                                                              \
  do {                                                                                          \
    const std::string msg_ = ::kcpp::test::error_of([&] { (void)(expr); });                    \
    EXPECT_NE(msg_.find(needle), std::string::npos) << "message: '" << msg_ << "'";            \
  } while (0)
