#include "hub/lockfile.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "hub/crypto.h"
#include "hub/fs.h"
#include "hub/reference.h"
#include "hub/semver.h"

namespace kcpp::hub {

LockFile LockFile::load(const std::filesystem::path& path) {
  auto j = nlohmann::json::parse(read_file(path), nullptr, false);
  auto bad = [&](const std::string& why) { KCPP_FAIL("{}: {}", path.string(), why); };
  if (j.is_discarded() || !j.is_object()) bad("not a JSON object");
  if (!j.contains("kcpp_lock") || j["kcpp_lock"] != 1) bad("not a kcpp lock file of format 1 ('kcpp_lock': 1)");
  if (!j.contains("packages") || !j["packages"].is_array()) bad("no 'packages' list");
  LockFile lf;
  for (size_t i = 0; i < j["packages"].size(); ++i) {
    const auto& p = j["packages"][i];
    std::string where = fmt::format("packages[{}]", i);
    LockEntry e;
    for (auto [key, dst] : {std::pair{"repo", &e.repo}, {"requested", &e.requested}, {"revision", &e.revision},
                            {"commit", &e.commit}, {"manifest_sha256", &e.manifest_sha256}, {"publisher", &e.publisher}}) {
      if (!p.contains(key) || !p[key].is_string()) bad(fmt::format("{}: missing string '{}'", where, key));
      *dst = p[key].get<std::string>();
    }
    where += " (" + e.repo + ")";
    // The commit becomes a folder of the cache (snapshots/COMMIT/): a commit id and nothing else.
    if (!is_commit_id(e.commit))
      bad(fmt::format("{}: commit '{}' is not a commit id (40 lower-case hex digits); run `kcpp lock` again", where, e.commit));
    if (!is_commit_id(e.revision))
      if (const std::string why = e.revision.empty() ? "empty" : revision_problem(e.revision); !why.empty())
        bad(fmt::format("{}: revision: {}; run `kcpp lock` again", where, why));
    if (const std::string why = sha256_problem(e.manifest_sha256); !why.empty())
      bad(fmt::format("{}: manifest_sha256 {}; run `kcpp lock` again", where, why));
    if (p.contains("files")) {
      if (!p["files"].is_object()) bad(where + ": 'files' must be an object");
      for (const auto& [f, h] : p["files"].items()) {
        if (const std::string why = relative_path_problem(f); !why.empty())
          bad(fmt::format("{}: files[{}]: not a path inside the repository: {}", where, shown(f), why));
        if (!h.is_string()) bad(fmt::format("{}: files[{}]: not a sha256 but {}", where, f, h.type_name()));
        if (const std::string why = sha256_problem(h.get<std::string>()); !why.empty())
          bad(fmt::format("{}: files[{}]: {}; run `kcpp lock` again", where, f, why));
        e.files[f] = h.get<std::string>();
      }
    }
    lf.packages.push_back(std::move(e));
  }
  return lf;
}

void LockFile::save(const std::filesystem::path& path) const {
  nlohmann::json j = {{"kcpp_lock", 1}, {"packages", nlohmann::json::array()}};
  for (const LockEntry& e : packages)
    j["packages"].push_back({{"repo", e.repo}, {"requested", e.requested}, {"revision", e.revision},
                             {"commit", e.commit}, {"manifest_sha256", e.manifest_sha256},
                             {"publisher", e.publisher}, {"files", e.files}});
  write_file_atomic(path, j.dump(2) + "\n");
}

const LockEntry* LockFile::find(const std::string& repo, const std::string& requested) const {
  for (const LockEntry& e : packages)
    if (e.repo == repo && e.requested == requested) return &e;
  return nullptr;
}

void LockFile::upsert(LockEntry e) {
  for (LockEntry& x : packages)
    if (x.repo == e.repo && x.requested == e.requested) {
      x = std::move(e);
      return;
    }
  packages.push_back(std::move(e));
}

}  // namespace kcpp::hub
