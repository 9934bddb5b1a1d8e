// The hub's pieces in isolation: versions and constraints, references and mappings, variants and
// their selection, hashes and signatures, manifests, the trust store, and loading packages through
// the C ABI (including the ones that must be refused).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "core/error.h"
#include "hub/cache.h"
#include "hub/crypto.h"
#include "hub/fs.h"
#include "hub/hub.h"
#include "hub/lockfile.h"
#include "hub/manifest.h"
#include "hub/package.h"
#include "hub/reference.h"
#include "hub/semver.h"
#include "hub/trust.h"
#include "hub/variant.h"
#include "hub_test_util.h"
#include "kcpp/kernel/cpu.h"

namespace kcpp::hub {
namespace {

using test::throws_with;

// ---- versions and constraints -------------------------------------------------------------------

TEST(Semver, PrecedenceFollowsTheSpec) {
  // semver.org §11's example chain, plus numeric fields compared as numbers.
  const std::vector<std::string> ordered = {"1.0.0-alpha",      "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta",
                                            "1.0.0-beta.2",     "1.0.0-beta.11", "1.0.0-rc.1",       "1.0.0",
                                            "1.2.0",            "1.10.0",        "2.0.0"};
  for (size_t i = 0; i + 1 < ordered.size(); ++i)
    EXPECT_LT(Version::parse(ordered[i]), Version::parse(ordered[i + 1])) << ordered[i] << " < " << ordered[i + 1];
  EXPECT_EQ(Version::parse("v1.2.3+build.5"), Version::parse("1.2.3"));  // build metadata ignored
  EXPECT_EQ(Version::parse("v1.2.3-rc.1+b").str(), "1.2.3-rc.1+b");
}

TEST(Semver, MalformedVersionsAreErrors) {
  for (const char* bad : {"1.2", "01.2.3", "1.2.3-", "1.2.3-01", "1.2.3.4", "a.b.c", "1.2.3-rc..1", ""})
    EXPECT_TRUE(throws_with([&] { Version::parse(bad); }, "bad version")) << bad;
  EXPECT_FALSE(Version::try_parse("main"));
  EXPECT_TRUE(Version::try_parse("v2.0.0"));
}

TEST(Semver, ConstraintsMatchAsDocumented) {
  struct Case {
    const char* constraint;
    const char* version;
    bool match;
  };
  const Case cases[] = {
      {">=2.0,<3.0", "2.0.0", true},    {">=2.0,<3.0", "2.9.9", true},   {">=2.0,<3.0", "3.0.0", false},
      {">=2.0, <3.0", "1.9.9", false},  {">= 2.0 < 3.0", "2.5.0", true}, {"^1.2", "1.2.0", true},
      {"^1.2", "1.99.0", true},         {"^1.2", "2.0.0", false},        {"^1.2", "1.1.9", false},
      {"^0.2.3", "0.2.9", true},        {"^0.2.3", "0.3.0", false},      {"^0.0.3", "0.0.3", true},
      {"^0.0.3", "0.0.4", false},       {"^0", "0.9.0", true},           {"~1.4", "1.4.7", true},
      {"~1.4", "1.5.0", false},         {"~1", "1.9.0", true},           {"~1.4.2", "1.4.1", false},
      {"~=1.4", "1.9.0", true},         {"~=1.4", "2.0.0", false},       {"~=1.4.2", "1.5.0", false},
      {"1.2.3", "1.2.3", true},         {"=1.2.3", "1.2.4", false},      {"==1.2.3", "1.2.3", true},
      {"1.2", "1.2.7", true},           {"1.2", "1.3.0", false},         {"1.x", "1.7.0", true},
      {"*", "7.0.0", true},             {">1.4", "1.4.9", false},        {">1.4", "1.5.0", true},
      {">1.4.0", "1.4.1", true},        {"<=1.4", "1.4.9", true},        {"<=1.4", "1.5.0", false},
      {"<=1.4.0", "1.4.0", true},       {"!=1.2.3", "1.2.3", false},     {"!=1.2.3", "1.2.4", true},
      {"<1.0 || >=2.0", "0.5.0", true}, {"<1.0 || >=2.0", "1.5.0", false},
      // Pre-releases: only when the same MAJOR.MINOR.PATCH is named with a pre-release.
      {">=0.9", "1.0.0-rc.2", false},   {"^1.0.0-rc.1", "1.0.0-rc.2", true}, {"^1.0.0-rc.1", "1.0.0", true},
      {"^1.0.0-rc.1", "1.1.0-rc.1", false}, {"<2.0", "2.0.0-rc.1", false}, {">=1.0.0-beta", "1.0.0-alpha", false},
  };
  for (const Case& c : cases)
    EXPECT_EQ(Constraint::parse(c.constraint).matches(Version::parse(c.version)), c.match)
        << "'" << c.constraint << "' vs " << c.version;
}

TEST(Semver, BestPicksTheNewestMatch) {
  std::vector<Version> tags;
  for (const char* t : {"v1.0.0", "v1.2.0", "v1.3.0-rc.1", "v2.0.0", "v1.1.5"}) tags.push_back(Version::parse(t));
  EXPECT_EQ(Constraint::parse(">=1.0,<2.0").best(tags)->str(), "1.2.0");
  EXPECT_EQ(Constraint::parse("^1.3.0-rc.1").best(tags)->str(), "1.3.0-rc.1");
  EXPECT_EQ(Constraint::parse("^2").best(tags)->str(), "2.0.0");
  EXPECT_FALSE(Constraint::parse(">=3").best(tags));
}

TEST(Semver, MalformedConstraintsAreErrors) {
  for (const char* bad : {"", ">=", ">=x.1", "^", ">=1.0,,", "~=1", "!=1.2", "=>1.0", ">=1.0 ||", "1.2.3.4", "^01.2"})
    EXPECT_TRUE(throws_with([&] { Constraint::parse(bad); }, "constraint")) << "'" << bad << "'";
}

TEST(Semver, AWildcardAfterAnOperatorIsNotAVersion) {
  // ">=x" once meant "any version" and loaded the newest tag; only a lone "*" or "x" means that.
  const std::pair<const char*, const char*> bad[] = {
      {">=x", "'x' is not a version"}, {"<*", "'*' is not a version"},   {">X", "'X' is not a version"},
      {"=x", "'x' is not a version"},  {"^*", "'*' is not a version"},   {">=1.0, <=x", "'x' is not a version"},
      {">=x.x", "'x.x' is not a version"}, {">=foo", "'foo' is not a number"},
  };
  for (const auto& [text, needle] : bad)
    EXPECT_TRUE(throws_with([&] { Constraint::parse(text); }, needle)) << "'" << text << "'";
  EXPECT_TRUE(Constraint::parse("x").matches(Version::parse("9.0.0")));
  EXPECT_TRUE(Constraint::parse(">=1.x").matches(Version::parse("1.0.0")));
}

TEST(Semver, EveryVersionHasANextOne) {
  // A field of 2^64 - 1 has no successor: "^X.0.0" would end at a wrapped-around bound and admit nothing.
  EXPECT_TRUE(throws_with([] { Version::parse("18446744073709551615.0.0"); }, "below 2^64 - 1"));
  EXPECT_TRUE(throws_with([] { Constraint::parse("<=1.18446744073709551615"); }, "below 2^64 - 1"));
  const Version top = Version::parse("18446744073709551614.18446744073709551614.18446744073709551614");
  for (const char* c : {"^18446744073709551614", "~18446744073709551614.18446744073709551614", "<=18446744073709551614"})
    EXPECT_TRUE(Constraint::parse(c).matches(top)) << c;
}

// ---- references and mappings ----------------------------------------------------------------------

TEST(Reference, ParsesEveryForm) {
  Reference r = Reference::parse("kernels-community/liger");
  EXPECT_EQ(r.repo, "kernels-community/liger");
  EXPECT_EQ(r.revision, "main");
  EXPECT_FALSE(r.constraint);
  EXPECT_EQ(r.layer, "");
  r = Reference::parse("acme/kernels@>=2.0,<3.0:RMSNorm");
  EXPECT_EQ(r.repo, "acme/kernels");
  ASSERT_TRUE(r.constraint);
  EXPECT_EQ(r.constraint->text(), ">=2.0,<3.0");
  EXPECT_EQ(r.layer, "RMSNorm");
  r = Reference::parse("acme/kernels@v2.1.0");
  EXPECT_EQ(r.revision, "v2.1.0");
  EXPECT_FALSE(r.constraint);
  r = Reference::parse("acme/kernels@1.2:X");  // a leading digit is a constraint (1.2.x)
  ASSERT_TRUE(r.constraint);
  EXPECT_TRUE(r.constraint->matches(Version::parse("1.2.9")));
  r = Reference::parse("acme/k.v2_x@feature/new-thing:Layer_2");
  EXPECT_EQ(r.revision, "feature/new-thing");
  EXPECT_EQ(r.layer, "Layer_2");
  r = Reference::parse("  /opt/kernels/my-pkg:SiLU ");
  EXPECT_TRUE(r.is_local());
  EXPECT_EQ(r.path, "/opt/kernels/my-pkg");
  EXPECT_EQ(r.layer, "SiLU");
  r = Reference::parse("/opt/a:b/pkg");  // ':' not followed by an identifier stays in the path
  EXPECT_EQ(r.path, "/opt/a:b/pkg");
  EXPECT_EQ(r.layer, "");
}

TEST(Reference, AFullCommitIdIsARevisionWhateverItStartsWith) {
  // huggingface_hub's rule (REGEX_COMMIT_HASH, ^[0-9a-f]{40}$): a full commit id is a revision.
  for (const std::string sha : {"0123456789abcdef0123456789abcdef01234567", "abcdef0123456789abcdef0123456789abcdef01",
                                "9fe4d3b5c1e0a7f2d8b6c4e2a0f8d6b4c2e0a8f6"}) {
    const Reference r = Reference::parse("acme/kernels@" + sha + ":SiLU");
    EXPECT_FALSE(r.constraint) << sha;
    EXPECT_EQ(r.revision, sha);
    EXPECT_EQ(r.layer, "SiLU");
  }
  // Shorter hex starting with a digit reads as a version; one that is no version says to give it in full.
  EXPECT_TRUE(Reference::parse("acme/kernels@1234567").constraint);
  EXPECT_TRUE(throws_with([] { Reference::parse("acme/kernels@0123abc"); }, "a commit must be given in full"));
  EXPECT_TRUE(throws_with([] { Reference::parse("acme/kernels@>=x:SiLU"); }, "'x' is not a version"));
}

TEST(Reference, MalformedReferencesAreErrorsNamingTheProblem) {
  const std::pair<const char*, const char*> bad[] = {
      {"", "empty"},
      {"liger", "exactly one '/'"},
      {"a/b/c", "exactly one '/'"},
      {"org/", "empty repo name"},
      {":Layer", "no repo or path"},
      {"-org/repo", "starts or ends"},
      {"org/re--po", "contains '--'"},
      {"org/re po", "character ' '"},
      {"org/repo@", "nothing after '@'"},
      {"org/repo@>=1.0,<", "constraint"},
      {"org/repo@^", "constraint"},
      {"org/repo@v1..2", "not a valid tag or branch"},
      {"org/repo@-rf", "not a valid tag or branch"},
      {"org/repo:", "empty layer name"},
      {"org/repo:1abc", "not an identifier"},
      {"org/repo@main:Layer-x", "not an identifier"},
      {"./local/pkg", "absolute"},
      {"~/pkg", "absolute"},
  };
  for (const auto& [text, needle] : bad)
    EXPECT_TRUE(throws_with([&] { Reference::parse(text); }, needle)) << "'" << text << "'";
}

TEST(LayerMapping, PlainStringsDeviceTablesCapabilitiesAndDisabled) {
  auto m = LayerMapping::parse(nlohmann::json("acme/k@^1:RMSNorm"), "kernel_mapping.RMSNorm");
  ASSERT_TRUE(m.select(Backend::CUDA, 9, 0));
  EXPECT_EQ(m.select(Backend::CPU)->ref->repo, "acme/k");

  m = LayerMapping::parse(nlohmann::json::parse(R"({
      "cuda": [{"ref": "acme/hopper:RMSNorm", "capability": ">=9.0"}, {"ref": "acme/any:RMSNorm"}],
      "rocm": "amd/k:RMSNorm", "cpu": ""})"),
                          "kernel_mapping.RMSNorm");
  EXPECT_EQ(m.select(Backend::CUDA, 9, 0)->ref->repo, "acme/hopper");
  EXPECT_EQ(m.select(Backend::CUDA, 8, 6)->ref->repo, "acme/any");
  EXPECT_EQ(m.select(Backend::ROCm)->ref->repo, "amd/k");
  ASSERT_TRUE(m.select(Backend::CPU));
  EXPECT_FALSE(m.select(Backend::CPU)->ref);  // "" = explicitly disabled
  EXPECT_EQ(m.select(Backend::Metal), nullptr);  // not mapped at all

