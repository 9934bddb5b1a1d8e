// safetensors files (https://huggingface.co/docs/safetensors): reading memory-mapped, writing.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}}
// then the data, offsets relative to its start.  open() checks everything the header claims against
// the file before any tensor is read: the header length against the file size, JSON, every entry's
// dtype / shape / offsets (end - begin = numel * element size, inside the data, no two tensors
// overlapping), and names the file and the tensor in every error.  A truncated file or a header that
// lies about sizes is an error, never a read past the mapping.
//
// Dtypes read: F64 F32 BF16 F16 I64 I32 U8 BOOL (the runtime's); others (F8_*, I16, I8, U16...) are
// listed and can be inspected, and load() refuses them by name.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace kcpp::models {

class SafetensorsFile {
 public:
  struct Entry {
    std::string dtype;            // as written: "BF16", "F32", ...
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // byte offsets into the data area
  };

  // Maps and validates the file; throws kcpp::Error naming the file (and the tensor) on any problem.
  static SafetensorsFile open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  const std::map<std::string, Entry, std::less<>>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(std::string_view name) const { return entries_.find(name) != entries_.end(); }
  const Entry& entry(std::string_view name) const;  // throws naming the file when absent

  // The tensor as stored, on the CPU: a view of the mapping when its offset is aligned for its dtype
  // (the mapping stays alive while the view does), else a copy.
  Tensor view(std::string_view name) const;
  // Converted to `dtype` on `device` (a copy; the view itself when nothing changes).
  Tensor load(std::string_view name, DType dtype, Device device) const;

 private:
  std::filesystem::path path_;
  std::shared_ptr<const void> mapping_;  // the whole file, munmap'ed with the last user
  const unsigned char* data_ = nullptr;  // start of the data area
  uint64_t data_size_ = 0;
  std::map<std::string, Entry, std::less<>> entries_;
  std::map<std::string, std::string> metadata_;
};

// The runtime dtype of a safetensors dtype string; throws for the ones the runtime has no type for.
DType safetensors_dtype(std::string_view s);
const char* safetensors_dtype_name(DType t);

// Writes tensors (any device, any strides; stored contiguous in their dtype) in name order, with
// the header padded to 8 bytes as the reference writer does; to a temporary file renamed into place.
void save_safetensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// A model's weights: `model.safetensors`, or `model.safetensors.index.json` and its shards
// ({"weight_map": {"tensor": "model-00001-of-00002.safetensors", ...}}), each shard opened once.
// It remembers which tensors were loaded, so that a model can tell which ones it never used.
class WeightStore {
 public:
  static WeightStore open_folder(const std::filesystem::path& folder);
  const std::filesystem::path& folder() const { return folder_; }
  bool contains(std::string_view name) const;
  std::vector<std::string> names() const;
  // The tensor in `dtype` on `device`; `shape`, when given, must match (the error names the tensor,
  // its file and both shapes).
  Tensor load(std::string_view name, DType dtype, Device device, const std::vector<int64_t>* shape = nullptr) const;
  std::string source(std::string_view name) const;  // the file it is in, for messages
  // The tensors never given by load(), in name order.
  std::vector<std::string> unused() const;
  // Whether two stored tensors have the same dtype, shape and bytes.
  bool same(std::string_view a, std::string_view b) const;

 private:
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t, std::less<>> where_;  // tensor -> index into files_
  std::filesystem::path folder_;
  mutable std::set<std::string, std::less<>> loaded_;
};

// "'a', 'b', 'c'": tensor names for an error message, at most `most` of them, then how many more.
std::string name_list(const std::vector<std::string>& names, size_t most = 12);

}  // namespace kcpp::models
