// The hub end to end against a real `kcpp serve` server on 127.0.0.1: publishing, resolving by
// version constraint, the cache, lock files, trust, and every fault the issue lists.  Each test
// gets its own hub folder, cache, keys and server.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <atomic>
#include <thread>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <map>
#include <set>

#include "hub/crypto.h"
#include "hub/fs.h"
#include "hub/hub.h"
#include "hub/server.h"
#include "hub_test_util.h"

extern char** environ;

namespace kcpp::hub {
namespace {

namespace fs = std::filesystem;
using test::throws_with;

class HubServer : public ::testing::Test {
 protected:
  test::TempDir tmp;
  fs::path hub_dir = tmp.path() / "hub", cache_dir = tmp.path() / "cache";
  KeyPair acme = KeyPair::generate("acme");
  std::mutex mu;
  std::function<Fault(const RequestView&)> fault;  // set by a test; guarded by mu
  std::vector<std::string> requests, authorizations;
  std::unique_ptr<Server> server;

  void SetUp() override {
    fs::create_directories(hub_dir);
    server = std::make_unique<Server>(hub_dir, [this](const RequestView& r) {
      std::lock_guard<std::mutex> g(mu);
      requests.emplace_back(r.path);
      authorizations.emplace_back(r.authorization);
      return fault ? fault(r) : Fault{};
    });
    server->start();
  }
  void TearDown() override { server->stop(); }

  void set_fault(std::function<Fault(const RequestView&)> f) {
    std::lock_guard<std::mutex> g(mu);
    fault = std::move(f);
  }

  fs::path library_path(const fs::path& pkg) const {
    return pkg / Manifest::parse(read_file(pkg / "manifest.json"), "x").variants[0].library;
  }

