#include "hub/hub.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "core/error.h"
#include "hub/crypto.h"
#include "hub/fs.h"

namespace kcpp::hub {
namespace fs = std::filesystem;

namespace {

#define KCPP_UNAVAILABLE(...) throw HubUnavailable(fmt::format(__VA_ARGS__))

std::string list_names(const std::vector<RepoRef>& refs, bool tags) {
  std::string s;
  for (const RepoRef& r : refs)
    if (r.is_tag == tags) s += (s.empty() ? "" : ", ") + r.name;
  return s.empty() ? "none" : s;
}

}  // namespace

HubConfig HubConfig::from_env() {
  HubConfig c;
  c.endpoint = env_or("HF_ENDPOINT", "https://huggingface.co");
  while (c.endpoint.size() > 1 && c.endpoint.back() == '/') c.endpoint.pop_back();
  c.cache_dir = Cache::default_root();
  c.offline = env_flag("HF_HUB_OFFLINE", false);
  c.enabled = env_flag("USE_HUB_KERNELS", true);
  c.allow_all_kernels = env_flag("KCPP_ALLOW_ALL_KERNELS", false);
  if (const char* p = std::getenv("KCPP_LOCK_FILE"); p && *p) c.lock_file = fs::path(p);
  else if (fs::exists("kcpp.lock")) c.lock_file = fs::path("kcpp.lock");
  c.trust = TrustStore::from_env();
  c.machine = Machine::detect();
  c.http = HttpOptions::from_env(c.endpoint);
  c.http.progress = true;
  return c;
}

std::string PackageInfo::origin() const {
  if (ref.is_local()) return ref.path;
  return resolved.repo + "@" + resolved.revision;
}

std::vector<RepoRef> parse_refs_answer(std::string_view body, const std::string& endpoint, const std::string& repo) {
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object()) KCPP_FAIL("{}: the refs of {} are not a JSON object", endpoint, repo);
  std::vector<RepoRef> out;
  for (auto [key, is_tag] : {std::pair{"branches", false}, {"tags", true}}) {
    if (!j.contains(key)) continue;
    if (!j[key].is_array()) KCPP_FAIL("{}: refs of {}: '{}' is not a list", endpoint, repo, key);
    for (const auto& r : j[key]) {
      if (!r.is_object() || !r.contains("name") || !r["name"].is_string() || !r.contains("targetCommit") ||
          !r["targetCommit"].is_string())
        KCPP_FAIL("{}: refs of {}: an entry without name or targetCommit", endpoint, repo);
      RepoRef ref{r["name"], r["targetCommit"], is_tag};
      // Both become names in the cache (refs/NAME, snapshots/COMMIT/): what git would not make is refused.
      if (ref.name.empty()) KCPP_FAIL("{}: refs of {}: a ref in '{}' has an empty name", endpoint, repo, key);
      if (const std::string p = revision_problem(ref.name); !p.empty())
        KCPP_FAIL("{}: refs of {}: a ref in '{}': {}; is HF_ENDPOINT a Hugging Face hub?", endpoint, repo, key, p);
      if (!is_commit_id(ref.commit))
        KCPP_FAIL("{}: refs of {}: {} has the targetCommit '{}', not a commit id (40 lower-case hex digits); is "
                  "HF_ENDPOINT a Hugging Face hub?",
                  endpoint, repo, ref.name, ref.commit);
      out.push_back(std::move(ref));
    }
  }
  return out;
}

