// core/: dtype conversions, tensor views and copies, DLPack, the allocator, platform detection.
#include <dlpack/dlpack.h>
#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>
#include <nlohmann/json.hpp>

#include "core/allocator.h"
#include "core/cuda_graph.h"
#include "core/platform.h"
#include "core/profile.h"
#include "ops/ops.h"
#include "test_util.h"

namespace kcpp {
namespace {

using test::test_generator;

// ---- 16-bit conversions ----------------------------------------------------------------------

TEST(DType, F16RoundTripsEveryValue) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const f16 h{static_cast<uint16_t>(b)};
    const float f = f16_to_f32(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f)))) << b;
      continue;
    }
    ASSERT_EQ(f32_to_f16(f).bits, b) << "f16 bits " << b << " -> " << f;
  }
}

TEST(DType, Bf16RoundTripsEveryValue) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const bf16 h{static_cast<uint16_t>(b)};
    const float f = bf16_to_f32(h);
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_bf16(f).bits, b) << b;
  }
}

#if defined(__FLT16_MAX__)
// The compiler's own _Float16 conversion is an independent reference for every rounding case.
TEST(DType, F16MatchesCompilerConversion) {
  Generator gen = test_generator();
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = bits(gen.engine());
    // Concentrate on the f16 range (exponents around 2^-26 .. 2^17) where rounding is subtle.
    u = (u & 0x807fffffu) | ((100u + (u >> 23) % 45u) << 23);
    const float f = std::bit_cast<float>(u);
    const _Float16 ref = static_cast<_Float16>(f);
    ASSERT_EQ(f32_to_f16(f).bits, std::bit_cast<uint16_t>(ref)) << "f32 bits " << u;
  }
}
#endif

TEST(DType, RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one (1).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 0x1p-8f)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);
  EXPECT_EQ(f16_to_f32(f32_to_f16(65519.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(65520.0f))));
  EXPECT_EQ(f16_to_f32(f32_to_f16(0x1p-24f)), 0x1p-24f);   // smallest subnormal
  EXPECT_EQ(f16_to_f32(f32_to_f16(0x1p-25f)), 0.0f);       // tie with 0 goes to even (0)
  EXPECT_EQ(f16_to_f32(f32_to_f16(0x1.8p-25f)), 0x1p-24f);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::infinity()))));
}

TEST(DType, ParsesNamesAndRejectsUnknown) {
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_EQ(parse_dtype("f16"), DType::f16);
  EXPECT_THROW(parse_dtype("float8"), Error);
  EXPECT_EQ(parse_device("cuda:3"), Device::cuda(3));
  EXPECT_THROW(parse_device("gpu"), Error);
  EXPECT_THROW(parse_device("cuda:x"), Error);
}

// ---- tensors -----------------------------------------------------------------------------------

class TensorOnDevice : public ::testing::TestWithParam<Device> {};

TEST_P(TensorOnDevice, ViewsShareStorageAndIndexCorrectly) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  std::vector<double> v(2 * 3 * 5);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(i);
  const Tensor t = Tensor::from_f64(v, {2, 3, 5}, DType::f32, dev);
  const Tensor tr = t.transpose(0, 2);  // [5, 3, 2]
  EXPECT_TRUE(tr.shares_storage(t));
  EXPECT_FALSE(tr.is_contiguous());
  const auto trv = tr.to_f64_vector();
  for (int64_t a = 0; a < 5; ++a)
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t c = 0; c < 2; ++c) ASSERT_EQ(trv[(a * 3 + b) * 2 + c], v[(c * 3 + b) * 5 + a]);
  const Tensor nar = t.narrow(2, 1, 3).select(1, 2);  // [2, 3]: t[:, 2, 1:4]
  EXPECT_EQ(nar.shape(), (Shape{2, 3}));
  EXPECT_EQ(nar.to_f64_vector(), (std::vector<double>{11, 12, 13, 26, 27, 28}));
  const Tensor p = t.permute({1, 0, 2}).contiguous();
  EXPECT_TRUE(p.is_contiguous());
  EXPECT_EQ(p.to_f64_vector()[5], v[15]);  // p[0, 1, 0] = t[1, 0, 0]
  const Tensor e = t.narrow(1, 0, 1).expand({2, 4, 5});
  EXPECT_EQ(e.stride(1), 0);
  EXPECT_EQ(e.to_f64_vector()[3 * 5 + 2], v[2]);
  // reshape of a non-viewable layout copies; view refuses.
  EXPECT_THROW(tr.view({30}), Error);
  EXPECT_EQ(tr.reshape({30}).to_f64_vector(), trv);
  EXPECT_EQ(t.view({6, -1}).shape(), (Shape{6, 5}));
  EXPECT_TRUE(t.view({6, -1}).shares_storage(t));
}