  EXPECT_FALSE(LayerMapping::parse(nlohmann::json(""), "x").select(Backend::CUDA, 9, 0)->ref);
}

TEST(LayerMapping, MalformedTablesAreErrors) {
  const std::pair<const char*, const char*> bad[] = {
      {R"({"tpu": "a/b"})", "unknown device 'tpu'"},
      {R"({"cuda": 3})", "expected a reference"},
      {R"({"cuda": [{"capability": ">=9.0"}]})", "missing 'ref'"},
      {R"({"cuda": [{"ref": "a/b", "cc": ">=9.0"}]})", "unknown key 'cc'"},
      {R"({"cpu": {"ref": "a/b", "capability": ">=9.0"}})", "CUDA entries only"},
      {R"({"cuda": {"ref": "a/b", "capability": ">>9"}})", "capability"},
      {R"({"cuda": []})", "empty list"},
      {R"({"cuda": "not a ref"})", "bad kernel reference"},
      {R"(12)", "expected a kernel reference or a table"},
  };
  for (const auto& [text, needle] : bad)
    EXPECT_TRUE(throws_with([&] { LayerMapping::parse(nlohmann::json::parse(text), "kernel_mapping.L"); }, needle))
        << text;
  EXPECT_TRUE(throws_with([&] { LayerMapping::parse(nlohmann::json::parse(R"({"tpu": "a/b"})"), "kernel_mapping.L"); },
                          "kernel_mapping.L"));
}

// ---- variants ---------------------------------------------------------------------------------------

TEST(Variant, EveryBackendParses) {
  Variant v = Variant::parse("kcpp1-cu130-x86_64-linux");
  EXPECT_EQ(v.abi, 1);
  EXPECT_EQ(v.backend, Backend::CUDA);
  EXPECT_EQ(v.major, 13);
  EXPECT_EQ(v.minor, 0);
  EXPECT_EQ(v.arch, "x86_64");
  EXPECT_EQ(v.os, "linux");
  v = Variant::parse("kcpp1-cu118-aarch64-linux");
  EXPECT_EQ(v.major, 11);
  EXPECT_EQ(v.minor, 8);
  v = Variant::parse("kcpp1-rocm70-x86_64-linux");
  EXPECT_EQ(v.backend, Backend::ROCm);
  EXPECT_EQ(v.major, 7);
  v = Variant::parse("kcpp1-metal-aarch64-darwin");
  EXPECT_EQ(v.backend, Backend::Metal);
  EXPECT_EQ(v.os, "darwin");
  v = Variant::parse("kcpp1-xpu20253-x86_64-linux");
  EXPECT_EQ(v.backend, Backend::XPU);
  EXPECT_EQ(v.major, 2025);
  EXPECT_EQ(v.minor, 3);
  EXPECT_EQ(Variant::parse("kcpp1-cpu-x86_64-linux").backend, Backend::CPU);
  for (const char* bad : {"kcpp1-cu-x86_64-linux", "kcpp-cpu-x86_64-linux", "kcpp1-tpu-x86_64-linux",
                          "kcpp1-cpu-x86_64", "torch27-cxx11-cu128-x86_64-linux", "kcpp1-xpu3-x86_64-linux",
                          "kcpp1-cpu-X86-linux"})
    EXPECT_TRUE(throws_with([&] { Variant::parse(bad); }, "bad variant name")) << bad;
}

TEST(Variant, CudaArchitectureFit) {
  EXPECT_EQ(cuda_arch_fit("90a", 9, 0), ArchFit::Native);
  EXPECT_EQ(cuda_arch_fit("90a", 10, 0), ArchFit::None);  // arch-specific code runs on sm_90 only
  EXPECT_EQ(cuda_arch_fit("80", 8, 6), ArchFit::Native);  // same major, newer minor
  EXPECT_EQ(cuda_arch_fit("80", 9, 0), ArchFit::Ptx);     // PTX JIT on a newer GPU
  EXPECT_EQ(cuda_arch_fit("80-real", 9, 0), ArchFit::None);
  EXPECT_EQ(cuda_arch_fit("86", 8, 0), ArchFit::None);    // older GPU
  EXPECT_EQ(cuda_arch_fit("sm_90", 9, 0), ArchFit::Native);
  EXPECT_EQ(cuda_arch_fit("compute_90", 12, 0), ArchFit::Ptx);
  EXPECT_EQ(cuda_arch_fit("100f", 10, 3), ArchFit::Native);
  EXPECT_EQ(cuda_arch_fit("100f", 12, 0), ArchFit::None);
  EXPECT_EQ(cuda_arch_fit("garbage", 9, 0), ArchFit::None);
}

Machine cpu_machine() { return Machine{}; }
Machine hopper(int driver) {
  Machine m;
  m.cuda_driver = driver;
  m.gpus.push_back({9, 0});
  return m;
}

TEST(Variant, SelectionPrefersTheBestFitAndExplainsRefusals) {
  const std::vector<VariantCandidate> all = {{"kcpp1-cpu-x86_64-linux", {}},
                                             {"kcpp1-cu126-x86_64-linux", {"80"}},
                                             {"kcpp1-cu130-x86_64-linux", {"80", "90a"}},
                                             {"kcpp1-rocm70-x86_64-linux", {}},
                                             {"kcpp1-metal-aarch64-darwin", {}},
                                             {"kcpp1-xpu20253-x86_64-linux", {}},
                                             {"kcpp1-cpu-aarch64-linux", {}},
                                             {"kcpp2-cpu-x86_64-linux", {}}};
  VariantChoice c = select_variant(all, hopper(13000));
  EXPECT_EQ(c.chosen, "kcpp1-cu130-x86_64-linux");  // native sm_90a beats cu126's PTX
  EXPECT_NE(c.why.find("native"), std::string::npos) << c.why;
  EXPECT_EQ(c.refused.size(), all.size() - 1);

  c = select_variant(all, hopper(12040));  // a 12.4 driver cannot run CUDA 13 code
  EXPECT_EQ(c.chosen, "kcpp1-cu126-x86_64-linux");
  c = select_variant(all, cpu_machine());
  EXPECT_EQ(c.chosen, "kcpp1-cpu-x86_64-linux");

  const std::vector<VariantCandidate> gpu_only = {{"kcpp1-cu130-x86_64-linux", {"90a"}},
                                                  {"kcpp1-rocm70-x86_64-linux", {}},
                                                  {"kcpp1-metal-aarch64-darwin", {}},
                                                  {"kcpp1-xpu20253-x86_64-linux", {}},
                                                  {"kcpp2-cpu-x86_64-linux", {}},
                                                  {"kcpp1-cpu-aarch64-linux", {}}};
  c = select_variant(gpu_only, cpu_machine());
  EXPECT_EQ(c.chosen, "");
  const std::string why = c.explain("acme/k", cpu_machine());
  for (const char* needle : {"needs a CUDA driver", "needs ROCm", "built for darwin", "needs an Intel XPU",
                             "built for ABI 2", "built for aarch64"})
    EXPECT_NE(why.find(needle), std::string::npos) << needle << " not in:\n" << why;

  Machine ampere = hopper(13000);
  ampere.gpus = {{8, 0}};
  c = select_variant({{"kcpp1-cu130-x86_64-linux", {"90a"}}}, ampere);
  EXPECT_EQ(c.chosen, "");
  EXPECT_NE(c.refused[0].second.find("none runs on this GPU (sm_80)"), std::string::npos) << c.refused[0].second;
}

// ---- hashes, keys, signatures -------------------------------------------------------------------

TEST(Crypto, Sha256AndBase64KnownAnswers) {
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");  // FIPS 180-2
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(base64_encode("foobar"), "Zm9vYmFy");  // RFC 4648 §10
  EXPECT_EQ(base64_decode("Zm9vYg==", "x"), "foob");
  EXPECT_TRUE(throws_with([] { base64_decode("Zm9v!", "field q"); }, "field q: not valid base64"));
  test::TempDir t;
  write_file_atomic(t.path() / "f", "abc");
  uint64_t size = 0;
  EXPECT_EQ(sha256_file(t.path() / "f", &size), sha256_hex("abc"));
  EXPECT_EQ(size, 3u);
}

// libsodium decodes every byte from 0x80 up as '/': a key or signature with such a byte in place of a
// '/' read as the real one.  Only the alphabet is base64 (fuzz finding:
// tests/fuzz/corpus/trust/regression-base64-high-byte).
TEST(Crypto, Base64IsTheAlphabetAndNothingElse) {
  const std::string key = "11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=";  // RFC 8032 7.1, TEST 1
  EXPECT_EQ(PublicKey::parse(key, "k").str(), "ed25519:" + key);
  for (const char high : {'\x80', '\x88', '\xff'}) {
    std::string twin = key;
    twin[key.find('/')] = high;
    EXPECT_TRUE(throws_with([&] { PublicKey::parse(twin, "k"); }, "k: not valid base64 (the byte 0x")) << int(high);
    EXPECT_TRUE(throws_with([&] { base64_decode(std::string(1, high) + "A==", "v"); }, "v: not valid base64"));
  }
  const KeyPair k = KeyPair::generate("acme");
  std::string sig = k.sign("message");
  for (size_t i = 0; i < sig.size(); ++i)
    if (sig[i] == '/') sig[i] = '\xc0';
  EXPECT_EQ(verify_signature(k.public_key, "message", sig), sig == k.sign("message"));
  for (const char* bad : {"Zg", "Zg=", "AB==", "Zg==Zg==", "=", " Zg==", "Zg==\n"})
    EXPECT_TRUE(throws_with([&] { base64_decode(bad, "v"); }, "v: not valid base64")) << bad;
}

TEST(Crypto, SignVerifyAndKeyFiles) {
  test::TempDir t;
  const KeyPair k = KeyPair::generate("acme");
  const std::string sig = k.sign("message");
  EXPECT_TRUE(verify_signature(k.public_key, "message", sig));
  EXPECT_FALSE(verify_signature(k.public_key, "messagf", sig));
  EXPECT_FALSE(verify_signature(KeyPair::generate("other").public_key, "message", sig));
  EXPECT_FALSE(verify_signature(k.public_key, "message", "AAAA"));

  k.save(t.path() / "acme.key", t.path() / "acme.pub");
  struct stat st{};
  ASSERT_EQ(::stat((t.path() / "acme.key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);  // the secret key is private
  const KeyPair back = KeyPair::load(t.path() / "acme.key");
  EXPECT_EQ(back.public_key, k.public_key);
  EXPECT_TRUE(verify_signature(k.public_key, "m", back.sign("m")));
  EXPECT_EQ(load_public_key(t.path() / "acme.pub").second, k.public_key);
  EXPECT_TRUE(throws_with([&] { KeyPair::load(t.path() / "acme.pub"); }, "no secret key"));
  EXPECT_TRUE(throws_with([] { KeyPair::generate("bad name"); }, "bad publisher name"));
  EXPECT_TRUE(throws_with([] { PublicKey::parse("rsa:AAAA", "k"); }, "only ed25519"));
  EXPECT_TRUE(throws_with([] { PublicKey::parse("ed25519:AAAA", "k"); }, "32 bytes"));
}

// A .key file's secret key is its seed, then its public key: a damaged seed (the public half intact)
// was accepted and signed what the public key does not verify (fuzz finding:
// tests/fuzz/corpus/trust/regression-key-file-damaged-seed).
TEST(Crypto, AKeyFileIsItsSeedsPair) {
  test::TempDir t;
  const KeyPair k = KeyPair::generate("acme");
  k.save(t.path() / "acme.key", t.path() / "acme.pub");
  const nlohmann::json saved = nlohmann::json::parse(read_file(t.path() / "acme.key"));
  for (const size_t byte : {size_t{0}, size_t{7}, size_t{31}, size_t{32}, size_t{63}}) {
    std::string secret = base64_decode(saved["secret_key"].get<std::string>(), "secret");
    secret[byte] ^= 0x10;
    nlohmann::json j = saved;
    j["secret_key"] = base64_encode(secret);
    write_file_atomic(t.path() / "damaged.key", j.dump(), 0600);
    EXPECT_TRUE(throws_with([&] { KeyPair::load(t.path() / "damaged.key"); }, "the public key does not belong to the secret key"))
        << "byte " << byte;
  }
  nlohmann::json other = saved;
  other["public_key"] = KeyPair::generate("acme").public_key.str();
  write_file_atomic(t.path() / "other.key", other.dump(), 0600);
  EXPECT_TRUE(throws_with([&] { KeyPair::load(t.path() / "other.key"); }, "the public key does not belong to the secret key"));
  EXPECT_TRUE(verify_signature(k.public_key, "m", KeyPair::load(t.path() / "acme.key").sign("m")));
}

// ---- manifests and trust --------------------------------------------------------------------------

std::string example_manifest_text() { return read_file(test::example_package_dir() / "manifest.json"); }

TEST(Manifest, TheBuiltExamplePackageIsIndexedCompletely) {
  const Manifest m = Manifest::parse(example_manifest_text(), "example");
  EXPECT_EQ(m.name, "example");
  EXPECT_EQ(m.version, "1.0.0");
  EXPECT_EQ(m.abi_version, 1);
  ASSERT_GE(m.variants.size(), 1u);
  const ManifestVariant* v = m.variant(host_variant_name(Backend::CPU));
  ASSERT_NE(v, nullptr);
  ASSERT_EQ(v->layers.size(), 1u);
  EXPECT_EQ(v->layers[0].name, "SiLU");
  EXPECT_EQ(v->layers[0].contract, "SiLU/1");
  EXPECT_TRUE(v->layers[0].backward);
  ASSERT_EQ(v->ops.size(), 1u);
  EXPECT_EQ(v->ops[0].name, "scale");
  for (const ManifestFile& f : v->files) {
    uint64_t size = 0;
    EXPECT_EQ(sha256_file(test::example_package_dir() / f.path, &size), f.sha256) << f.path;
    EXPECT_EQ(size, f.size);
  }
}

TEST(Manifest, TheCudaVariantListsItsArchitectures) {
#if KCPP_WITH_CUDA
  const Manifest m = Manifest::parse(example_manifest_text(), "example");
  ASSERT_EQ(m.variants.size(), 2u);
  const ManifestVariant* cuda = nullptr;
  for (const auto& v : m.variants)
    if (Variant::parse(v.name).backend == Backend::CUDA) cuda = &v;
  ASSERT_NE(cuda, nullptr);
  EXPECT_FALSE(cuda->cuda_archs.empty());
  ASSERT_EQ(cuda->ops.size(), 1u);
  EXPECT_EQ(cuda->ops[0].devices, (std::vector<std::string>{"cpu", "cuda"}));
  // On a Hopper machine with a CUDA 13 driver the CUDA build is chosen; on a CPU machine the CPU one.
  std::vector<VariantCandidate> cands;
  for (const auto& v : m.variants) cands.push_back({v.name, v.cuda_archs});
  Machine gpu;
  gpu.arch = Machine::detect().arch;
  gpu.cuda_driver = 13000;
  gpu.gpus = {{9, 0}};
  EXPECT_EQ(select_variant(cands, gpu).chosen, cuda->name);
  Machine cpu;
  cpu.arch = gpu.arch;
  EXPECT_EQ(select_variant(cands, cpu).chosen, host_variant_name(Backend::CPU));
#else
  GTEST_SKIP() << "skipped: a CPU-only build has no CUDA variant";
#endif
}

// A copy of the built example package in a scratch folder, and its host library.
struct ExampleCopy {
  test::TempDir tmp;
  std::filesystem::path dir = tmp.path() / "example";
  ExampleCopy() {
    std::filesystem::copy(test::example_package_dir(), dir, std::filesystem::copy_options::recursive);
  }
  std::filesystem::path library() const {
    const Manifest m = Manifest::parse(read_file(dir / "manifest.json"), "x");
    return dir / m.variant(host_variant_name(Backend::CPU))->library;
  }
};

TEST(Manifest, IndexReadsEveryLibraryAfreshAndFailsOnOneThatDoesNotLoad) {
  for (const bool random : {false, true}) {
    ExampleCopy pkg;
    const size_t variants = Manifest::parse(read_file(pkg.dir / "manifest.json"), "x").variants.size();
    EXPECT_EQ(index_package(pkg.dir).variants.size(), variants);
    const std::string before = read_file(pkg.dir / "manifest.json");
    const std::filesystem::path lib = pkg.library();
    if (random) {
      std::string bytes(4096, '\0');
      for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 2654435761u) >> 13);
      write_file_atomic(lib, bytes);
    } else {
      std::filesystem::resize_file(lib, std::filesystem::file_size(lib) / 3);
    }
    // Never the earlier manifest's layer list for a library that is now broken.
    EXPECT_TRUE(throws_with([&] { index_package(pkg.dir); }, "cannot load the library")) << random;
    EXPECT_EQ(read_file(pkg.dir / "manifest.json"), before);  // left as it was: it no longer matches, sign refuses
    EXPECT_TRUE(throws_with([&] { check_package_files(Manifest::parse(before, "x"), pkg.dir); },
                            "but manifest.json says"));
  }
}

TEST(Manifest, SignChecksTheManifestAgainstTheFilesItSigns) {
  ExampleCopy pkg;
  const Manifest indexed = index_package(pkg.dir);
  EXPECT_NO_THROW(check_package_files(indexed, pkg.dir));
  auto edited = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = indexed.json;
    edit(j);
    return Manifest::parse(j.dump(), "x");
  };
  const std::string v = host_variant_name(Backend::CPU);
  // Layers the library does not declare (a hand-edited manifest whose hashes are all right).
  const Manifest renamed = edited([&](auto& j) { j["variants"][v]["layers"][0]["name"] = "GeLU"; });
  EXPECT_TRUE(throws_with([&] { check_package_files(renamed, pkg.dir); }, "differ from what its library declares"));
  EXPECT_TRUE(throws_with([&] { check_package_files(edited([](auto& j) { j["version"] = "1.0.1"; }), pkg.dir); },
                          "the library is example 1.0.0 but manifest.json says example 1.0.1"));
  // A truncated library re-hashed into the manifest: the hashes agree, the library does not load.
  const std::filesystem::path lib = pkg.library();
  std::filesystem::resize_file(lib, std::filesystem::file_size(lib) / 3);
  uint64_t size = 0;
  const std::string sha = sha256_file(lib, &size);
  const std::string rel = std::filesystem::relative(lib, pkg.dir).generic_string();
  const Manifest rehashed = edited([&](auto& j) { j["variants"][v]["files"][rel] = {{"sha256", sha}, {"size", size}}; });
  EXPECT_TRUE(throws_with([&] { check_package_files(rehashed, pkg.dir); }, "cannot load the library"));
  std::filesystem::remove(lib);
  EXPECT_TRUE(throws_with([&] { check_package_files(indexed, pkg.dir); }, "missing"));
}

// The `kernels` library's noarch folders (build/torch-<backend>/): hashed under "noarch", signed with
// the rest, checked by sign; any other folder that is no kcpp variant is still refused.
TEST(Manifest, NoarchVariantsAreHashedAndChecked) {
  EXPECT_TRUE(is_noarch_variant_name("torch-cpu"));
  EXPECT_TRUE(is_noarch_variant_name("torch-universal"));
  for (const char* no : {"torch-", "torch", "torch28-cxx11-cu128-x86_64-linux", "torch-cu128", "kcpp1-cpu-x86_64-linux"})
    EXPECT_FALSE(is_noarch_variant_name(no)) << no;
  ExampleCopy pkg;  // kcpp_add_package wrote torch-cpu and torch-cuda; a third one here
  const auto noarch = pkg.dir / "build" / "torch-universal";
  std::filesystem::create_directories(noarch / "__pycache__");
  write_file_atomic(noarch / "layers.py", "LAYERS = {}\n");
  write_file_atomic(noarch / "__pycache__" / "layers.cpython-311.pyc", "bytecode");
  const Manifest m = index_package(pkg.dir);
  std::vector<std::string> names;
  for (const auto& n : m.noarch) names.push_back(n.name);
  EXPECT_EQ(names, (std::vector<std::string>{"torch-cpu", "torch-cuda", "torch-universal"}));
  const ManifestNoarch& u = m.noarch[2];
  ASSERT_EQ(u.files.size(), 1u);  // bytecode is not part of the package
  EXPECT_EQ(u.files[0].path, "build/torch-universal/layers.py");
  EXPECT_EQ(Manifest::parse(m.dump(), "x").noarch[2].files[0].sha256, u.files[0].sha256);
  EXPECT_NO_THROW(check_package_files(m, pkg.dir));
  write_file_atomic(noarch / "layers.py", "LAYERS = {'evil': 1}\n");
  EXPECT_TRUE(throws_with([&] { check_package_files(m, pkg.dir); }, "layers.py: sha256"));
  // A bad noarch entry in a manifest names the field.
  nlohmann::json j = m.json;
  j["noarch"]["pytorch-cpu"] = j["noarch"]["torch-universal"];
  EXPECT_TRUE(throws_with([&] { Manifest::parse(j.dump(), "x"); }, "noarch.pytorch-cpu: not a noarch variant name"));
  // Another folder that is no variant at all.
  std::filesystem::create_directories(pkg.dir / "build" / "docs");
  write_file_atomic(pkg.dir / "build" / "docs" / "a.txt", "a");
  EXPECT_THROW(index_package(pkg.dir), Error);
}

TEST(Manifest, MalformedManifestsAreErrorsNamingTheField) {
  const nlohmann::json good = nlohmann::json::parse(example_manifest_text());
  const std::string variant = good["variants"].begin().key();
  const std::string lib = good["variants"][variant]["library"];
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = good;
    edit(j);
    return j.dump();
  };
  const std::pair<std::string, std::string> bad[] = {
      {"{not json", "not valid JSON"},
      {"[1,2]", "must be a JSON object"},
      {with([](auto& j) { j.erase("name"); }), "missing field 'name'"},
      {with([](auto& j) { j.erase("variants"); }), "missing field 'variants'"},
      {with([](auto& j) { j["kcpp_manifest"] = 2; }), "format 2 is not supported"},
      {with([](auto& j) { j["version"] = "one"; }), "not a semantic version"},
      {with([](auto& j) { j["name"] = "a/b"; }), "not a package name"},
      {with([](auto& j) { j["variants"] = nlohmann::json::object(); }), "non-empty object"},
      {with([&](auto& j) { j["variants"]["kcpp1-gpu-x-y"] = j["variants"][variant]; }), "bad variant name"},
      {with([&](auto& j) { j["variants"][variant]["files"][lib]["sha256"] = "abc"; }), "64 lower-case hex"},
      {with([&](auto& j) { j["variants"][variant]["files"][lib]["size"] = -1; }), "non-negative"},
      {with([&](auto& j) { j["variants"][variant]["files"][lib]["sha256"] = std::string(64, 'A'); }),
       "files[" + lib + "]: sha256 '" + std::string(64, 'A') + "' is not a sha256 (64 lower-case hex digits)"},
      {with([&](auto& j) { j["variants"][variant]["files"][lib]["sha256"] = "../../blobs/x"; }), "'../../blobs/x' is not a sha256"},
      {with([&](auto& j) { j["variants"][variant]["files"][lib]["size"] = 1.5; }), "size must be a non-negative integer"},
      {with([&](auto& j) { j["variants"][variant]["files"][lib]["size"] = uint64_t{1} << 41; }),
       "files[" + lib + "]: the size 2199023255552 is more than the 1099511627776 bytes (1 TiB) a hub file may have"},
      {with([&](auto& j) { j["variants"][variant]["files"]["build/" + variant + "/../../../etc/passwd"] = j["variants"][variant]["files"][lib]; }), "'..' component"},
      {with([&](auto& j) { j["variants"][variant]["files"]["/etc/passwd"] = j["variants"][variant]["files"][lib]; }), "is absolute"},
      {with([&](auto& j) { j["variants"][variant]["files"]["build/other/x.so"] = j["variants"][variant]["files"][lib]; }), "must be under build/" + variant},
      {with([&](auto& j) { j["variants"][variant]["library"] = "build/" + variant + "/missing.so"; }), "is not one of the variant's files"},
      {with([](auto& j) { j["signature"] = {{"algorithm", "rsa"}, {"publisher", "a"}, {"public_key", "x"}, {"value", "y"}}; }), "unsupported algorithm"},
  };
  for (const auto& [text, needle] : bad)
    EXPECT_TRUE(throws_with([&] { Manifest::parse(text, "acme/example@v1"); }, needle)) << needle;
  EXPECT_TRUE(throws_with([&] { Manifest::parse("{", "acme/example@v1"); }, "acme/example@v1: manifest.json"));
}