std::vector<RepoFile> parse_tree_answer(std::string_view body, const std::string& endpoint, const std::string& repo,
                                        const std::string& revision) {
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_array()) KCPP_FAIL("{}: the file list of {}@{} is not a JSON list", endpoint, repo, revision);
  // A field of an entry that the server typed wrongly is its error, named (not a JSON library's).
  auto bad = [&](const std::string& what) {
    KCPP_FAIL("{}: the file list of {}@{} has an entry whose {}; is HF_ENDPOINT a Hugging Face hub?", endpoint, repo,
              revision, what);
  };
  // A size: a JSON integer, not negative, at most kMaxFileSize.
  auto size_of = [&](const nlohmann::json& v, const std::string& field, const std::string& path) {
    if (!v.is_number_unsigned()) bad(fmt::format("'{}' is not a non-negative integer ({})", field, path));
    const uint64_t n = v.get<uint64_t>();
    if (const std::string p = size_problem(n); !p.empty()) bad(fmt::format("'{}' is not sane: {} ({})", field, p, path));
    return n;
  };
  std::vector<RepoFile> out;
  std::set<std::string> seen;
  for (const auto& e : j) {
    if (!e.is_object()) continue;
    if (e.contains("type") && !e["type"].is_string()) bad("'type' is not a string");
    if (e.value("type", std::string()) != "file") continue;  // folders
    if (!e.contains("path") || !e["path"].is_string()) bad("'path' is missing or not a string");
    RepoFile f;
    f.path = e["path"].get<std::string>();
    if (const std::string p = relative_path_problem(f.path); !p.empty())
      bad(fmt::format("'path' is not a path inside the repository: {} ({})", p, shown(f.path)));
    // Two entries for one path would let the second's claims replace the first's.
    if (!seen.insert(f.path).second) bad(fmt::format("'path' repeats an earlier entry's ({})", f.path));
    if (e.contains("size")) f.size = size_of(e["size"], "size", f.path);
    // The git object id (sha1, or sha256 in a sha256 repository): never used, but a listing that
    // claims one claims a well-formed one.
    if (e.contains("oid")) {
      const auto& oid = e["oid"];
      if (!oid.is_string() || !(is_commit_id(oid.get<std::string>()) || is_sha256_hex(oid.get<std::string>())))
        bad(fmt::format("'oid' {} is not a git object id (40 or 64 lower-case hex digits) ({})",
                        oid.is_string() ? shown(oid.get<std::string>()) : oid.dump().substr(0, 80), f.path));
    }
    // Large files carry their sha256 as the LFS object id, and their size again; small ones only a
    // git blob id.  The sha256 names the file in the cache and is what its download is checked against.
    if (e.contains("lfs") && !e["lfs"].is_null()) {
      const auto& lfs = e["lfs"];
      if (!lfs.is_object()) bad("'lfs' is not an object (" + f.path + ")");
      if (!lfs.contains("oid")) bad("'lfs' has no 'oid' (" + f.path + ")");
      if (!lfs["oid"].is_string()) bad("'lfs.oid' is not a string (" + f.path + ")");
      f.sha256 = lfs["oid"].get<std::string>();
      if (const std::string p = sha256_problem(f.sha256); !p.empty()) bad(fmt::format("'lfs.oid' {} ({})", p, f.path));
      if (lfs.contains("size")) {
        const uint64_t n = size_of(lfs["size"], "lfs.size", f.path);
        if (e.contains("size") && n != f.size)
          bad(fmt::format("'lfs.size' {} differs from its 'size' {} ({})", n, f.size, f.path));
        f.size = n;
      }
    }
    out.push_back(std::move(f));
  }
  return out;
}

Hub::Hub(HubConfig config) : cfg_(std::move(config)), cache_(cfg_.cache_dir) {
  const std::string& e = cfg_.endpoint;
  if (e.starts_with("file://")) dir_.emplace(e.substr(7));
  else if (e.starts_with("/")) dir_.emplace(e);
  else if (e.starts_with("http://") || e.starts_with("https://")) http_.emplace(cfg_.http);
  else KCPP_FAIL("HF_ENDPOINT '{}': expected an http(s) URL or an absolute folder path", e);
  if (dir_ && !fs::is_directory(dir_->root()))
    KCPP_FAIL("HF_ENDPOINT '{}': the folder does not exist", e);
  if (cfg_.lock_file) lock_ = LockFile::load(*cfg_.lock_file);
}

std::vector<RepoRef> Hub::refs(const std::string& repo) const {
  validate_repo_id(repo);
  if (cfg_.offline) {
    std::vector<RepoRef> out;
    for (const auto& [name, commit] : cache_.refs(repo)) out.push_back({name, commit, Version::try_parse(name).has_value()});
    return out;
  }
  if (dir_) {
    auto r = dir_->refs(repo);
    if (r.empty()) KCPP_UNAVAILABLE("repository {} not found in {}", repo, dir_->root().string());
    return r;
  }
  HttpResponse resp;
  try {
    resp = http_->get(cfg_.endpoint + "/api/models/" + repo + "/refs");
  } catch (const HttpError& e) {
    if (e.status() == 404 || e.status() == 401)
      KCPP_UNAVAILABLE("repository {} not found on {} (HTTP {}; a private repo needs HF_TOKEN)", repo, cfg_.endpoint,
                       e.status());
    throw HubUnavailable(e.what(), e.status() == 0 || e.transient());
  }
  return parse_refs_answer(resp.body, cfg_.endpoint, repo);
}