  // Copies the built example package to hub/acme/example/<rev>, lets `edit` change files (the
  // manifest's hashes are then recomputed for `rehash` files), and signs it with `key` (nullptr:
  // unsigned).  Returns the revision folder.
  fs::path publish(const std::string& rev, const KeyPair* key, const std::function<void(const fs::path&)>& edit = {},
                   const std::string& repo = "acme/example") {
    const fs::path dst = hub_dir / repo / rev;
    fs::create_directories(dst.parent_path());
    fs::copy(test::example_package_dir(), dst, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    // Each revision's content differs (so does its commit id); the library stays example 1.0.0.
    auto j = nlohmann::json::parse(read_file(dst / "manifest.json"));
    j["description"] = "revision " + rev;
    // A version tag holds that version: the example's library built at it (a fixture beside the
    // others, tests/hub/CMakeLists.txt), as the package's one variant.  A version with no such
    // fixture keeps the example's 1.0.0 (what a mislabelled tag looks like).
    if (const auto v = Version::try_parse(rev)) {
      const fs::path lib = test::abi99_library().parent_path() / ("libkcpp_fixture_example_" + v->str() + ".so");
      if (fs::exists(lib)) {
        const std::string cpu = host_variant_name(Backend::CPU);
        // A named copy to iterate while the original loses entries (a temporary's items() would
        // outlive it: the range-for keeps only the proxy alive, not the json it points into).
        const nlohmann::json variants = j["variants"];
        for (const auto& [name, _] : variants.items())
          if (name != cpu) j["variants"].erase(name), fs::remove_all(dst / "build" / name);
        fs::copy_file(lib, dst / j["variants"][cpu]["library"].get<std::string>(),
                      fs::copy_options::overwrite_existing);
        j["version"] = v->str();
      }
    }
    write_file_atomic(dst / "manifest.json", j.dump(2));
    if (edit) edit(dst);
    rehash(dst);
    if (key) {
      try {
        Manifest m = Manifest::parse(read_file(dst / "manifest.json"), rev);
        m.sign(*key);
        write_file_atomic(dst / "manifest.json", m.dump());
      } catch (const Error&) {
        // A broken manifest (what the test publishes on purpose) cannot be signed.
      }
    }
    return dst;
  }

  // Recomputes every file's sha256 and size in the manifest (a publisher's honest re-index).
  static void rehash(const fs::path& dir) {
    auto j = nlohmann::json::parse(read_file(dir / "manifest.json"), nullptr, false);
    if (j.is_discarded() || !j.contains("variants")) return;
    for (auto& [vn, v] : j["variants"].items())
      for (auto& [path, f] : v["files"].items()) {
        uint64_t size = 0;
        if (!fs::exists(dir / path)) continue;
        f["sha256"] = sha256_file(dir / path, &size);
        f["size"] = size;
      }
    write_file_atomic(dir / "manifest.json", j.dump(2));
  }

  // Runs the kcpp binary against this test's server, cache and trust (as a user's shell would);
  // returns its exit status and, in `out`, what it printed.  `kill_when` (optional) is polled while
  // it runs: when it returns true the process is killed with SIGKILL.
  int run_kcpp(std::vector<std::string> args, std::string* out = nullptr, const std::function<bool()>& kill_when = {}) {
    const std::string trust = "acme=" + acme.public_key.str();
    std::vector<std::string> env_strings = {"HF_ENDPOINT=" + server->url(), "KCPP_CACHE=" + cache_dir.string(),
                                            "KCPP_TRUSTED_PUBLISHERS=" + trust, "KCPP_TRUST_STORE=/nonexistent",
                                            "HOME=" + tmp.path().string(), "KCPP_LOCK_FILE="};
    if (const char* ld = std::getenv("LD_LIBRARY_PATH")) env_strings.push_back(std::string("LD_LIBRARY_PATH=") + ld);
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    const std::string bin = test::kcpp_binary().string();
    args.insert(args.begin(), bin);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const fs::path log = tmp.path() / "kcpp.out";
    posix_spawn_file_actions_t io;
    posix_spawn_file_actions_init(&io);
    posix_spawn_file_actions_addopen(&io, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&io, 1, 2);
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, bin.c_str(), &io, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&io);
    if (rc != 0) return -1;
    int status = 0;
    while (true) {
      if (kill_when && kill_when()) ::kill(pid, SIGKILL);
      const pid_t done = ::waitpid(pid, &status, kill_when ? WNOHANG : 0);
      if (done == pid) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (out) *out = read_file(log);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  HubConfig config() {
    HubConfig c;
    c.endpoint = server->url();
    c.cache_dir = cache_dir;
    c.trust.add("acme", acme.public_key);
    c.machine = Machine{};  // a CPU machine: the example's variant
    c.machine.arch = Machine::detect().arch;
    c.http.retries = 2;
    c.http.backoff_ms = 5;
    c.http.connect_timeout_s = c.http.stall_timeout_s = c.http.request_timeout_s = 2;
    c.http.token_origin = c.endpoint;
    return c;
  }

  // No temporary or partial file anywhere in the cache, and every blob is named by its hash.
  void expect_cache_consistent() {
    if (!fs::exists(cache_dir)) return;
    for (const auto& e : fs::recursive_directory_iterator(cache_dir)) {
      const std::string name = e.path().filename().string();
      EXPECT_EQ(name.find(".incomplete"), std::string::npos) << e.path();
      EXPECT_EQ(name.find(".tmp."), std::string::npos) << e.path();
      if (e.path().parent_path().filename() == "blobs") {
        EXPECT_EQ(sha256_file(e.path()), name) << e.path();
      }
      if (e.is_symlink()) {
        EXPECT_TRUE(fs::exists(e.path())) << "dangling " << e.path();
      }
    }
  }
  size_t blob_count() {
    size_t n = 0;
    const fs::path b = cache_dir / "models--acme--example" / "blobs";
    if (fs::exists(b))
      for (const auto& e : fs::directory_iterator(b)) n += e.is_regular_file();
    return n;
  }
};

TEST_F(HubServer, ServesTheHubApiSubset) {
  publish("v1.0.0", &acme);
  publish("main", &acme);
  HttpClient http(config().http);
  auto refs = nlohmann::json::parse(http.get(server->url() + "/api/models/acme/example/refs").body);
  ASSERT_EQ(refs["tags"].size(), 1u);
  EXPECT_EQ(refs["tags"][0]["name"], "v1.0.0");
  EXPECT_EQ(refs["tags"][0]["ref"], "refs/tags/v1.0.0");
  EXPECT_EQ(refs["tags"][0]["targetCommit"].get<std::string>().size(), 40u);
  EXPECT_EQ(refs["branches"][0]["name"], "main");
  // The commit id is derived from the files, which differ between the two revisions.
  EXPECT_NE(refs["tags"][0]["targetCommit"], refs["branches"][0]["targetCommit"]);
  auto tree = nlohmann::json::parse(http.get(server->url() + "/api/models/acme/example/tree/v1.0.0?recursive=true").body);
  std::set<std::string> paths;
  for (const auto& f : tree) paths.insert(f["path"].get<std::string>());
  EXPECT_TRUE(paths.count("manifest.json"));
  // The query's recursive=false reaches the listing: the top folder's own entries, "build" a directory.
  const auto top = nlohmann::json::parse(http.get(server->url() + "/api/kernels/acme/example/tree/v1.0.0?recursive=false&expand=false").body);
  std::map<std::string, std::string> types;
  for (const auto& f : top) types[f["path"].get<std::string>()] = f["type"].get<std::string>();
  EXPECT_EQ(types.at("build"), "directory");
  EXPECT_EQ(types.at("manifest.json"), "file");
  EXPECT_LT(types.size(), paths.size());
  auto info = nlohmann::json::parse(http.get(server->url() + "/api/models/acme/example/revision/v1.0.0").body);
  EXPECT_EQ(info["sha"], refs["tags"][0]["targetCommit"]);
  const HttpResponse r = http.get(server->url() + "/acme/example/resolve/v1.0.0/manifest.json");
  EXPECT_EQ(r.body, read_file(hub_dir / "acme/example/v1.0.0/manifest.json"));
  EXPECT_EQ(r.repo_commit, refs["tags"][0]["targetCommit"]);
  EXPECT_EQ(r.etag, sha256_hex(r.body));
  // Unknown things are 404, and the client does not retry them.
  requests.clear();
  EXPECT_TRUE(throws_with([&] { http.get(server->url() + "/acme/example/resolve/v1.0.0/nope"); }, "HTTP 404"));
  EXPECT_EQ(requests.size(), 1u);
  // A JSON answer past the limit is refused at once (not retried), naming the limit (by default
  // kMaxJsonAnswerBytes).
  requests.clear();
  EXPECT_TRUE(throws_with([&] { http.get(server->url() + "/api/models/acme/example/tree/v1.0.0?recursive=true", 64); },
                          "the answer is longer than 64 bytes"));
  EXPECT_EQ(requests.size(), 1u);
  EXPECT_NO_THROW(http.get(server->url() + "/api/models/acme/example/tree/v1.0.0?recursive=true", 1 << 20));
  EXPECT_TRUE(throws_with([&] { http.get(server->url() + "/acme/example/resolve/v1.0.0/../../../etc/passwd"); },
                          "HTTP 40"));
}

// ---- route_request: kcpp serve's routing without sockets (also fuzzed: tests/fuzz/fuzz_serve_routing.cpp)

class ServeRouting : public ::testing::Test {
 protected:
  test::TempDir tmp;
  fs::path root = tmp.path() / "served", outside = tmp.path() / "outside";
  RepoDir dir{root};

  void SetUp() override {
    write_file_atomic(root / "acme/example/v1.0.0/manifest.json", "{}");
    write_file_atomic(root / "acme/example/v1.0.0/build/a.so", "library");
    write_file_atomic(root / "acme/example/main/README.md", "main");
    write_file_atomic(outside / "secret.txt", "secret");
    write_file_atomic(outside / "org/pkg/v1.0.0/secret.txt", "secret");
  }
  ServeAnswer get(const std::string& path, const std::string& method = "GET") {
    return route_request(dir, ServeRequest{method, path});
  }
  // The status, and for an error that its body is {"error": ...}.
  int status(const std::string& path, const std::string& method = "GET") {
    const ServeAnswer a = get(path, method);
    if (a.status != 200) {
      const auto j = nlohmann::json::parse(a.body, nullptr, false);
      EXPECT_TRUE(j.is_object() && j.contains("error") && j["error"].is_string()) << path << ": " << a.body;
    }
    return a.status;
  }
};

TEST_F(ServeRouting, AnswersTheApiSubset) {
  const std::string commit = dir.commit_of("acme/example", "v1.0.0");
  const auto refs = nlohmann::json::parse(get("/api/models/acme/example/refs").body);
  EXPECT_EQ(refs["tags"][0]["targetCommit"], commit);
  EXPECT_EQ(refs["branches"][0]["name"], "main");
  EXPECT_EQ(nlohmann::json::parse(get("/api/models/acme/example/revision/v1.0.0").body)["sha"], commit);
  EXPECT_EQ(nlohmann::json::parse(get("/api/models/acme/example/tree/" + commit).body).size(), 2u);
  EXPECT_EQ(nlohmann::json::parse(get("/api/models/acme/example/tree/v1.0.0/build/").body).size(), 1u);
  EXPECT_EQ(nlohmann::json::parse(get("/api/models/acme/example/tree/v1.0.0/build").body).size(), 1u);
  EXPECT_EQ(nlohmann::json::parse(get("/api/models/acme/example/tree/v1.0.0/").body).size(), 2u);
  for (const char* method : {"GET", "HEAD"}) {
    const ServeAnswer a = get("/acme/example/resolve/v1.0.0/build/a.so", method);
    EXPECT_EQ(a.status, 200);
    EXPECT_EQ(a.body, "library");
    EXPECT_EQ(a.file, root / "acme/example/v1.0.0/build/a.so");
    EXPECT_EQ(a.content_type, "application/octet-stream");
    const std::vector<std::pair<std::string, std::string>> headers = {{"ETag", "\"" + sha256_hex("library") + "\""},
                                                                      {"X-Repo-Commit", commit}};
    EXPECT_EQ(a.headers, headers);
  }
}

// The Hub's kernel repositories (the `kernels` library's repo_type "kernel"): the same answers under
// /api/kernels/ and /kernels/ORG/REPO/resolve/; and a tree listed with recursive=false (as
// huggingface_hub asks) has the path's own files and one directory entry a folder, whose oid changes
// with the files below it.
TEST_F(ServeRouting, KernelRepositoriesAndFolderListings) {
  for (const char* api : {"refs", "revision/v1.0.0", "tree/v1.0.0", "tree/v1.0.0/build"})
    EXPECT_EQ(get(std::string("/api/kernels/acme/example/") + api).body, get(std::string("/api/models/acme/example/") + api).body)
        << api;
  const ServeAnswer file = get("/kernels/acme/example/resolve/v1.0.0/build/a.so");
  EXPECT_EQ(file.status, 200);
  EXPECT_EQ(file.body, "library");
  EXPECT_EQ(file.headers, get("/acme/example/resolve/v1.0.0/build/a.so").headers);
  EXPECT_EQ(status("/kernels/acme/example/resolve/v1.0.0/nothing"), 404);
  EXPECT_EQ(status("/kernels/acme/example/tree/v1.0.0"), 404);

  auto list = [&](const std::string& path) { return nlohmann::json::parse(route_request(dir, ServeRequest{"GET", path, false}).body); };
  const auto top = list("/api/kernels/acme/example/tree/v1.0.0");
  ASSERT_EQ(top.size(), 2u) << top.dump();
  EXPECT_EQ(top[0]["type"], "file");
  EXPECT_EQ(top[0]["path"], "manifest.json");
  EXPECT_EQ(top[0]["lfs"]["pointerSize"], 43 + 11 + 64 + 1 + 5 + 1 + 1);  // "size 2\n"
  EXPECT_EQ(top[1]["type"], "directory");
  EXPECT_EQ(top[1]["path"], "build");
  ASSERT_TRUE(top[1]["oid"].is_string());
  EXPECT_EQ(top[1]["oid"].get<std::string>().size(), 40u);
  const auto build = list("/api/kernels/acme/example/tree/v1.0.0/build");
  ASSERT_EQ(build.size(), 1u);
  EXPECT_EQ(build[0]["path"], "build/a.so");
  write_file_atomic(root / "acme/example/v1.0.0/build/a.so", "library 2");
  EXPECT_NE(list("/api/kernels/acme/example/tree/v1.0.0")[1]["oid"], top[1]["oid"]);
  // The query's value as the server reads it: Python's requests writes False, httpx false.
  for (const char* no : {"false", "False", "FALSE", "0"}) EXPECT_FALSE(tree_recursive(no)) << no;
  for (const char* yes : {"", "true", "True", "1", "falsey"}) EXPECT_TRUE(tree_recursive(yes)) << yes;
}

TEST_F(ServeRouting, OtherMethodsRoutesAndIdsAreErrors) {
  for (const char* method : {"POST", "PUT", "DELETE", "OPTIONS", "PATCH", "get", ""}) {
    const ServeAnswer a = get("/api/models/acme/example/refs", method);
    EXPECT_EQ(a.status, 405) << method;
    ASSERT_EQ(a.headers.size(), 1u);
    EXPECT_EQ(a.headers[0].second, "GET, HEAD");
  }
  for (const char* path : {"", "/", "*", "/api/models/acme/example", "/api/models/acme/example/refs/", "/api/models/acme/example/revision/",
                           "/api/models/acme/example/revision/v1.0.0/x", "/api/models/acme/example/tree/", "/acme/example/resolve/v1.0.0",
                           "/acme/example/resolve/v1.0.0/", "//acme/example/resolve/v1.0.0/manifest.json", "/api/models/-acme/example/refs",
                           "/api/models/acme/example/branches"})
    EXPECT_EQ(status(path), 404) << path;
  EXPECT_EQ(status("/api/models/acme--x/example/refs"), 400);  // a route, but not a repo id
  EXPECT_EQ(status("/api/models/acme/nothing/refs"), 404);
  EXPECT_EQ(status("/api/models/acme/example/revision/v9"), 404);
}

// Traversal in every spelling the HTTP layer may hand over (it percent-decodes the path: "%2e%2e"
// arrives as ".."), absolute paths, NULs: never a 200, never a file outside the served folder.
TEST_F(ServeRouting, NoPathLeavesTheServedFolder) {
  for (const std::string& path : std::vector<std::string>{
           "/acme/example/resolve/v1.0.0/../../../../outside/secret.txt", "/acme/example/resolve/v1.0.0/../main/README.md",
           "/acme/example/resolve/../main/README.md", "/acme/example/resolve/v1.0.0//etc/passwd",
           "/acme/example/resolve/v1.0.0/./manifest.json", "/acme/example/resolve/v1.0.0/build\\..\\manifest.json",
           "/acme/example/resolve/.hidden/x", std::string("/acme/example/resolve/v1.0.0/manifest.json") + '\0' + ".txt",
           "/acme/example/resolve/v1.0.0/%2e%2e/main/README.md", "/api/models/acme/../refs", "/api/models/../../refs"})
    EXPECT_NE(status(path), 200) << path;
  EXPECT_EQ(status("/api/models/acme/example/tree/v1.0.0/../main"), 400);
  EXPECT_EQ(status("/api/models/acme/example/tree/v1.0.0/./"), 400);
  EXPECT_EQ(status("/api/models/acme/example/tree/v1.0.0//etc"), 400);
}

// Symbolic links are never followed, wherever they sit: a file, a folder, a revision, a repo, an org
// (fuzz findings: the org and repo folders were followed; tests/fuzz/corpus/serve_routing/regression-*).
TEST_F(ServeRouting, SymbolicLinksAreNeverFollowed) {
  fs::create_symlink(outside / "secret.txt", root / "acme/example/v1.0.0/build/link.so");
  fs::create_symlink(outside, root / "acme/example/v1.0.0/build/out");
  fs::create_symlink(outside / "org/pkg/v1.0.0", root / "acme/example/v2.0.0");
  fs::create_symlink(outside / "org/pkg", root / "acme/linked");
  fs::create_symlink(outside / "org", root / "evil");
  for (const char* path : {"/acme/example/resolve/v1.0.0/build/link.so", "/acme/example/resolve/v1.0.0/build/out/secret.txt",
                           "/acme/example/resolve/v2.0.0/secret.txt", "/api/models/acme/example/revision/v2.0.0",
                           "/acme/linked/resolve/v1.0.0/secret.txt", "/api/models/acme/linked/refs",
                           "/api/models/acme/linked/tree/v1.0.0", "/evil/pkg/resolve/v1.0.0/secret.txt",
                           "/api/models/evil/pkg/refs", "/api/models/evil/pkg/revision/v1.0.0"})
    EXPECT_EQ(status(path), 404) << path;
  const std::string tree = get("/api/models/acme/example/tree/v1.0.0").body;
  EXPECT_EQ(tree.find("secret"), std::string::npos) << tree;
  EXPECT_EQ(get("/api/models/acme/example/refs").body.find("v2.0.0"), std::string::npos);
}

// A revision with a NUL byte named the folder before it ("v1.0.0\0x" served v1.0.0: the file system
// stops reading a name at a NUL); bytes that are not UTF-8 made the JSON error itself fail (a 500).
// Fuzz findings, kept in tests/fuzz/corpus/serve_routing/regression-*.
TEST_F(ServeRouting, NulBytesAndNonUtf8AreClientErrors) {
  EXPECT_EQ(status(std::string("/acme/example/resolve/v1.0.0") + '\0' + "x/manifest.json"), 404);
  EXPECT_EQ(status(std::string("/api/models/acme/example/revision/v1.0.0") + '\0'), 404);
  EXPECT_EQ(status(std::string("/api/models/acme/example/tree/v1.0.0") + '\0' + "/build"), 404);
  EXPECT_EQ(status("/api/models/acme/example/revision/\xff\xfe"), 404);
  EXPECT_EQ(status("/acme/example/resolve/v1.0.0/\xff"), 404);
  write_file_atomic(root / "acme/example/v1.0.0/bad\xff.bin", "x");
  const ServeAnswer a = get("/api/models/acme/example/tree/v1.0.0");
  EXPECT_EQ(a.status, 200);
  EXPECT_FALSE(nlohmann::json::parse(a.body, nullptr, false).is_discarded());
}

// The server hands every request to route_request: HEAD is GET without the body, other methods are
// 405, unknown paths 404 with a JSON error, and a percent-encoded '..' arrives decoded and is refused.
TEST_F(HubServer, EveryRequestGoesThroughTheRouter) {
  publish("v1.0.0", &acme);
  httplib::Client client(server->url());
  const std::string file = "/acme/example/resolve/v1.0.0/manifest.json";
  const auto head = client.Head(file);
  ASSERT_TRUE(head);
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(head->body, "");
  EXPECT_EQ(head->get_header_value("ETag"), "\"" + sha256_file(hub_dir / "acme/example/v1.0.0/manifest.json") + "\"");
  const auto post = client.Post(file, "x", "text/plain");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);
  EXPECT_EQ(post->get_header_value("Allow"), "GET, HEAD");
  const auto none = client.Get("/nothing/here/at/all");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 404);
  EXPECT_TRUE(nlohmann::json::parse(none->body).contains("error"));
  for (const char* path : {"/acme/example/resolve/v1.0.0/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
                           "/acme/example/resolve/v1.0.0%00x/manifest.json", "/api/models/acme/example/revision/%ff"}) {
    const auto r = client.Get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_EQ(r->status, 404) << path;
  }
}

TEST_F(HubServer, ListsTheFilesOfARevision) {
  const fs::path rev = publish("v1.0.0", &acme);
  Hub hub(config());
  const std::string commit = hub.resolve(Reference::parse("acme/example@v1.0.0")).commit;
  for (const std::string& r : {std::string("v1.0.0"), commit}) {
    const auto files = hub.files("acme/example", r);
    ASSERT_GE(files.size(), 2u) << r;
    for (const RepoFile& f : files) {
      uint64_t size = 0;
      EXPECT_EQ(f.sha256, sha256_file(rev / f.path, &size)) << f.path;
      EXPECT_EQ(f.size, size) << f.path;
    }
  }
  EXPECT_TRUE(throws_with([&] { hub.files("acme/example", "v9.9.9"); }, "no revision v9.9.9"));
}

// A file list whose entries the server typed wrongly is an error naming the field, not the JSON
// library's exception; a well-typed list with folders and files without LFS ids still reads.
TEST_F(HubServer, AMistypedFileListIsANamedError) {
  publish("v1.0.0", &acme);
  std::mutex mu;  // the reply is read on the server's thread
  std::string reply_body;
  auto reply = [&](std::string b) {
    std::lock_guard<std::mutex> lock(mu);
    reply_body = std::move(b);
  };
  set_fault([&](const RequestView& r) {
    if (r.path.find("/tree/") == std::string_view::npos) return Fault{};
    Fault f;
    f.kind = Fault::Kind::Body;
    std::lock_guard<std::mutex> lock(mu);
    f.body = reply_body;
    return f;
  });
  Hub hub(config());
  const std::pair<const char*, const char*> cases[] = {
      {R"([{"type": 7, "path": "a"}])", "'type' is not a string"},
      {R"([{"type": "file", "path": 3}])", "'path' is missing or not a string"},
      {R"([{"type": "file"}])", "'path' is missing or not a string"},
      {R"([{"type": "file", "path": "a.so", "size": "12"}])", "'size' is not a non-negative integer (a.so)"},
      {R"([{"type": "file", "path": "a.so", "size": -1}])", "'size' is not a non-negative integer (a.so)"},
      {R"([{"type": "file", "path": "a.so", "lfs": {"oid": 5}}])", "'lfs.oid' is not a string (a.so)"},
      {R"({"type": "file"})", "is not a JSON list"},
  };
  for (const auto& [text, why] : cases) {
    reply(text);
    EXPECT_TRUE(throws_with([&] { hub.files("acme/example", "v1.0.0"); }, why)) << text;
  }
  // An LFS oid that is no sha256 is refused, naming the repository, revision and file.
  reply(R"([{"type": "file", "path": "d/a.so", "size": 4, "lfs": {"oid": "ab"}}])");
  EXPECT_TRUE(throws_with([&] { hub.files("acme/example", "v1.0.0"); },
                          server->url() + ": the file list of acme/example@v1.0.0 has an entry whose 'lfs.oid' 'ab' is "
                                          "not a sha256 (64 lower-case hex digits) (d/a.so)"));
  const std::string sha(64, 'a');
  reply(R"([{"type": "directory", "path": "d"}, {"type": "file", "path": "d/a.so", "size": 4, "lfs": {"oid": ")" + sha +
        R"("}}, {"type": "file", "path": "b.json"}, 5])");
  const auto files = hub.files("acme/example", "v1.0.0");
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0].path, "d/a.so");
  EXPECT_EQ(files[0].size, 4u);
  EXPECT_EQ(files[0].sha256, sha);
  EXPECT_EQ(files[1].path, "b.json");
  EXPECT_EQ(files[1].size, 0u);
  EXPECT_EQ(files[1].sha256, "");
}

