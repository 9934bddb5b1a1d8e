#include "models/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kcpp::models {

namespace {

constexpr uint64_t kMaxHeader = uint64_t{100} << 20;  // the reference implementation's limit (100 MB)

struct DTypeName {
  const char* name;
  DType dtype;
};
constexpr DTypeName kDTypes[] = {{"F64", DType::f64}, {"F32", DType::f32}, {"BF16", DType::bf16}, {"F16", DType::f16},
                                 {"I64", DType::i64}, {"I32", DType::i32}, {"U8", DType::u8},     {"BOOL", DType::boolean}};
// Element sizes of the dtypes the format has but the runtime does not (inspectable, not loadable).
constexpr std::pair<const char*, size_t> kOtherDTypes[] = {{"I16", 2},    {"U16", 2},      {"I8", 1},      {"U32", 4},
                                                            {"U64", 8},    {"F8_E4M3", 1},  {"F8_E5M2", 1}, {"F8_E8M0", 1}};

size_t element_size(std::string_view dtype) {
  for (const auto& d : kDTypes)
    if (dtype == d.name) return dtype_size(d.dtype);
  for (const auto& [n, s] : kOtherDTypes)
    if (dtype == n) return s;
  return 0;
}

}  // namespace

DType safetensors_dtype(std::string_view s) {
  for (const auto& d : kDTypes)
    if (s == d.name) return d.dtype;
  KCPP_FAIL("safetensors dtype '{}' has no runtime type (readable: F64 F32 BF16 F16 I64 I32 U8 BOOL)", s);
}

const char* safetensors_dtype_name(DType t) {
  for (const auto& d : kDTypes)
    if (d.dtype == t) return d.name;
  return "?";
}

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  SafetensorsFile f;
  f.path_ = path;
  const std::string p = path.string();
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  KCPP_CHECK(fd >= 0, "{}: cannot open: {}", p, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    KCPP_FAIL("{}: cannot stat: {}", p, std::strerror(errno));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    KCPP_FAIL("{}: {} bytes is too short for a safetensors file (an 8-byte header length comes first)", p, size);
  }
  // Private and writable: views can be modified (copy-on-write), the file never is.
  void* map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ::close(fd);
  KCPP_CHECK(map != MAP_FAILED, "{}: mmap failed: {}", p, std::strerror(errno));
  f.mapping_ = std::shared_ptr<const void>(map, [size](const void* m) { ::munmap(const_cast<void*>(m), size); });
  const auto* bytes = static_cast<const unsigned char*>(map);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  KCPP_CHECK(n <= kMaxHeader, "{}: header length {} is over the format's limit of {} bytes", p, n, kMaxHeader);
  KCPP_CHECK(n <= size - 8, "{}: header length {} runs past the end of the file ({} bytes): truncated or not safetensors", p,
             n, size);
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(bytes + 8, bytes + 8 + n);
  } catch (const nlohmann::json::exception& e) {
    KCPP_FAIL("{}: the header is not JSON: {}", p, e.what());
  }
  KCPP_CHECK(h.is_object(), "{}: the header is not a JSON object", p);
  f.data_ = bytes + 8 + n;
  f.data_size_ = size - 8 - n;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, e] : h.items()) {
    if (name == "__metadata__") {
      KCPP_CHECK(e.is_object(), "{}: __metadata__ must be an object of strings", p);
      for (const auto& [k, v] : e.items()) {
        KCPP_CHECK(v.is_string(), "{}: __metadata__.{} must be a string", p, k);
        f.metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string where = fmt::format("{}: tensor '{}'", p, name);
    KCPP_CHECK(e.is_object() && e.contains("dtype") && e.contains("shape") && e.contains("data_offsets"),
               "{}: expected {{\"dtype\", \"shape\", \"data_offsets\"}}", where);
    Entry en;
    KCPP_CHECK(e["dtype"].is_string(), "{}: dtype must be a string", where);
    en.dtype = e["dtype"].get<std::string>();
    const size_t es = element_size(en.dtype);
    KCPP_CHECK(es > 0, "{}: unknown dtype '{}'", where, en.dtype);
    KCPP_CHECK(e["shape"].is_array(), "{}: shape must be an array", where);
    uint64_t numel = 1;
    for (const auto& d : e["shape"]) {
      KCPP_CHECK((d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()}) ||
                     (d.is_number_integer() && d.get<int64_t>() >= 0),
                 "{}: shape must hold non-negative integers below 2^63, got {}", where, e["shape"].dump());
      const uint64_t v = d.get<uint64_t>();
      KCPP_CHECK(v == 0 || numel <= std::numeric_limits<uint64_t>::max() / v, "{}: shape {} overflows", where, e["shape"].dump());
      numel *= v;
      en.shape.push_back(static_cast<int64_t>(v));
    }
    const auto& off = e["data_offsets"];
    KCPP_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
               "{}: data_offsets must be [begin, end] (non-negative integers)", where);
    en.begin = off[0].get<uint64_t>();
    en.end = off[1].get<uint64_t>();
    KCPP_CHECK(en.begin <= en.end, "{}: data_offsets [{}, {}] run backwards", where, en.begin, en.end);
    KCPP_CHECK(numel <= std::numeric_limits<uint64_t>::max() / es && en.end - en.begin == numel * es,
               "{}: data_offsets [{}, {}] hold {} bytes but {} {} x {} needs {}", where, en.begin, en.end, en.end - en.begin,
               en.dtype, e["shape"].dump(), numel, numel * es);
    KCPP_CHECK(en.end <= f.data_size_, "{}: data_offsets end {} is past the data ({} bytes): the file is truncated", where,
               en.end, f.data_size_);
    if (en.end > en.begin) ranges.emplace_back(en.begin, en.end);
    f.entries_.emplace(name, std::move(en));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    KCPP_CHECK(ranges[i].first >= ranges[i - 1].second, "{}: two tensors overlap at data bytes [{}, {})", p, ranges[i].first,
               ranges[i - 1].second);
  return f;
}

