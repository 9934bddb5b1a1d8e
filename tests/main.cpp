// Test runner: turns on allocator poisoning (unwritten outputs read as NaN) and prints the seed.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "core/allocator.h"
#include "test_util.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  kcpp::set_allocator_poison(true);
  // Every row count of the few-rows matmul path (ops/cuda/gemv.cu), not only the default's one.
  ::setenv("KCPP_GEMV", "8", 0);
  std::printf("kernels.cpp tests: seed %llu (set KCPP_SEED to repeat a run)\n",
              static_cast<unsigned long long>(kcpp::test::run_seed()));
  return RUN_ALL_TESTS();
}
