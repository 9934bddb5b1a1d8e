// The hub: from a reference ("acme/example@>=1.0,<2.0:SiLU") to a verified, loaded package.
//
//   resolve   the revision: a locked commit, else the best tag for a constraint, else the named
//             tag / branch / commit (online: from the hub's refs; offline: from the cache's refs)
//   inspect   + manifest.json (downloaded once into the cache), its lock pin, its trust verdict
//             and the variant chosen for this machine — no library is downloaded; a version tag
//             ("v1.2.0") whose manifest says another version is refused
//   fetch     + the chosen variant's files, each checked against the manifest's sha256 before it
//             enters the cache (lazily: only when a layer first needs them)
//   load      + the policy: the manifest is trusted, or allow_all_kernels and it is unsigned or from
//             an untrusted publisher (a signature that fails to verify never loads); the lock file
//             agrees; every file of the variant hashes as the manifest says, checked on every load;
//             the library's ABI table is valid and names the package and version of the manifest.
//
// Sources: HF_ENDPOINT (default https://huggingface.co) speaks the Hub HTTP API; an endpoint that is
// a folder ("/srv/hub" or "file:///srv/hub") is read directly, in kcpp serve's layout.
// HF_HUB_OFFLINE=1 resolves from the cache alone.  USE_HUB_KERNELS=0|OFF|NO|false makes load()
// refuse every reference (references still parse and inspect still works).
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "hub/cache.h"
#include "hub/http.h"
#include "hub/lockfile.h"
#include "hub/manifest.h"
#include "hub/package.h"
#include "hub/reference.h"
#include "hub/repo_dir.h"
#include "hub/trust.h"
#include "hub/variant.h"

namespace kcpp::hub {

struct HubConfig {
  std::string endpoint = "https://huggingface.co";
  std::filesystem::path cache_dir;
  bool offline = false;
  bool enabled = true;             // USE_HUB_KERNELS
  bool allow_all_kernels = false;  // load unsigned / untrusted packages
  std::optional<std::filesystem::path> lock_file;
  TrustStore trust;
  Machine machine;
  HttpOptions http;

  // HF_ENDPOINT, KCPP_CACHE / HF_HUB_CACHE / HF_HOME, HF_HUB_OFFLINE, USE_HUB_KERNELS,
  // KCPP_ALLOW_ALL_KERNELS, KCPP_LOCK_FILE, the trust store, the real machine, HTTP options.
  static HubConfig from_env();
};

// Thrown by load() when USE_HUB_KERNELS disables kernels, so hosts can keep the reference quietly.
class HubDisabled : public Error {
 public:
  using Error::Error;
};

// Thrown when the hub cannot supply a reference: the endpoint is unreachable (the HTTP client's
// transport failures, timeouts and 5xx after its retries), the repository, the revision or tag, or
// a file is not there, or HF_HUB_OFFLINE is set and the cache lacks it.  Never for a refusal: a
// hash, signature, trust or lock problem stays a plain kcpp::Error.  The default mapping
// (nn/kernel_config.h) falls back to this build's own packages on it.
class HubUnavailable : public Error {
 public:
  explicit HubUnavailable(std::string message, bool unreachable = false)
      : Error(std::move(message)), unreachable_(unreachable) {}
  // The endpoint itself did not answer (not: it answered that something is missing).
  bool unreachable() const { return unreachable_; }

 private:
  bool unreachable_;
};

// Thrown by load() for a package it will not load for lack of trust: unsigned, or signed by a
// publisher the trust store does not list, without allow_all_kernels.  (A signature that does not
// verify is a plain kcpp::Error: that is tampering, not lack of trust.)
class Untrusted : public Error {
 public:
  using Error::Error;
};

struct Resolved {
  std::string repo, revision, commit;  // revision: the tag or branch (or the commit itself)
};

struct PackageInfo {
  Reference ref;
  Resolved resolved;              // empty for local references
  std::filesystem::path folder;   // the package folder: local path, or the cache snapshot
  Manifest manifest;
  std::string manifest_sha256;
  TrustVerdict trust;
  VariantChoice variant;
  std::string origin() const;     // "acme/example@v1.0.0" or the path, for messages
};

struct LoadedKernel {
  std::shared_ptr<LoadedPackage> package;
  const kcpp_layer* layer = nullptr;  // the reference's :Layer, or nullptr when none was named
  PackageInfo info;
  // Set by a loader that loaded another source than the reference names (the default mapping's
  // fallback to this build's packages): what it loaded and why; reports show it.
  std::string substituted;
};

// The Hub API's answers as Hub::refs and Hub::files read them, from the body the server sent:
// GET /api/models/REPO/refs ({"branches": [{"name", "targetCommit"}], "tags": [...]}) and
// GET /api/models/REPO/tree/REV?recursive=true ([{"type": "file", "path", "size", "lfs": {"oid"}}]).
// Every ref's targetCommit must be a commit id (40 lower-case hex digits) and its name a valid tag or
// branch name, every file's path a relative path inside the repository (revision_problem,
// relative_path_problem): they become paths of the cache.  Anything else is a kcpp::Error naming
// `endpoint`, the repo (and revision) and the entry.
std::vector<RepoRef> parse_refs_answer(std::string_view body, const std::string& endpoint, const std::string& repo);
std::vector<RepoFile> parse_tree_answer(std::string_view body, const std::string& endpoint, const std::string& repo,
                                        const std::string& revision);

// Throws "REF: no layer 'L' in NAME VERSION (variant V has: A, B)" when the reference names a layer
// (":L") that `variant` does not list; with no variant, that no variant of the package lists.
void check_layer(const PackageInfo& info, const ManifestVariant* variant = nullptr);

class Hub {
 public:
  explicit Hub(HubConfig config);
  const HubConfig& config() const { return cfg_; }
  const Cache& cache() const { return cache_; }

  // A repo's tags and branches (online), or what the cache knows (offline).
  std::vector<RepoRef> refs(const std::string& repo) const;
  Resolved resolve(const Reference& ref) const;
  // The files of a revision (tag, branch or commit), from the hub's tree API (or the folder).
  std::vector<RepoFile> files(const std::string& repo, const std::string& revision) const;
  PackageInfo inspect(const Reference& ref) const;
  // Downloads what is missing of the chosen variant; returns the folder that holds it.
  std::filesystem::path fetch(const PackageInfo& info) const;
  // Checks every file of the chosen variant against the manifest and the policy; throws on any
  // problem.  Returns the library's bytes (what load() maps).
  std::string verify(const PackageInfo& info) const;
  LoadedKernel load(const Reference& ref);

 private:
  HubConfig cfg_;
  Cache cache_;
  std::optional<HttpClient> http_;
  std::optional<RepoDir> dir_;
  std::optional<LockFile> lock_;
  std::mutex mu_;
  std::map<std::string, std::weak_ptr<LoadedPackage>> loaded_;

  std::string requested(const Reference& ref) const;  // the lock key: text after '@' or ""
  const LockEntry* lock_entry(const Reference& ref) const;
  // Fetches repo@commit:path into the cache (if absent), checking sha256 and size when sha256 is
  // given; without one (manifest.json) the file may have at most kMaxManifestSize bytes.
  std::filesystem::path fetch_file(const std::string& repo, const std::string& commit, const std::string& path,
                                   const std::string& sha256, uint64_t size) const;
  // Copies or downloads the file to `dest`, refusing one of more than `max_bytes`.
  void download(const std::string& repo, const std::string& commit, const std::string& path,
                const std::filesystem::path& dest, uint64_t max_bytes) const;
};

}  // namespace kcpp::hub
