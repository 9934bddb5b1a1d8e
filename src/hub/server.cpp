#include "hub/server.h"

#include <httplib.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "core/error.h"
#include "hub/repo_dir.h"

namespace kcpp::hub {

namespace {

// Why binding host:port fails, found by trying it with the server's own socket options (cpp-httplib
// reports only that it failed); "" when it now succeeds.
std::string bind_problem(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); rc != 0)
    return fmt::format("cannot resolve '{}': {}", host, ::gai_strerror(rc));
  int err = 0;
  for (addrinfo* ai = found; ai; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    const int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    const bool bound = ::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0;
    err = bound ? 0 : errno;
    ::close(fd);
    if (bound) break;
  }
  ::freeaddrinfo(found);
  if (err == EADDRINUSE)
    return "address in use (another server listens there: stop it, or choose another --port; --port 0 takes a "
           "free one)";
  return err ? std::strerror(err) : "";
}

}  // namespace

struct Server::Impl {
  RepoDir dir;
  FaultHook faults;
  httplib::Server http;
  std::thread thread;
  std::string host;
  int port = 0;

  Impl(std::filesystem::path root, FaultHook f) : dir(std::move(root)), faults(std::move(f)) {
    // SO_REUSEADDR only: a restarted server may take the port back from connections in TIME_WAIT, but
    // a second server on a port in use fails to bind.  (cpp-httplib's default also sets SO_REUSEPORT,
    // with which the kernel lets both listen and splits the connections between them.)
    http.set_socket_options([](socket_t sock) {
      const int yes = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    });
  }

  // Binds (port 0: any free port) and records the port; throws saying why it cannot.
  void bind(const std::string& h, int p) {
    host = h;
    port = p == 0 ? http.bind_to_any_port(h) : (http.bind_to_port(h, p) ? p : -1);
    if (port > 0) return;
    const std::string why = bind_problem(h, p);
    KCPP_FAIL("kcpp serve: cannot listen on {}:{}{}", h, p, why.empty() ? "" : ": " + why);
  }

  static void error(httplib::Response& res, int status, const std::string& msg) {
    res.status = status;
    res.set_content(nlohmann::json{{"error", msg}}.dump(), "application/json");
  }

  // Applies an injected fault; true when the response is already decided.
  bool fault(const httplib::Request& req, httplib::Response& res, bool* drop) {
    if (!faults) return false;
    const std::string auth = req.get_header_value("Authorization");
    const Fault f = faults(RequestView{req.path, auth});
    switch (f.kind) {
      case Fault::Kind::None: return false;
      case Fault::Kind::Status: error(res, f.status, "injected fault"); return true;
      case Fault::Kind::Delay: std::this_thread::sleep_for(std::chrono::milliseconds(f.delay_ms)); return false;
      case Fault::Kind::DropMidBody: *drop = true; return false;
      case Fault::Kind::Body:
        res.status = 200;
        res.set_content(f.body, "application/json");
        return true;
    }
    return false;
  }

  // The repo of a matched route ("org/repo" from the first two groups).
  static std::string repo_of(const httplib::Request& req) { return req.matches[1].str() + "/" + req.matches[2].str(); }

  // A folder for the revision in the third group, or a 404 already written.
  std::optional<std::string> revision(const httplib::Request& req, httplib::Response& res) {
    const std::string repo = repo_of(req), rev = req.matches[3].str();
    auto folder = dir.revision_folder(repo, rev);
    if (!folder) error(res, 404, "revision " + rev + " of " + repo + " not found");
    return folder;
  }

  // Registers a GET route for "/<prefix>org/repo<suffix>": faults first, then the handler, whose
  // exceptions become 400 (kcpp::Error: a bad id) or 500 responses.
  template <typename F>
  void route(const std::string& prefix, const std::string& suffix, F handler) {
    const std::string repo_re = "([A-Za-z0-9][A-Za-z0-9._-]*)/([A-Za-z0-9][A-Za-z0-9._-]*)";
    http.Get(prefix + repo_re + suffix, [this, handler](const httplib::Request& req, httplib::Response& res) {
      bool drop = false;
      if (fault(req, res, &drop)) return;
      guarded(res, [&] { handler(req, res, drop); });
    });
  }