std::vector<RepoFile> Hub::files(const std::string& repo, const std::string& revision) const {
  validate_repo_id(repo);
  if (cfg_.offline)
    KCPP_UNAVAILABLE("listing the files of {}@{} needs the hub, and HF_HUB_OFFLINE is set", repo, revision);
  if (dir_) {
    const auto folder = dir_->revision_folder(repo, revision);
    if (!folder) KCPP_UNAVAILABLE("{}: no revision {} of {}", dir_->root().string(), revision, repo);
    return dir_->files(repo, *folder);
  }
  HttpResponse resp;
  try {
    resp = http_->get(cfg_.endpoint + "/api/models/" + repo + "/tree/" + url_escape(revision) + "?recursive=true");
  } catch (const HttpError& e) {
    if (e.status() == 404)
      KCPP_UNAVAILABLE("{}: no revision {} of {} ({})", cfg_.endpoint, revision, repo, e.what());
    throw HubUnavailable(e.what(), e.status() == 0 || e.transient());
  }
  return parse_tree_answer(resp.body, cfg_.endpoint, repo, revision);
}

std::string Hub::requested(const Reference& ref) const {
  if (ref.constraint) return ref.constraint->text();
  return ref.revision;
}

const LockEntry* Hub::lock_entry(const Reference& ref) const {
  if (!lock_ || ref.is_local()) return nullptr;
  return lock_->find(ref.repo, requested(ref));
}

Resolved Hub::resolve(const Reference& ref) const {
  KCPP_CHECK(!ref.is_local(), "resolve() takes hub references, not the local path {}", ref.path);
  Resolved r{ref.repo, "", ""};
  if (const LockEntry* e = lock_entry(ref)) {
    r.revision = e->revision, r.commit = e->commit;
    if (cfg_.offline || is_commit_id(e->revision)) return r;
    for (const RepoRef& x : refs(ref.repo))
      if (x.name == e->revision) {
        if (x.commit != e->commit)
          KCPP_FAIL("{}: {} pins {}@{} at commit {}, but the hub now has commit {} there; refusing to load it "
                    "(run `kcpp lock` to accept the new commit)",
                    ref.text, cfg_.lock_file->string(), ref.repo, e->revision, e->commit, x.commit);
        cache_.set_ref(ref.repo, x.name, x.commit);
        return r;
      }
    KCPP_FAIL("{}: {} pins {}@{}, which the hub no longer has", ref.text, cfg_.lock_file->string(), ref.repo,
              e->revision);
  }
  const std::vector<RepoRef> all = refs(ref.repo);
  if (ref.constraint) {
    std::optional<Version> best;
    const RepoRef* best_ref = nullptr;
    for (const RepoRef& x : all) {
      if (!x.is_tag) continue;
      const auto v = Version::try_parse(x.name);
      if (v && ref.constraint->matches(*v) && (!best || *v > *best)) best = v, best_ref = &x;
    }
    if (!best_ref)
      KCPP_UNAVAILABLE("{}: no tag of {} matches '{}'{} (tags: {})", ref.text, ref.repo, ref.constraint->text(),
                       cfg_.offline ? " in the offline cache (HF_HUB_OFFLINE is set)" : "", list_names(all, true));
    r.revision = best_ref->name, r.commit = best_ref->commit;
  } else {
    for (const RepoRef& x : all)
      if (x.name == ref.revision) r.revision = x.name, r.commit = x.commit;
    if (r.commit.empty() && is_commit_id(ref.revision)) r.revision = r.commit = ref.revision;
    if (r.commit.empty())
      KCPP_UNAVAILABLE("{}: {} has no tag or branch '{}'{} (branches: {}; tags: {}){}", ref.text, ref.repo, ref.revision,
                       cfg_.offline ? " in the offline cache (HF_HUB_OFFLINE is set)" : "", list_names(all, false),
                       list_names(all, true),
                       ref.text.find('@') == std::string::npos
                           ? fmt::format("; a reference without '@' means the branch main: name a tag or a version, as in "
                                         "{}@>=1.0{}",
                                         ref.repo, ref.layer.empty() ? "" : ":" + ref.layer)
                           : "");
  }
  if (!cfg_.offline && r.revision != r.commit) cache_.set_ref(ref.repo, r.revision, r.commit);
  return r;
}

