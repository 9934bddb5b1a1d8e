#include "core/random.h"

#include <cstdlib>
#include <string>

namespace kcpp {

void Generator::fill_normal(std::span<double> out, double mean, double std) {
  std::normal_distribution<double> d(mean, std);
  for (double& v : out) v = d(eng_);
}

void Generator::fill_uniform(std::span<double> out, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  for (double& v : out) v = d(eng_);
}

void Generator::fill_int(std::span<int64_t> out, int64_t lo, int64_t hi) {
  std::uniform_int_distribution<int64_t> d(lo, hi - 1);
  for (int64_t& v : out) v = d(eng_);
}

uint64_t default_seed() {
  if (const char* s = std::getenv("KCPP_SEED"); s && *s) return std::stoull(s);
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

}  // namespace kcpp
