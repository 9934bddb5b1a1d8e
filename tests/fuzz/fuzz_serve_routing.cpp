// kcpp serve's request routing (src/hub/server.h: route_request), without sockets, over a small
// served folder that this target writes under $TMPDIR once: two revisions of acme/example (a tag and
// a branch), a hidden folder, a file whose name is not UTF-8, and symbolic links out of it (a file, a
// folder, a revision, a repo and an org, each leading to files named kcpp-outside-* beside the
// served folder).
//
// Input: an HTTP request as a client sends it, "METHOD TARGET ..." on the first line (a missing
// method is GET); the rest (headers, body) is ignored, since the router reads none of it (the
// server reads the Authorization header only for its test fault hook).  The text "{commit}" in the
// target becomes acme/example@v1.0.0's commit id.  The target's path (before '?') is routed twice:
// as it is (any bytes: NULs, '\', absolute parts) and percent-decoded by cpp-httplib's own
// decode_url, which is what the server hands the router ("%2e%2e" becomes ".."); the query's
// `recursive`, parsed by cpp-httplib and read by tree_recursive as the server does, sets the listing's.
//
// Properties of every answer: the status is 200, 400, 404 or 405 (405 exactly for a method other
// than GET and HEAD; a 500 is an exception the router did not expect); a JSON body parses, and an
// error's holds {"error": "..."}; a 200 is never the answer to a path with a NUL byte or a "." or
// ".." segment; nothing from outside the served folder is ever answered (no kcpp-outside name or
// content in a 200's body, a served file is a regular file under the folder reached through no
// symbolic link, and the body is its bytes with their sha256 as the ETag).
#include <httplib.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "fuzz.h"
#include "hub/crypto.h"
#include "hub/fs.h"
#include "hub/server.h"

using namespace kcpp;
using namespace kcpp::hub;
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kOutside = "kcpp-outside";

void put(const fs::path& p, std::string_view content) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << content;
}

struct Served {
  fuzz::TempFolder tmp{"serve"};
  fs::path root = tmp.path / "served", outside = tmp.path / "kcpp-outside";
  std::unique_ptr<RepoDir> dir;
  std::string commit;

  Served() {
    const fs::path rev = root / "acme/example/v1.0.0";
    put(rev / "manifest.json", R"({"kcpp_manifest": 1})");
    put(rev / "build/kcpp1-cpu-x86_64-linux/libexample.so", "\x7f" "ELF not really");
    put(rev / "build/kcpp1-cpu-x86_64-linux/name with space.txt", "spaces");
    put(rev / "build/bad\xff\xfe.bin", "a name that is not UTF-8");
    put(rev / "a%2e%2e", "a name with percent signs");
    put(root / "acme/example/main/README.md", "main branch");
    put(root / "acme/example/.hidden/manifest.json", "{}");
    put(root / "acme/other/1.0.0/x.txt", "another repo");
    // Outside the served folder: what no answer may hold.
    const std::string secret = std::string(kOutside) + "-secret";
    put(outside / "kcpp-outside-secret.txt", secret);
    put(outside / "rev/kcpp-outside-file.txt", secret);
    put(outside / "repo/kcpp-outside-v1/kcpp-outside-file.txt", secret);
    put(outside / "org/pkg/kcpp-outside-v1/kcpp-outside-file.txt", secret);
    fs::create_symlink(outside / "kcpp-outside-secret.txt", rev / "build/link-out.txt");
    fs::create_symlink(outside, rev / "build/dir-out");
    fs::create_symlink(outside / "rev", root / "acme/example/linked-rev");
    fs::create_symlink(outside / "repo", root / "acme/linked-repo");
    fs::create_symlink(outside / "org", root / "evil");
    dir = std::make_unique<RepoDir>(root);
    commit = dir->commit_of("acme/example", "v1.0.0");
  }
};

Served& served() {
  static Served s;
  return s;
}

bool has_segment(std::string_view path, std::string_view seg) {
  size_t start = 0;
  while (start <= path.size()) {
    const size_t at = path.find('/', start);
    if (path.substr(start, at == std::string_view::npos ? std::string_view::npos : at - start) == seg) return true;
    if (at == std::string_view::npos) break;
    start = at + 1;
  }
  return false;
}

