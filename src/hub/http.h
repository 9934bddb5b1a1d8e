// The HTTP client of the hub (libcurl): GETs with timeouts and retries with exponential back-off.
//
// - Proxies come from the environment as libcurl reads them (http_proxy, https_proxy, no_proxy;
//   HTTPS_PROXY and ALL_PROXY too).
// - The token (HF_TOKEN) is sent as "Authorization: Bearer ..." only to URLs under `token_origin`
//   (the hub endpoint), never to another host, including after a redirect (libcurl drops custom
//   Authorization headers when a redirect changes host; redirects are limited to http/https).
// - Retried: connection failures, timeouts, a connection dropped mid-body, HTTP 408, 429 and 5xx;
//   `retries` more attempts, waiting backoff_ms x 2^attempt.  Not retried: other 4xx.
// - A transfer that moves less than 1 byte/s for `stall_timeout_s` is a timeout; API requests
//   (get()) also have a total limit of `request_timeout_s`.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "core/error.h"

namespace kcpp::hub {

struct HttpOptions {
  double connect_timeout_s = 10;
  double stall_timeout_s = 30;
  double request_timeout_s = 60;
  int retries = 3;
  int backoff_ms = 500;
  std::string token;         // HF_TOKEN
  std::string token_origin;  // the endpoint the token belongs to
  bool progress = false;     // a progress bar on stderr for downloads

  // From KCPP_HTTP_TIMEOUT (seconds: connect, stall and request), KCPP_HTTP_RETRIES,
  // KCPP_HTTP_BACKOFF_MS, HF_TOKEN.
  static HttpOptions from_env(const std::string& endpoint);
};

class HttpError : public Error {
 public:
  HttpError(std::string message, int status, bool transient)
      : Error(std::move(message)), status_(status), transient_(transient) {}
  int status() const { return status_; }  // HTTP status, or 0 for a transport failure
  bool transient() const { return transient_; }

 private:
  int status_;
  bool transient_;
};

struct HttpResponse {
  std::string body;
  std::string etag, repo_commit;  // ETag and X-Repo-Commit headers, if any
  // download() with max_bytes: the server sent more, and the transfer was stopped there (the file
  // holds a part); never retried, since the server says what it has.
  bool over_limit = false;
};

// The longest answer get() reads by default: a hub's JSON answers (refs, a revision's file list)
// are far smaller, so a longer one is a server's fault, not something to hold in memory.
constexpr uint64_t kMaxJsonAnswerBytes = uint64_t{64} << 20;

class HttpClient {
 public:
  explicit HttpClient(HttpOptions options);
  // The body of a GET (for JSON APIs).  Throws HttpError after the last attempt, and at once (not
  // retried) when the body grows past `max_bytes`, naming the limit.
  HttpResponse get(const std::string& url, uint64_t max_bytes = kMaxJsonAnswerBytes) const;
  // Streams a GET into `dest` (created or truncated at each attempt).  `label` names the download
  // on the progress bar.  A body longer than `max_bytes` (0: no limit) is cut off there and the
  // answer says so (over_limit), so that a server cannot fill the disk.
  HttpResponse download(const std::string& url, const std::filesystem::path& dest, const std::string& label,
                        uint64_t max_bytes = 0) const;
  const HttpOptions& options() const { return opt_; }

 private:
  HttpOptions opt_;
  HttpResponse perform(const std::string& url, const std::filesystem::path* dest, const std::string& label,
                       uint64_t max_bytes) const;
};

// Percent-encodes one path segment (a revision name may contain '/').
std::string url_escape(const std::string& segment);

}  // namespace kcpp::hub
