// `kcpp serve`: a directory of package repos (repo_dir.h) over the Hugging Face Hub HTTP API subset
// that the hub client speaks, so an organisation can run a private hub and every hub test talks to
// a real server on loopback.
//
//   GET /api/models/<org>/<repo>/refs                    {"branches": [...], "tags": [...], "converts": []}
//                                                        each {"name", "ref": "refs/tags/NAME", "targetCommit"}
//   GET /api/models/<org>/<repo>/revision/<rev>          {"id", "sha", "siblings": [{"rfilename"}]}
//   GET /api/models/<org>/<repo>/tree/<rev>[/<path>]     [{"type": "file", "path", "size", "oid",
//                                                          "lfs": {"oid": SHA256, "size", "pointerSize"}}]: every file
//                                                        below; with ?recursive=false the path's own
//                                                        files and {"type": "directory", "path", "oid"}
//                                                        for each folder in it
//   GET /<org>/<repo>/resolve/<rev>/<path>               the file; headers X-Repo-Commit, ETag (sha256)
//
// The Hub's kernel repositories (huggingface_hub's repo_type "kernel", which the Hugging Face `kernels`
// library reads) have the same routes under /api/kernels/ and /kernels/<org>/<repo>/resolve/: the
// folder's repos are served as both kinds, so `kernels.get_kernel("<org>/<repo>", ...)` with HF_ENDPOINT
// set to the server loads a package's noarch variant.  (The Hub lists a tree non-recursively unless
// asked; kcpp's client asks, and an absent parameter lists every file as it always has here.)
//
// HEAD is answered as GET (without the body).  Errors are JSON {"error": "..."} with 404 (no such
// route, or an unknown repo, revision or file), 400 (a bad id or path) or 405 (a method other than
// GET and HEAD).  The server never follows symbolic links and never serves a path with '..'.
//
// What a request gets is decided by route_request(), a function of the folder and the request alone
// (no socket, no HTTP library): the Server hands it each request that cpp-httplib parsed (the path
// percent-decoded, the query string apart), and tests/fuzz/fuzz_serve_routing.cpp hands it arbitrary
// ones.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hub/repo_dir.h"

namespace kcpp::hub {

// A request as the router sees it.  The routes read no header, and of the query string only a tree
// listing's `recursive`.
struct ServeRequest {
  std::string_view method;  // "GET", "HEAD", "POST", ...
  std::string_view path;    // percent-decoded, without the query: "/api/models/acme/example/refs"
  bool recursive = true;    // a tree listing's: tree_recursive(the query's `recursive`)
};

// Whether a tree listing's query parameter `recursive` (its decoded value, "" when absent) asks for
// every file below the path: anything but "false" and "0" (in any case: Python's requests writes False).
bool tree_recursive(std::string_view value);

// What the server answers: a status, and a JSON body or the bytes of a served file.
struct ServeAnswer {
  int status = 200;                                          // 200, 400, 404, 405 (500: a bug)
  std::string content_type = "application/json";           // or application/octet-stream for a file
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // ETag, X-Repo-Commit; Allow with 405
  std::filesystem::path file;                                // resolve: the file whose bytes `body` holds
};

// Routes one request over `dir` (see above).  Never throws: a kcpp::Error of the folder (a bad repo
// id) is a 400, any other exception a 500.
ServeAnswer route_request(const RepoDir& dir, const ServeRequest& request);

// Fault injection for tests: consulted on every request.
struct RequestView {
  std::string_view path;
  std::string_view authorization;  // the Authorization header, "" if none
};
struct Fault {
  enum class Kind { None, Status, Delay, DropMidBody, Body };
  Kind kind = Kind::None;
  int status = 0;    // Kind::Status
  int delay_ms = 0;  // Kind::Delay: sleep before answering
  std::string body;  // Kind::Body: answered with status 200 and this JSON body instead
};
using FaultHook = std::function<Fault(const RequestView& request)>;

class Server {
 public:
  explicit Server(std::filesystem::path root, FaultHook faults = {}, bool log = false);
  ~Server();  // stops and joins
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds (port 0: any free port) and serves on a background thread; returns the port.
  int start(const std::string& host = "127.0.0.1", int port = 0);
  // Binds and serves on this thread until stop() (kcpp serve).  `on_ready` gets the bound port.
  void run(const std::string& host, int port, const std::function<void(int)>& on_ready = {});
  void stop();
  std::string url() const;  // "http://127.0.0.1:PORT"

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kcpp::hub