void check(const Served& s, std::string_view method, const std::string& path, bool recursive) {
  const ServeAnswer a = route_request(*s.dir, ServeRequest{method, path, recursive});
  const bool readable = method == "GET" || method == "HEAD";
  KCPP_FUZZ_EXPECT(a.status == 200 || a.status == 400 || a.status == 404 || a.status == 405,
                   "{} '{}': status {} ({})", method, path, a.status, a.body.substr(0, 300));
  KCPP_FUZZ_EXPECT((a.status == 405) == !readable, "{} '{}': status {}", method, path, a.status);
  if (a.content_type == "application/json") {
    const auto j = nlohmann::json::parse(a.body, nullptr, false);
    KCPP_FUZZ_EXPECT(!j.is_discarded(), "{} '{}': the body is not JSON: {}", method, path, a.body.substr(0, 300));
    if (a.status != 200)
      KCPP_FUZZ_EXPECT(j.is_object() && j.contains("error") && j["error"].is_string(), "{} '{}': error body {}", method,
                       path, a.body.substr(0, 300));
  }
  if (a.status != 200) return;  // (an error may echo the request, kcpp-outside included)
  KCPP_FUZZ_EXPECT(a.body.find(kOutside) == std::string::npos, "{} '{}' answers from outside the served folder: {}",
                   method, path, a.body.substr(0, 300));
  KCPP_FUZZ_EXPECT(path.find('\0') == std::string::npos, "'{}' (with a NUL byte) is answered 200", path);
  KCPP_FUZZ_EXPECT(!has_segment(path, "..") && !has_segment(path, "."), "'{}' (with a '.' or '..' segment) is answered 200",
                   path);
  if (a.file.empty()) return;
  // A served file: under the folder, through no symbolic link, and the body is its bytes.
  const fs::path rel = a.file.lexically_relative(s.root);
  KCPP_FUZZ_EXPECT(!rel.empty() && *rel.begin() != "..", "'{}' serves {}, outside {}", path, a.file.string(),
                   s.root.string());
  fs::path at = s.root;
  for (const fs::path& part : rel) {
    at /= part;
    KCPP_FUZZ_EXPECT(!fs::is_symlink(at), "'{}' serves {} through the symbolic link {}", path, a.file.string(), at.string());
  }
  KCPP_FUZZ_EXPECT(fs::is_regular_file(a.file), "'{}' serves {}, not a regular file", path, a.file.string());
  KCPP_FUZZ_EXPECT(a.body == read_file(a.file), "'{}': the body is not the bytes of {}", path, a.file.string());
  bool etag = false;
  for (const auto& [name, value] : a.headers)
    if (name == "ETag") etag = value == "\"" + sha256_hex(a.body) + "\"";
  KCPP_FUZZ_EXPECT(etag, "'{}': no ETag with the body's sha256", path);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Served& s = served();
  std::string_view line = fuzz::text(data, size);
  line = line.substr(0, line.find('\n'));
  if (line.ends_with('\r')) line.remove_suffix(1);
  // "METHOD TARGET [VERSION]", or a target alone (GET).
  std::string_view method = "GET", target = line;
  if (const size_t sp = line.find(' '); sp != std::string_view::npos) {
    method = line.substr(0, sp);
    target = line.substr(sp + 1);
    target = target.substr(0, target.find(' '));
  }
  const size_t q = target.find('?');
  std::string path(target.substr(0, q));
  httplib::Params params;
  if (q != std::string_view::npos) httplib::detail::parse_query_text(std::string(target.substr(q + 1)), params);
  const auto it = params.find("recursive");
  const bool recursive = hub::tree_recursive(it == params.end() ? "" : it->second);
  for (size_t at = path.find("{commit}"); at != std::string::npos; at = path.find("{commit}", at))
    path.replace(at, 8, s.commit);
  check(s, method, path, recursive);
  check(s, method, httplib::detail::decode_url(path, false), recursive);
  return 0;
}