// Fields of the wrong JSON type are kcpp::Errors naming the field, never a JSON library exception
// (inputs found by tests/fuzz).
TEST(Manifest, MistypedOptionalFieldsAreErrors) {
  nlohmann::json j = nlohmann::json::parse(example_manifest_text());
  const std::string variant = j["variants"].begin().key();
  j["variants"][variant]["layers"] = {{{"name", "SiLU"}, {"contract", "SiLU/1"}, {"backward", "yes"}}};
  EXPECT_THROW(Manifest::parse(j.dump(), "example"), Error);
  EXPECT_TRUE(throws_with([&] { Manifest::parse(j.dump(), "example"); }, "layers[0]: field 'backward' must be true or false"));
}

TEST(LockFile, AFormatThatIsNotANumberIsAnError) {
  test::TempDir d;
  for (const char* text : {R"({"kcpp_lock": "1", "packages": []})", R"({"kcpp_lock": null, "packages": []})", R"({"packages": []})"}) {
    write_file_atomic(d.path() / "kcpp.lock", text);
    EXPECT_THROW(LockFile::load(d.path() / "kcpp.lock"), Error) << text;
    EXPECT_TRUE(throws_with([&] { LockFile::load(d.path() / "kcpp.lock"); }, "not a kcpp lock file of format 1")) << text;
  }
  write_file_atomic(d.path() / "kcpp.lock", R"({"kcpp_lock": 1, "packages": []})");
  EXPECT_TRUE(LockFile::load(d.path() / "kcpp.lock").packages.empty());
}

