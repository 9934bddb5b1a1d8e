// The local cache, in the Hugging Face hub layout (so `huggingface-cli scan-cache` and friends
// understand it):
//
//   ROOT/models--<org>--<repo>/refs/<revision>            the commit id a tag or branch resolved to
//   ROOT/models--<org>--<repo>/blobs/<sha256>             file contents, named by their hash
//   ROOT/models--<org>--<repo>/snapshots/<commit>/<path>  symbolic link to ../../blobs/<sha256>
//   ROOT/.locks/models--<org>--<repo>/<key>.lock          one lock per file being downloaded
//
// ROOT is KCPP_CACHE, else HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub,
// else ~/.cache/huggingface/hub.  A file enters the cache only complete and with the expected hash:
// it is downloaded to a temporary file in blobs/ (KEY.incomplete.PID.RANDOM, KEY the expected sha256),
// checked, renamed to its hash, then linked (the link is made under a temporary name and renamed into
// place).  A sha256 or commit id that names a file or folder here is checked to be one first (a
// kcpp::Error otherwise).  Concurrent processes serialize on the file's lock and the second finds the file there.
// A download killed outright (kill -9, power loss) leaves its temporary file behind; such files are
// removed, not resumed: before downloading, remove_stale_partials() deletes every partial file of the
// repo whose key's lock is free (a live download holds its lock from before it creates its partial
// file until after it renamed or removed it, so only a dead process's leftovers go).
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kcpp::hub {

class Cache {
 public:
  explicit Cache(std::filesystem::path root);
  static std::filesystem::path default_root();
  const std::filesystem::path& root() const { return root_; }

  std::filesystem::path repo_dir(const std::string& repo) const;
  std::optional<std::string> ref(const std::string& repo, const std::string& name) const;
  void set_ref(const std::string& repo, const std::string& name, const std::string& commit) const;
  std::vector<std::pair<std::string, std::string>> refs(const std::string& repo) const;  // (name, commit)

  std::filesystem::path snapshot_dir(const std::string& repo, const std::string& commit) const;
  // The cached file's path in the snapshot, when present and pointing at an existing blob.
  std::optional<std::filesystem::path> file(const std::string& repo, const std::string& commit,
                                            const std::string& path) const;
  // The name of the blob that the snapshot path links to: the sha256 the blob claims to hold (the
  // link's whole target when it points anywhere but blobs/); nullopt when the path is no symbolic
  // link (absent, or a copy).
  std::optional<std::string> blob_sha256(const std::string& repo, const std::string& commit,
                                         const std::string& path) const;
  // Moves the complete, checked `tmp` into blobs/<sha256> and links the snapshot path to it.
  std::filesystem::path commit_file(const std::string& repo, const std::string& commit, const std::string& path,
                                    const std::string& sha256, const std::filesystem::path& tmp) const;
  // The lock and a fresh partial download's name of the file with the key `key` (its sha256).
  std::filesystem::path lock_path(const std::string& repo, const std::string& key) const;
  std::filesystem::path temp_path(const std::string& repo, const std::string& key) const;
  // Deletes the repo's partial downloads that no live download owns (see above); returns how many.
  size_t remove_stale_partials(const std::string& repo) const;

 private:
  std::filesystem::path root_;
};

}  // namespace kcpp::hub
