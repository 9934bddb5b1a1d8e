#include "hub/server.h"

#include <httplib.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "core/error.h"
#include "hub/crypto.h"
#include "hub/fs.h"
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

// ---- The routes (server.h), matched by hand: each part of the path is one '/'-separated segment.

// What dump() writes for any string: bytes that are not UTF-8 (a request may hold any) become U+FFFD
// instead of an exception.
std::string json_text(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

ServeAnswer error_answer(int status, const std::string& message) {
  ServeAnswer a;
  a.status = status;
  a.body = json_text(nlohmann::json{{"error", message}});
  return a;
}

// An org or repo name as the routes take it: a letter or digit, then letters, digits, '.', '_', '-'
// (validate_repo_id then applies the Hub's full rules).
bool is_repo_part(std::string_view s) {
  auto ok = [](char c, bool first) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (!first && (c == '.' || c == '_' || c == '-'));
  };
  if (s.empty() || !ok(s[0], true)) return false;
  for (char c : s.substr(1))
    if (!ok(c, false)) return false;
  return true;
}

// Takes the segment up to the next '/' (or the end) off the front of `rest`; `slash` tells whether
// one followed.
std::string_view take_segment(std::string_view& rest, bool* slash) {
  const size_t at = rest.find('/');
  const std::string_view seg = rest.substr(0, at);
  *slash = at != std::string_view::npos;
  rest = *slash ? rest.substr(at + 1) : std::string_view();
  return seg;
}

struct Route {
  enum class Kind { None, Refs, Revision, Tree, Resolve } kind = Kind::None;
  std::string repo, revision, rest;  // rest: the tree's path prefix (may be empty) or the resolved file
};

// "/api/models/ORG/REPO/refs", ".../revision/REV", ".../tree/REV[/PREFIX]", or "/ORG/REPO/resolve/REV/PATH";
// the same under "/api/kernels/" and "/kernels/ORG/REPO/resolve/" (kernel repositories).
Route match(std::string_view path) {
  Route r;
  auto repo_then = [&](std::string_view& rest) {
    bool slash = false;
    const std::string_view org = take_segment(rest, &slash);
    if (!slash || !is_repo_part(org)) return false;
    const std::string_view name = take_segment(rest, &slash);
    if (!slash || !is_repo_part(name)) return false;
    r.repo = std::string(org) + "/" + std::string(name);
    return true;
  };
  for (const std::string_view api : {std::string_view("/api/models/"), std::string_view("/api/kernels/")}) {
    if (!path.starts_with(api)) continue;
    std::string_view rest = path.substr(api.size());
    bool slash = false;
    if (repo_then(rest)) {
      const std::string_view verb = take_segment(rest, &slash);
      if (verb == "refs" && !slash) {
        r.kind = Route::Kind::Refs;
        return r;
      }
      if (slash && (verb == "revision" || verb == "tree")) {
        r.revision = take_segment(rest, &slash);
        if (!r.revision.empty() && verb == "revision" && !slash) {
          r.kind = Route::Kind::Revision;
          return r;
        }
        if (!r.revision.empty() && verb == "tree") {
          r.kind = Route::Kind::Tree, r.rest = rest;
          return r;
        }
      }
    }
  }
  // "/ORG/REPO/resolve/..." first, then "/kernels/ORG/REPO/resolve/...".  A path of both forms
  // ("/kernels/X/resolve/resolve/R/P": repo kernels/X at revision "resolve", or repo X/resolve at R)
  // is read as the first.
  for (const std::string_view prefix : {std::string_view("/"), std::string_view("/kernels/")}) {
    r = Route{};
    if (!path.starts_with(prefix)) continue;
    std::string_view rest = path.substr(prefix.size());
    bool slash = false;
    if (!repo_then(rest) || take_segment(rest, &slash) != "resolve" || !slash) continue;
    r.revision = take_segment(rest, &slash);
    if (r.revision.empty() || !slash || rest.empty()) continue;
    r.kind = Route::Kind::Resolve, r.rest = rest;
    return r;
  }
  return Route{};
}

