// model.safetensors.index.json of a sharded model folder (src/models/safetensors.h:
// WeightStore::open_folder): the weight map from tensor names to the shard files of the folder.  The
// input is the index; the folder holds two shards and a model.safetensors, written once:
//   model-00001-of-00002.safetensors  model.embed_tokens.weight (f32 [4, 2]), model.norm.weight (bf16 [2])
//   model-00002-of-00002.safetensors  lm_head.weight (f32 [4, 2])
//   model.safetensors                 all three
// Every tensor of a store that opens is then loaded (f32).
//
// Properties of an index that opens: its tensors are the weight map's names, each read from a file
// of the folder itself whose name is the one the map gives, and each one loads.
#include <stdlib.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "fuzz.h"
#include "models/safetensors.h"

using namespace kcpp;
using namespace kcpp::models;
namespace fs = std::filesystem;

namespace {

// The shards the index under test names: two of a tiny model, and the single file.
const fuzz::TempFolder& shards() {
  static const fuzz::TempFolder folder("weights");
  const std::vector<double> e = {0, 1, 2, 3, 4, 5, 6, 7}, n = {1, 1}, h = {7, 6, 5, 4, 3, 2, 1, 0};
  const Tensor embed = Tensor::from_f64(e, {4, 2}, DType::f32);
  const Tensor norm = Tensor::from_f64(n, {2}, DType::bf16);
  const Tensor head = Tensor::from_f64(h, {4, 2}, DType::f32);
  save_safetensors(folder.path / "model-00001-of-00002.safetensors", {{"model.embed_tokens.weight", embed}, {"model.norm.weight", norm}});
  save_safetensors(folder.path / "model-00002-of-00002.safetensors", {{"lm_head.weight", head}});
  save_safetensors(folder.path / "model.safetensors",
                   {{"model.embed_tokens.weight", embed}, {"model.norm.weight", norm}, {"lm_head.weight", head}});
  return folder;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fuzz::TempFolder& folder = shards();
  static fs::path index = folder.path / "model.safetensors.index.json";
  {
    std::FILE* f = std::fopen(index.c_str(), "wb");
    if (!f || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0) std::perror("write"), std::abort();
  }
  WeightStore w;
  try {
    w = WeightStore::open_folder(folder.path);
  } catch (const Error&) {
    return 0;
  }
  const nlohmann::json j = nlohmann::json::parse(fuzz::text(data, size));  // it opened: the index is JSON
  const nlohmann::json& map = j.at("weight_map");
  KCPP_FUZZ_EXPECT(w.names().size() == map.size(), "{} tensors from a weight map of {}", w.names().size(), map.size());
  for (const std::string& name : w.names()) {
    KCPP_FUZZ_EXPECT(map.contains(name), "'{}' is not in the weight map", name);
    const fs::path source = w.source(name);
    KCPP_FUZZ_EXPECT(source.parent_path() == folder.path && source.filename().string() == map[name].get<std::string>() &&
                         source.string().find('\0') == std::string::npos && fs::is_regular_file(source),
                     "'{}' is read from '{}', the map says '{}'", name, source.string(), map[name].get<std::string>());
    try {
      (void)w.load(name, DType::f32, Device::cpu());
    } catch (const Error& e) {
      KCPP_FUZZ_EXPECT(false, "'{}' does not load: {}", name, e.what());
    }
  }
  return 0;
}