TEST_F(HubServer, LoadsTheBestVersionForAConstraintAndCachesIt) {
  for (const char* v : {"v1.0.0", "v1.2.0", "v1.3.0-rc.1", "v2.0.0"}) publish(v, &acme);
  Hub hub(config());
  LoadedKernel k = hub.load(Reference::parse("acme/example@>=1.0,<2.0:SiLU"));
  EXPECT_EQ(k.info.resolved.revision, "v1.2.0");
  EXPECT_EQ(k.info.manifest.description, "revision v1.2.0");
  ASSERT_NE(k.layer, nullptr);
  EXPECT_STREQ(k.layer->contract, "SiLU/1");
  EXPECT_EQ(k.info.trust.level, TrustLevel::Trusted);
  EXPECT_EQ(hub.load(Reference::parse("acme/example@^1.3.0-rc.1")).info.resolved.revision, "v1.3.0-rc.1");
  EXPECT_EQ(hub.load(Reference::parse("acme/example@^2")).info.resolved.revision, "v2.0.0");
  EXPECT_TRUE(fs::exists(cache_dir / "models--acme--example" / "refs" / "v1.2.0"));
  expect_cache_consistent();

  // A second load downloads nothing.
  const size_t before = requests.size();
  Hub again(config());
  again.load(Reference::parse("acme/example@v1.2.0:SiLU"));
  for (size_t i = before; i < requests.size(); ++i) EXPECT_EQ(requests[i].find("/resolve/"), std::string::npos) << requests[i];
}