// A view or reshape of a strided tensor holds the same elements in the same (row-major) order as
// its contiguous copy: narrowed and transposed layouts with size-1 dims between the strided ones
// (a decode step's [B, H, 1, D]), split and merged in every way the shape allows.  A view either
// succeeds with those elements or refuses; reshape always succeeds.
TEST(Tensor, ViewsOfStridedLayoutsKeepTheElementOrder) {
  struct Case {
    Shape shape;
    int64_t narrow_dim, narrow_len;
    Shape to;
  };
  const Case cases[] = {{{2, 2, 1, 8}, 3, 4, {2, 2, 1, 2, 2}}, {{2, 2, 1, 8}, 3, 4, {4, 4}},      {{2, 1, 3, 1, 6}, 4, 2, {2, 3, 2}},
                        {{3, 1, 5}, 2, 5, {15}},             {{1, 4, 1, 6}, 3, 3, {4, 3}},      {{2, 3, 1, 1, 4}, 1, 2, {2, 2, 4}},
                        {{2, 3, 1, 1, 4}, 1, 2, {4, 4}},     {{4, 1, 1, 2}, 0, 3, {3, 2}},       {{2, 5, 1}, 1, 4, {8}},
                        {{2, 5, 1}, 1, 4, {2, 2, 2, 1}}};
  for (const Case& c : cases) {
    std::vector<double> v(static_cast<size_t>(shape_numel(c.shape)));
    std::iota(v.begin(), v.end(), 1.0);
    const Tensor base = Tensor::from_f64(v, c.shape, DType::f64, Device::cpu());
    for (const Tensor& x : {base.narrow(c.narrow_dim, 0, c.narrow_len), base.narrow(c.narrow_dim, 1, c.narrow_len - 1)}) {
      Shape to = c.to;
      if (x.numel() != shape_numel(to)) to = {x.numel()};
      const std::vector<double> want = x.contiguous().to_f64_vector();
      const std::string what = fmt::format("{} strides {} as {}", shape_str(x.shape()), shape_str(x.strides()), shape_str(to));
      EXPECT_EQ(x.reshape(to).contiguous().to_f64_vector(), want) << what;
      const std::string refused = test::error_of([&] { (void)x.view(to); });
      if (refused.empty()) {
        EXPECT_EQ(x.view(to).contiguous().to_f64_vector(), want) << what;
      }
    }
  }
}

TEST_P(TensorOnDevice, CastsAndCopiesAcrossDtypes) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  const Tensor x = Tensor::randn({7, 13}, DType::f32, dev, gen);
  const auto xv = x.to_f64_vector();
  for (DType t : {DType::bf16, DType::f16, DType::f64, DType::i32}) {
    if (t == DType::f64 && dev.is_cuda()) continue;
    const auto got = x.to(t).to_f64_vector();
    for (size_t i = 0; i < xv.size(); ++i) {
      double expect = xv[i];
      if (t == DType::bf16) expect = bf16_to_f32(f32_to_bf16(static_cast<float>(xv[i])));
      if (t == DType::f16) expect = f16_to_f32(f32_to_f16(static_cast<float>(xv[i])));
      if (t == DType::i32) expect = static_cast<double>(static_cast<int32_t>(xv[i]));
      ASSERT_EQ(got[i], expect) << dtype_name(t) << " at " << i;
    }
  }
  // copy_ into a strided destination, broadcasting the source.
  const Tensor dst = Tensor::zeros({13, 7}, DType::bf16, dev).transpose(0, 1);  // [7, 13] non-contiguous
  dst.copy_(x.narrow(0, 0, 1));
  const auto dv = dst.to_f64_vector();
  for (int64_t r = 0; r < 7; ++r)
    for (int64_t c = 0; c < 13; ++c) ASSERT_EQ(dv[r * 13 + c], bf16_to_f32(f32_to_bf16(static_cast<float>(xv[c]))));
}

