#include "hub/http.h"

#include <curl/curl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>

#include "hub/fs.h"

namespace kcpp::hub {
namespace {

void ensure_curl() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

struct Transfer {
  std::FILE* file = nullptr;
  std::string* body = nullptr;
  HttpResponse* response = nullptr;
  std::string label;
  bool progress = false;
  uint64_t limit = 0, written = 0;  // max_bytes (0: none) and, for a download, the bytes so far
  bool over_limit = false;
  std::chrono::steady_clock::time_point last_draw{};
  bool drew = false;
};

size_t on_write(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t bytes = size * n;
  if (t->file) {
    // Writing fewer bytes than given makes libcurl stop the transfer (CURLE_WRITE_ERROR).
    if (t->limit && bytes > t->limit - t->written) {
      t->over_limit = true;
      return 0;
    }
    t->written += bytes;
    return std::fwrite(data, 1, bytes, t->file);
  }
  if (t->limit && bytes > t->limit - t->body->size()) {
    t->over_limit = true;
    return 0;
  }
  t->body->append(data, bytes);
  return bytes;
}

std::string header_value(std::string_view line, std::string_view name) {
  if (line.size() < name.size() + 1) return "";
  for (size_t i = 0; i < name.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(line[i])) != std::tolower(static_cast<unsigned char>(name[i])))
      return "";
  if (line[name.size()] != ':') return "";
  std::string_view v = line.substr(name.size() + 1);
  while (!v.empty() && (v.front() == ' ' || v.front() == '"')) v.remove_prefix(1);
  while (!v.empty() && (v.back() == '\r' || v.back() == '\n' || v.back() == ' ' || v.back() == '"')) v.remove_suffix(1);
  return std::string(v);
}

size_t on_header(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const std::string_view line(data, size * n);
  if (auto v = header_value(line, "etag"); !v.empty()) t->response->etag = v;
  if (auto v = header_value(line, "x-repo-commit"); !v.empty()) t->response->repo_commit = v;
  return size * n;
}

int on_progress(void* user, curl_off_t total, curl_off_t now, curl_off_t, curl_off_t) {
  auto* t = static_cast<Transfer*>(user);
  if (!t->progress) return 0;
  const auto clock = std::chrono::steady_clock::now();
  if (t->drew && clock - t->last_draw < std::chrono::milliseconds(100) && (total == 0 || now < total)) return 0;
  t->last_draw = clock, t->drew = true;
  const double mb = static_cast<double>(now) / 1e6, tot = static_cast<double>(total) / 1e6;
  if (total > 0) {
    const int width = 30, filled = static_cast<int>(width * static_cast<double>(now) / static_cast<double>(total));
    std::fprintf(stderr, "\r%-40.40s [%-*.*s] %7.2f / %.2f MB", t->label.c_str(), width, filled,
                 "##############################", mb, tot);
  } else {
    std::fprintf(stderr, "\r%-40.40s %7.2f MB", t->label.c_str(), mb);
  }
  return 0;
}

}  // namespace

HttpOptions HttpOptions::from_env(const std::string& endpoint) {
  HttpOptions o;
  if (const char* t = std::getenv("KCPP_HTTP_TIMEOUT"); t && *t) {
    const double s = std::atof(t);
    if (s > 0) o.connect_timeout_s = o.stall_timeout_s = o.request_timeout_s = s;
  }
  if (const char* r = std::getenv("KCPP_HTTP_RETRIES"); r && *r) o.retries = std::max(0, std::atoi(r));
  if (const char* b = std::getenv("KCPP_HTTP_BACKOFF_MS"); b && *b) o.backoff_ms = std::max(0, std::atoi(b));
  o.token = env_or("HF_TOKEN", "");
  o.token_origin = endpoint;
  return o;
}

std::string url_escape(const std::string& s) {
  ensure_curl();
  char* e = curl_easy_escape(nullptr, s.c_str(), static_cast<int>(s.size()));
  std::string out = e ? e : "";
  curl_free(e);
  return out;
}

HttpClient::HttpClient(HttpOptions options) : opt_(std::move(options)) { ensure_curl(); }