TEST_F(HubServer, NothingMatchingIsAnErrorListingWhatExists) {
  publish("v1.0.0", &acme);
  publish("main", &acme);
  Hub hub(config());
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@>=2.0,<3.0")); },
                          "no tag of acme/example matches '>=2.0,<3.0' (tags: v1.0.0)"));
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@dev")); },
                          "has no tag or branch 'dev' (branches: main; tags: v1.0.0)"));
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/nothing@v1.0.0")); },
                          "repository acme/nothing not found"));
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@v1.0.0:RMSNorm")); },
                          "no layer 'RMSNorm' in example 1.0.0"));
}

TEST_F(HubServer, BrokenManifestsAreRefused) {
  publish("v1.0.0", &acme, [](const fs::path& d) { write_file_atomic(d / "manifest.json", "{\"kcpp_manifest\": 1,"); });
  publish("v1.1.0", &acme, [](const fs::path& d) {
    auto j = nlohmann::json::parse(read_file(d / "manifest.json"));
    j.erase("variants");
    write_file_atomic(d / "manifest.json", j.dump());
  });
  publish("v1.2.0", &acme, [](const fs::path& d) {
    auto j = nlohmann::json::parse(read_file(d / "manifest.json"));
    auto& files = j["variants"].begin().value()["files"];
    files["build/" + j["variants"].begin().key() + "/../../escape.so"] = files.begin().value();
    write_file_atomic(d / "manifest.json", j.dump());
  });
  publish("v1.3.0", &acme, [](const fs::path& d) {
    auto j = nlohmann::json::parse(read_file(d / "manifest.json"));
    j["abi_version"] = 2;
    write_file_atomic(d / "manifest.json", j.dump());
  });
  Hub hub(config());
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@v1.0.0")); }, "manifest.json: not valid JSON"));
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@v1.1.0")); }, "missing field 'variants'"));
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@v1.2.0")); }, "'..' component"));
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@v1.3.0")); },
                          "built for kernel ABI 2, this host speaks ABI 1"));
  expect_cache_consistent();
}