const SafetensorsFile::Entry& SafetensorsFile::entry(std::string_view name) const {
  const auto it = entries_.find(name);
  KCPP_CHECK(it != entries_.end(), "{}: no tensor '{}'", path_.string(), name);
  return it->second;
}

Tensor SafetensorsFile::view(std::string_view name) const {
  const Entry& e = entry(name);
  DType t;
  try {
    t = safetensors_dtype(e.dtype);
  } catch (const Error& err) {
    KCPP_FAIL("{}: tensor '{}': {}", path_.string(), name, err.what());
  }
  void* p = const_cast<unsigned char*>(data_ + e.begin);
  if (t == DType::boolean) {  // a C++ bool must hold 0 or 1; any other byte is undefined behaviour to read
    const auto* b = static_cast<const unsigned char*>(p);
    const auto* bad = std::find_if(b, b + (e.end - e.begin), [](unsigned char c) { return c > 1; });
    if (bad != b + (e.end - e.begin))
      KCPP_FAIL("{}: tensor '{}': BOOL element {} is the byte {}, not 0 or 1", path_.string(), name, bad - b, int{*bad});
  }
  if (reinterpret_cast<uintptr_t>(p) % dtype_size(t) != 0) {  // unaligned: copy out
    Tensor out = Tensor::empty(e.shape, t, Device::cpu());
    if (e.end > e.begin) std::memcpy(out.data(), p, e.end - e.begin);  // an empty tensor has no data pointer
    return out;
  }
  auto keep = mapping_;
  return Tensor::from_blob(p, e.shape, t, Device::cpu(), {}, [keep] {});
}

Tensor SafetensorsFile::load(std::string_view name, DType dtype, Device device) const {
  Tensor t = view(name);
  if (device.is_cuda()) t = t.to(device);  // convert where it is fast
  return t.dtype() == dtype ? t : t.to(dtype);
}

void save_safetensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, Tensor>> sorted = tensors;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t at = 0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const auto& [name, t] = sorted[i];
    KCPP_CHECK(name != "__metadata__" && !name.empty(), "save_safetensors: bad tensor name '{}'", name);
    KCPP_CHECK(i == 0 || sorted[i - 1].first != name, "save_safetensors: tensor '{}' given twice", name);
    const uint64_t bytes = static_cast<uint64_t>(t.nbytes());
    h[name] = {{"dtype", safetensors_dtype_name(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {at, at + bytes}}};
    at += bytes;
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    KCPP_CHECK(out.good(), "save_safetensors: cannot write {}", tmp.string());
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((header.size() >> (8 * i)) & 0xff);
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const auto& [name, t] : sorted) {
      const Tensor c = t.to(Device::cpu()).contiguous();
      out.write(static_cast<const char*>(c.data()), static_cast<std::streamsize>(c.nbytes()));
    }
    out.flush();
    KCPP_CHECK(out.good(), "save_safetensors: writing {} failed", tmp.string());
  }
  std::filesystem::rename(tmp, path);
}

