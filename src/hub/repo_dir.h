// A directory of package repos, as `kcpp serve DIR` publishes it and as a plain-directory hub reads it:
//
//   DIR/<org>/<repo>/<revision>/manifest.json
//   DIR/<org>/<repo>/<revision>/build/<variant>/...
//
// Each revision folder is one tag or branch: a name that parses as a version ("v1.2.0", "1.2.0")
// is a tag, anything else ("main") a branch.  A revision's commit id is 40 hex digits derived from
// its content (sha256 over the sorted list of (path, sha256 of the file), truncated), so it changes
// exactly when a file does, and a client can pin it like a git commit.  Symbolic links (an org, a
// repo or a revision folder, or anything under one) and names that are not safe relative paths are
// never served; a revision name is one name, not hidden, without control bytes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace kcpp::hub {

struct RepoRef {
  std::string name;    // "v1.2.0", "main"
  std::string commit;  // 40 hex digits
  bool is_tag = false;
};

struct RepoFile {
  std::string path;  // relative, '/'-separated
  uint64_t size = 0;
  std::string sha256;
};

class RepoDir {
 public:
  explicit RepoDir(std::filesystem::path root);
  const std::filesystem::path& root() const { return root_; }

  // Throws kcpp::Error for an invalid repo id; an unknown repo gives an empty list.
  std::vector<RepoRef> refs(const std::string& repo) const;
  // `revision`: a ref name or a commit id.  nullopt when the repo or revision does not exist.
  std::optional<std::string> revision_folder(const std::string& repo, const std::string& revision) const;
  std::vector<RepoFile> files(const std::string& repo, const std::string& folder) const;
  // The file to serve, or nullopt when absent or unsafe.
  std::optional<std::filesystem::path> file(const std::string& repo, const std::string& folder,
                                            const std::string& path) const;
  std::string commit_of(const std::string& repo, const std::string& folder) const;
  static std::string commit_of(const std::vector<RepoFile>& files);  // from files() of one revision

 private:
  std::filesystem::path root_;
  struct Memo {
    uint64_t size;
    int64_t mtime;
    std::string sha256;
  };
  mutable std::mutex mu_;
  mutable std::map<std::string, Memo> hashes_;  // by absolute path
  std::string hash_memo(const std::filesystem::path& p, uint64_t size, int64_t mtime) const;
  // ROOT/org/repo when both are folders and neither a symbolic link; throws for an invalid repo id.
  std::optional<std::filesystem::path> repo_folder(const std::string& repo) const;
};

}  // namespace kcpp::hub
