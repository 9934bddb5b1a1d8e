// kcpp.lock (src/hub/lockfile.h), read from a file as `kcpp lock` and every locked load read it.
//
// Properties of a lock file that loads: every entry is found by its (repo, requested) pair, its
// commit is a commit id (40 hex digits: it becomes a folder of the cache, snapshots/COMMIT/) and its
// revision a tag, branch or commit id, and its manifest hash and file hashes are sha256 hex.
#include "fuzz.h"
#include "hub/crypto.h"
#include "hub/lockfile.h"
#include "hub/reference.h"
#include "hub/semver.h"

using namespace kcpp;
using namespace kcpp::hub;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::MemFile file;
  LockFile lf;
  try {
    lf = LockFile::load(file.write(fuzz::text(data, size)));
  } catch (const Error&) {
    return 0;
  }
  for (const LockEntry& e : lf.packages) {
    const LockEntry* found = lf.find(e.repo, e.requested);
    KCPP_FUZZ_EXPECT(found && found->repo == e.repo && found->requested == e.requested, "entry '{}' not found", e.repo);
    KCPP_FUZZ_EXPECT(is_commit_id(e.commit), "'{}': commit '{}' is not a commit id", e.repo, e.commit);
    KCPP_FUZZ_EXPECT(is_commit_id(e.revision) || revision_problem(e.revision).empty(), "'{}': revision '{}': {}", e.repo,
                     e.revision, revision_problem(e.revision));
    KCPP_FUZZ_EXPECT(is_sha256_hex(e.manifest_sha256), "'{}': manifest_sha256 is not a sha256", e.repo);
    for (const auto& [path, sha] : e.files) KCPP_FUZZ_EXPECT(is_sha256_hex(sha), "'{}': file '{}'", e.repo, path);
  }
  return 0;
}
