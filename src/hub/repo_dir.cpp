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

std::vector<RepoFile> RepoDir::files(const std::string& repo, const std::string& folder) const {
  const fs::path base = root_ / repo / folder;
  std::vector<RepoFile> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(base, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it->is_symlink() || !it->is_regular_file()) continue;
    const std::string rel = fs::relative(it->path(), base).generic_string();
    if (!relative_path_problem(rel).empty()) continue;
    const uint64_t size = it->file_size();
    const int64_t mtime = it->last_write_time().time_since_epoch().count();
    out.push_back({rel, size, hash_memo(it->path(), size, mtime)});
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
  validate_repo_id(repo);
  std::vector<RepoRef> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root_ / repo, ec)) {
    if (e.is_symlink() || !e.is_directory()) continue;
    const std::string name = e.path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    out.push_back({name, commit_of(repo, name), Version::try_parse(name).has_value()});
  }
  std::sort(out.begin(), out.end(), [](const RepoRef& a, const RepoRef& b) { return a.name < b.name; });
  return out;
}

std::optional<std::string> RepoDir::revision_folder(const std::string& repo, const std::string& revision) const {
  validate_repo_id(repo);
  if (revision.empty() || revision.find('/') != std::string::npos || revision[0] == '.') return std::nullopt;
  std::error_code ec;
  if (fs::is_directory(root_ / repo / revision, ec) && !fs::is_symlink(root_ / repo / revision, ec)) return revision;
  if (revision.size() == 40)
    for (const RepoRef& r : refs(repo))
      if (r.commit == revision) return r.name;
  return std::nullopt;
}

std::optional<fs::path> RepoDir::file(const std::string& repo, const std::string& folder, const std::string& path) const {
  if (!relative_path_problem(path).empty()) return std::nullopt;
  const fs::path base = root_ / repo / folder;
  fs::path p = base;
  // No component may be a symbolic link (a link could point outside the served folder).
  std::error_code ec;
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