// A lock file's commit becomes a folder of the cache (snapshots/COMMIT/): anything but a commit id is
// refused, as is a revision that is neither a tag or branch name nor a commit (fuzz findings: kept in
// tests/fuzz/corpus/lockfile/regression-*).
TEST(LockFile, CommitsAreCommitIdsAndRevisionsRefNames) {
  test::TempDir d;
  const std::string sha(64, 'a'), commit(40, 'c');
  auto entry = [&](const std::string& revision, const std::string& c) {
    return nlohmann::json{{"kcpp_lock", 1},
                          {"packages", {{{"repo", "acme/example"}, {"requested", "^1.0"}, {"revision", revision}, {"commit", c},
                                         {"manifest_sha256", sha}, {"publisher", "acme"}}}}}
        .dump();
  };
  for (const std::string& bad : std::vector<std::string>{"../../../../tmp/x", "C0FFEE" + std::string(34, '0'), std::string(39, 'c'), ""}) {
    write_file_atomic(d.path() / "kcpp.lock", entry("v1.0.0", bad));
    EXPECT_TRUE(throws_with([&] { LockFile::load(d.path() / "kcpp.lock"); }, "packages[0] (acme/example): commit '" + bad + "' is not a commit id"))
        << bad;
  }
  for (const char* bad : {"../v1.0.0", "", "a b", "v1.0.0.lock"}) {
    write_file_atomic(d.path() / "kcpp.lock", entry(bad, commit));
    EXPECT_TRUE(throws_with([&] { LockFile::load(d.path() / "kcpp.lock"); }, "packages[0] (acme/example): revision: ")) << bad;
  }
  for (const std::string& good : std::vector<std::string>{"v1.0.0", "feature/x", commit}) {
    write_file_atomic(d.path() / "kcpp.lock", entry(good, commit));
    EXPECT_EQ(LockFile::load(d.path() / "kcpp.lock").packages.at(0).revision, good);
  }
}