// ---- WeightStore -------------------------------------------------------------------------------------

WeightStore WeightStore::open_folder(const std::filesystem::path& folder) {
  WeightStore w;
  w.folder_ = folder;
  const auto single = folder / "model.safetensors", index = folder / "model.safetensors.index.json";
  if (std::filesystem::exists(index)) {
    nlohmann::json j;
    try {
      std::ifstream in(index);
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      KCPP_FAIL("{}: not JSON: {}", index.string(), e.what());
    }
    KCPP_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
               "{}: expected {{\"weight_map\": {{tensor: file}}}}", index.string());
    std::map<std::string, size_t> shard_index;
    for (const auto& [tensor, file] : j["weight_map"].items()) {
      KCPP_CHECK(file.is_string(), "{}: weight_map.{} must be a file name", index.string(), tensor);
      const std::string fname = file.get<std::string>();
      // A plain name in the folder: no '/', not "." or "..", and no NUL (the OS would open the name
      // before it: "shard.safetensors\0x" read shard.safetensors).
      KCPP_CHECK(fname.find('/') == std::string::npos && fname.find('\0') == std::string::npos && fname != "." &&
                     fname != ".." && !fname.empty(),
                 "{}: weight_map.{} = {} is not a file in the folder", index.string(), tensor, file.dump());
      auto [it, fresh] = shard_index.try_emplace(fname, w.files_.size());
      if (fresh) w.files_.push_back(SafetensorsFile::open(folder / fname));
      KCPP_CHECK(w.files_[it->second].contains(tensor), "{}: weight_map says '{}' is in {}, which has no such tensor",
                 index.string(), tensor, fname);
      w.where_[tensor] = it->second;
    }
  } else {
    KCPP_CHECK(std::filesystem::exists(single), "{}: no model.safetensors or model.safetensors.index.json", folder.string());
    w.files_.push_back(SafetensorsFile::open(single));
    for (const auto& [name, e] : w.files_[0].entries()) w.where_[name] = 0;
  }
  return w;
}

bool WeightStore::contains(std::string_view name) const { return where_.find(name) != where_.end(); }

std::vector<std::string> WeightStore::names() const {
  std::vector<std::string> out;
  for (const auto& [n, i] : where_) out.push_back(n);
  return out;
}

std::vector<std::string> WeightStore::unused() const {
  std::vector<std::string> out;
  for (const auto& [n, i] : where_)
    if (!loaded_.contains(n)) out.push_back(n);
  return out;
}

bool WeightStore::same(std::string_view a, std::string_view b) const {
  const auto ia = where_.find(a), ib = where_.find(b);
  KCPP_CHECK(ia != where_.end() && ib != where_.end(), "{}: missing weight '{}'", folder_.string(), ia == where_.end() ? a : b);
  const SafetensorsFile &fa = files_[ia->second], &fb = files_[ib->second];
  const SafetensorsFile::Entry &ea = fa.entry(a), &eb = fb.entry(b);
  if (ea.dtype != eb.dtype || ea.shape != eb.shape) return false;
  const Tensor va = fa.view(a), vb = fb.view(b);
  return std::memcmp(va.data(), vb.data(), static_cast<size_t>(va.nbytes())) == 0;
}

std::string WeightStore::source(std::string_view name) const {
  const auto it = where_.find(name);
  return it == where_.end() ? folder_.string() : files_[it->second].path().string();
}

Tensor WeightStore::load(std::string_view name, DType dtype, Device device, const std::vector<int64_t>* shape) const {
  const auto it = where_.find(name);
  KCPP_CHECK(it != where_.end(), "{}: missing weight '{}'", folder_.string(), name);
  const SafetensorsFile& f = files_[it->second];
  if (shape) {
    const auto& have = f.entry(name).shape;
    KCPP_CHECK(have == *shape, "{}: weight '{}' has shape [{}], the config needs [{}]", f.path().string(), name,
               fmt::join(have, ", "), fmt::join(*shape, ", "));
  }
  Tensor t = f.load(name, dtype, device);
  loaded_.emplace(name);
  return t;
}

std::string name_list(const std::vector<std::string>& names, size_t most) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < most; ++i) out += fmt::format("{}'{}'", i ? ", " : "", names[i]);
  if (names.size() > most) out += fmt::format(" and {} more", names.size() - most);
  return out;
}

}  // namespace kcpp::models