void Hub::download(const std::string& repo, const std::string& commit, const std::string& path,
                   const fs::path& dest, uint64_t max_bytes) const {
  auto too_long = [&](const std::string& source) {
    KCPP_FAIL("{}@{}: {}: {} holds more than the {} bytes expected ({}); not stored, not loaded", repo,
              commit.substr(0, 12), path, source, max_bytes,
              path == "manifest.json" ? "the most a manifest.json may have" : "the size the manifest gives");
  };
  if (dir_) {
    const auto folder = dir_->revision_folder(repo, commit);
    if (!folder) KCPP_UNAVAILABLE("{}: no revision with commit {} of {}", dir_->root().string(), commit, repo);
    const auto file = dir_->file(repo, *folder, path);
    if (!file) KCPP_UNAVAILABLE("{}: {}@{} has no file {}", dir_->root().string(), repo, *folder, path);
    std::error_code ec;
    if (fs::file_size(*file, ec) > max_bytes && !ec) too_long(file->string());
    fs::copy_file(*file, dest, fs::copy_options::overwrite_existing);
    return;
  }
  const std::string url = cfg_.endpoint + "/" + repo + "/resolve/" + url_escape(commit) + "/" + path;
  HttpResponse resp;
  try {
    resp = http_->download(url, dest, repo + "/" + fs::path(path).filename().string(), max_bytes);
  } catch (const HttpError& e) {
    if (e.status() == 404)
      KCPP_UNAVAILABLE("{}@{}: the hub has no file {} ({})", repo, commit.substr(0, 12), path, e.what());
    throw HubUnavailable(e.what(), e.status() == 0 || e.transient());
  }
  if (resp.over_limit) too_long("the hub's answer (" + url + ")");
}

fs::path Hub::fetch_file(const std::string& repo, const std::string& commit, const std::string& path,
                         const std::string& sha256, uint64_t size) const {
  // What names the file in the cache and bounds its download is checked first, whoever supplied it.
  if (!is_commit_id(commit))
    KCPP_FAIL("{}: {}: the commit {} is not a commit id (40 lower-case hex digits); not downloaded", repo, path,
              shown(commit));
  if (const std::string p = relative_path_problem(path); !p.empty())
    KCPP_FAIL("{}@{}: {} is not a path inside the repository: {}; not downloaded", repo, commit.substr(0, 12),
              shown(path), p);
  if (!sha256.empty()) {
    std::string p = sha256_problem(sha256);
    if (p.empty()) p = size_problem(size);
    if (!p.empty()) KCPP_FAIL("{}@{}: {}: the manifest's claim: {}; not downloaded", repo, commit.substr(0, 12), path, p);
  }
  if (auto p = cache_.file(repo, commit, path)) return *p;
  if (cfg_.offline)
    KCPP_UNAVAILABLE("{}@{}: {} is not in the cache {} and HF_HUB_OFFLINE is set", repo, commit.substr(0, 12), path,
                     cache_.root().string());
  const std::string key = sha256.empty() ? sha256_hex(repo + "@" + commit + ":" + path) : sha256;
  cache_.remove_stale_partials(repo);  // left by downloads that were killed
  FileLock lock(cache_.lock_path(repo, key));
  if (auto p = cache_.file(repo, commit, path)) return *p;  // another process finished it meanwhile
  const fs::path tmp = cache_.temp_path(repo, key);
  std::error_code ec;
  fs::create_directories(tmp.parent_path(), ec);
  try {
    download(repo, commit, path, tmp, sha256.empty() ? kMaxManifestSize : size);
    uint64_t got_size = 0;
    const std::string got = sha256_file(tmp, &got_size);
    if (!sha256.empty() && (got != sha256 || got_size != size))
      KCPP_FAIL("{}@{}: {} has sha256 {} ({} bytes) but the manifest says {} ({} bytes); not stored, not loaded",
                repo, commit.substr(0, 12), path, got, got_size, sha256, size);
    return cache_.commit_file(repo, commit, path, got, tmp);
  } catch (...) {
    fs::remove(tmp, ec);
    throw;
  }
}