// Every hash a lock file pins is a sha256 and every file it names a path inside the repository; the
// error names the entry's repository and the file.
TEST(LockFile, PinnedHashesAreSha256sOfPathsInsideTheRepository) {
  test::TempDir d;
  const std::string sha(64, 'a'), commit(40, 'c');
  auto entry = [&](const std::string& manifest_sha256, const nlohmann::json& files) {
    return nlohmann::json{{"kcpp_lock", 1},
                          {"packages", {{{"repo", "acme/example"}, {"requested", "^1.0"}, {"revision", "v1.0.0"},
                                         {"commit", commit}, {"manifest_sha256", manifest_sha256}, {"publisher", "acme"},
                                         {"files", files}}}}}
        .dump();
  };
  const std::pair<std::string, std::string> bad[] = {
      {entry(std::string(64, 'A'), nlohmann::json::object()),
       "packages[0] (acme/example): manifest_sha256 '" + std::string(64, 'A') + "' is not a sha256"},
      {entry("", nlohmann::json::object()), "packages[0] (acme/example): manifest_sha256 '' is not a sha256"},
      {entry(sha, {{"build/x/a.so", "abc"}}), "packages[0] (acme/example): files[build/x/a.so]: 'abc' is not a sha256"},
      {entry(sha, {{"build/x/a.so", 5}}), "packages[0] (acme/example): files[build/x/a.so]: not a sha256 but number"},
      {entry(sha, {{"../../x", sha}}), "packages[0] (acme/example): files['../../x']: not a path inside the repository"},
      {entry(sha, {{"/etc/passwd", sha}}), "files['/etc/passwd']: not a path inside the repository"},
  };
  for (const auto& [text, needle] : bad) {
    write_file_atomic(d.path() / "kcpp.lock", text);
    EXPECT_TRUE(throws_with([&] { LockFile::load(d.path() / "kcpp.lock"); }, needle)) << needle;
  }
  write_file_atomic(d.path() / "kcpp.lock", entry(sha, {{"build/x/a.so", sha}}));
  EXPECT_EQ(LockFile::load(d.path() / "kcpp.lock").packages.at(0).files.at("build/x/a.so"), sha);
}