// A copy from host memory to the device returns without waiting for the stream where the memory is
// pageable (Tensor::copy_), and after the copy where it is page-locked: either way the host may
// rewrite or free its buffer as soon as the copy returns, while the stream is still busy with work
// queued before it.  Sizes from a few bytes to 64 MiB (the driver stages pageable copies in pieces);
// the page-locked buffer is registered with the driver.
TEST_P(TensorOnDevice, HostBufferIsFreeOnceTheCopyReturns) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  if (!dev.is_cuda()) GTEST_SKIP() << "on the host, to() returns the buffer itself";
  Generator gen = test_generator();
  const Tensor busy = Tensor::randn({2048, 2048}, DType::f32, dev, gen);
  for (int64_t n : {int64_t{3}, int64_t{4096}, int64_t{1} << 20, int64_t{16} << 20}) {
    std::vector<int32_t> host(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) host[static_cast<size_t>(i)] = static_cast<int32_t>(i * 7 + 1);
    for (int r = 0; r < 4; ++r) (void)ops::matmul(busy, busy, false, false);  // work ahead of the copy
    Tensor d = Tensor::from_blob(host.data(), {n}, DType::i32, Device::cpu()).to(dev);
    std::fill(host.begin(), host.end(), -1);
    host.clear();
    host.shrink_to_fit();
    const auto got = d.to_i64_vector();
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[static_cast<size_t>(i)], i * 7 + 1) << "n=" << n << " at " << i;
  }
#if KCPP_WITH_CUDA
  const int64_t n = int64_t{4} << 20;
  std::vector<int32_t> locked(static_cast<size_t>(n));
  ASSERT_EQ(cudaHostRegister(locked.data(), locked.size() * sizeof(int32_t), cudaHostRegisterDefault), cudaSuccess);
  for (int64_t i = 0; i < n; ++i) locked[static_cast<size_t>(i)] = static_cast<int32_t>(i * 3 + 2);
  for (int r = 0; r < 4; ++r) (void)ops::matmul(busy, busy, false, false);
  const Tensor d = Tensor::from_blob(locked.data(), {n}, DType::i32, Device::cpu()).to(dev);
  std::fill(locked.begin(), locked.end(), -1);
  const auto got = d.to_i64_vector();
  ASSERT_EQ(cudaHostUnregister(locked.data()), cudaSuccess);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[static_cast<size_t>(i)], i * 3 + 2) << "page-locked, at " << i;
#endif
}

TEST_P(TensorOnDevice, DlpackRoundTripSharesMemory) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test_generator();
  const Tensor x = Tensor::randn({4, 6}, DType::bf16, dev, gen).narrow(1, 1, 4);
  DLManagedTensor* m = x.to_dlpack();
  EXPECT_EQ(m->dl_tensor.ndim, 2);
  EXPECT_EQ(m->dl_tensor.dtype.code, kDLBfloat);
  EXPECT_EQ(m->dl_tensor.device.device_type, dev.is_cuda() ? kDLCUDA : kDLCPU);
  EXPECT_EQ(m->dl_tensor.byte_offset, 2u);
  const Tensor y = Tensor::from_dlpack(m);
  EXPECT_EQ(y.data(), x.data());
  EXPECT_EQ(y.strides(), x.strides());
  EXPECT_EQ(y.to_f64_vector(), x.to_f64_vector());
}

TEST_P(TensorOnDevice, AllocatorCountsCurrentAndPeak) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Allocator& a = allocator_for(dev);
  a.reset_peak();
  const size_t base = a.stats().current;
  {
    const Tensor t = Tensor::empty({1 << 20}, DType::f32, dev);  // 4 MiB
    EXPECT_EQ(a.stats().current, base + (size_t{4} << 20));
  }
  EXPECT_EQ(a.stats().current, base);
  EXPECT_EQ(a.stats().peak, base + (size_t{4} << 20));
  a.reset_peak();
  EXPECT_EQ(a.stats().peak, base);
  // The freed block is reused without a new backend allocation.
  const uint64_t backend = a.stats().backend_allocations;
  const Tensor again = Tensor::empty({1 << 20}, DType::f32, dev);
  EXPECT_EQ(a.stats().backend_allocations, backend);
}