  void routes() {
    route("/api/models/", "/refs", [this](const httplib::Request& req, httplib::Response& res, bool) {
      const std::string repo = repo_of(req);
      const auto refs = dir.refs(repo);
      if (refs.empty()) return error(res, 404, "repository " + repo + " not found");
      nlohmann::json j = {{"branches", nlohmann::json::array()}, {"tags", nlohmann::json::array()},
                          {"converts", nlohmann::json::array()}};
      for (const RepoRef& r : refs)
        j[r.is_tag ? "tags" : "branches"].push_back(
            {{"name", r.name}, {"ref", (r.is_tag ? "refs/tags/" : "refs/heads/") + r.name}, {"targetCommit", r.commit}});
      res.set_content(j.dump(), "application/json");
    });
    route("/api/models/", "/revision/([^/]+)", [this](const httplib::Request& req, httplib::Response& res, bool) {
      const auto folder = revision(req, res);
      if (!folder) return;
      const auto files = dir.files(repo_of(req), *folder);
      nlohmann::json j = {{"id", repo_of(req)}, {"sha", RepoDir::commit_of(files)}, {"siblings", nlohmann::json::array()}};
      for (const RepoFile& f : files) j["siblings"].push_back({{"rfilename", f.path}});
      res.set_content(j.dump(), "application/json");
    });
    route("/api/models/", "/tree/([^/]+)(/.*)?", [this](const httplib::Request& req, httplib::Response& res, bool) {
      const auto folder = revision(req, res);
      if (!folder) return;
      std::string prefix = req.matches[4].str();
      if (!prefix.empty()) prefix = prefix.substr(1) + (prefix.size() > 1 && prefix.back() != '/' ? "/" : "");
      nlohmann::json j = nlohmann::json::array();
      for (const RepoFile& f : dir.files(repo_of(req), *folder))
        if (f.path.starts_with(prefix))
          j.push_back({{"type", "file"}, {"path", f.path}, {"size", f.size}, {"oid", f.sha256.substr(0, 40)},
                       {"lfs", {{"oid", f.sha256}, {"size", f.size}}}});
      res.set_content(j.dump(), "application/json");
    });
    route("/", "/resolve/([^/]+)/(.+)", [this](const httplib::Request& req, httplib::Response& res, bool drop) {
      const auto folder = revision(req, res);
      if (!folder) return;
      const std::string repo = repo_of(req), path = req.matches[4].str();
      const auto file = dir.file(repo, *folder, path);
      if (!file) return error(res, 404, "file " + path + " not found in " + repo + "@" + *folder);
      auto content = std::make_shared<std::string>();
      {
        std::ifstream in(*file, std::ios::binary);
        content->assign(std::istreambuf_iterator<char>(in), {});
      }
      // One walk of the revision gives both the commit id and this file's hash.
      const auto files = dir.files(repo, *folder);
      for (const RepoFile& f : files)
        if (f.path == path) res.set_header("ETag", "\"" + f.sha256 + "\"");
      res.set_header("X-Repo-Commit", RepoDir::commit_of(files));
      res.set_content_provider(content->size(), "application/octet-stream",
                               [content, drop](size_t offset, size_t length, httplib::DataSink& sink) {
                                 // A dropped connection sends the first half, then hangs up.
                                 const size_t limit = drop ? content->size() / 2 : content->size();
                                 if (offset >= limit) return false;
                                 const size_t n = std::min({length, limit - offset, size_t{1} << 16});
                                 sink.write(content->data() + offset, n);
                                 return true;
                               });
    });
  }

  template <typename F>
  void guarded(httplib::Response& res, F&& f) {
    try {
      f();
    } catch (const Error& e) {
      error(res, 400, e.what());
    } catch (const std::exception& e) {
      error(res, 500, e.what());
    }
  }
};

Server::Server(std::filesystem::path root, FaultHook faults, bool log)
    : impl_(std::make_unique<Impl>(std::move(root), std::move(faults))) {
  if (!std::filesystem::is_directory(impl_->dir.root()))
    KCPP_FAIL("kcpp serve: {} is not a directory", impl_->dir.root().string());
  impl_->routes();
  impl_->http.set_read_timeout(30, 0);
  impl_->http.set_write_timeout(30, 0);
  if (log)
    impl_->http.set_logger([](const httplib::Request& req, const httplib::Response& res) {
      std::fprintf(stderr, "%s %s %d\n", req.method.c_str(), req.path.c_str(), res.status);
    });
}

Server::~Server() { stop(); }

int Server::start(const std::string& host, int port) {
  impl_->bind(host, port);
  impl_->thread = std::thread([this] { impl_->http.listen_after_bind(); });
  for (int i = 0; i < 500 && !impl_->http.is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  return impl_->port;
}

void Server::run(const std::string& host, int port, const std::function<void(int)>& on_ready) {
  impl_->bind(host, port);
  if (on_ready) on_ready(impl_->port);
  impl_->http.listen_after_bind();
}

void Server::stop() {
  if (!impl_) return;
  impl_->http.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::string Server::url() const { return "http://" + impl_->host + ":" + std::to_string(impl_->port); }

}  // namespace kcpp::hub