TEST_F(HubServer, AFileWhoseHashDiffersNeverEntersTheCacheOrLoads) {
  const fs::path rev = publish("v1.0.0", &acme);
  // Tampered after signing: the manifest still lists the original hash.
  { std::ofstream(library_path(rev), std::ios::app) << "evil"; }
  Hub hub(config());
  // (Longer than the manifest says: the download stops at the manifest's size.)
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@v1.0.0:SiLU")); },
                          "bytes expected (the size the manifest gives); not stored, not loaded"));
  EXPECT_EQ(blob_count(), 1u);  // the manifest only
  expect_cache_consistent();
  // A tampered *cached* copy is refused on the next load as well.
  publish("v1.1.0", &acme);
  hub.load(Reference::parse("acme/example@v1.1.0:SiLU"));
  const fs::path cached = hub.cache().snapshot_dir("acme/example", hub.resolve(Reference::parse("acme/example@v1.1.0")).commit) /
                          fs::relative(library_path(hub_dir / "acme/example/v1.1.0"), hub_dir / "acme/example/v1.1.0");
  { std::ofstream(fs::canonical(cached), std::ios::app) << "x"; }
  Hub fresh(config());
  EXPECT_TRUE(throws_with([&] { fresh.load(Reference::parse("acme/example@v1.1.0:SiLU")); },
                          "the file was modified or corrupted; refusing to load"));
}

// A download stops at the size the manifest gives (at 16 MiB for manifest.json, whose size nothing
// gives), so that a server cannot fill the disk; a file of the right size but other bytes is refused
// by its hash.  Neither enters the cache.
TEST_F(HubServer, ADownloadLongerThanClaimedIsCutOffAndRefused) {
  const fs::path rev = publish("v1.0.0", &acme);
  const fs::path lib = library_path(rev);
  const uint64_t size = fs::file_size(lib);
  std::mutex m;
  std::string body;  // what the server answers for the library, when set
  set_fault([&](const RequestView& r) {
    std::lock_guard<std::mutex> g(m);
    if (body.empty() || r.path.find("/resolve/") == std::string_view::npos) return Fault{};
    const bool manifest = r.path.ends_with("/manifest.json");
    if (manifest != (body.size() > (uint64_t{16} << 20))) return Fault{};
    Fault f;
    f.kind = Fault::Kind::Body;
    f.body = body;
    return f;
  });
  auto answer = [&](std::string b) {
    std::lock_guard<std::mutex> g(m);
    body = std::move(b);
  };
  const std::string lib_name = fs::relative(lib, rev).generic_string();
  answer(std::string(size + 100000, 'x'));
  EXPECT_TRUE(throws_with([&] { Hub(config()).load(Reference::parse("acme/example@v1.0.0:SiLU")); },
                          "acme/example@" + Hub(config()).resolve(Reference::parse("acme/example@v1.0.0")).commit.substr(0, 12) +
                              ": " + lib_name + ": the hub's answer (" + server->url() + "/acme/example/resolve/"));
  EXPECT_TRUE(throws_with([&] { Hub(config()).load(Reference::parse("acme/example@v1.0.0:SiLU")); },
                          fmt::format("holds more than the {} bytes expected (the size the manifest gives); not stored, "
                                      "not loaded",
                                      size)));
  answer(std::string(size, 'x'));
  EXPECT_TRUE(throws_with([&] { Hub(config()).load(Reference::parse("acme/example@v1.0.0:SiLU")); },
                          fmt::format("{} has sha256 {} ({} bytes) but the manifest says", lib_name,
                                      sha256_hex(std::string(size, 'x')), size)));
  EXPECT_EQ(blob_count(), 1u);  // the manifest only
  fs::remove_all(cache_dir);
  answer(std::string((uint64_t{16} << 20) + 1, ' '));
  EXPECT_TRUE(throws_with([&] { Hub(config()).inspect(Reference::parse("acme/example@v1.0.0")); },
                          "manifest.json: the hub's answer"));
  EXPECT_TRUE(throws_with([&] { Hub(config()).inspect(Reference::parse("acme/example@v1.0.0")); },
                          "holds more than the 16777216 bytes expected (the most a manifest.json may have)"));
  EXPECT_EQ(blob_count(), 0u);
  expect_cache_consistent();
  // A plain-directory hub (HF_ENDPOINT a folder) checks the size before copying.
  answer("");
  { std::ofstream(lib, std::ios::app) << "longer"; }
  HubConfig c = config();
  c.endpoint = hub_dir.string();
  EXPECT_TRUE(throws_with([&] { Hub(c).load(Reference::parse("acme/example@v1.0.0:SiLU")); },
                          fmt::format("{}: {} holds more than the {} bytes expected", lib_name, lib.string(), size)));
  expect_cache_consistent();
}

