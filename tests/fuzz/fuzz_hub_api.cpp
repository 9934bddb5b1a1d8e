// The Hub API's answers as the client reads them off the network (src/hub/hub.h: parse_refs_answer
// for GET /api/models/REPO/refs, parse_tree_answer for GET /api/models/REPO/tree/REV, what
// Hub::refs and Hub::files hand them).  Each input is given to both, as a server's answer body.
//
// Properties of an answer that reads: every commit id is 40 hex digits and every ref name a valid
// tag or branch name (both become names in the cache: refs/NAME, snapshots/COMMIT/), every file
// path a relative path inside the repository; the answer kcpp serve would write for what was read
// reads back the same.
#include <nlohmann/json.hpp>

#include "fuzz.h"
#include "hub/fs.h"
#include "hub/hub.h"
#include "hub/semver.h"

using namespace kcpp;
using namespace kcpp::hub;

namespace {

void refs(std::string_view body) {
  std::vector<RepoRef> got;
  try {
    got = parse_refs_answer(body, "http://fuzz", "acme/example");
  } catch (const Error&) {
    return;
  }
  nlohmann::json again = {{"branches", nlohmann::json::array()}, {"tags", nlohmann::json::array()}};
  for (const RepoRef& r : got) {
    KCPP_FUZZ_EXPECT(is_commit_id(r.commit), "ref '{}': targetCommit '{}' is not a commit id", r.name, r.commit);
    KCPP_FUZZ_EXPECT(!r.name.empty() && revision_problem(r.name).empty(), "ref name '{}': {}", r.name,
                     revision_problem(r.name));
    again[r.is_tag ? "tags" : "branches"].push_back(
        {{"name", r.name}, {"ref", (r.is_tag ? "refs/tags/" : "refs/heads/") + r.name}, {"targetCommit", r.commit}});
  }
  const std::vector<RepoRef> back = parse_refs_answer(again.dump(), "http://fuzz", "acme/example");
  KCPP_FUZZ_EXPECT(back.size() == got.size(), "{} refs read back as {}", got.size(), back.size());
  for (size_t i = 0; i < got.size(); ++i)  // branches first, then tags: the order parse_refs_answer reads
    KCPP_FUZZ_EXPECT(back[i].name == got[i].name && back[i].commit == got[i].commit && back[i].is_tag == got[i].is_tag,
                     "ref {} '{}' reads back as '{}'", i, got[i].name, back[i].name);
}

void tree(std::string_view body) {
  std::vector<RepoFile> got;
  try {
    got = parse_tree_answer(body, "http://fuzz", "acme/example", "main");
  } catch (const Error&) {
    return;
  }
  nlohmann::json again = nlohmann::json::array();
  for (const RepoFile& f : got) {
    KCPP_FUZZ_EXPECT(relative_path_problem(f.path).empty(), "file '{}': {}", f.path, relative_path_problem(f.path));
    nlohmann::json e = {{"type", "file"}, {"path", f.path}, {"size", f.size}};
    if (!f.sha256.empty()) e["lfs"] = {{"oid", f.sha256}, {"size", f.size}};
    again.push_back(std::move(e));
  }
  const std::vector<RepoFile> back = parse_tree_answer(again.dump(), "http://fuzz", "acme/example", "main");
  KCPP_FUZZ_EXPECT(back.size() == got.size(), "{} files read back as {}", got.size(), back.size());
  for (size_t i = 0; i < got.size(); ++i)
    KCPP_FUZZ_EXPECT(back[i].path == got[i].path && back[i].size == got[i].size && back[i].sha256 == got[i].sha256,
                     "file '{}' reads back differently", got[i].path);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body = fuzz::text(data, size);
  refs(body);
  tree(body);
  return 0;
}
