#include "hub/cache.h"

#include <unistd.h>

#include <random>

#include "core/error.h"
#include "hub/crypto.h"
#include "hub/fs.h"
#include "hub/semver.h"

namespace kcpp::hub {
namespace fs = std::filesystem;

namespace {

// A key names files of the cache: a sha256 and nothing else.
void check_key(const std::string& repo, const std::string& key) {
  if (const std::string p = sha256_problem(key); !p.empty()) KCPP_FAIL("cache: {}: the file key {}", repo, p);
}

}  // namespace

Cache::Cache(fs::path root) : root_(std::move(root)) {}

fs::path Cache::default_root() {
  if (const char* p = std::getenv("KCPP_CACHE"); p && *p) return p;
  if (const char* p = std::getenv("HF_HUB_CACHE"); p && *p) return p;
  if (const char* p = std::getenv("HF_HOME"); p && *p) return fs::path(p) / "hub";
  if (const char* p = std::getenv("XDG_CACHE_HOME"); p && *p) return fs::path(p) / "huggingface" / "hub";
  const char* home = std::getenv("HOME");
  return fs::path(home && *home ? home : "/tmp") / ".cache" / "huggingface" / "hub";
}

fs::path Cache::repo_dir(const std::string& repo) const {
  std::string folder = "models--" + repo;
  for (size_t at = folder.find('/'); at != std::string::npos; at = folder.find('/', at)) folder.replace(at, 1, "--");
  return root_ / folder;
}

std::optional<std::string> Cache::ref(const std::string& repo, const std::string& name) const {
  const fs::path p = repo_dir(repo) / "refs" / name;
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return std::nullopt;
  std::string c = read_file(p);
  while (!c.empty() && (c.back() == '\n' || c.back() == ' ')) c.pop_back();
  // The commit names a snapshot folder: anything else in the file (damaged, or written by hand) must
  // not become a path.
  KCPP_CHECK(is_commit_id(c), "{}: the cache's ref '{}' of {} holds '{}', not a commit id (40 hex digits); delete the file and "
             "fetch the repository again", p.string(), name, repo, c.substr(0, 64));
  return c;
}

void Cache::set_ref(const std::string& repo, const std::string& name, const std::string& commit) const {
  KCPP_CHECK(is_commit_id(commit), "cache: {}@{}: the commit {} is not a commit id (40 lower-case hex digits); not "
             "recorded", repo, name, shown(commit));
  KCPP_CHECK(relative_path_problem(name).empty(), "cache: {}: the ref {} cannot name a file under refs/: {}; not "
             "recorded", repo, shown(name), relative_path_problem(name));
  write_file_atomic(repo_dir(repo) / "refs" / name, commit);
}

std::vector<std::pair<std::string, std::string>> Cache::refs(const std::string& repo) const {
  std::vector<std::pair<std::string, std::string>> out;
  const fs::path dir = repo_dir(repo) / "refs";
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (!it->is_regular_file()) continue;
    const std::string name = fs::relative(it->path(), dir).generic_string();
    if (name.find(".tmp.") != std::string::npos) continue;
    if (auto c = ref(repo, name)) out.emplace_back(name, *c);
  }
  return out;
}

fs::path Cache::snapshot_dir(const std::string& repo, const std::string& commit) const {
  KCPP_CHECK(is_commit_id(commit), "cache: {}: the commit {} is not a commit id (40 lower-case hex digits)", repo,
             shown(commit));
  return repo_dir(repo) / "snapshots" / commit;
}

std::optional<fs::path> Cache::file(const std::string& repo, const std::string& commit, const std::string& path) const {
  const fs::path p = snapshot_dir(repo, commit) / path;
  std::error_code ec;
  if (!fs::exists(p, ec)) return std::nullopt;  // follows the link: a dangling one is absent
  return p;
}

std::optional<std::string> Cache::blob_sha256(const std::string& repo, const std::string& commit,
                                              const std::string& path) const {
  std::error_code ec;
  const fs::path link = snapshot_dir(repo, commit) / path;
  const fs::path target = fs::read_symlink(link, ec);
  if (ec) return std::nullopt;
  // A link that leaves blobs/ names no blob of this cache: the whole target is returned, which is
  // no sha256 and so matches no content.
  if ((link.parent_path() / target).lexically_normal().parent_path() != (repo_dir(repo) / "blobs").lexically_normal())
    return target.string();
  return target.filename().string();
}


fs::path Cache::lock_path(const std::string& repo, const std::string& key) const {
  check_key(repo, key);
  return root_ / ".locks" / repo_dir(repo).filename() / (key + ".lock");
}

fs::path Cache::temp_path(const std::string& repo, const std::string& key) const {
  check_key(repo, key);
  std::random_device rd;
  return repo_dir(repo) / "blobs" / (key + ".incomplete." + std::to_string(::getpid()) + "." + std::to_string(rd()));
}

size_t Cache::remove_stale_partials(const std::string& repo) const {
  static constexpr std::string_view kMark = ".incomplete.";
  size_t removed = 0;
  std::error_code ec;
  for (auto it = fs::directory_iterator(repo_dir(repo) / "blobs", ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const size_t at = name.find(kMark);
    if (at == std::string::npos) continue;
    const std::string key = name.substr(0, at);
    if (!is_sha256_hex(key)) continue;  // not a name temp_path() makes
    // Held: a live download owns it (or a file of the same key is being fetched); it is left alone.
    const auto lock = FileLock::try_lock(lock_path(repo, key));
    if (!lock) continue;
    std::error_code rm;
    if (fs::remove(it->path(), rm)) ++removed;
  }
  return removed;
}

fs::path Cache::commit_file(const std::string& repo, const std::string& commit, const std::string& path,
                            const std::string& sha256, const fs::path& tmp) const {
  check_key(repo, sha256);
  const fs::path snapshot = snapshot_dir(repo, commit);
  if (const std::string p = relative_path_problem(path); !p.empty())
    KCPP_FAIL("cache: {}@{}: {} is not a path inside the repository: {}; not stored", repo, commit.substr(0, 12),
              shown(path), p);
  const fs::path blob = repo_dir(repo) / "blobs" / sha256;
  std::error_code ec;
  fs::create_directories(blob.parent_path(), ec);
  fs::rename(tmp, blob, ec);
  if (ec) KCPP_FAIL("cache: cannot move {} to {}: {}", tmp.string(), blob.string(), ec.message());
  const fs::path link = snapshot / path;
  fs::create_directories(link.parent_path(), ec);
  const fs::path target = fs::relative(blob, link.parent_path());
  const fs::path tmp_link = link.string() + ".tmp." + std::to_string(::getpid());
  fs::remove(tmp_link, ec);
  fs::create_symlink(target, tmp_link, ec);
  if (ec) KCPP_FAIL("cache: cannot link {}: {}", link.string(), ec.message());
  fs::rename(tmp_link, link, ec);
  if (ec) KCPP_FAIL("cache: cannot link {}: {}", link.string(), ec.message());
  return link;
}

}  // namespace kcpp::hub