// The cached manifest.json is read only when its bytes are what its blob's name says (nothing else
// checks an unsigned, unlocked one).
TEST_F(HubServer, ACachedManifestThatIsNotItsBlobsHashIsRefused) {
  publish("v1.0.0", &acme);
  Hub hub(config());
  const PackageInfo info = hub.inspect(Reference::parse("acme/example@v1.0.0"));
  const fs::path link = info.folder / "manifest.json";
  const fs::path blob = fs::canonical(link);
  EXPECT_EQ(blob.filename().string(), info.manifest_sha256);
  { std::ofstream(blob, std::ios::app) << " "; }
  EXPECT_TRUE(throws_with([&] { Hub(config()).inspect(Reference::parse("acme/example@v1.0.0")); },
                          "acme/example@v1.0.0: the cache's manifest.json has sha256 " + sha256_file(blob) +
                              " but its blob is named '" + info.manifest_sha256 + "'"));
  fs::remove(link);  // as the message says: then it is downloaded again
  fs::remove(blob);
  EXPECT_EQ(Hub(config()).inspect(Reference::parse("acme/example@v1.0.0")).manifest_sha256, info.manifest_sha256);
  // A link out of blobs/ names no blob, even to a file named by its own hash.
  const std::string other = R"({"kcpp_manifest": 1})";
  const fs::path elsewhere = tmp.path() / "elsewhere" / sha256_hex(other);
  write_file_atomic(elsewhere, other);
  fs::remove(link);
  fs::create_symlink(elsewhere, link);
  EXPECT_TRUE(throws_with([&] { Hub(config()).inspect(Reference::parse("acme/example@v1.0.0")); },
                          "but its blob is named '" + elsewhere.string() + "'"));
}

TEST_F(HubServer, SignaturesAndTrustDecideWhatLoads) {
  publish("v1.0.0", nullptr);  // unsigned
  const KeyPair other = KeyPair::generate("other");
  publish("v1.1.0", &other);  // signed, untrusted
  const fs::path bad = publish("v1.2.0", &acme);
  {  // changed after signing
    auto j = nlohmann::json::parse(read_file(bad / "manifest.json"));
    j["description"] = "now with a backdoor";
    write_file_atomic(bad / "manifest.json", j.dump());
  }
  const fs::path garbage = publish("v1.3.0", &acme);
  {  // a signature that is garbage
    auto j = nlohmann::json::parse(read_file(garbage / "manifest.json"));
    j["signature"] = {{"algorithm", "ed25519"}, {"publisher", "acme"}, {"public_key", "ed25519:AAAA"}, {"value", "AAAA"}};
    write_file_atomic(garbage / "manifest.json", j.dump());
  }
  Hub strict(config());
  EXPECT_TRUE(throws_with([&] { strict.load(Reference::parse("acme/example@v1.0.0")); },
                          "refusing to load: the manifest is not signed"));
  EXPECT_TRUE(throws_with([&] { strict.load(Reference::parse("acme/example@v1.1.0")); },
                          "signed by 'other'"));
  EXPECT_TRUE(throws_with([&] { strict.load(Reference::parse("acme/example@v1.2.0")); },
                          "does not match the manifest (altered after signing?)"));
  EXPECT_TRUE(throws_with([&] { strict.load(Reference::parse("acme/example@v1.3.0")); }, "refusing to load"));

  HubConfig c = config();
  c.allow_all_kernels = true;
  Hub lenient(c);
  EXPECT_EQ(lenient.load(Reference::parse("acme/example@v1.0.0:SiLU")).info.trust.level, TrustLevel::Unsigned);
  EXPECT_EQ(lenient.load(Reference::parse("acme/example@v1.1.0:SiLU")).info.trust.level, TrustLevel::Untrusted);
  // A signature that does not verify is tampering: refused even with allow_all_kernels.
  EXPECT_TRUE(throws_with([&] { lenient.load(Reference::parse("acme/example@v1.2.0")); }, "altered after signing"));
}

TEST_F(HubServer, LibrariesWithTheWrongAbiNoEntryPointOrTruncatedAreRefused) {
  auto swap_library = [&](const fs::path& replacement, bool truncate) {
    return [=, this](const fs::path& d) {
      const fs::path lib = library_path(d);
      fs::copy_file(replacement, lib, fs::copy_options::overwrite_existing);
      if (truncate) fs::resize_file(lib, fs::file_size(lib) / 3);
    };
  };
  publish("v1.0.0", &acme, swap_library(test::abi99_library(), false));
  publish("v1.1.0", &acme, swap_library(test::no_symbol_library(), false));
  publish("v1.2.0", &acme, swap_library(library_path(test::example_package_dir()), true));
  Hub hub(config());
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@v1.0.0")); }, "built for ABI version 99"));
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@v1.1.0")); }, "does not export kcpp_package_v1"));
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@v1.2.0")); }, "cannot load the library"));
}

TEST_F(HubServer, ServerErrorsAreRetriedThenReported) {
  publish("v1.0.0", &acme);
  std::atomic<int> failures{2};
  set_fault([&](const RequestView& r) {
    if (r.path.find("/resolve/") != std::string_view::npos && failures.fetch_sub(1) > 0)
      return Fault{Fault::Kind::Status, 500, 0, {}};
    return Fault{};
  });
  Hub hub(config());  // 2 retries: the third attempt succeeds
  EXPECT_NO_THROW(hub.load(Reference::parse("acme/example@v1.0.0:SiLU")));

  set_fault([](const RequestView&) { return Fault{Fault::Kind::Status, 503, 0, {}}; });
  test::TempDir other_cache;
  HubConfig c = config();
  c.cache_dir = other_cache.path();
  Hub failing(c);
  EXPECT_TRUE(throws_with([&] { failing.load(Reference::parse("acme/example@v1.0.0")); }, "after 3 attempts: HTTP 503"));
}

TEST_F(HubServer, TimeoutsAndDroppedConnectionsLeaveTheCacheConsistent) {
  publish("v1.0.0", &acme);
  HubConfig c = config();
  c.http.retries = 0;
  c.http.connect_timeout_s = c.http.stall_timeout_s = c.http.request_timeout_s = 1;
  set_fault([](const RequestView& r) {
    return r.path.ends_with(".so") ? Fault{Fault::Kind::DropMidBody, 0, 0, {}} : Fault{};
  });
  EXPECT_TRUE(throws_with([&] { Hub(c).load(Reference::parse("acme/example@v1.0.0")); }, "GET "));
  expect_cache_consistent();
  EXPECT_EQ(blob_count(), 1u);

  set_fault([](const RequestView& r) {
    return r.path.ends_with("/refs") ? Fault{Fault::Kind::Delay, 0, 2500, {}} : Fault{};
  });
  EXPECT_TRUE(throws_with([&] { Hub(c).load(Reference::parse("acme/example@v1.0.0")); }, "imeout"));
  expect_cache_consistent();

  set_fault({});
  EXPECT_NO_THROW(Hub(config()).load(Reference::parse("acme/example@v1.0.0:SiLU")));
  expect_cache_consistent();
}