HttpResponse HttpClient::get(const std::string& url, uint64_t max_bytes) const { return perform(url, nullptr, "", max_bytes); }

HttpResponse HttpClient::download(const std::string& url, const std::filesystem::path& dest, const std::string& label,
                                  uint64_t max_bytes) const {
  return perform(url, &dest, label, max_bytes);
}

HttpResponse HttpClient::perform(const std::string& url, const std::filesystem::path* dest, const std::string& label,
                                 uint64_t max_bytes) const {
  const bool send_token = !opt_.token.empty() && !opt_.token_origin.empty() && url.starts_with(opt_.token_origin) &&
                          (url.size() == opt_.token_origin.size() || url[opt_.token_origin.size()] == '/');
  for (int attempt = 0;; ++attempt) {
    HttpResponse resp;
    Transfer t;
    t.response = &resp;
    t.body = &resp.body;
    t.label = label;
    t.limit = max_bytes;
    t.progress = dest && opt_.progress && ::isatty(2);
    if (dest) {
      t.file = std::fopen(dest->c_str(), "wb");
      if (!t.file) KCPP_FAIL("cannot write {}: {}", dest->string(), std::strerror(errno));
    }
    CURL* h = curl_easy_init();
    if (!h) KCPP_FAIL("libcurl could not create a handle");
    char errbuf[CURL_ERROR_SIZE] = {0};
    curl_slist* headers = nullptr;
    if (send_token) headers = curl_slist_append(headers, ("Authorization: Bearer " + opt_.token).c_str());
    headers = curl_slist_append(headers, "User-Agent: kcpp/0.1 (kernels.cpp)");
    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(h, CURLOPT_MAXREDIRS, 10L);
    curl_easy_setopt(h, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(opt_.connect_timeout_s * 1000));
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, std::max(1L, static_cast<long>(opt_.stall_timeout_s)));
    if (!dest) curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(opt_.request_timeout_s * 1000));
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, &t);
    curl_easy_setopt(h, CURLOPT_NOPROGRESS, t.progress ? 0L : 1L);
    curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(h, CURLOPT_XFERINFODATA, &t);
    const CURLcode rc = curl_easy_perform(h);
    long status = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(h);
    curl_slist_free_all(headers);
    bool write_failed = false;
    if (t.file) write_failed = std::fclose(t.file) != 0;
    if (t.drew) std::fputs("\n", stderr);

    std::string what;
    bool transient = false;
    if (t.over_limit && status < 400) {
      if (!dest)
        throw HttpError(fmt::format("GET {}: the answer is longer than {} bytes, the most kcpp reads from a hub's JSON API; "
                                    "is HF_ENDPOINT a Hugging Face hub?",
                                    url, max_bytes),
                        static_cast<int>(status), false);
      resp.over_limit = true;
      return resp;
    }
    if (rc != CURLE_OK && !t.over_limit) {  // (an error page past the limit is reported by its status)
      what = fmt::format("{} ({})", *errbuf ? errbuf : curl_easy_strerror(rc), curl_easy_strerror(rc));
      transient = rc != CURLE_UNSUPPORTED_PROTOCOL && rc != CURLE_URL_MALFORMAT && rc != CURLE_WRITE_ERROR;
    } else if (write_failed) {
      KCPP_FAIL("writing {} failed: {}", dest->string(), std::strerror(errno));
    } else if (status >= 400) {
      what = fmt::format("HTTP {}", status);
      if (!dest && !resp.body.empty() && resp.body.size() < 500) what += ": " + resp.body;
      transient = status == 408 || status == 429 || status >= 500;
    } else {
      return resp;
    }
    if (!transient || attempt >= opt_.retries)
      throw HttpError(fmt::format("GET {} failed{}: {}", url,
                                  attempt ? fmt::format(" after {} attempts", attempt + 1) : "", what),
                      static_cast<int>(rc == CURLE_OK ? status : 0), transient);
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(opt_.backoff_ms) << attempt));
  }
}

}  // namespace kcpp::hub
