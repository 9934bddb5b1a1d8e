#include "hub/crypto.h"

#include <sodium.h>
#include <sys/stat.h>

#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "hub/fs.h"
#include "hub/reference.h"

namespace kcpp::hub {
namespace {

void ensure_sodium() {
  static std::once_flag once;
  static int rc = 0;
  std::call_once(once, [] { rc = sodium_init(); });
  KCPP_CHECK(rc >= 0, "libsodium failed to initialize");
}

std::string to_hex(const unsigned char* p, size_t n) {
  std::string s(2 * n + 1, '\0');
  sodium_bin2hex(s.data(), s.size(), p, n);
  s.pop_back();
  return s;
}

}  // namespace

std::string sha256_hex(std::string_view bytes) {
  ensure_sodium();
  unsigned char out[crypto_hash_sha256_BYTES];
  crypto_hash_sha256(out, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  return to_hex(out, sizeof out);
}

std::string sha256_file(const std::filesystem::path& path, uint64_t* size) {
  ensure_sodium();
  std::ifstream in(path, std::ios::binary);
  if (!in) KCPP_FAIL("cannot read {}: {}", path.string(), std::strerror(errno));
  crypto_hash_sha256_state st;
  crypto_hash_sha256_init(&st);
  std::string buf(1 << 20, '\0');
  uint64_t total = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto got = static_cast<size_t>(in.gcount());
    crypto_hash_sha256_update(&st, reinterpret_cast<const unsigned char*>(buf.data()), got);
    total += got;
  }
  if (in.bad()) KCPP_FAIL("error reading {}", path.string());
  unsigned char out[crypto_hash_sha256_BYTES];
  crypto_hash_sha256_final(&st, out);
  if (size) *size = total;
  return to_hex(out, sizeof out);
}

bool is_sha256_hex(std::string_view s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

std::string shown(std::string_view s, size_t max) {
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') out += static_cast<char>(c);
    else out += fmt::format("\\x{:02x}", c);
  }
  return out + (s.size() > max ? "'..." : "'");
}

std::string sha256_problem(std::string_view s) {
  if (is_sha256_hex(s)) return "";
  return fmt::format("{} is not a sha256 (64 lower-case hex digits)", shown(s));
}

std::string size_problem(uint64_t size) {
  if (size <= kMaxFileSize) return "";
  return fmt::format("the size {} is more than the {} bytes (1 TiB) a hub file may have", size, kMaxFileSize);
}

std::string base64_encode(std::string_view bytes) {
  ensure_sodium();
  std::string s(sodium_base64_encoded_len(bytes.size(), sodium_base64_VARIANT_ORIGINAL), '\0');
  sodium_bin2base64(s.data(), s.size(), reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(),
                    sodium_base64_VARIANT_ORIGINAL);
  s.resize(std::strlen(s.c_str()));
  return s;
}

std::string base64_decode(std::string_view text, std::string_view what) {
  ensure_sodium();
  // libsodium (1.0.18) decodes every byte from 0x80 up as '/': only the alphabet is base64 here, so
  // that a key or a signature has one text.
  for (const char c : text)
    if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' || c == '/' || c == '='))
      KCPP_FAIL("{}: not valid base64 (the byte 0x{:02x} is not one of A-Z a-z 0-9 + / =)", what, static_cast<unsigned char>(c));
  std::string out(text.size(), '\0');
  size_t len = 0;
  const char* end = nullptr;
  if (sodium_base642bin(reinterpret_cast<unsigned char*>(out.data()), out.size(), text.data(), text.size(), nullptr,
                        &len, &end, sodium_base64_VARIANT_ORIGINAL) != 0 ||
      end != text.data() + text.size())
    KCPP_FAIL("{}: not valid base64", what);
  out.resize(len);
  return out;
}

std::string PublicKey::str() const {
  return "ed25519:" + base64_encode(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

PublicKey PublicKey::parse(std::string_view text, std::string_view what) {
  if (text.starts_with("ed25519:")) text.remove_prefix(8);
  else if (text.find(':') != std::string_view::npos)
    KCPP_FAIL("{}: unsupported key algorithm '{}' (only ed25519)", what, text.substr(0, text.find(':')));
  const std::string raw = base64_decode(text, what);
  if (raw.size() != 32) KCPP_FAIL("{}: an Ed25519 public key has 32 bytes, this one {}", what, raw.size());
  PublicKey k;
  std::memcpy(k.bytes.data(), raw.data(), 32);
  return k;
}

void validate_publisher(std::string_view name) {
  if (auto p = repo_part_problem(name, "publisher name"); !p.empty()) KCPP_FAIL("bad publisher name '{}': {}", name, p);
}

KeyPair KeyPair::generate(std::string publisher) {
  ensure_sodium();
  validate_publisher(publisher);
  KeyPair k;
  k.publisher = std::move(publisher);
  crypto_sign_ed25519_keypair(k.public_key.bytes.data(), k.secret.data());
  return k;
}

void KeyPair::save(const std::filesystem::path& secret_file, const std::filesystem::path& public_file) const {
  nlohmann::json pub = {{"kcpp_key", 1}, {"publisher", publisher}, {"algorithm", "ed25519"},
                        {"public_key", public_key.str()}};
  nlohmann::json sec = pub;
  sec["secret_key"] =
      base64_encode(std::string_view(reinterpret_cast<const char*>(secret.data()), secret.size()));
  write_file_atomic(secret_file, sec.dump(2) + "\n", 0600);
  write_file_atomic(public_file, pub.dump(2) + "\n", 0644);
}

namespace {
nlohmann::json read_key_json(const std::filesystem::path& file) {
  const std::string text = read_file(file);
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) KCPP_FAIL("{}: not a kcpp key file (not a JSON object)", file.string());
  for (const char* k : {"publisher", "algorithm", "public_key"})
    if (!j.contains(k) || !j[k].is_string()) KCPP_FAIL("{}: missing string field '{}'", file.string(), k);
  if (j["algorithm"] != "ed25519") KCPP_FAIL("{}: unsupported algorithm {}", file.string(), j["algorithm"].dump());
  validate_publisher(j["publisher"].get<std::string>());
  return j;
}
}  // namespace

KeyPair KeyPair::load(const std::filesystem::path& file) {
  ensure_sodium();
  nlohmann::json j = read_key_json(file);
  if (!j.contains("secret_key") || !j["secret_key"].is_string())
    KCPP_FAIL("{}: no secret key in it (is this the .pub file? signing needs the .key file)", file.string());
  KeyPair k;
  k.publisher = j["publisher"];
  k.public_key = PublicKey::parse(j["public_key"].get<std::string>(), file.string());
  const std::string raw = base64_decode(j["secret_key"].get<std::string>(), file.string());
  if (raw.size() != 64) KCPP_FAIL("{}: an Ed25519 secret key has 64 bytes, this one {}", file.string(), raw.size());
  std::memcpy(k.secret.data(), raw.data(), 64);
  // A secret key is its 32-byte seed, then the public key; the pair is derived from the seed
  // (crypto_sign_ed25519_sk_to_pk only copies the second half: a damaged seed passed and signed what
  // the public key does not verify).
  unsigned char seed[crypto_sign_SEEDBYTES], pk[crypto_sign_PUBLICKEYBYTES], sk[crypto_sign_SECRETKEYBYTES];
  crypto_sign_ed25519_sk_to_seed(seed, k.secret.data());
  crypto_sign_seed_keypair(pk, sk, seed);
  const bool same = std::memcmp(pk, k.public_key.bytes.data(), 32) == 0 && std::memcmp(sk, k.secret.data(), 64) == 0;
  sodium_memzero(seed, sizeof seed);
  sodium_memzero(sk, sizeof sk);
  if (!same)
    KCPP_FAIL("{}: the public key does not belong to the secret key (a damaged key file? `kcpp keygen` makes a new pair)",
              file.string());
  return k;
}

std::pair<std::string, PublicKey> load_public_key(const std::filesystem::path& file) {
  nlohmann::json j = read_key_json(file);
  return {j["publisher"].get<std::string>(), PublicKey::parse(j["public_key"].get<std::string>(), file.string())};
}

std::string KeyPair::sign(std::string_view message) const {
  ensure_sodium();
  unsigned char sig[crypto_sign_BYTES];
  crypto_sign_detached(sig, nullptr, reinterpret_cast<const unsigned char*>(message.data()), message.size(),
                       secret.data());
  return base64_encode(std::string_view(reinterpret_cast<const char*>(sig), sizeof sig));
}

bool verify_signature(const PublicKey& key, std::string_view message, std::string_view signature_base64) {
  ensure_sodium();
  std::string sig;
  try {
    sig = base64_decode(signature_base64, "signature");
  } catch (const Error&) {
    return false;
  }
  if (sig.size() != crypto_sign_BYTES) return false;
  return crypto_sign_verify_detached(reinterpret_cast<const unsigned char*>(sig.data()),
                                     reinterpret_cast<const unsigned char*>(message.data()), message.size(),
                                     key.bytes.data()) == 0;
}

}  // namespace kcpp::hub
