#include "hub/repo_dir.h"

#include <algorithm>

#include "core/error.h"
#include "hub/crypto.h"
#include "hub/fs.h"
#include "hub/reference.h"
#include "hub/semver.h"

namespace kcpp::hub {
namespace fs = std::filesystem;

RepoDir::RepoDir(fs::path root) : root_(std::move(root)) {}

std::string RepoDir::hash_memo(const fs::path& p, uint64_t size, int64_t mtime) const {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = hashes_.find(p.string());
    if (it != hashes_.end() && it->second.size == size && it->second.mtime == mtime) return it->second.sha256;
  }
  std::string h = sha256_file(p);
  std::lock_guard<std::mutex> g(mu_);
  hashes_[p.string()] = {size, mtime, h};
  return h;
}

std::optional<fs::path> RepoDir::repo_folder(const std::string& repo) const {
  validate_repo_id(repo);
  const size_t slash = repo.find('/');
  const fs::path org = root_ / repo.substr(0, slash), folder = org / repo.substr(slash + 1);
  std::error_code ec;
  for (const fs::path& p : {org, folder})
    if (fs::is_symlink(p, ec) || !fs::is_directory(p, ec)) return std::nullopt;
  return folder;
}

namespace {

// A revision folder's name as a request may give it: one name, not hidden, no NUL or other control
// byte (the file system would read a name only up to a NUL: "v1.0.0\0x" would be v1.0.0).
bool is_revision_name(std::string_view name) {
  if (name.empty() || name[0] == '.' || name.size() > 255) return false;
  return std::none_of(name.begin(), name.end(), [](char c) {
    return c == '/' || c == '\\' || static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
  });
}

}  // namespace

std::vector<RepoFile> RepoDir::files(const std::string& repo, const std::string& folder) const {
  std::vector<RepoFile> out;
  const auto repo_path = repo_folder(repo);
  if (!repo_path || !is_revision_name(folder)) return out;
  const fs::path base = *repo_path / folder;
  std::error_code ec;
  if (fs::is_symlink(base, ec)) return out;
  for (auto it = fs::recursive_directory_iterator(base, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    // A file that changes or goes while it is listed is left out (no exception from a race).
    std::error_code fe;
    if (it->is_symlink(fe) || !it->is_regular_file(fe) || fe) continue;
    const std::string rel = it->path().lexically_relative(base).generic_string();
    if (!relative_path_problem(rel).empty()) continue;
    const uint64_t size = it->file_size(fe);
    const auto mtime = it->last_write_time(fe);
    if (fe) continue;
    out.push_back({rel, size, hash_memo(it->path(), size, mtime.time_since_epoch().count())});
  }
  std::sort(out.begin(), out.end(), [](const RepoFile& a, const RepoFile& b) { return a.path < b.path; });
  return out;
}

std::string RepoDir::commit_of(const std::vector<RepoFile>& files) {
  std::string listing;
  for (const RepoFile& f : files) listing += f.path + '\0' + f.sha256 + '\n';
  return sha256_hex(listing).substr(0, 40);
}

std::string RepoDir::commit_of(const std::string& repo, const std::string& folder) const {
  return commit_of(files(repo, folder));
}

std::vector<RepoRef> RepoDir::refs(const std::string& repo) const {
  std::vector<RepoRef> out;
  const auto repo_path = repo_folder(repo);
  if (!repo_path) return out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(*repo_path, ec)) {
    std::error_code ec2;
    if (e.is_symlink(ec2) || !e.is_directory(ec2)) continue;
    const std::string name = e.path().filename().string();
    if (!is_revision_name(name)) continue;
    out.push_back({name, commit_of(repo, name), Version::try_parse(name).has_value()});
  }
  std::sort(out.begin(), out.end(), [](const RepoRef& a, const RepoRef& b) { return a.name < b.name; });
  return out;
}

std::optional<std::string> RepoDir::revision_folder(const std::string& repo, const std::string& revision) const {
  const auto repo_path = repo_folder(repo);
  if (!repo_path || !is_revision_name(revision)) return std::nullopt;
  std::error_code ec;
  if (fs::is_directory(*repo_path / revision, ec) && !fs::is_symlink(*repo_path / revision, ec)) return revision;
  if (revision.size() == 40)
    for (const RepoRef& r : refs(repo))
      if (r.commit == revision) return r.name;
  return std::nullopt;
}

std::optional<fs::path> RepoDir::file(const std::string& repo, const std::string& folder, const std::string& path) const {
  if (!relative_path_problem(path).empty()) return std::nullopt;
  const auto repo_path = repo_folder(repo);
  if (!repo_path || !is_revision_name(folder)) return std::nullopt;
  fs::path p = *repo_path / folder;
  // No component may be a symbolic link (a link could point outside the served folder).
  std::error_code ec;
  if (fs::is_symlink(p, ec)) return std::nullopt;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t at = path.find('/', start);
    p /= path.substr(start, at == std::string::npos ? std::string::npos : at - start);
    if (fs::is_symlink(p, ec)) return std::nullopt;
    if (at == std::string::npos) break;
    start = at + 1;
  }
  if (!fs::is_regular_file(p, ec)) return std::nullopt;
  return p;
}

}  // namespace kcpp::hub