// The Hub API's answers: a ref's targetCommit and name, and a file's path, become paths of the cache;
// a server sending others is refused by name (fuzz findings: tests/fuzz/corpus/hub_api/regression-*).
TEST(HubAnswers, RefsAndFilesNameOnlyWhatTheCacheCanHold) {
  const std::string c(40, 'a');
  auto refs = [&](const std::string& name, const std::string& commit) {
    return nlohmann::json{{"branches", nlohmann::json::array()}, {"tags", {{{"name", name}, {"targetCommit", commit}}}}}.dump();
  };
  const auto ok = parse_refs_answer(refs("v1.0.0", c), "http://hub", "acme/example");
  ASSERT_EQ(ok.size(), 1u);
  EXPECT_EQ(ok[0].commit, c);
  EXPECT_TRUE(ok[0].is_tag);
  for (const std::string& bad : std::vector<std::string>{"../../../../home/me/.bashrc", "A" + std::string(39, 'a'), std::string(41, 'a'), ""})
    EXPECT_TRUE(throws_with([&] { parse_refs_answer(refs("v1.0.0", bad), "http://hub", "acme/example"); },
                            "http://hub: refs of acme/example: v1.0.0 has the targetCommit '" + bad + "', not a commit id"))
        << bad;
  EXPECT_TRUE(throws_with([&] { parse_refs_answer(refs("", c), "http://hub", "acme/example"); }, "a ref in 'tags' has an empty name"));
  for (const char* bad : {"../../x", "v1..0", "/v1", "v1/", "a\nb", "v1.lock"})
    EXPECT_TRUE(throws_with([&] { parse_refs_answer(refs(bad, c), "http://hub", "acme/example"); }, "refs of acme/example: a ref in 'tags'"))
        << bad;

  auto tree = [](const std::string& path) { return nlohmann::json{{{"type", "file"}, {"path", path}, {"size", 1}}}.dump(); };
  EXPECT_EQ(parse_tree_answer(tree("build/x/a.so"), "http://hub", "acme/example", "main").at(0).path, "build/x/a.so");
  for (const char* bad : {"../a.so", "/etc/passwd", "build//a.so", "build/./a.so", "a\\b", ""})
    EXPECT_TRUE(throws_with([&] { parse_tree_answer(tree(bad), "http://hub", "acme/example", "main"); },
                            "the file list of acme/example@main has an entry whose 'path' is not a path inside the repository"))
        << bad;
}

// Every sha256 and size of a tree listing is checked before anything uses it: the LFS oid names the
// file in the cache and is what its download is checked against, the sizes bound the download.  Each
// refusal names the endpoint, the repository and revision, the file and what was wrong.
TEST(HubAnswers, TreeHashesAndSizesAreWhatTheyClaim) {
  const std::string sha(64, 'e'), git(40, 'd');
  auto tree = [](nlohmann::json entry) {
    entry["type"] = "file";
    if (!entry.contains("path")) entry["path"] = "build/x/a.so";
    return nlohmann::json::array({entry}).dump();
  };
  auto parse = [](const std::string& body) { return parse_tree_answer(body, "http://hub", "acme/example", "v1.0.0"); };
  const std::string at = "http://hub: the file list of acme/example@v1.0.0 has an entry whose ";
  const std::pair<std::string, std::string> bad[] = {
      {tree({{"lfs", {{"oid", "ab"}}}}), at + "'lfs.oid' 'ab' is not a sha256 (64 lower-case hex digits) (build/x/a.so)"},
      {tree({{"lfs", {{"oid", std::string(64, 'E')}}}}), "'lfs.oid' '" + std::string(64, 'E') + "' is not a sha256"},
      {tree({{"lfs", {{"oid", sha + "0"}}}}), "'lfs.oid' '" + sha + "0' is not a sha256"},
      {tree({{"lfs", {{"oid", "../../../../tmp/x"}}}}), "'lfs.oid' '../../../../tmp/x' is not a sha256"},
      {tree({{"lfs", {{"oid", std::string(63, 'a') + '\n'}}}}), "'lfs.oid' '" + std::string(63, 'a') + "\\x0a' is not"},
      {tree({{"lfs", {{"oid", ""}}}}), "'lfs.oid' '' is not a sha256"},
      {tree({{"lfs", {{"oid", 5}}}}), "'lfs.oid' is not a string (build/x/a.so)"},
      {tree({{"lfs", "yes"}}), at + "'lfs' is not an object (build/x/a.so)"},
      {tree({{"lfs", nlohmann::json::object()}}), at + "'lfs' has no 'oid' (build/x/a.so)"},
      {tree({{"size", 4}, {"lfs", {{"oid", sha}, {"size", 5}}}}), at + "'lfs.size' 5 differs from its 'size' 4 (build/x/a.so)"},
      {tree({{"lfs", {{"oid", sha}, {"size", -5}}}}), at + "'lfs.size' is not a non-negative integer (build/x/a.so)"},
      {tree({{"size", -1}}), at + "'size' is not a non-negative integer (build/x/a.so)"},
      {tree({{"size", 2.5}}), at + "'size' is not a non-negative integer (build/x/a.so)"},
      {tree({{"size", uint64_t{1} << 41}}),
       at + "'size' is not sane: the size 2199023255552 is more than the 1099511627776 bytes (1 TiB) a hub file may have"},
      {tree({{"lfs", {{"oid", sha}, {"size", ~uint64_t{0}}}}}), "'lfs.size' is not sane"},
      {tree({{"oid", "zz"}}), at + "'oid' 'zz' is not a git object id (40 or 64 lower-case hex digits) (build/x/a.so)"},
      {tree({{"oid", 7}}), "'oid' 7 is not a git object id"},
      {nlohmann::json::array({{{"type", "file"}, {"path", "a.so"}, {"lfs", {{"oid", sha}}}},
                              {{"type", "file"}, {"path", "a.so"}, {"lfs", {{"oid", std::string(64, 'f')}}}}})
           .dump(),
       at + "'path' repeats an earlier entry's (a.so)"},
  };
  for (const auto& [body, needle] : bad) EXPECT_TRUE(throws_with([&] { parse(body); }, needle)) << body;

  // What a Hugging Face hub answers reads: a git oid, size and LFS size that agree; a small file
  // without LFS; "lfs": null; a folder.
  const auto files = parse(nlohmann::json::array({{{"type", "file"}, {"path", "a.so"}, {"oid", git}, {"size", 4},
                                                   {"lfs", {{"oid", sha}, {"size", 4}, {"pointerSize", 134}}}},
                                                  {{"type", "file"}, {"path", "b.json"}, {"oid", sha}, {"size", 2}},
                                                  {{"type", "file"}, {"path", "c.txt"}, {"lfs", nullptr}},
                                                  {{"type", "file"}, {"path", "d.so"}, {"lfs", {{"oid", sha}, {"size", 9}}}},
                                                  {{"type", "directory"}, {"path", "build"}, {"oid", git}}})
                               .dump());
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(files[0].sha256, sha);
  EXPECT_EQ(files[0].size, 4u);
  EXPECT_EQ(files[1].sha256, "");
  EXPECT_EQ(files[1].size, 2u);
  EXPECT_EQ(files[2].sha256, "");
  EXPECT_EQ(files[3].size, 9u);  // the LFS size, when the entry gives no other
  EXPECT_EQ(parse(tree({{"size", kMaxFileSize}})).at(0).size, kMaxFileSize);
}

TEST(Crypto, ClaimedHashesAndSizesAreNamedWhenWrong) {
  EXPECT_EQ(sha256_problem(std::string(64, '0')), "");
  EXPECT_EQ(sha256_problem(sha256_hex("x")), "");
  EXPECT_EQ(sha256_problem("abc"), "'abc' is not a sha256 (64 lower-case hex digits)");
  EXPECT_EQ(sha256_problem(std::string(64, 'g')), "'" + std::string(64, 'g') + "' is not a sha256 (64 lower-case hex digits)");
  EXPECT_EQ(sha256_problem(std::string(65, 'a')).substr(0, 4), "'aaa");
  EXPECT_EQ(size_problem(0), "");
  EXPECT_EQ(size_problem(kMaxFileSize), "");
  EXPECT_NE(size_problem(kMaxFileSize + 1), "");
  // Untrusted text in a message: control bytes escaped, long text cut.
  EXPECT_EQ(shown(std::string("a\0b\x1b[31m\\", 9)), "'a\\x00b\\x1b[31m\\x5c'");
  EXPECT_EQ(shown(std::string(100, 'a')), "'" + std::string(80, 'a') + "'...");
}

TEST(Trust, SignedUnsignedUntrustedAndTampered) {
  Manifest m = Manifest::parse(example_manifest_text(), "example");
  TrustStore store;
  EXPECT_EQ(store.verify(m).level, TrustLevel::Unsigned);

  const KeyPair acme = KeyPair::generate("acme");
  m.sign(acme);
  EXPECT_EQ(store.verify(m).level, TrustLevel::Untrusted);
  store.add("acme", acme.public_key);
  EXPECT_EQ(store.verify(m).level, TrustLevel::Trusted);
  // Round trip through text: the signature covers the canonical bytes, not the formatting.
  const Manifest reread = Manifest::parse(m.dump(), "example");
  EXPECT_EQ(store.verify(reread).level, TrustLevel::Trusted);

  // Any change after signing breaks it, wherever it is.
  for (auto edit : std::vector<std::function<void(nlohmann::json&)>>{
           [](nlohmann::json& j) { j["version"] = "1.0.1"; },
           [](nlohmann::json& j) { j["variants"].begin().value()["files"].begin().value()["sha256"] = std::string(64, 'a'); },
           [](nlohmann::json& j) { j["extra"] = 1; }}) {
    nlohmann::json j = m.json;
    edit(j);
    EXPECT_EQ(store.verify(Manifest::parse(j.dump(), "x")).level, TrustLevel::BadSignature);
  }
  // Signed by someone else claiming to be acme: a valid signature, an untrusted key.
  KeyPair impostor = KeyPair::generate("acme");
  Manifest forged = Manifest::parse(example_manifest_text(), "example");
  forged.sign(impostor);
  const TrustVerdict v = store.verify(forged);
  EXPECT_EQ(v.level, TrustLevel::Untrusted);
  EXPECT_NE(v.detail.find("a key the trust store does not list"), std::string::npos) << v.detail;
}