ServeAnswer answer(const RepoDir& dir, const ServeRequest& req) {
  if (req.method != "GET" && req.method != "HEAD") {
    ServeAnswer a = error_answer(405, "kcpp serve answers GET and HEAD only, not " + std::string(req.method));
    a.headers.emplace_back("Allow", "GET, HEAD");
    return a;
  }
  const Route r = match(req.path);
  if (r.kind == Route::Kind::None) return error_answer(404, "no such route: " + std::string(req.path));
  ServeAnswer a;
  if (r.kind == Route::Kind::Refs) {
    const auto refs = dir.refs(r.repo);
    if (refs.empty()) return error_answer(404, "repository " + r.repo + " not found");
    nlohmann::json j = {{"branches", nlohmann::json::array()}, {"tags", nlohmann::json::array()},
                        {"converts", nlohmann::json::array()}};
    for (const RepoRef& ref : refs)
      j[ref.is_tag ? "tags" : "branches"].push_back({{"name", ref.name},
                                                     {"ref", (ref.is_tag ? "refs/tags/" : "refs/heads/") + ref.name},
                                                     {"targetCommit", ref.commit}});
    a.body = json_text(j);
    return a;
  }
  const auto folder = dir.revision_folder(r.repo, r.revision);
  if (!folder) return error_answer(404, "revision " + r.revision + " of " + r.repo + " not found");
  if (r.kind == Route::Kind::Revision) {
    const auto files = dir.files(r.repo, *folder);
    nlohmann::json j = {{"id", r.repo}, {"sha", RepoDir::commit_of(files)}, {"siblings", nlohmann::json::array()}};
    for (const RepoFile& f : files) j["siblings"].push_back({{"rfilename", f.path}});
    a.body = json_text(j);
    return a;
  }
  if (r.kind == Route::Kind::Tree) {
    // The listing under a folder of the revision ("" or "/": all of it), a path inside it.
    std::string prefix = r.rest;
    while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
    if (!prefix.empty()) {
      if (const std::string p = relative_path_problem(prefix); !p.empty())
        return error_answer(400, "tree of " + r.repo + "@" + r.revision + ": '" + prefix + "' is not a folder path: " + p);
      prefix += '/';
    }
    nlohmann::json j = nlohmann::json::array();
    // Not recursive: each folder directly under the prefix once, in the order of its first file, its
    // oid a hash of the paths and hashes of the files below it.
    std::map<std::string, std::string> folders;  // path -> the paths and hashes below it
    std::vector<std::string> folder_order;
    for (const RepoFile& f : dir.files(r.repo, *folder)) {
      if (!f.path.starts_with(prefix)) continue;
      const size_t slash = f.path.find('/', prefix.size());
      if (!req.recursive && slash != std::string::npos) {
        const std::string sub = f.path.substr(0, slash);
        if (!folders.count(sub)) folder_order.push_back(sub);
        folders[sub] += f.path + " " + f.sha256 + "\n";
        continue;
      }
      // pointerSize: the bytes of the Git LFS pointer the Hub would store for the file ("version
      // https://git-lfs.github.com/spec/v1\noid sha256:HEX\nsize N\n"), which huggingface_hub reads.
      const size_t pointer = 43 + 11 + f.sha256.size() + 1 + 5 + std::to_string(f.size).size() + 1;
      j.push_back({{"type", "file"}, {"path", f.path}, {"size", f.size}, {"oid", f.sha256.substr(0, 40)},
                   {"lfs", {{"oid", f.sha256}, {"size", f.size}, {"pointerSize", pointer}}}});
    }
    for (const std::string& sub : folder_order)
      j.push_back({{"type", "directory"}, {"path", sub}, {"oid", sha256_hex(folders.at(sub)).substr(0, 40)}});
    a.body = json_text(j);
    return a;
  }
  const auto file = dir.file(r.repo, *folder, r.rest);
  if (!file) return error_answer(404, "file " + r.rest + " not found in " + r.repo + "@" + *folder);
  {
    std::ifstream in(*file, std::ios::binary);
    a.body.assign(std::istreambuf_iterator<char>(in), {});
    if (in.bad()) return error_answer(404, "file " + r.rest + " of " + r.repo + "@" + *folder + " cannot be read");
  }
  a.file = *file;
  a.content_type = "application/octet-stream";
  // The ETag is the hash of the very bytes sent; the commit, of the revision as it is now.
  a.headers.emplace_back("ETag", "\"" + sha256_hex(a.body) + "\"");
  a.headers.emplace_back("X-Repo-Commit", dir.commit_of(r.repo, *folder));
  return a;
}

}  // namespace

bool tree_recursive(std::string_view value) {
  std::string v(value);
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return v != "false" && v != "0";
}

ServeAnswer route_request(const RepoDir& dir, const ServeRequest& request) {
  try {
    return answer(dir, request);
  } catch (const Error& e) {
    return error_answer(400, e.what());
  } catch (const std::exception& e) {
    return error_answer(500, e.what());
  }
}

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
    // Every request, whatever its method and path, goes to route_request (before cpp-httplib's own
    // routing, which then has nothing registered).
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      bool drop = false;
      if (!fault(req, res, &drop))
        send(route_request(dir, ServeRequest{req.method, req.path, tree_recursive(req.get_param_value("recursive"))}), res, drop);
      return httplib::Server::HandlerResponse::Handled;
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
    res.set_content(json_text(nlohmann::json{{"error", msg}}), "application/json");
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

  // Writes the router's answer; a file's body is streamed (and, with `drop`, hung up on halfway).
  static void send(ServeAnswer a, httplib::Response& res, bool drop) {
    if (a.status != 200) res.status = a.status;  // (200: cpp-httplib's own choice, 206 for a range)
    for (const auto& [name, value] : a.headers) res.set_header(name, value);
    if (a.file.empty()) return res.set_content(a.body, a.content_type);
    auto content = std::make_shared<std::string>(std::move(a.body));
    res.set_content_provider(content->size(), a.content_type,
                             [content, drop](size_t offset, size_t length, httplib::DataSink& sink) {
                               // A dropped connection sends the first half, then hangs up.
                               const size_t limit = drop ? content->size() / 2 : content->size();
                               if (offset >= limit) return false;
                               const size_t n = std::min({length, limit - offset, size_t{1} << 16});
                               sink.write(content->data() + offset, n);
                               return true;
                             });
  }
};

Server::Server(std::filesystem::path root, FaultHook faults, bool log)
    : impl_(std::make_unique<Impl>(std::move(root), std::move(faults))) {
  if (!std::filesystem::is_directory(impl_->dir.root()))
    KCPP_FAIL("kcpp serve: {} is not a directory", impl_->dir.root().string());
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
