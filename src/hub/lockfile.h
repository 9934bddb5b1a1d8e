// kcpp.lock: the packages a project uses, pinned.  `kcpp lock` writes it from the references in a
// project file; every load through a Hub that has a lock file checks against it.
//
//   {"kcpp_lock": 1, "packages": [
//     {"repo": "acme/example", "requested": ">=1.0,<2.0",      // what the reference asked for
//      "revision": "v1.2.0", "commit": "<40 hex>",             // what it resolved to
//      "manifest_sha256": "<64 hex>",                          // pins every file's hash in turn
//      "publisher": "acme",                                    // who signed it ("" if unsigned)
//      "files": {"build/kcpp1-cpu-x86_64-linux/libexample.so": "<64 hex>", ...}}]}
//
// A locked load uses the pinned commit and refuses it when the hub's revision now points at a
// different commit, when the manifest's hash differs, or when a file's hash differs.  Reading one, a
// commit that is not 40 lower-case hex digits (it names a folder of the cache) or a revision that is
// neither a tag or branch name nor a commit is an error.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace kcpp::hub {

struct LockEntry {
  std::string repo, requested, revision, commit, manifest_sha256, publisher;
  std::map<std::string, std::string> files;  // path -> sha256, every variant
};

struct LockFile {
  std::vector<LockEntry> packages;

  static LockFile load(const std::filesystem::path& path);  // throws naming the file and field
  void save(const std::filesystem::path& path) const;
  const LockEntry* find(const std::string& repo, const std::string& requested) const;
  void upsert(LockEntry e);
};

}  // namespace kcpp::hub
