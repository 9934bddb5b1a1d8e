// manifest.json: what a package revision contains, the sha256 of every file, and its signature.
//
//   {
//     "kcpp_manifest": 1,
//     "name": "example", "version": "1.0.0", "description": "...", "abi_version": 1,
//     "variants": {
//       "kcpp1-cpu-x86_64-linux": {
//         "library": "build/kcpp1-cpu-x86_64-linux/libexample.so",
//         "cuda_archs": [],                                    // e.g. ["80", "90a"] for CUDA builds
//         "files": {"build/kcpp1-cpu-x86_64-linux/libexample.so": {"sha256": HEX, "size": N}, ...},
//         "layers": [{"name": "SiLU", "contract": "SiLU/1", "modes": ["inference", "training"],
//                     "devices": ["cpu"], "backward": true, "doc": "..."}],
//         "ops": [{"name": "scale", "devices": ["cpu"], "doc": "..."}]
//       }
//     },
//     "noarch": {                                              // optional: the `kernels` library's
//       "torch-cpu": {"files": {"build/torch-cpu/layers.py": {"sha256": HEX, "size": N}, ...}}
//     },                                                       // pure-Python variants (section 8)
//     "signature": {"algorithm": "ed25519", "publisher": "acme", "public_key": "ed25519:BASE64",
//                   "value": BASE64}
//   }
//
// The signature covers the manifest's *canonical bytes*: the JSON object without its "signature"
// member, serialized with object keys sorted, no insignificant whitespace, strings in UTF-8 with
// only the characters JSON requires escaped (nlohmann::json::dump()).  Since every file's sha256
// is inside, the signature covers every file.  Manifests contain no floating-point numbers.
// Every path is relative, inside build/<variant>/, without '.', '..' or empty components.
//
// `noarch` lists the folders of build/ that are no kcpp variant but a Hugging Face `kernels` noarch
// variant ("torch-cpu", "torch-cuda": Python that loads this package's library through the bridge,
// python/kcpp/hf_kernels.py): their files are hashed and signed with the rest, and checked by
// `kcpp package sign` / check_package_files; a host loading the package never reads them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "hub/crypto.h"

namespace kcpp::hub {

// The largest manifest.json the hub downloads (16 MiB: some hundred thousand files).
inline constexpr uint64_t kMaxManifestSize = uint64_t{16} << 20;

struct ManifestFile {
  std::string path;
  std::string sha256;
  uint64_t size = 0;
};

struct ManifestLayer {
  std::string name, contract, doc;
  std::vector<std::string> modes, devices;
  bool backward = false;
};

struct ManifestOp {
  std::string name, doc;
  std::vector<std::string> devices;
};

struct ManifestVariant {
  std::string name;
  std::string library;
  std::vector<std::string> cuda_archs;
  std::vector<ManifestFile> files;
  std::vector<ManifestLayer> layers;
  std::vector<ManifestOp> ops;
  const ManifestFile* file(std::string_view path) const;
};

struct Signature {
  std::string algorithm, publisher, public_key, value;
};

// A `kernels` noarch variant folder: its name ("torch-cpu") and files.
struct ManifestNoarch {
  std::string name;
  std::vector<ManifestFile> files;
};

// True for a build/ folder name the Hugging Face `kernels` library reads as a noarch variant:
// "torch-" and a backend of lower-case letters ("torch-cpu", "torch-cuda", "torch-universal").
bool is_noarch_variant_name(std::string_view name);

struct Manifest {
  std::string name, version, description;
  int abi_version = 0;
  std::vector<ManifestVariant> variants;
  std::vector<ManifestNoarch> noarch;
  std::optional<Signature> signature;
  nlohmann::json json;  // the whole document as read (unknown fields kept, and signed)

  // Validates everything above; throws "SOURCE: manifest.json: WHAT" naming the field.
  static Manifest parse(std::string_view text, std::string_view source);
  std::string canonical_bytes() const;  // what the signature covers
  const ManifestVariant* variant(std::string_view name) const;
  void sign(const KeyPair& key);        // sets "signature" (in `json` too)
  std::string dump() const;             // pretty, for writing manifest.json
};

// Writes DIR/manifest.json (unsigned) from DIR/build/<variant>/ folders (and the noarch folders,
// build/torch-<backend>/, whose files are listed under "noarch"): every file's sha256 and
// size; the library (the one lib*.so of the folder); CUDA architectures from the folder's
// variant.json ({"cuda_archs": [...]}) if any; layers and ops read afresh from each library (loaded:
// dlopen and the ABI table), so a library that does not load on this machine is an error.  Only the
// description carries over from an earlier manifest.json.
Manifest index_package(const std::filesystem::path& dir, std::string description = "");

// What `kcpp package sign` checks before signing: every file the manifest lists (noarch ones too) is in DIR with that
// sha256 and size, and each variant's library loads and declares the manifest's name, version,
// layers and ops.  Throws naming the first difference.
void check_package_files(const Manifest& m, const std::filesystem::path& dir);

// The JSON name of each KCPP_MODE_* bit / device, and back.
std::vector<std::string> mode_names(uint32_t modes);
std::vector<std::string> device_names(uint32_t devices);

}  // namespace kcpp::hub
