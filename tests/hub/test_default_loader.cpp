// The default mapping's loader (nn::default_loader) against a real `kcpp serve` server on 127.0.0.1
// and offline: a reference to this project's org loads from the hub when the hub has it; when the
// hub cannot supply it (unreachable, offline without it in the cache, not published, not trusted)
// this build's package loads instead, saying why; a package that fails verification is an error,
// never replaced.  The built example package stands in for the org's packages (published as
// kernels-cpp/example; "this build's" copy is the same folder).
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>

#include "hub/crypto.h"
#include "hub/fs.h"
#include "hub/hub.h"
#include "hub/server.h"
#include "hub_test_util.h"
#include "nn/module.h"

namespace kcpp::hub {
namespace {

namespace fs = std::filesystem;
using test::throws_with;

class DefaultLoader : public ::testing::Test {
 protected:
  test::TempDir tmp;
  fs::path hub_dir = tmp.path() / "hub", cache_dir = tmp.path() / "cache";
  std::atomic<int> requests{0};
  std::atomic<bool> down{false};  // every request answered 503
  std::unique_ptr<Server> server;

  void SetUp() override {
    fs::create_directories(hub_dir);
    server = std::make_unique<Server>(hub_dir, [this](const RequestView&) {
      ++requests;
      Fault f;
      if (down) f.kind = Fault::Kind::Status, f.status = 503;
      return f;
    });
    server->start();
  }
  void TearDown() override { server->stop(); }

  // This build's example package published as kernels-cpp/example at tag v1.0.0 (unsigned).
  fs::path publish() {
    const fs::path dst = hub_dir / "kernels-cpp" / "example" / "v1.0.0";
    fs::create_directories(dst.parent_path());
    fs::copy(test::example_package_dir(), dst, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    return dst;
  }

  std::shared_ptr<Hub> hub(bool allow_all = true, bool offline = false, std::string endpoint = "") {
    HubConfig c;
    c.endpoint = endpoint.empty() ? server->url() : endpoint;
    c.cache_dir = cache_dir;
    c.offline = offline;
    c.allow_all_kernels = allow_all;
    c.machine = Machine::detect();
    c.http.retries = 0;
    c.http.connect_timeout_s = 5;
    return std::make_shared<Hub>(c);
  }

  static nn::KernelLoader loader(std::shared_ptr<Hub> h, bool have_local = true) {
    return nn::default_loader(std::move(h), [have_local](const std::string& p) -> std::optional<fs::path> {
      if (have_local && p == "example") return test::example_package_dir();
      return std::nullopt;
    });
  }
};

const Reference kRef = Reference::parse("kernels-cpp/example@^1.0:SiLU");

TEST_F(DefaultLoader, LoadsTheOrgsPackageFromTheHub) {
  publish();
  const LoadedKernel k = loader(hub())(kRef);
  EXPECT_TRUE(k.substituted.empty()) << k.substituted;
  EXPECT_EQ(k.info.resolved.repo, "kernels-cpp/example");
  EXPECT_EQ(k.info.resolved.revision, "v1.0.0");
  ASSERT_NE(k.layer, nullptr);
  EXPECT_STREQ(k.layer->name, "SiLU");
}

TEST_F(DefaultLoader, AnUnreachableHubFallsBackOnceForEveryPackage) {
  publish();
  down = true;  // 503: the endpoint does not serve
  auto load = loader(hub());
  const LoadedKernel k = load(kRef);
  EXPECT_EQ(k.info.folder, test::example_package_dir());
  EXPECT_NE(k.substituted.find("this build's example 1.0.0"), std::string::npos) << k.substituted;
  EXPECT_NE(k.substituted.find("503"), std::string::npos) << k.substituted;
  ASSERT_NE(k.layer, nullptr);
  // The endpoint is not asked again, for this package or another.
  const int asked = requests;
  EXPECT_NO_THROW(load(Reference::parse("kernels-cpp/example@^1.0")));
  EXPECT_TRUE(throws_with([&] { load(Reference::parse("kernels-cpp/other@^1.0")); }, "this build has no package other"));
  EXPECT_EQ(requests, asked);
  // A closed port: the same.
  const int port = [] {
    Server s(fs::temp_directory_path());
    s.start();
    const std::string u = s.url();
    s.stop();
    return std::stoi(u.substr(u.rfind(':') + 1));
  }();
  const LoadedKernel k2 = loader(hub(true, false, "http://127.0.0.1:" + std::to_string(port)))(kRef);
  EXPECT_NE(k2.substituted.find("this build's example"), std::string::npos);
}

TEST_F(DefaultLoader, OfflineWithoutTheCacheFallsBack) {
  publish();
  const LoadedKernel k = loader(hub(true, /*offline=*/true))(kRef);
  EXPECT_NE(k.substituted.find("HF_HUB_OFFLINE"), std::string::npos) << k.substituted;
  EXPECT_EQ(requests, 0);
  // Once in the cache, offline loads the hub's copy.
  loader(hub())(kRef);
  const LoadedKernel cached = loader(hub(true, true))(kRef);
  EXPECT_TRUE(cached.substituted.empty()) << cached.substituted;
  EXPECT_EQ(cached.info.resolved.repo, "kernels-cpp/example");
}

TEST_F(DefaultLoader, NotPublishedOrNoMatchingVersionFallsBack) {
  // No repo at all, then a repo without a tag in range: this build's 1.0.0 stands in for ^1.0 ...
  EXPECT_NE(loader(hub())(kRef).substituted.find("not found"), std::string::npos);
  publish();
  // ... but not for ^2.0, which this build's package does not satisfy either.
  EXPECT_TRUE(throws_with([&] { loader(hub())(Reference::parse("kernels-cpp/example@^2.0")); },
                          "this build's example is version 1.0.0"));
}

TEST_F(DefaultLoader, AnUntrustedPackageIsNotLoadedButReplaced) {
  publish();  // unsigned, and this hub does not allow all kernels
  const LoadedKernel k = loader(hub(/*allow_all=*/false))(kRef);
  EXPECT_NE(k.substituted.find("refusing to load"), std::string::npos) << k.substituted;
  EXPECT_EQ(k.info.folder, test::example_package_dir());
}

TEST_F(DefaultLoader, ATamperedPackageIsAnErrorNotReplaced) {
  const fs::path dst = publish();
  const Manifest m = Manifest::parse(read_file(dst / "manifest.json"), "x");
  const std::string cpu = host_variant_name(Backend::CPU);
  std::string lib = read_file(dst / m.variant(cpu)->library);
  lib[lib.size() / 2] ^= 1;
  write_file_atomic(dst / m.variant(cpu)->library, lib);
  EXPECT_TRUE(throws_with([&] { loader(hub())(kRef); }, "but the manifest says"));
}

TEST_F(DefaultLoader, OtherReferencesAreTheHubsAlone) {
  down = true;
  EXPECT_THROW(loader(hub())(Reference::parse("acme/example@^1.0")), HubUnavailable);
  // And a disabled hub disables the default too.
  HubConfig c = hub()->config();
  c.enabled = false;
  EXPECT_THROW(loader(std::make_shared<Hub>(c))(kRef), HubDisabled);
}

}  // namespace
}  // namespace kcpp::hub