PackageInfo Hub::inspect(const Reference& ref) const {
  PackageInfo info;
  info.ref = ref;
  std::string text;
  if (ref.is_local()) {
    info.folder = ref.path;
    if (!fs::is_directory(info.folder)) KCPP_FAIL("{}: not a folder", ref.path);
    if (!fs::exists(info.folder / "manifest.json"))
      KCPP_FAIL("{}: no manifest.json (build the package with kcpp_add_package or run `kcpp package index`)", ref.path);
    text = read_file(info.folder / "manifest.json");
  } else {
    info.resolved = resolve(ref);
    const LockEntry* e = lock_entry(ref);
    const fs::path cached = fetch_file(ref.repo, info.resolved.commit, "manifest.json", "", 0);
    text = read_file(cached);
    info.folder = cache_.snapshot_dir(ref.repo, info.resolved.commit);
    info.manifest_sha256 = sha256_hex(text);
    // Nothing else checks the manifest's bytes (the lock, when there is one, and the signature, when
    // trusted, cover them): the cache's blob must hold what its name says.
    if (const auto named = cache_.blob_sha256(ref.repo, info.resolved.commit, "manifest.json");
        named && *named != info.manifest_sha256)
      KCPP_FAIL("{}: the cache's manifest.json has sha256 {} but its blob is named {}: the file was modified or "
                "damaged; refusing to read it (delete {} and the blob it links to, to download it again)",
                info.origin(), info.manifest_sha256, shown(*named, 1024), cached.string());
    if (e && e->manifest_sha256 != info.manifest_sha256)
      KCPP_FAIL("{}: manifest.json has sha256 {} but {} pins {}; refusing to load it", info.origin(),
                info.manifest_sha256, cfg_.lock_file->string(), e->manifest_sha256);
  }
  if (info.manifest_sha256.empty()) info.manifest_sha256 = sha256_hex(text);
  info.manifest = Manifest::parse(text, info.origin());
  // A version tag is a claim about what it holds: the tag and the manifest name the same version, or
  // a constraint could pick a package for a version it is not.
  if (!ref.is_local() && info.resolved.revision != info.resolved.commit)
    if (const auto tagged = Version::try_parse(info.resolved.revision)) {
      const Version said = Version::parse(info.manifest.version);
      if (!(*tagged == said))
        KCPP_FAIL("{}: the tag {} says version {} but its manifest.json says {} {}; refusing to load it (the "
                  "publisher must tag each release with the version it holds)",
                  info.origin(), info.resolved.revision, tagged->str(), info.manifest.name, info.manifest.version);
    }
  if (info.manifest.abi_version != KCPP_ABI_VERSION)
    KCPP_FAIL("{}: built for kernel ABI {}, this host speaks ABI {}", info.origin(), info.manifest.abi_version,
              KCPP_ABI_VERSION);
  info.trust = cfg_.trust.verify(info.manifest);
  std::vector<VariantCandidate> cands;
  for (const ManifestVariant& v : info.manifest.variants) cands.push_back({v.name, v.cuda_archs});
  info.variant = select_variant(cands, cfg_.machine);
  return info;
}

fs::path Hub::fetch(const PackageInfo& info) const {
  if (info.variant.chosen.empty()) KCPP_FAIL("{}", info.variant.explain(info.origin(), cfg_.machine));
  if (info.ref.is_local()) return info.folder;
  const ManifestVariant* v = info.manifest.variant(info.variant.chosen);
  for (const ManifestFile& f : v->files) fetch_file(info.resolved.repo, info.resolved.commit, f.path, f.sha256, f.size);
  return info.folder;
}