TEST_P(TensorOnDevice, PoisonMarksUnwrittenMemory) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  ASSERT_TRUE(allocator_poison());  // the test runner turns it on
  for (DType t : {DType::f32, DType::bf16, DType::f16}) {
    const auto v = Tensor::empty({37}, t, dev).to_f64_vector();
    for (double e : v) ASSERT_TRUE(std::isnan(e)) << dtype_name(t);
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, TensorOnDevice, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

TEST(Tensor, BadArgumentsThrowWithContext) {
  const Tensor t = Tensor::zeros({2, 3}, DType::f32);
  EXPECT_THROW(t.transpose(0, 2), Error);
  EXPECT_THROW(t.narrow(1, 2, 2), Error);
  EXPECT_THROW(t.view({4, 2}), Error);
  EXPECT_THROW(t.data_ptr<double>(), Error);
  EXPECT_THROW(t.expand({3, 3}), Error);
  EXPECT_THROW(Tensor().device(), Error);
  EXPECT_THROW(Tensor::empty({-1}, DType::f32), Error);
  try {
    t.narrow(1, 2, 2);
    FAIL() << "narrow out of bounds did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of bounds for dim 1 of size 3"), std::string::npos) << e.what();
  }
}

TEST(Tensor, CudaWithoutDeviceIsAClearError) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  try {
    Tensor::zeros({4}, DType::f32, Device::cuda(0));
    FAIL() << "allocating on a missing GPU did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
  }
}

// A failed check's message is the user's: the expression and the source location are added only in
// a debug build or with KCPP_DEBUG=1.
TEST(Error, SourceLocationOnlyWhenDebugging) {
  auto message = [](bool fail) {
    try {
      const int n = -1;
      if (fail) KCPP_FAIL("n is {}", n);
      KCPP_CHECK(n >= 0, "n is {}", n);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const char* saved = std::getenv("KCPP_DEBUG");
  const std::string saved_value = saved ? saved : "";
  ::unsetenv("KCPP_DEBUG");
  const std::string plain = message(false), plain_fail = message(true);
  ::setenv("KCPP_DEBUG", "1", 1);
  const std::string debug = message(false), debug_fail = message(true);
  ::setenv("KCPP_DEBUG", "0", 1);
  const std::string off = message(false);
  if (saved) ::setenv("KCPP_DEBUG", saved_value.c_str(), 1);
  else ::unsetenv("KCPP_DEBUG");
  EXPECT_EQ(debug.rfind("n is -1 [check 'n >= 0' failed at ", 0), 0u) << debug;
  EXPECT_NE(debug.find("test_core.cpp:"), std::string::npos) << debug;
  EXPECT_EQ(debug_fail.rfind("n is -1 [at ", 0), 0u) << debug_fail;
  EXPECT_NE(debug_fail.find("test_core.cpp:"), std::string::npos) << debug_fail;
#ifdef NDEBUG
  EXPECT_EQ(plain, "n is -1");
  EXPECT_EQ(plain_fail, "n is -1");
  EXPECT_EQ(off, "n is -1");
#else
  EXPECT_EQ(plain, debug);  // a debug build always has them
  EXPECT_EQ(off, debug);
  EXPECT_EQ(plain_fail.rfind("n is -1 [at ", 0), 0u) << plain_fail;
#endif
}

TEST(Allocator, OutOfMemoryIsAnErrorNotACrash) {
  try {
    Tensor::empty({int64_t{1} << 50}, DType::f32);  // 4 PiB
    FAIL() << "a 4 PiB allocation did not throw";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
  }
}

// A private pool (for CUDA graphs) keeps its blocks: freed, they go back to it and nothing outside
// the pool gets them until it is released.  A captured graph replays what it recorded on the
// inputs' current values, into the same output.
TEST(Allocator, PrivatePoolKeepsItsBlocksAndGraphsReplay) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "skipped: no CUDA device";
  const Device dev = Device::cuda(0);
  Allocator& a = allocator_for(dev);
  void* in_pool = nullptr;
  {
    auto pool = std::make_unique<PrivatePool>(dev);
    {
      PoolScope scope(*pool);
      in_pool = a.allocate(3 << 20);
    }
    a.deallocate(in_pool);
    void* outside = a.allocate(3 << 20);  // the same size class, from the common cache or the device
    EXPECT_NE(outside, in_pool);
    {
      PoolScope scope(*pool);
      void* again = a.allocate(3 << 20);
      EXPECT_EQ(again, in_pool);  // the pool's own free block
      a.deallocate(again);
    }
    a.deallocate(outside);
  }
  Tensor x = Tensor::from_f64(std::vector<double>{1, 2, 3}, {3}, DType::f32, dev), y;
  CudaGraph g;
  g.capture(dev, [&] { y = ops::scale(ops::add(x, x), 0.5); });
  ASSERT_TRUE(g.captured());
  for (double v : {5.0, -7.0}) {
    x.copy_(Tensor::from_f64(std::vector<double>{v, v + 1, v + 2}, {3}, DType::f32, Device::cpu()));
    g.replay();
    EXPECT_EQ(y.to_f64_vector(), (std::vector<double>{v, v + 1, v + 2}));
  }
  // A body that waits for the device cannot be captured: an error, no graph, nothing broken after.
  CudaGraph bad;
  EXPECT_THROW(bad.capture(dev, [&] { (void)x.to_f64_vector(); }), Error);
  EXPECT_FALSE(bad.captured());
  EXPECT_EQ(ops::add(x, x).to_f64_vector(), (std::vector<double>{-14, -12, -10}));
}

TEST(Allocator, RoundsSizes) {
  EXPECT_EQ(allocator_round_size(0), 0u);
  EXPECT_EQ(allocator_round_size(1), 512u);
  EXPECT_EQ(allocator_round_size(513), 1024u);
  EXPECT_EQ(allocator_round_size((size_t{1} << 20) + 1), (size_t{1} << 20) + (size_t{1} << 17));
  for (size_t n : {size_t{3} << 20, (size_t{5} << 30) + 7}) {
    EXPECT_GE(allocator_round_size(n), n);
    EXPECT_LE(allocator_round_size(n), n + n / 8 + 1);
  }
}

// ---- platform ------------------------------------------------------------------------------------

TEST(Platform, DetectsWithoutThrowing) {
  const PlatformInfo p = detect_platform();
  EXPECT_FALSE(p.os.empty());
  EXPECT_FALSE(p.cpu_arch.empty());
  EXPECT_GT(p.cpu_threads, 0);
  EXPECT_GT(p.host_memory, 0u);
  EXPECT_FALSE(p.cuda_status.empty());
  EXPECT_EQ(p.gpus.size(), static_cast<size_t>(cuda_device_count()));
  if (p.gpus.empty()) {
    EXPECT_NE(p.cuda_status, "ok");
  }
  for (const GpuInfo& g : p.gpus) {
    EXPECT_GT(g.cc_major, 0);
    EXPECT_GT(g.sm_count, 0);
    EXPECT_GT(g.kernel_image_arch, 0) << g.kernel_image_note;
  }
  const auto j = nlohmann::json::parse(platform_json(p));
  EXPECT_EQ(j["cpu_arch"], p.cpu_arch);
  EXPECT_FALSE(format_platform(p).empty());
}

}  // namespace
}  // namespace kcpp

