// `kcpp serve`: a directory of package repos (repo_dir.h) over the Hugging Face Hub HTTP API subset
// that the hub client speaks, so an organisation can run a private hub and every hub test talks to
// a real server on loopback.
//
//   GET /api/models/<org>/<repo>/refs                    {"branches": [...], "tags": [...], "converts": []}
//                                                        each {"name", "ref": "refs/tags/NAME", "targetCommit"}
//   GET /api/models/<org>/<repo>/revision/<rev>          {"id", "sha", "siblings": [{"rfilename"}]}
//   GET /api/models/<org>/<repo>/tree/<rev>[/<path>]     [{"type": "file", "path", "size", "oid",
//                                                          "lfs": {"oid": SHA256, "size"}}]  (recursive)
//   GET /<org>/<repo>/resolve/<rev>/<path>               the file; headers X-Repo-Commit, ETag (sha256)
//
// Errors are JSON {"error": "..."} with 404 (unknown repo, revision or file) or 400 (bad id).
// The server never follows symbolic links and never serves a path with '..'.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace kcpp::hub {

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
