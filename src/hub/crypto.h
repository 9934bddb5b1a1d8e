// Hashes, encodings and Ed25519 signatures (libsodium), and the key file formats.
//
// Key files (JSON; `kcpp keygen` writes them):
//   NAME.key  {"kcpp_key": 1, "publisher": NAME, "algorithm": "ed25519",
//              "public_key": BASE64(32 bytes), "secret_key": BASE64(64 bytes)}     mode 0600
//   NAME.pub  {"kcpp_key": 1, "publisher": NAME, "algorithm": "ed25519", "public_key": BASE64}
// A public key is written "ed25519:BASE64" where one string must carry it (trust store, env var).
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace kcpp::hub {

// Lower-case hex sha256 of bytes / of a file (streamed; throws naming the file if unreadable).
std::string sha256_hex(std::string_view bytes);
std::string sha256_file(const std::filesystem::path& path, uint64_t* size = nullptr);
bool is_sha256_hex(std::string_view s);

// What a hash or size that a server, a manifest, a lock file or the cache claims must be before the
// hub names a file by it, compares with it or downloads up to it.  The largest file it accepts is
// 1 TiB: a larger size is damaged or hostile, not a package file.
inline constexpr uint64_t kMaxFileSize = uint64_t{1} << 40;
// "" when `s` is a sha256 (64 lower-case hex digits), else why not, showing `s` (see shown()).
std::string sha256_problem(std::string_view s);
// "" when a claimed size is at most kMaxFileSize, else why not.
std::string size_problem(uint64_t size);
// Untrusted text for an error message: quoted, bytes outside printable ASCII as \xNN, at most
// `max` bytes of it ("..." after them).
std::string shown(std::string_view s, size_t max = 80);

std::string base64_encode(std::string_view bytes);
// Standard base64 with padding, canonical (the unused bits of the last character zero); throws
// kcpp::Error (naming `what`) on anything else, a byte outside the alphabet included.
std::string base64_decode(std::string_view text, std::string_view what);

struct PublicKey {
  std::array<unsigned char, 32> bytes{};
  std::string str() const;  // "ed25519:BASE64"
  // Accepts "ed25519:BASE64" or bare BASE64; throws naming `what`.
  static PublicKey parse(std::string_view text, std::string_view what);
  bool operator==(const PublicKey&) const = default;
};

struct KeyPair {
  std::string publisher;
  PublicKey public_key;
  std::array<unsigned char, 64> secret{};

  static KeyPair generate(std::string publisher);
  void save(const std::filesystem::path& secret_file, const std::filesystem::path& public_file) const;
  static KeyPair load(const std::filesystem::path& secret_file);
  std::string sign(std::string_view message) const;  // detached signature, BASE64
};

// Reads a NAME.pub (or a NAME.key, using only its public half): (publisher, key).
std::pair<std::string, PublicKey> load_public_key(const std::filesystem::path& file);

bool verify_signature(const PublicKey& key, std::string_view message, std::string_view signature_base64);

// Valid publisher names: the organization rules of repo ids (letters, digits, '-', '_', '.').
void validate_publisher(std::string_view name);

}  // namespace kcpp::hub