std::string Hub::verify(const PackageInfo& info) const {
  const std::string origin = info.origin();
  switch (info.trust.level) {
    case TrustLevel::Trusted: break;
    case TrustLevel::BadSignature: KCPP_FAIL("{}: refusing to load: {}", origin, info.trust.detail);
    case TrustLevel::Unsigned:
    case TrustLevel::Untrusted:
      if (!cfg_.allow_all_kernels)
        throw Untrusted(fmt::format("{}: refusing to load: {}; trust the publisher (`kcpp trust add NAME.pub`, or "
                                    "KCPP_TRUSTED_PUBLISHERS) or pass allow_all_kernels (--allow-all-kernels, "
                                    "KCPP_ALLOW_ALL_KERNELS=1)",
                                    origin, info.trust.detail));
  }
  if (info.variant.chosen.empty()) KCPP_FAIL("{}", info.variant.explain(origin, cfg_.machine));
  const ManifestVariant* v = info.manifest.variant(info.variant.chosen);
  const LockEntry* e = lock_entry(info.ref);
  std::string library;
  for (const ManifestFile& f : v->files) {
    if (e) {
      const auto it = e->files.find(f.path);
      if (it != e->files.end() && it->second != f.sha256)
        KCPP_FAIL("{}: {} is pinned to sha256 {} by {} but the manifest says {}", origin, f.path, it->second,
                  cfg_.lock_file->string(), f.sha256);
    }
    const fs::path p = info.folder / f.path;
    std::error_code ec;
    if (!fs::exists(p, ec)) KCPP_FAIL("{}: {} is missing", origin, f.path);
    if (info.ref.is_local() && fs::is_symlink(p, ec))
      KCPP_FAIL("{}: {} is a symbolic link; package files must be regular files", origin, f.path);
    // The library is hashed from the very bytes that will be mapped; other files from disk.
    uint64_t size = 0;
    std::string got;
    if (f.path == v->library) {
      library = read_file(p);
      got = sha256_hex(library), size = library.size();
    } else {
      got = sha256_file(p, &size);
    }
    if (got != f.sha256 || size != f.size)
      KCPP_FAIL("{}: {} has sha256 {} ({} bytes) but the manifest says {} ({} bytes): the file was modified or "
                "corrupted; refusing to load{}",
                origin, f.path, got, size, f.sha256, f.size,
                info.ref.is_local() ? "" : fmt::format(" (delete {} to download it again)", p.string()));
  }
  return library;
}

void check_layer(const PackageInfo& info, const ManifestVariant* variant) {
  const std::string& want = info.ref.layer;
  if (want.empty()) return;
  std::vector<std::string> names;
  for (const ManifestVariant& v : info.manifest.variants) {
    if (variant && &v != variant) continue;
    for (const ManifestLayer& l : v.layers) {
      if (l.name == want) return;
      if (std::find(names.begin(), names.end(), l.name) == names.end()) names.push_back(l.name);
    }
  }
  KCPP_FAIL("{}: no layer '{}' in {} {} ({} has: {})", info.ref.text, want, info.manifest.name, info.manifest.version,
            variant ? "variant " + variant->name : "the package",
            names.empty() ? "no layers" : fmt::format("{}", fmt::join(names, ", ")));
}

LoadedKernel Hub::load(const Reference& ref) {
  if (!cfg_.enabled)
    throw HubDisabled(fmt::format("hub kernels are disabled (USE_HUB_KERNELS={}); {} not loaded",
                                  env_or("USE_HUB_KERNELS", "0"), ref.text));
  LoadedKernel out;
  out.info = inspect(ref);
  const PackageInfo& info = out.info;
  if (info.variant.chosen.empty()) KCPP_FAIL("{}", info.variant.explain(info.origin(), cfg_.machine));
  const ManifestVariant* v = info.manifest.variant(info.variant.chosen);
  check_layer(info, v);
  fetch(info);
  const std::string library = verify(info);
  const std::string key = info.folder.string() + "|" + v->name + "|" + info.manifest_sha256;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (auto p = loaded_[key].lock()) out.package = p;
  }
  if (!out.package) {
    out.package = LoadedPackage::open_image(library, info.origin() + " (" + v->name + ")");
    const kcpp_package& t = out.package->table();
    if (info.manifest.name != t.name || info.manifest.version != t.version)
      KCPP_FAIL("{}: the library is {} {} but the manifest says {} {}", out.package->origin(), t.name, t.version,
                info.manifest.name, info.manifest.version);
    std::lock_guard<std::mutex> g(mu_);
    loaded_[key] = out.package;
  }
  if (!ref.layer.empty()) {
    out.layer = out.package->layer(ref.layer);
    if (!out.layer) KCPP_FAIL("{}: the manifest lists layer '{}' but the library has none", out.package->origin(), ref.layer);
  }
  return out;
}

}  // namespace kcpp::hub
