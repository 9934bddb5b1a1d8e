#include "hub/manifest.h"

#include <algorithm>

#include "core/error.h"
#include "hub/fs.h"
#include "hub/package.h"
#include "hub/semver.h"
#include "hub/variant.h"
#include "kcpp/abi.h"

namespace kcpp::hub {
namespace {

struct Reader {
  std::string_view source;
  [[noreturn]] void fail(const std::string& where, const std::string& what) const {
    KCPP_FAIL("{}: manifest.json: {}{}{}", source, where, where.empty() ? "" : ": ", what);
  }
  const nlohmann::json& field(const nlohmann::json& obj, const char* key, const std::string& where) const {
    if (!obj.is_object()) fail(where, "expected an object");
    if (!obj.contains(key)) fail(where, fmt::format("missing field '{}'", key));
    return obj.at(key);
  }
  std::string str(const nlohmann::json& obj, const char* key, const std::string& where, bool required = true) const {
    if (!obj.contains(key)) {
      if (required) fail(where, fmt::format("missing field '{}'", key));
      return "";
    }
    const auto& v = obj.at(key);
    if (!v.is_string()) fail(where, fmt::format("field '{}' must be a string, is {}", key, v.type_name()));
    return v.get<std::string>();
  }
  bool flag(const nlohmann::json& obj, const char* key, const std::string& where, bool fallback) const {
    if (!obj.contains(key)) return fallback;
    const auto& v = obj.at(key);
    if (!v.is_boolean()) fail(where, fmt::format("field '{}' must be true or false, is {}", key, v.type_name()));
    return v.get<bool>();
  }
  std::vector<std::string> strings(const nlohmann::json& obj, const char* key, const std::string& where) const {
    std::vector<std::string> out;
    if (!obj.contains(key)) return out;
    const auto& v = obj.at(key);
    if (!v.is_array()) fail(where, fmt::format("field '{}' must be a list of strings", key));
    for (const auto& e : v) {
      if (!e.is_string()) fail(where, fmt::format("field '{}' must be a list of strings", key));
      out.push_back(e.get<std::string>());
    }
    return out;
  }
  // A variant's "files": {path: {"sha256", "size"}}, every path under `prefix`.
  std::vector<ManifestFile> files(const nlohmann::json& vj, const std::string& prefix, const std::string& where) const {
    std::vector<ManifestFile> out;
    const auto& files = field(vj, "files", where);
    if (!files.is_object() || files.empty()) fail(where + ".files", "must be a non-empty object keyed by path");
    for (const auto& [path, fj] : files.items()) {
      const std::string fw = where + ".files[" + path + "]";
      if (auto p = relative_path_problem(path); !p.empty()) fail(fw, p);
      if (!path.starts_with(prefix)) fail(fw, fmt::format("files of this variant must be under {}", prefix));
      ManifestFile f;
      f.path = path;
      f.sha256 = str(fj, "sha256", fw);
      if (const std::string p = sha256_problem(f.sha256); !p.empty()) fail(fw, "sha256 " + p);
      const auto& size = field(fj, "size", fw);
      if (!size.is_number_unsigned()) fail(fw, "size must be a non-negative integer");
      f.size = size.get<uint64_t>();
      if (const std::string p = size_problem(f.size); !p.empty()) fail(fw, p);
      out.push_back(std::move(f));
    }
    return out;
  }
};

}  // namespace

bool is_noarch_variant_name(std::string_view name) {
  constexpr std::string_view prefix = "torch-";
  if (!name.starts_with(prefix) || name.size() == prefix.size()) return false;
  for (char c : name.substr(prefix.size()))
    if (c < 'a' || c > 'z') return false;
  return true;
}

const ManifestFile* ManifestVariant::file(std::string_view path) const {
  for (const ManifestFile& f : files)
    if (f.path == path) return &f;
  return nullptr;
}

Manifest Manifest::parse(std::string_view text, std::string_view source) {
  Reader r{source};
  Manifest m;
  m.json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (m.json.is_discarded()) r.fail("", "not valid JSON");
  const nlohmann::json& j = m.json;
  if (!j.is_object()) r.fail("", "the document must be a JSON object");
  const auto& fmtv = r.field(j, "kcpp_manifest", "");
  if (!fmtv.is_number_integer() || fmtv.get<int64_t>() != 1)
    r.fail("kcpp_manifest", fmt::format("format {} is not supported (this kcpp reads format 1)", fmtv.dump()));
  m.name = r.str(j, "name", "");
  if (m.name.empty() || m.name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.") !=
                            std::string::npos)
    r.fail("name", fmt::format("'{}' is not a package name (letters, digits, '_', '-', '.')", m.name));
  m.version = r.str(j, "version", "");
  if (!Version::try_parse(m.version)) r.fail("version", fmt::format("'{}' is not a semantic version", m.version));
  m.description = r.str(j, "description", "", false);
  const auto& abi = r.field(j, "abi_version", "");
  if (!abi.is_number_integer()) r.fail("abi_version", "must be an integer");
  m.abi_version = abi.get<int>();

  const auto& vars = r.field(j, "variants", "");
  if (!vars.is_object() || vars.empty()) r.fail("variants", "must be a non-empty object keyed by variant name");
  for (const auto& [vname, vj] : vars.items()) {
    const std::string where = "variants." + vname;
    try {
      Variant::parse(vname);
    } catch (const Error& e) {
      r.fail(where, e.what());
    }
    ManifestVariant v;
    v.name = vname;
    v.library = r.str(vj, "library", where);
    v.cuda_archs = r.strings(vj, "cuda_archs", where);
    v.files = r.files(vj, "build/" + vname + "/", where);
    if (!v.file(v.library)) r.fail(where + ".library", fmt::format("'{}' is not one of the variant's files", v.library));
    if (vj.contains("layers")) {
      const auto& ls = vj.at("layers");
      if (!ls.is_array()) r.fail(where + ".layers", "must be a list");
      for (size_t i = 0; i < ls.size(); ++i) {
        const std::string lw = fmt::format("{}.layers[{}]", where, i);
        ManifestLayer l;
        l.name = r.str(ls[i], "name", lw);
        l.contract = r.str(ls[i], "contract", lw);
        l.doc = r.str(ls[i], "doc", lw, false);
        l.modes = r.strings(ls[i], "modes", lw);
        l.devices = r.strings(ls[i], "devices", lw);
        l.backward = r.flag(ls[i], "backward", lw, false);
        v.layers.push_back(std::move(l));
      }
    }
    if (vj.contains("ops")) {
      const auto& os = vj.at("ops");
      if (!os.is_array()) r.fail(where + ".ops", "must be a list");
      for (size_t i = 0; i < os.size(); ++i) {
        const std::string ow = fmt::format("{}.ops[{}]", where, i);
        v.ops.push_back({r.str(os[i], "name", ow), r.str(os[i], "doc", ow, false), r.strings(os[i], "devices", ow)});
      }
    }
    m.variants.push_back(std::move(v));
  }
  if (j.contains("noarch")) {
    const auto& na = j.at("noarch");
    if (!na.is_object()) r.fail("noarch", "must be an object keyed by noarch variant name");
    for (const auto& [nname, nj] : na.items()) {
      const std::string where = "noarch." + nname;
      if (!is_noarch_variant_name(nname))
        r.fail(where, "not a noarch variant name (torch-<backend>: torch-cpu, torch-cuda, ...)");
      m.noarch.push_back({nname, r.files(nj, "build/" + nname + "/", where)});
    }
  }
  if (j.contains("signature")) {
    const auto& s = j.at("signature");
    Signature sig{r.str(s, "algorithm", "signature"), r.str(s, "publisher", "signature"),
                  r.str(s, "public_key", "signature"), r.str(s, "value", "signature")};
    if (sig.algorithm != "ed25519") r.fail("signature", fmt::format("unsupported algorithm '{}'", sig.algorithm));
    m.signature = std::move(sig);
  }
  return m;
}

std::string Manifest::canonical_bytes() const {
  nlohmann::json j = json;
  j.erase("signature");
  return j.dump();
}

const ManifestVariant* Manifest::variant(std::string_view n) const {
  for (const ManifestVariant& v : variants)
    if (v.name == n) return &v;
  return nullptr;
}

void Manifest::sign(const KeyPair& key) {
  const std::string value = key.sign(canonical_bytes());
  signature = Signature{"ed25519", key.publisher, key.public_key.str(), value};
  json["signature"] = {{"algorithm", "ed25519"},
                       {"publisher", key.publisher},
                       {"public_key", key.public_key.str()},
                       {"value", value}};
}

std::string Manifest::dump() const { return json.dump(2) + "\n"; }

std::vector<std::string> mode_names(uint32_t modes) {
  std::vector<std::string> out;
  if (modes & KCPP_MODE_INFERENCE) out.emplace_back("inference");
  if (modes & KCPP_MODE_TRAINING) out.emplace_back("training");
  if (modes & KCPP_MODE_GRAPH) out.emplace_back("graph");
  return out;
}

std::vector<std::string> device_names(uint32_t devices) {
  std::vector<std::string> out;
  for (auto [bit, name] : {std::pair{kDLCPU, "cpu"}, {kDLCUDA, "cuda"}, {kDLROCM, "rocm"}, {kDLMetal, "metal"},
                           {static_cast<DLDeviceType>(14), "xpu"}})
    if (devices & KCPP_DEVICE_BIT(bit)) out.emplace_back(name);
  return out;
}

namespace {

struct LibraryDescription {
  std::string name, version;
  nlohmann::json layers, ops;  // as manifest.json lists them
};

// Loads the library (dlopen + the ABI table) and describes it.  A library that does not load
// (truncated, not a package, or needing what this machine lacks) is an error: a package is indexed
// and signed where each of its libraries loads, never described from an earlier manifest.
LibraryDescription describe_library(const std::filesystem::path& lib, const std::string& variant) {
  std::shared_ptr<LoadedPackage> pkg;
  try {
    pkg = LoadedPackage::open_file(lib);
  } catch (const Error& e) {
    KCPP_FAIL("variant {}: {} (index and sign a package where each of its libraries loads)", variant, e.what());
  }
  const kcpp_package& t = pkg->table();
  LibraryDescription d{t.name, t.version, nlohmann::json::array(), nlohmann::json::array()};
  for (int32_t i = 0; i < t.num_layers; ++i) {
    const kcpp_layer& l = t.layers[i];
    d.layers.push_back({{"name", l.name},
                        {"contract", l.contract},
                        {"doc", l.doc ? l.doc : ""},
                        {"modes", mode_names(l.modes)},
                        {"devices", device_names(l.devices)},
                        {"backward", l.backward != nullptr}});
  }
  for (int32_t i = 0; i < t.num_ops; ++i)
    d.ops.push_back({{"name", t.ops[i].name}, {"doc", t.ops[i].doc ? t.ops[i].doc : ""},
                     {"devices", device_names(t.ops[i].devices)}});
  return d;
}

}  // namespace

void check_package_files(const Manifest& m, const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  const std::string again = fmt::format("; run `kcpp package index {}` again", dir.string());
  for (const ManifestNoarch& n : m.noarch)
    for (const ManifestFile& f : n.files) {
      const fs::path p = dir / f.path;
      std::error_code ec;
      if (!fs::is_regular_file(p, ec) || fs::is_symlink(p, ec))
        KCPP_FAIL("{}: listed in manifest.json but missing or not a regular file{}", p.string(), again);
      uint64_t size = 0;
      const std::string got = sha256_file(p, &size);
      if (got != f.sha256 || size != f.size)
        KCPP_FAIL("{}: sha256 {} ({} bytes), but manifest.json says {} ({} bytes){}", p.string(), got, size, f.sha256,
                  f.size, again);
    }
  for (const ManifestVariant& v : m.variants) {
    for (const ManifestFile& f : v.files) {
      const fs::path p = dir / f.path;
      std::error_code ec;
      if (!fs::is_regular_file(p, ec) || fs::is_symlink(p, ec))
        KCPP_FAIL("{}: listed in manifest.json but missing or not a regular file{}", p.string(), again);
      uint64_t size = 0;
      const std::string got = sha256_file(p, &size);
      if (got != f.sha256 || size != f.size)
        KCPP_FAIL("{}: sha256 {} ({} bytes), but manifest.json says {} ({} bytes){}", p.string(), got, size, f.sha256,
                  f.size, again);
    }
    const LibraryDescription d = describe_library(dir / v.library, v.name);
    if (d.name != m.name || d.version != m.version)
      KCPP_FAIL("{}: the library is {} {} but manifest.json says {} {}{}", (dir / v.library).string(), d.name,
                d.version, m.name, m.version, again);
    const nlohmann::json& vj = m.json.at("variants").at(v.name);
    if (vj.value("layers", nlohmann::json::array()) != d.layers || vj.value("ops", nlohmann::json::array()) != d.ops)
      KCPP_FAIL("{}: the layers and ops of variant {} differ from what its library declares{}", dir.string(), v.name,
                again);
  }
}

Manifest index_package(const std::filesystem::path& dir, std::string description) {
  namespace fs = std::filesystem;
  const fs::path build = dir / "build";
  if (!fs::is_directory(build)) KCPP_FAIL("{}: no build/ folder to index", dir.string());
  // Only the description carries over from an earlier manifest; everything else is read afresh.
  if (description.empty() && fs::exists(dir / "manifest.json")) {
    auto pj = nlohmann::json::parse(read_file(dir / "manifest.json"), nullptr, false);
    if (!pj.is_discarded() && pj.is_object() && pj.contains("description") && pj["description"].is_string())
      description = pj["description"];
  }

  nlohmann::json j = {{"kcpp_manifest", 1}, {"abi_version", KCPP_ABI_VERSION}, {"variants", nlohmann::json::object()}};
  std::string name, version;
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(build))
    if (e.is_directory()) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end());
  if (dirs.empty()) KCPP_FAIL("{}: build/ has no variant folders", dir.string());
  // Every file of a folder, sorted; symbolic links refused.
  const auto folder_files = [&](const fs::path& vdir) {
    std::vector<fs::path> files;
    for (const auto& e : fs::recursive_directory_iterator(vdir)) {
      if (e.is_symlink()) KCPP_FAIL("{}: symbolic links are not allowed in a package", e.path().string());
      if (e.is_regular_file()) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    return files;
  };
  std::vector<fs::path> variant_dirs;
  for (const fs::path& vdir : dirs) {
    const std::string vname = vdir.filename().string();
    if (!is_noarch_variant_name(vname)) {
      variant_dirs.push_back(vdir);
      continue;
    }
    // A `kernels` noarch variant: its files hashed, nothing loaded.
    nlohmann::json files = nlohmann::json::object();
    for (const fs::path& f : folder_files(vdir)) {
      if (f.extension() == ".pyc") continue;  // bytecode Python leaves beside the sources
      uint64_t size = 0;
      const std::string rel = fs::relative(f, dir).generic_string();
      if (auto p = relative_path_problem(rel); !p.empty()) KCPP_FAIL("{}: {}", f.string(), p);
      files[rel] = {{"sha256", sha256_file(f, &size)}, {"size", size}};
    }
    if (!files.empty()) j["noarch"][vname] = {{"files", files}};
  }
  if (variant_dirs.empty()) KCPP_FAIL("{}: build/ has no kcpp variant folders", dir.string());
  for (const fs::path& vdir : variant_dirs) {
    const std::string vname = vdir.filename().string();
    Variant::parse(vname);  // throws for a folder that is not a variant
    nlohmann::json vj = {{"files", nlohmann::json::object()}, {"cuda_archs", nlohmann::json::array()}};
    std::vector<fs::path> libs;
    const std::vector<fs::path> files = folder_files(vdir);
    for (const fs::path& f : files) {
      uint64_t size = 0;
      const std::string rel = fs::relative(f, dir).generic_string();
      if (auto p = relative_path_problem(rel); !p.empty()) KCPP_FAIL("{}: {}", f.string(), p);
      vj["files"][rel] = {{"sha256", sha256_file(f, &size)}, {"size", size}};
      if (f.parent_path() == vdir && f.extension() == ".so") libs.push_back(f);
    }
    if (libs.size() != 1)
      KCPP_FAIL("{}: expected exactly one library (*.so) at the top of the variant folder, found {}", vdir.string(),
                libs.size());
    vj["library"] = fs::relative(libs[0], dir).generic_string();
    if (fs::exists(vdir / "variant.json")) {
      auto info = nlohmann::json::parse(read_file(vdir / "variant.json"), nullptr, false);
      if (info.is_discarded() || !info.is_object()) KCPP_FAIL("{}: not a JSON object", (vdir / "variant.json").string());
      if (info.contains("cuda_archs")) vj["cuda_archs"] = info["cuda_archs"];
    }
    // Layers and ops from the library itself, read afresh on every index.
    const LibraryDescription d = describe_library(libs[0], vname);
    if (name.empty()) name = d.name, version = d.version;
    if (name != d.name || version != d.version)
      KCPP_FAIL("{}: the library says {} {}, another variant says {} {}", libs[0].string(), d.name, d.version, name,
                version);
    vj["layers"] = d.layers;
    vj["ops"] = d.ops;
    j["variants"][vname] = vj;
  }
  j["name"] = name;
  j["version"] = version;
  if (!description.empty()) j["description"] = description;
  Manifest m = Manifest::parse(j.dump(), dir.string());
  write_file_atomic(dir / "manifest.json", m.dump());
  return m;
}

}  // namespace kcpp::hub
