// Seeded random numbers for tests and benchmarks.  Draws happen on the host so that a seed gives
// the same values on every device; KCPP_SEED, when set, overrides the seed of default_seed().
#pragma once

#include <cstdint>
#include <random>
#include <span>

namespace kcpp {

class Generator {
 public:
  explicit Generator(uint64_t seed) : seed_(seed), eng_(seed) {}
  uint64_t seed() const { return seed_; }
  void fill_normal(std::span<double> out, double mean, double std);
  void fill_uniform(std::span<double> out, double lo, double hi);
  void fill_int(std::span<int64_t> out, int64_t lo, int64_t hi);  // [lo, hi)
  std::mt19937_64& engine() { return eng_; }

 private:
  uint64_t seed_;
  std::mt19937_64 eng_;
};

// KCPP_SEED if set, else a fresh seed from std::random_device (print it when a check fails).
uint64_t default_seed();

}  // namespace kcpp