TEST(Trust, StoreFileAndEnvironment) {
  test::TempDir t;
  const KeyPair a = KeyPair::generate("acme"), b = KeyPair::generate("beta");
  TrustStore::add_to_file(t.path() / "trust.json", "acme", a.public_key);
  TrustStore::add_to_file(t.path() / "trust.json", "acme", a.public_key);  // idempotent
  TrustStore s;
  s.load_file(t.path() / "trust.json");
  ASSERT_EQ(s.publishers().at("acme").size(), 1u);
  ::setenv("KCPP_TRUST_STORE", (t.path() / "trust.json").c_str(), 1);
  ::setenv("KCPP_TRUSTED_PUBLISHERS", ("beta=" + b.public_key.str()).c_str(), 1);
  const TrustStore env = TrustStore::from_env();
  EXPECT_EQ(env.publishers().size(), 2u);
  ::setenv("KCPP_TRUSTED_PUBLISHERS", "beta", 1);
  EXPECT_TRUE(throws_with([] { TrustStore::from_env(); }, "KCPP_TRUSTED_PUBLISHERS"));
  ::unsetenv("KCPP_TRUSTED_PUBLISHERS");
  write_file_atomic(t.path() / "trust.json", "{\"publishers\": {\"acme\": [\"ed25519:AAAA\"]}}");
  EXPECT_TRUE(throws_with([] { TrustStore::from_env(); }, "32 bytes"));
  ::unsetenv("KCPP_TRUST_STORE");
}

// ---- the cache -------------------------------------------------------------------------------------

TEST(Cache, StalePartialDownloadsAreRemovedLiveOnesKept) {
  test::TempDir t;
  const Cache cache(t.path());
  const std::string repo = "acme/example", dead = std::string(64, 'a'), live = std::string(64, 'b');
  const std::filesystem::path blobs = cache.repo_dir(repo) / "blobs";
  std::filesystem::create_directories(blobs);
  // Left by a download killed with -9: nobody holds its key's lock.
  write_file_atomic(blobs / (dead + ".incomplete.4242.17"), "half a file");
  // Being written now: its key's lock is held (here by this test, as by a downloading process).
  FileLock holder(cache.lock_path(repo, live));
  write_file_atomic(blobs / (live + ".incomplete.4243.18"), "still coming");
  write_file_atomic(blobs / dead, "a finished blob is never touched");
  EXPECT_FALSE(FileLock::try_lock(cache.lock_path(repo, live)));
  EXPECT_EQ(cache.remove_stale_partials(repo), 1u);
  EXPECT_FALSE(std::filesystem::exists(blobs / (dead + ".incomplete.4242.17")));
  EXPECT_TRUE(std::filesystem::exists(blobs / (live + ".incomplete.4243.18")));
  EXPECT_TRUE(std::filesystem::exists(blobs / dead));
  EXPECT_EQ(cache.remove_stale_partials("acme/absent"), 0u);
}

// A ref file of the cache that does not hold a commit id is an error naming it (offline, refs are read
// from these files and their commits become snapshot paths).
TEST(Cache, RefsHoldCommitIds) {
  test::TempDir t;
  const Cache cache(t.path());
  const std::string repo = "acme/example", commit = std::string(40, 'c');
  cache.set_ref(repo, "v1.0.0", commit);
  EXPECT_EQ(cache.ref(repo, "v1.0.0"), commit);
  write_file_atomic(cache.repo_dir(repo) / "refs" / "main", "../../../elsewhere\n");
  EXPECT_TRUE(throws_with([&] { (void)cache.ref(repo, "main"); }, "the cache's ref 'main' of acme/example holds '../../../elsewhere'"));
  EXPECT_TRUE(throws_with([&] { (void)cache.refs(repo); }, "not a commit id"));
  EXPECT_EQ(cache.ref(repo, "absent"), std::nullopt);
}

// What names a file or folder of the cache is checked to be a sha256 or a commit id (or a path inside
// the repository) first, whoever passes it.
TEST(Cache, KeysCommitsAndRefNamesAreCheckedBeforeTheyNameFiles) {
  test::TempDir t;
  const Cache cache(t.path());
  const std::string repo = "acme/example", sha(64, 'a'), commit(40, 'c');
  for (const std::string& bad : {std::string("../../x"), std::string(64, 'A'), std::string(""), sha + "/x"}) {
    EXPECT_TRUE(throws_with([&] { (void)cache.lock_path(repo, bad); }, "cache: acme/example: the file key")) << bad;
    EXPECT_TRUE(throws_with([&] { (void)cache.temp_path(repo, bad); }, "is not a sha256")) << bad;
  }
  const std::filesystem::path tmp = t.path() / "download";
  write_file_atomic(tmp, "x");
  EXPECT_TRUE(throws_with([&] { cache.commit_file(repo, commit, "a.so", "../../../a", tmp); },
                          "cache: acme/example: the file key '../../../a' is not a sha256"));
  EXPECT_TRUE(throws_with([&] { cache.commit_file(repo, commit, "../a.so", sha256_hex("x"), tmp); },
                          "cache: acme/example@cccccccccccc: '../a.so' is not a path inside the repository"));
  EXPECT_TRUE(throws_with([&] { cache.commit_file(repo, "../../../x", "a.so", sha256_hex("x"), tmp); },
                          "the commit '../../../x' is not a commit id"));
  EXPECT_TRUE(std::filesystem::exists(tmp));  // nothing moved
  EXPECT_TRUE(throws_with([&] { (void)cache.snapshot_dir(repo, "C" + std::string(39, 'c')); }, "is not a commit id"));
  EXPECT_TRUE(throws_with([&] { cache.set_ref(repo, "v1.0.0", "../x"); }, "cache: acme/example@v1.0.0: the commit '../x' is not a commit id"));
  EXPECT_TRUE(throws_with([&] { cache.set_ref(repo, "../../refs-elsewhere", commit); }, "cannot name a file under refs/"));
  const auto link = cache.commit_file(repo, commit, "build/a.so", sha256_hex("x"), tmp);
  EXPECT_EQ(read_file(link), "x");
  EXPECT_EQ(cache.blob_sha256(repo, commit, "build/a.so"), sha256_hex("x"));
  EXPECT_EQ(cache.blob_sha256(repo, commit, "absent"), std::nullopt);
}

// ---- loading packages through the ABI ---------------------------------------------------------------

std::filesystem::path example_library() {
  const Manifest m = Manifest::parse(example_manifest_text(), "example");
  return test::example_package_dir() / m.variant(host_variant_name(Backend::CPU))->library;
}

struct ArgTensor {
  std::vector<int64_t> shape;
  DLTensor t{};
  ArgTensor(void* data, std::vector<int64_t> s, DLDataType dt) : shape(std::move(s)) {
    t.data = data;
    t.device = {kDLCPU, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = dt;
    t.shape = shape.data();
  }
};

kcpp_arg tensor_arg(const char* name, DLTensor* t) {
  kcpp_arg a{};
  a.name = name, a.kind = KCPP_ARG_TENSOR, a.value.tensor = t;
  return a;
}

TEST(Package, ExampleLoadsAndComputesThroughTheABI) {
  auto pkg = LoadedPackage::open_image(read_file(example_library()), "example");
  EXPECT_EQ(std::string(pkg->table().name), "example");
  EXPECT_EQ(pkg->table().abi_version, KCPP_ABI_VERSION);
  const kcpp_layer* silu = pkg->layer("SiLU");
  ASSERT_NE(silu, nullptr);
  EXPECT_EQ(pkg->layer_by_contract("SiLU/1"), silu);
  EXPECT_EQ(pkg->layer("RMSNorm"), nullptr);

  // Forward and backward on f32, against the f64 formula; awkward length 7.
  std::vector<float> x = {-30.f, -2.5f, -1e-3f, 0.f, 0.75f, 3.f, 40.f}, y(7, NAN), dy(7, 1.5f), dx(7, NAN);
  const DLDataType f32{kDLFloat, 32, 1};
  ArgTensor tx(x.data(), {7}, f32), ty(y.data(), {7}, f32), tdy(dy.data(), {7}, f32), tdx(dx.data(), {7}, f32);
  char err[256] = {0};
  kcpp_context ctx{};
  ctx.struct_size = sizeof ctx, ctx.mode = KCPP_MODE_TRAINING, ctx.device = {kDLCPU, 0};
  ctx.error = err, ctx.error_size = sizeof err;
  const kcpp_arg fwd[] = {tensor_arg("x", &tx.t), tensor_arg("y", &ty.t)};
  ASSERT_EQ(silu->supports(&ctx, fwd, 2), KCPP_OK) << err;
  ASSERT_EQ(silu->forward(&ctx, fwd, 2), KCPP_OK) << err;
  const kcpp_arg bwd[] = {tensor_arg("dy", &tdy.t), tensor_arg("x", &tx.t), tensor_arg("dx", &tdx.t)};
  ASSERT_EQ(silu->backward(&ctx, bwd, 3), KCPP_OK) << err;
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i], s = 1.0 / (1.0 + std::exp(-v));
    EXPECT_NEAR(y[i], v * s, 4e-7 * (std::abs(v * s) + 1e-30)) << i;
    EXPECT_NEAR(dx[i], 1.5 * s * (1 + v * (1 - s)), 4e-7 * (1.5 * s * std::abs(1 + v * (1 - s)) + 1e-30)) << i;
  }

  // The op, with a float argument.
  std::vector<float> z(7, NAN);
  ArgTensor tz(z.data(), {7}, f32);
  kcpp_arg scale_args[] = {tensor_arg("x", &tx.t), tensor_arg("y", &tz.t), {}};
  scale_args[2].name = "alpha", scale_args[2].kind = KCPP_ARG_FLOAT, scale_args[2].value.f = -2.0;
  ASSERT_EQ(pkg->op("scale")->call(&ctx, scale_args, 3), KCPP_OK) << err;
  EXPECT_EQ(z[4], -1.5f);
}

