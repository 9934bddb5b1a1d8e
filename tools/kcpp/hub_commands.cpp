// The hub commands.  Publisher side: keygen, trust, package index|sign, serve.  Consumer side:
// versions, show, download, verify, lock.  Every consumer command reads the same environment as the
// library (HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE, KCPP_CACHE / HF_HUB_CACHE, the trust store,
// kcpp.lock), and its flags override it.
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>

#include "commands.h"
#include "core/error.h"
#include "hub/crypto.h"
#include "hub/fs.h"
#include "hub/hub.h"
#include "hub/manifest.h"
#include "hub/server.h"
#include "hub/trust.h"
#include "nn/kernel_config.h"

namespace kcpp::tools {
namespace fs = std::filesystem;
namespace {

struct Options {
  std::string publisher, out_dir = ".", key_file, dir, description, pub_file, trust_file;
  // consumer side
  std::vector<std::string> refs;
  std::string repo, endpoint, cache, lock_file, project = "kcpp.json", out_lock = "kcpp.lock";
  bool offline = false, allow_all = false, quiet = false, no_lock = false;
  std::string host = "127.0.0.1";
  int port = 8080;
};

hub::HubConfig config(const Options& o, bool use_lock = true) {
  hub::HubConfig c = hub::HubConfig::from_env();
  if (!o.endpoint.empty()) {
    c.endpoint = o.endpoint;
    while (c.endpoint.size() > 1 && c.endpoint.back() == '/') c.endpoint.pop_back();
    c.http.token_origin = c.endpoint;
  }
  if (!o.cache.empty()) c.cache_dir = o.cache;
  if (o.offline) c.offline = true;
  if (o.allow_all) c.allow_all_kernels = true;
  if (o.quiet) c.http.progress = false;
  if (!o.lock_file.empty()) c.lock_file = fs::path(o.lock_file);
  if (!use_lock || o.no_lock) c.lock_file.reset();
  return c;
}

int serve(const Options& o) {
  hub::Server server(o.dir, {}, /*log=*/!o.quiet);
  server.run(o.host, o.port, [&](int port) {
    fmt::print("kcpp serve: {} at http://{}:{}\n  use it with HF_ENDPOINT=http://{}:{}\n",
               fs::absolute(o.dir).string(), o.host, port, o.host, port);
    std::fflush(stdout);
  });
  return 0;
}

int versions(const Options& o) {
  hub::Hub h(config(o));
  std::vector<std::pair<hub::Version, hub::RepoRef>> tags;
  std::vector<hub::RepoRef> other;
  for (const hub::RepoRef& r : h.refs(o.repo)) {
    auto v = r.is_tag ? hub::Version::try_parse(r.name) : std::nullopt;
    if (v) tags.emplace_back(*v, r);
    else other.push_back(r);
  }
  std::sort(tags.begin(), tags.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [v, r] : tags) fmt::print("{:<20} {}  tag\n", r.name, r.commit);
  for (const auto& r : other) fmt::print("{:<20} {}  {}\n", r.name, r.commit, r.is_tag ? "tag" : "branch");
  if (tags.empty() && other.empty()) fmt::print("{}: no tags or branches\n", o.repo);
  return 0;
}

void print_info(const hub::PackageInfo& info, const hub::HubConfig& cfg) {
  const hub::Manifest& m = info.manifest;
  fmt::print("{} {}{}\n", m.name, m.version, m.description.empty() ? "" : "  " + m.description);
  fmt::print("  source     {}\n", info.origin());
  if (!info.resolved.commit.empty()) fmt::print("  commit     {}\n", info.resolved.commit);
  fmt::print("  manifest   sha256 {}\n", info.manifest_sha256);
  fmt::print("  signature  {}: {}\n", hub::trust_level_name(info.trust.level), info.trust.detail);
  fmt::print("  machine    {}\n", cfg.machine.str());
  fmt::print("  variants\n");
  for (const auto& v : m.variants) {
    std::string why;
    if (v.name == info.variant.chosen) why = "CHOSEN: " + info.variant.why;
    for (const auto& [n, w] : info.variant.refused)
      if (n == v.name) why = w;
    fmt::print("    {:<28} {}\n", v.name, why);
  }
  const hub::ManifestVariant* v = info.manifest.variant(info.variant.chosen);
  if (!v && !m.variants.empty()) v = &m.variants[0];
  if (v) {
    fmt::print("  layers ({})\n", v->name);
    for (const auto& l : v->layers)
      fmt::print("    {:<20} {:<14} {:<28} {}{}\n", l.name, l.contract, fmt::format("{}", fmt::join(l.modes, ",")),
                 fmt::format("{}", fmt::join(l.devices, ",")), l.backward ? "" : " (no backward)");
    if (!v->ops.empty()) fmt::print("  ops ({})\n", v->name);
    for (const auto& op : v->ops) fmt::print("    {:<20} {}\n", op.name, op.doc);
  }
}

int show(const Options& o) {
  hub::Hub h(config(o));
  for (const std::string& r : o.refs) {
    const hub::PackageInfo info = h.inspect(hub::Reference::parse(r));
    print_info(info, h.config());
    if (info.ref.is_local() || h.config().offline) continue;
    // What the hub holds at that commit, against what the manifest lists.
    const auto files = h.files(info.resolved.repo, info.resolved.commit);
    size_t listed = 0, missing = 0;
    for (const auto& v : info.manifest.variants)
      for (const auto& f : v.files) {
        ++listed;
        missing += std::none_of(files.begin(), files.end(), [&](const hub::RepoFile& x) { return x.path == f.path; });
      }
    fmt::print("  hub files  {} at this commit; {} listed in the manifest{}\n", files.size(), listed,
               missing ? fmt::format(", {} of them MISSING on the hub", missing) : "");
  }
  return 0;
}

int download(const Options& o) {
  hub::Hub h(config(o));
  for (const std::string& r : o.refs) {
    const hub::PackageInfo info = h.inspect(hub::Reference::parse(r));
    const fs::path folder = h.fetch(info);
    h.verify(info);
    fmt::print("{} {} ({}) -> {}\n", info.origin(), info.manifest.version, info.variant.chosen, folder.string());
  }
  return 0;
}

int verify(const Options& o) {
  hub::Hub h(config(o));
  for (const std::string& r : o.refs) {
    const hub::LoadedKernel k = h.load(hub::Reference::parse(r));
    fmt::print("OK {} {} {} ({}, {}): every file matches the manifest, library loaded, ABI {}, {} layer(s)\n",
               k.info.origin(), k.info.manifest.name, k.info.manifest.version, k.info.variant.chosen,
               hub::trust_level_name(k.info.trust.level), k.package->table().abi_version,
               k.package->table().num_layers);
  }
  return 0;
}

int lock(const Options& o) {
  // The project file is read as --kernels reads it: a kernel_mapping (or {"kernel_mapping": ...}),
  // every layer name, device, mode and reference checked.
  nn::KernelConfig kc;
  try {
    kc = nn::KernelConfig::parse_text(hub::read_file(o.project));
  } catch (const Error& e) {
    KCPP_FAIL("{}: {}", o.project, e.what());
  }
  hub::Hub h(config(o, /*use_lock=*/false));  // resolve afresh
  hub::LockFile lf;
  for (const auto& [layer, e] : kc.entries()) {
    if (!e.ref || e.ref->is_local()) continue;
    hub::PackageInfo info;
    try {
      info = h.inspect(*e.ref);
      hub::check_layer(info);
    } catch (const Error& err) {
      KCPP_FAIL("{}: kernel_mapping.{}: {}", o.project, layer, err.what());
    }
    hub::LockEntry le{e.ref->repo, e.ref->constraint ? e.ref->constraint->text() : e.ref->revision,
                      info.resolved.revision, info.resolved.commit, info.manifest_sha256,
                      info.manifest.signature ? info.manifest.signature->publisher : "", {}};
    for (const auto& v : info.manifest.variants)
      for (const auto& f : v.files) le.files[f.path] = f.sha256;
    fmt::print("{:<40} {} @ {} ({})\n", e.ref->text, info.resolved.revision, info.resolved.commit.substr(0, 12),
               hub::trust_level_name(info.trust.level));
    lf.upsert(std::move(le));
  }
  lf.save(o.out_lock);
  fmt::print("wrote {} ({} package(s))\n", o.out_lock, lf.packages.size());
  return 0;
}

int keygen(const Options& o) {
  const fs::path sec = fs::path(o.out_dir) / (o.publisher + ".key");
  const fs::path pub = fs::path(o.out_dir) / (o.publisher + ".pub");
  if (fs::exists(sec)) KCPP_FAIL("{} exists; not overwriting a secret key", sec.string());
  const hub::KeyPair k = hub::KeyPair::generate(o.publisher);
  k.save(sec, pub);
  fmt::print("publisher {}\npublic key {}\nsecret key written to {} (keep it private)\npublic key written to {}\n",
             k.publisher, k.public_key.str(), sec.string(), pub.string());
  fmt::print("consumers trust it with: kcpp trust add {}\n", pub.string());
  return 0;
}

int trust_add(const Options& o) {
  const auto [publisher, key] = hub::load_public_key(o.pub_file);
  const fs::path store = o.trust_file.empty() ? hub::TrustStore::default_path() : fs::path(o.trust_file);
  hub::TrustStore::add_to_file(store, publisher, key);
  fmt::print("trusted {} ({}) in {}\n", publisher, key.str(), store.string());
  return 0;
}

int trust_list() {
  const hub::TrustStore s = hub::TrustStore::from_env();
  fmt::print("trust store: {}{}\n", hub::TrustStore::default_path().string(),
             fs::exists(hub::TrustStore::default_path()) ? "" : " (absent)");
  if (s.publishers().empty()) fmt::print("no trusted publishers\n");
  for (const auto& [name, keys] : s.publishers())
    for (const auto& k : keys) fmt::print("{:<24} {}\n", name, k.str());
  return 0;
}

int package_index(const Options& o) {
  const hub::Manifest m = hub::index_package(o.dir, o.description);
  size_t files = 0;
  for (const auto& v : m.variants) files += v.files.size();
  fmt::print("{}: {} {}, {} variant(s), {} file(s) hashed; unsigned (kcpp package sign {} --key KEY)\n",
             (fs::path(o.dir) / "manifest.json").string(), m.name, m.version, m.variants.size(), files, o.dir);
  return 0;
}

int package_sign(const Options& o) {
  const fs::path path = fs::path(o.dir) / "manifest.json";
  hub::Manifest m = hub::Manifest::parse(hub::read_file(path), o.dir);
  // Refuse to sign what the manifest does not describe: every file hashes as listed, every library
  // loads and declares what the manifest says.
  hub::check_package_files(m, o.dir);
  const hub::KeyPair key = hub::KeyPair::load(o.key_file);
  m.sign(key);
  hub::write_file_atomic(path, m.dump());
  fmt::print("signed {} {} as {} ({})\n", m.name, m.version, key.publisher, key.public_key.str());
  return 0;
}

}  // namespace

void add_hub_commands(CLI::App& app, Action& action) {
  static Options o;  // the parsed values outlive add_hub_commands (CLI11 binds by reference)

  auto* keygen_cmd = app.add_subcommand("keygen", "Make an Ed25519 key pair for signing packages");
  keygen_cmd->add_option("--publisher", o.publisher, "Publisher name (as trust stores will list it)")->required();
  keygen_cmd->add_option("--out", o.out_dir, "Folder for NAME.key and NAME.pub")->capture_default_str();
  keygen_cmd->callback([&] { action = [] { return keygen(o); }; });

  auto* trust = app.add_subcommand("trust", "Manage trusted publishers");
  trust->require_subcommand(1);
  auto* trust_add_cmd = trust->add_subcommand("add", "Trust the publisher and key in a .pub file");
  trust_add_cmd->add_option("pub", o.pub_file, "NAME.pub written by kcpp keygen")->required()->check(CLI::ExistingFile);
  trust_add_cmd->add_option("--store", o.trust_file, "Trust store file (default: KCPP_TRUST_STORE or ~/.config/kcpp/)");
  trust_add_cmd->callback([&] { action = [] { return trust_add(o); }; });
  auto* trust_list_cmd = trust->add_subcommand("list", "List trusted publishers (file and KCPP_TRUSTED_PUBLISHERS)");
  trust_list_cmd->callback([&] { action = [] { return trust_list(); }; });

  auto* package = app.add_subcommand("package", "Build-side package tools");
  package->require_subcommand(1);
  auto* index = package->add_subcommand("index", "Write DIR/manifest.json from DIR/build/<variant>/ (hashes, layers)");
  index->add_option("dir", o.dir, "Package folder")->required()->check(CLI::ExistingDirectory);
  index->add_option("--description", o.description, "One line describing the package");
  index->callback([&] { action = [] { return package_index(o); }; });
  auto* sign = package->add_subcommand("sign", "Check every file against DIR/manifest.json and sign it");
  sign->add_option("dir", o.dir, "Package folder")->required()->check(CLI::ExistingDirectory);
  sign->add_option("--key", o.key_file, "NAME.key written by kcpp keygen")->required()->check(CLI::ExistingFile);
  sign->callback([&] { action = [] { return package_sign(o); }; });

  auto* serve_cmd = app.add_subcommand("serve", "Serve a folder of package repos (DIR/org/repo/<tag or branch>/) "
                                                "over the Hub HTTP API");
  serve_cmd->add_option("dir", o.dir, "Folder of repos")->required()->check(CLI::ExistingDirectory);
  serve_cmd->add_option("--host", o.host, "Address to listen on")->capture_default_str();
  serve_cmd->add_option("--port", o.port, "Port (0: any free port)")->capture_default_str();
  serve_cmd->add_flag("--quiet", o.quiet, "Do not log requests");
  serve_cmd->callback([&] { action = [] { return serve(o); }; });

  auto consumer = [&](CLI::App* c) {
    c->add_option("--endpoint", o.endpoint, "Hub URL or folder (default: HF_ENDPOINT or https://huggingface.co)");
    c->add_option("--cache", o.cache, "Cache folder (default: KCPP_CACHE, HF_HUB_CACHE, ~/.cache/huggingface/hub)");
    c->add_flag("--offline", o.offline, "Use the cache only (as HF_HUB_OFFLINE=1)");
    c->add_option("--lock", o.lock_file, "Lock file to check against (default: KCPP_LOCK_FILE or ./kcpp.lock)");
    c->add_flag("--no-lock", o.no_lock, "Ignore any lock file");
    c->add_flag("--quiet", o.quiet, "No progress bar");
  };
  auto* versions_cmd = app.add_subcommand("versions", "List a repo's version tags and branches");
  versions_cmd->add_option("repo", o.repo, "org/repo")->required();
  consumer(versions_cmd);
  versions_cmd->callback([&] { action = [] { return versions(o); }; });

  auto* show_cmd = app.add_subcommand("show", "Show a package: version, signature, variants and why each fits, layers");
  show_cmd->add_option("ref", o.refs, "org/repo[@REV|@CONSTRAINT][:Layer] or /abs/path")->required();
  consumer(show_cmd);
  show_cmd->callback([&] { action = [] { return show(o); }; });

  auto* download_cmd = app.add_subcommand("download", "Download packages (this machine's variant) into the cache");
  download_cmd->add_option("ref", o.refs, "References")->required();
  download_cmd->add_flag("--allow-all-kernels", o.allow_all, "Accept unsigned or untrusted packages");
  consumer(download_cmd);
  download_cmd->callback([&] { action = [] { return download(o); }; });

  auto* verify_cmd = app.add_subcommand("verify", "Verify and load packages exactly as a model would");
  verify_cmd->add_option("ref", o.refs, "References")->required();
  verify_cmd->add_flag("--allow-all-kernels", o.allow_all, "Accept unsigned or untrusted packages");
  consumer(verify_cmd);
  verify_cmd->callback([&] { action = [] { return verify(o); }; });

  auto* lock_cmd = app.add_subcommand("lock", "Resolve the references of a project file into kcpp.lock");
  lock_cmd->add_option("--project", o.project, "Project file with a kernel_mapping")->capture_default_str();
  lock_cmd->add_option("--out", o.out_lock, "Lock file to write")->capture_default_str();
  consumer(lock_cmd);
  lock_cmd->callback([&] { action = [] { return lock(o); }; });
}

}  // namespace kcpp::tools