namespace kcpp {
namespace {
// Profile regions: summed by name in order of first appearance, nested ones folded into the outer
// region, nothing recorded while disabled, and a slot call and a GEMM of a model each recorded.
TEST(Profile, OutermostRegionsSummedByName) {
  profile::collect();
  { profile::Region off("off", Device::cpu(), 1, 1); }
  profile::enable(true);
  for (int i = 0; i < 3; ++i) {
    profile::Region a("a", Device::cpu(), 10, 100, "x");
    profile::Region inner("inner", Device::cpu(), 1000, 1000);  // folded into "a x"
  }
  { profile::Region b("b", Device::cpu(), 0, 7); }
  {
    profile::Region gemm_outside("outer", Device::cpu());
    ops::matmul(Tensor::full({4, 3}, 1.0, DType::f32), Tensor::full({3, 5}, 1.0, DType::f32));  // folded
  }
  ops::matmul(Tensor::full({4, 3}, 1.0, DType::f32), Tensor::full({3, 5}, 1.0, DType::f32));
  profile::enable(false);
  { profile::Region after("after", Device::cpu()); }
  const auto rows = profile::collect();
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows[0].name, "a x");
  EXPECT_EQ(rows[0].calls, 3);
  EXPECT_EQ(rows[0].flops, 30);
  EXPECT_EQ(rows[0].bytes, 300);
  EXPECT_GE(rows[0].ms, 0.0);
  EXPECT_EQ(rows[1].name, "b");
  EXPECT_EQ(rows[2].name, "outer");
  EXPECT_EQ(rows[3].name, "GEMM 4x5x3");
  EXPECT_EQ(rows[3].flops, 2.0 * 4 * 5 * 3);
  EXPECT_TRUE(profile::collect().empty());
}
}  // namespace
}  // namespace kcpp