TEST_F(HubServer, TwoProcessesDownloadingTheSamePackage) {
  publish("v1.0.0", &acme);
  // Slow file responses make the two downloads overlap.
  set_fault([](const RequestView& r) {
    return r.path.find("/resolve/") != std::string_view::npos ? Fault{Fault::Kind::Delay, 0, 300, {}} : Fault{};
  });
  const std::string trust = "acme=" + acme.public_key.str();
  std::vector<std::string> env_strings = {"HF_ENDPOINT=" + server->url(), "KCPP_CACHE=" + cache_dir.string(),
                                          "KCPP_TRUSTED_PUBLISHERS=" + trust, "KCPP_TRUST_STORE=/nonexistent",
                                          "HOME=" + tmp.path().string(), "KCPP_LOCK_FILE="};
  if (const char* ld = std::getenv("LD_LIBRARY_PATH")) env_strings.push_back(std::string("LD_LIBRARY_PATH=") + ld);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  const std::string bin = test::kcpp_binary().string();
  std::vector<pid_t> pids;
  for (int i = 0; i < 2; ++i) {
    std::vector<std::string> args = {bin, "download", "--quiet", "acme/example@>=1.0"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    ASSERT_EQ(posix_spawn(&pid, bin.c_str(), nullptr, nullptr, argv.data(), envp.data()), 0);
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  }
  expect_cache_consistent();
  // The manifest and the files of the variant this machine gets (the processes see the real machine),
  // each stored once.
  const Manifest m = Manifest::parse(read_file(hub_dir / "acme/example/v1.0.0/manifest.json"), "v1.0.0");
  std::vector<VariantCandidate> cands;
  for (const auto& v : m.variants) cands.push_back({v.name, v.cuda_archs});
  const std::string chosen = select_variant(cands, Machine::detect()).chosen;
  ASSERT_NE(m.variant(chosen), nullptr);
  EXPECT_EQ(blob_count(), 1 + m.variant(chosen)->files.size());
  size_t library_downloads = 0;
  for (const auto& r : requests) library_downloads += r.ends_with(".so");
  EXPECT_EQ(library_downloads, 1u) << "the second process must find the first one's download";
}

TEST_F(HubServer, ADownloadKilledMidwayLeavesNoPartialFileBehind) {
  publish("v1.0.0", &acme);
  // The library's answer waits, so the download is caught with its partial file open.
  set_fault([](const RequestView& r) {
    return r.path.ends_with(".so") ? Fault{Fault::Kind::Delay, 0, 1500, {}} : Fault{};
  });
  const fs::path blobs = cache_dir / "models--acme--example" / "blobs";
  const Manifest m = Manifest::parse(read_file(hub_dir / "acme/example/v1.0.0/manifest.json"), "v1.0.0");
  auto partial_library = [&] {
    std::error_code ec;
    for (auto it = fs::directory_iterator(blobs, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
      for (const ManifestVariant& v : m.variants)
        if (it->path().filename().string().starts_with(v.file(v.library)->sha256 + ".incomplete.")) return true;
    return false;
  };
  EXPECT_EQ(run_kcpp({"download", "--quiet", "acme/example@v1.0.0"}, nullptr, partial_library), 128 + SIGKILL);
  ASSERT_TRUE(partial_library()) << "kill -9 leaves the partial file";
  // The next download (no delay now) removes it: the dead process no longer holds its lock.
  set_fault({});
  EXPECT_NO_THROW(Hub(config()).load(Reference::parse("acme/example@v1.0.0:SiLU")));
  EXPECT_FALSE(partial_library());
  expect_cache_consistent();
}

TEST_F(HubServer, ASecondServerOnAPortInUseFails) {
  const std::string url = server->url();
  const int port = std::stoi(url.substr(url.rfind(':') + 1));
  Server second(hub_dir);
  EXPECT_TRUE(throws_with([&] { second.start("127.0.0.1", port); },
                          "kcpp serve: cannot listen on 127.0.0.1:" + std::to_string(port) + ": address in use"));
  // The first one still answers alone.
  publish("v1.0.0", &acme);
  EXPECT_NO_THROW(Hub(config()).inspect(Reference::parse("acme/example@v1.0.0")));
}

TEST_F(HubServer, ATagAndItsManifestNameTheSameVersionOrNothingLoads) {
  publish("v0.5.0", &acme);  // holds example 1.0.0
  publish("v1.2.0", &acme);  // holds example 1.2.0
  Hub hub(config());
  const std::string refused = "the tag v0.5.0 says version 0.5.0 but its manifest.json says example 1.0.0";
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@>=0.1,<1:SiLU")); }, refused));
  EXPECT_TRUE(throws_with([&] { hub.load(Reference::parse("acme/example@v0.5.0")); }, refused));
  const LoadedKernel k = hub.load(Reference::parse("acme/example@>=1.0:SiLU"));
  EXPECT_EQ(k.info.resolved.revision, "v1.2.0");
  EXPECT_STREQ(k.package->table().version, "1.2.0");
  // A full commit id is a revision, whatever its first character; nothing about it claims a version.
  const std::string commit = hub.resolve(Reference::parse("acme/example@v0.5.0")).commit;
  const PackageInfo info = hub.inspect(Reference::parse("acme/example@" + commit));
  EXPECT_EQ(info.resolved.commit, commit);
  EXPECT_EQ(info.manifest.version, "1.0.0");
}

TEST_F(HubServer, LockNamesAnUnknownLayerAndThePackagesLayers) {
  publish("v1.0.0", &acme);
  publish("main", &acme);
  publish("v1.0.0", &acme, {}, "acme/tagged");  // no main branch
  const fs::path project = tmp.path() / "kcpp.json", lock = tmp.path() / "kcpp.lock";
  auto lock_with = [&](const std::string& mapping, std::string* out) {
    write_file_atomic(project, "{\"kernel_mapping\": " + mapping + "}");
    return run_kcpp({"lock", "--quiet", "--project", project.string(), "--out", lock.string()}, out);
  };
  std::string out;
  EXPECT_NE(lock_with(R"({"SiLU": "acme/example@>=1.0:Nope"})", &out), 0);
  EXPECT_NE(out.find("kernel_mapping.SiLU: acme/example@>=1.0:Nope: no layer 'Nope' in example 1.0.0 (the package "
                     "has: SiLU)"), std::string::npos) << out;
  EXPECT_NE(lock_with(R"({"SiLU": "acme/example:Nope"})", &out), 0);
  EXPECT_NE(out.find("no layer 'Nope' in example 1.0.0"), std::string::npos) << out;
  EXPECT_NE(lock_with(R"({"SiLU": "acme/tagged:SiLU"})", &out), 0);
  EXPECT_NE(out.find("acme/tagged has no tag or branch 'main' (branches: none; tags: v1.0.0); a reference without "
                     "'@' means the branch main"), std::string::npos) << out;
  EXPECT_NE(lock_with(R"({"SiL": "acme/example@>=1.0:SiLU"})", &out), 0);
  EXPECT_NE(out.find("unknown layer name 'SiL'"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(lock));
  // Every device and mode of a mapping is locked.
  EXPECT_EQ(lock_with(R"({"SiLU": {"cpu": "acme/example@>=1.0:SiLU",
                                   "cuda": {"training": "acme/tagged@v1.0.0:SiLU"}}})", &out), 0) << out;
  const LockFile lf = LockFile::load(lock);
  ASSERT_EQ(lf.packages.size(), 2u);
}

TEST_F(HubServer, OfflineModeUsesTheCacheAlone) {
  publish("v1.0.0", &acme);
  HubConfig c = config();
  c.offline = true;
  EXPECT_TRUE(throws_with([&] { Hub(c).load(Reference::parse("acme/example@>=1.0")); },
                          "no tag of acme/example matches '>=1.0' in the offline cache"));
  EXPECT_TRUE(throws_with([&] { Hub(c).load(Reference::parse("acme/example@v1.0.0")); }, "HF_HUB_OFFLINE"));
  Hub(config()).load(Reference::parse("acme/example@v1.0.0:SiLU"));
  server->stop();  // no network at all from here on
  const size_t before = requests.size();
  EXPECT_EQ(Hub(c).load(Reference::parse("acme/example@>=1.0:SiLU")).info.resolved.revision, "v1.0.0");
  EXPECT_EQ(requests.size(), before);
}

TEST_F(HubServer, LockFilesPinCommitsAndHashes) {
  const fs::path rev = publish("v1.0.0", &acme);
  Hub first(config());
  const PackageInfo info = first.inspect(Reference::parse("acme/example@^1.0"));
  LockFile lf;
  LockEntry e{"acme/example", "^1.0", info.resolved.revision, info.resolved.commit, info.manifest_sha256, "acme", {}};
  for (const auto& v : info.manifest.variants)
    for (const auto& f : v.files) e.files[f.path] = f.sha256;
  lf.upsert(e);
  lf.save(tmp.path() / "kcpp.lock");
  HubConfig c = config();
  c.lock_file = tmp.path() / "kcpp.lock";
  EXPECT_NO_THROW(Hub(c).load(Reference::parse("acme/example@^1.0:SiLU")));
  EXPECT_EQ(LockFile::load(tmp.path() / "kcpp.lock").packages[0].commit, info.resolved.commit);

  // The publisher re-releases v1.0.0 with other content (signed, valid): the locked load refuses it.
  publish("v1.0.0", &acme, [](const fs::path& d) {
    auto j = nlohmann::json::parse(read_file(d / "manifest.json"));
    j["description"] = "rebuilt";
    write_file_atomic(d / "manifest.json", j.dump());
  });
  EXPECT_TRUE(throws_with([&] { Hub(c).load(Reference::parse("acme/example@^1.0")); },
                          "but the hub now has commit"));
  // A lock whose manifest hash differs from what the pinned commit serves.
  lf.packages[0].commit = first.resolve(Reference::parse("acme/example@v1.0.0")).commit;
  lf.packages[0].manifest_sha256 = std::string(64, '0');
  lf.save(tmp.path() / "kcpp.lock");
  Hub fresh_cache_hub([&] {
    HubConfig x = c;
    x.cache_dir = tmp.path() / "cache2";
    return x;
  }());
  EXPECT_TRUE(throws_with([&] { fresh_cache_hub.load(Reference::parse("acme/example@^1.0")); },
                          "refusing to load it"));
  write_file_atomic(tmp.path() / "kcpp.lock", "{\"kcpp_lock\": 1}");
  EXPECT_TRUE(throws_with([&] { Hub{c}; }, "no 'packages' list"));
  (void)rev;
}

TEST_F(HubServer, TheTokenGoesOnlyToTheEndpoint) {
  publish("v1.0.0", &acme);
  HubConfig c = config();
  c.http.token = "hf_secret";
  Hub(c).inspect(Reference::parse("acme/example@v1.0.0"));
  ASSERT_FALSE(authorizations.empty());
  for (const auto& a : authorizations) EXPECT_EQ(a, "Bearer hf_secret");
  authorizations.clear();
  c.http.token_origin = "https://huggingface.co";  // the token belongs elsewhere
  c.cache_dir = tmp.path() / "cache2";
  Hub(c).inspect(Reference::parse("acme/example@v1.0.0"));
  ASSERT_FALSE(authorizations.empty());
  for (const auto& a : authorizations) EXPECT_EQ(a, "");
}

TEST_F(HubServer, PlainDirectoriesAndLocalPackagesAreHubsToo) {
  publish("v1.0.0", &acme);
  HubConfig c = config();
  c.endpoint = hub_dir.string();
  EXPECT_EQ(Hub(c).load(Reference::parse("acme/example@~1.0:SiLU")).info.resolved.revision, "v1.0.0");
  c.endpoint = "file://" + hub_dir.string();
  EXPECT_NO_THROW(Hub(c).load(Reference::parse("acme/example@v1.0.0:SiLU")));

  // A local package folder: verified the same way; the built example is unsigned.
  const std::string local = test::example_package_dir().string() + ":SiLU";
  EXPECT_TRUE(throws_with([&] { Hub(config()).load(Reference::parse(local)); }, "not signed"));
  HubConfig lenient = config();
  lenient.allow_all_kernels = true;
  EXPECT_NE(Hub(lenient).load(Reference::parse(local)).layer, nullptr);
  EXPECT_TRUE(throws_with([&] { Hub(lenient).load(Reference::parse("/nonexistent/pkg")); }, "not a folder"));
}

TEST_F(HubServer, NoVariantFitsListsEveryRefusal) {
  publish("v1.0.0", &acme);
  HubConfig c = config();
  c.machine.arch = "riscv64";
  EXPECT_TRUE(throws_with([&] { Hub(c).load(Reference::parse("acme/example@v1.0.0")); },
                          "no build variant of acme/example@v1.0.0 fits this machine (linux riscv64"));
}

TEST_F(HubServer, UseHubKernelsOffDisablesLoading) {
  publish("v1.0.0", &acme);
  HubConfig c = config();
  c.enabled = false;
  Hub hub(c);
  EXPECT_THROW(hub.load(Reference::parse("acme/example@v1.0.0")), HubDisabled);
  EXPECT_NO_THROW(hub.inspect(Reference::parse("acme/example@v1.0.0")));  // references still resolve
  ::setenv("USE_HUB_KERNELS", "false", 1);
  EXPECT_FALSE(HubConfig::from_env().enabled);
  ::setenv("USE_HUB_KERNELS", "OFF", 1);
  EXPECT_FALSE(HubConfig::from_env().enabled);
  ::setenv("USE_HUB_KERNELS", "1", 1);
  EXPECT_TRUE(HubConfig::from_env().enabled);
  ::unsetenv("USE_HUB_KERNELS");
}

}  // namespace
}  // namespace kcpp::hub
