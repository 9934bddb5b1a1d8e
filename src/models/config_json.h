// Reading a model folder's config.json (ModelConfig and MambaConfig): the file parsed with an error
// that names it, and typed reads of its keys, each error naming the file and the key.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/files.h"

namespace kcpp::models::config_json {

// folder / "config.json" parsed; *where is set to its path, which the errors name.
inline nlohmann::json read(const std::filesystem::path& folder, std::string* where) {
  const auto path = folder / "config.json";
  *where = path.string();
  const std::string text = read_whole_file(path, "the model's config");
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    KCPP_FAIL("{}: not JSON: {}", *where, e.what());
  }
}

// Typed reads of config keys; a JSON integer past int64 (it arrives unsigned) is an error, not a wrapped value.
struct Reader {
  const nlohmann::json& j;
  const std::string& where;

  bool has(const char* key) const { return j.contains(key) && !j[key].is_null(); }
  int64_t integer(const char* key) const {
    KCPP_CHECK(has(key), "{}: missing key '{}'", where, key);
    const nlohmann::json& v = j[key];
    KCPP_CHECK(v.is_number_integer(), "{}: '{}' must be an integer, is {}", where, key, v.dump());
    KCPP_CHECK(!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()},
               "{}: '{}' is {}, past any size this library handles", where, key, v.dump());
    return v.get<int64_t>();
  }
  int64_t integer(const char* key, int64_t fallback) const { return has(key) ? integer(key) : fallback; }
  double real(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    KCPP_CHECK(j[key].is_number(), "{}: '{}' must be a number, is {}", where, key, j[key].dump());
    return j[key].get<double>();
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    KCPP_CHECK(j[key].is_boolean(), "{}: '{}' must be true or false, is {}", where, key, j[key].dump());
    return j[key].get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    KCPP_CHECK(j[key].is_string(), "{}: '{}' must be a string, is {}", where, key, j[key].dump());
    return j[key].get<std::string>();
  }
  std::vector<int64_t> ids(const char* key) const {  // an integer or a list of them
    std::vector<int64_t> out;
    if (!has(key)) return out;
    if (j[key].is_number_integer()) return {integer(key)};
    KCPP_CHECK(j[key].is_array(), "{}: '{}' must be a token id or a list of them", where, key);
    for (const auto& v : j[key]) {
      KCPP_CHECK(v.is_number_integer() && (!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()}),
                 "{}: '{}' must hold token ids, holds {}", where, key, v.dump());
      out.push_back(v.get<int64_t>());
    }
    return out;
  }
  std::vector<int64_t> indices(const char* key) const {  // a list of integers (layer indices, flags)
    std::vector<int64_t> out;
    if (!has(key)) return out;
    KCPP_CHECK(j[key].is_array(), "{}: '{}' must be a list of integers, is {}", where, key, j[key].dump());
    for (const auto& v : j[key]) {
      KCPP_CHECK(v.is_number_integer() && (!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()}),
                 "{}: '{}' must hold integers, holds {}", where, key, v.dump());
      out.push_back(v.get<int64_t>());
    }
    return out;
  }
  std::vector<std::string> strings(const char* key) const {
    std::vector<std::string> out;
    if (!has(key)) return out;
    KCPP_CHECK(j[key].is_array(), "{}: '{}' must be a list of strings, is {}", where, key, j[key].dump());
    for (const auto& v : j[key]) {
      KCPP_CHECK(v.is_string(), "{}: '{}' must hold strings, holds {}", where, key, v.dump());
      out.push_back(v.get<std::string>());
    }
    return out;
  }
};

}  // namespace kcpp::models::config_json