TEST(Package, BadCallsGetErrorsNamingTheArgument) {
  auto pkg = LoadedPackage::open_file(example_library());
  const kcpp_layer* silu = pkg->layer("SiLU");
  std::vector<float> x(6, 1.f), y(6);
  std::vector<int64_t> xi(6, 1);
  const DLDataType f32{kDLFloat, 32, 1}, i64{kDLInt, 64, 1}, bf16{kDLBfloat, 16, 1};
  ArgTensor tx(x.data(), {2, 3}, f32), ty(y.data(), {3, 2}, f32), ti(xi.data(), {2, 3}, i64),
      tb(y.data(), {2, 3}, bf16), tgood(y.data(), {2, 3}, f32);
  char err[256];
  kcpp_context ctx{};
  ctx.struct_size = sizeof ctx, ctx.device = {kDLCPU, 0}, ctx.error = err, ctx.error_size = sizeof err;
  auto call = [&](kcpp_entry_fn fn, std::vector<kcpp_arg> args) {
    err[0] = 0;
    return fn(&ctx, args.data(), static_cast<int32_t>(args.size()));
  };
  EXPECT_EQ(call(silu->forward, {tensor_arg("x", &tx.t)}), KCPP_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "SiLU.forward: missing tensor argument 'y'");
  EXPECT_EQ(call(silu->forward, {tensor_arg("x", &tx.t), tensor_arg("y", &ty.t)}), KCPP_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "SiLU.forward: tensor 'y' has shape [3, 2] but 'x' has shape [2, 3]");
  EXPECT_EQ(call(silu->forward, {tensor_arg("x", &tx.t), tensor_arg("y", &tb.t)}), KCPP_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "SiLU.forward: tensor 'y' is bf16 but 'x' is f32");
  EXPECT_EQ(call(silu->supports, {tensor_arg("x", &ti.t)}), KCPP_ERROR_UNSUPPORTED);
  EXPECT_STREQ(err, "SiLU: tensor 'x' has dtype i64; this kernel takes f32, bf16 or f16");
  kcpp_arg wrong_kind{};
  wrong_kind.name = "y", wrong_kind.kind = KCPP_ARG_INT, wrong_kind.value.i = 3;
  EXPECT_EQ(call(silu->forward, {tensor_arg("x", &tx.t), wrong_kind}), KCPP_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "SiLU.forward: argument 'y' must be a tensor");
  // Non-contiguous: a transposed view.
  std::vector<int64_t> strides = {1, 2};
  ArgTensor tt(x.data(), {2, 3}, f32);
  tt.t.strides = strides.data();
  EXPECT_EQ(call(silu->forward, {tensor_arg("x", &tt.t), tensor_arg("y", &tgood.t)}), KCPP_ERROR_UNSUPPORTED);
  EXPECT_STREQ(err, "SiLU.forward: tensor 'x' is not contiguous (row-major); this kernel needs it");
  // Wrong device.
  ArgTensor tc(x.data(), {2, 3}, f32);
  tc.t.device = {kDLCUDA, 0};
  EXPECT_EQ(call(silu->forward, {tensor_arg("x", &tc.t), tensor_arg("y", &tgood.t)}), KCPP_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "SiLU.forward: tensor 'x' is on cuda:0 but the call runs on cpu:0");
  // An argument the call does not read: refused naming it, not ignored.
  EXPECT_EQ(call(silu->forward, {tensor_arg("x", &tx.t), tensor_arg("y", &tgood.t), tensor_arg("dx", &tgood.t)}),
            KCPP_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "SiLU.forward: argument 'dx' is not one this call reads (misspelt, meaningless without another "
                    "argument, or added to the contract after this kernel's version): correct its name, drop it, or ask "
                    "for a newer version of the package");
  // A tiny error buffer truncates, never overflows; a missing one is tolerated.
  char small[8];
  ctx.error = small, ctx.error_size = sizeof small;
  EXPECT_EQ(call(silu->forward, {}), KCPP_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(small, "SiLU.fo");
  ctx.error = nullptr, ctx.error_size = 0;
  EXPECT_EQ(call(silu->forward, {}), KCPP_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(silu->forward(&ctx, nullptr, 5), KCPP_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(pkg->op("scale")->call(&ctx, nullptr, 0), KCPP_ERROR_INVALID_ARGUMENT);
  for (float v : y) EXPECT_EQ(v, 0.f);  // no call above wrote its output
}

TEST(Package, LibrariesThatAreNotValidPackagesAreRefused) {
  EXPECT_TRUE(throws_with([] { LoadedPackage::open_file(test::abi99_library()); },
                          "built for ABI version 99, this host speaks ABI version 1"));
  EXPECT_TRUE(throws_with([] { LoadedPackage::open_file(test::no_symbol_library()); },
                          "not a kcpp package: it does not export kcpp_package_v1"));
  const std::string image = read_file(example_library());
  EXPECT_TRUE(throws_with([&] { LoadedPackage::open_image(image.substr(0, image.size() / 2), "truncated"); },
                          "truncated: cannot load the library"));
  EXPECT_TRUE(throws_with([] { LoadedPackage::open_image("#!/bin/sh\nrm -rf /\n", "script"); }, "not an ELF"));
  EXPECT_TRUE(throws_with([] { LoadedPackage::open_file("/nonexistent/libx.so"); }, "cannot load the library"));
}

kcpp_status noop(kcpp_context*, const kcpp_arg*, int32_t) { return KCPP_OK; }

TEST(Package, TableValidationNamesTheProblem) {
  kcpp_layer layer{sizeof(kcpp_layer), KCPP_MODE_INFERENCE, KCPP_DEVICE_BIT(kDLCPU), 0, "L", "L/1", "", noop, noop, nullptr};
  kcpp_package t{sizeof(kcpp_package), KCPP_ABI_VERSION, "p", "1.0.0", &layer, 1, 0, nullptr};
  EXPECT_EQ(package_table_problem(&t), "");
  auto problem = [&](auto edit) {
    kcpp_layer l = layer;
    kcpp_package p = t;
    p.layers = &l;
    edit(p, l);
    return package_table_problem(&p);
  };
  EXPECT_EQ(problem([](kcpp_package&, kcpp_layer& l) { l.modes = KCPP_MODE_TRAINING; }),
            "layer 'L': claims training but has no backward");
  EXPECT_EQ(problem([](kcpp_package&, kcpp_layer& l) { l.contract = "L"; }),
            "layer 'L': bad layer contract 'L': expected Name/version, e.g. RMSNorm/1");
  EXPECT_EQ(problem([](kcpp_package&, kcpp_layer& l) { l.forward = nullptr; }), "layer 'L': no forward");
  EXPECT_EQ(problem([](kcpp_package&, kcpp_layer& l) { l.devices = 0; }), "layer 'L': runs on no device");
  EXPECT_EQ(problem([](kcpp_package&, kcpp_layer& l) { l.modes = KCPP_MODE_GRAPH; }),
            "layer 'L': fit for neither inference nor training");
  EXPECT_EQ(problem([](kcpp_package& p, kcpp_layer&) { p.name = nullptr; }), "the package has no name");
  EXPECT_EQ(problem([](kcpp_package& p, kcpp_layer&) { p.layers = nullptr; }), "num_layers > 0 but no layer table");
  EXPECT_EQ(problem([](kcpp_package& p, kcpp_layer&) { p.struct_size = 8; }),
            "package table of 8 bytes, ABI 1 needs 48");
  EXPECT_EQ(package_table_problem(nullptr), "kcpp_package_v1() returned NULL");
}

}  // namespace
}  // namespace kcpp::hub
