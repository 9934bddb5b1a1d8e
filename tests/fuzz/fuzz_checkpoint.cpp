// A training checkpoint as `kcpp train --resume` reads it, besides the model (config.json and
// model.safetensors: the config and safetensors targets): trainer_state.json
// (src/train/trainer.h: TrainerState::parse) and the optimizer state (src/train/data_parallel.h:
// load_optimizer_state), the files optimizer-rank<r>-of-<world>.safetensors of the folder with their
// "steps" and "slices" metadata and their state tensors, assembled into an AdamW's state.
//
// The input is the folder's files one after another, each ending at "KCPPFILE": trainer_state.json,
// then the optimizer state of ranks 0 to world - 1 (at most 4).  The state is read into a whole AdamW
// (an f32 [2, 3] and a bf16 [4] parameter, which has an f32 master copy) and into a data-parallel
// rank's shard of it (the pieces [3, 6) and [1, 3)).
//
// Properties: a trainer state that reads writes back to the same, its counts 0 or more; a single
// optimizer file without slices is read as it is (each f32 state tensor of the whole AdamW holds the
// file's elements).
#include <stdlib.h>

#include <cstring>
#include <filesystem>

#include "core/tensor.h"
#include "fuzz.h"
#include "models/safetensors.h"
#include "train/adamw.h"
#include "train/data_parallel.h"
#include "train/trainer.h"

using namespace kcpp;
namespace fs = std::filesystem;

namespace {

std::vector<std::pair<std::string, Tensor>> whole_params() {
  return {{"w", Tensor::zeros({2, 3}, DType::f32, Device::cpu())}, {"b", Tensor::zeros({4}, DType::bf16, Device::cpu())}};
}

void trainer_state(std::string_view text) {
  train::TrainerState s;
  try {
    s = train::TrainerState::parse(text, "fuzz");
  } catch (const Error&) {
    return;
  }
  KCPP_FUZZ_EXPECT(s.steps_done >= 0 && s.batch >= 0 && s.seq >= 0 && s.data_tokens >= 0 && s.warmup_steps >= 0 &&
                       s.schedule_steps >= 0,
                   "a negative count in {}", s.dump());
  const train::TrainerState back = train::TrainerState::parse(s.dump(), "fuzz (written back)");
  KCPP_FUZZ_EXPECT(back.steps_done == s.steps_done && back.seed == s.seed && back.batch == s.batch && back.seq == s.seq &&
                       back.lr == s.lr && back.dtype == s.dtype && back.data == s.data && back.data_tokens == s.data_tokens &&
                       back.data_sha256 == s.data_sha256 && back.lr_scheduler == s.lr_scheduler &&
                       back.warmup_steps == s.warmup_steps && back.schedule_steps == s.schedule_steps,
                   "the trainer state writes back as {}", back.dump());
}

void optimizer_state(const fs::path& folder, size_t world) {
  train::AdamW whole(whole_params(), {});
  bool loaded = false;
  try {
    train::load_optimizer_state(folder, whole);
    loaded = true;
  } catch (const Error&) {
  }
  if (loaded) KCPP_FUZZ_EXPECT(whole.steps() >= 0, "steps {}", whole.steps());
  if (loaded && world == 1) {
    const models::SafetensorsFile file = models::SafetensorsFile::open(folder / "optimizer-rank0-of-1.safetensors");
    if (!file.metadata().contains("slices"))
      for (const auto& [key, t] : whole.state_tensors()) {
        const Tensor saved = file.view(key);  // flat or shaped: the elements count
        if (saved.dtype() != DType::f32) continue;
        KCPP_FUZZ_EXPECT(saved.numel() == t.numel() && std::memcmp(saved.data(), t.contiguous().data(), t.nbytes()) == 0,
                         "'{}' does not read as the file holds it", key);
      }
  }
  auto params = whole_params();
  std::vector<std::pair<std::string, Tensor>> shard = {{"w", params[0].second.view({6}).narrow(0, 3, 3).contiguous()},
                                                       {"b", params[1].second.narrow(0, 1, 2).contiguous()}};
  train::AdamW piece(shard, {});
  try {
    train::load_optimizer_state(folder, piece, {{"w", {3, 6}}, {"b", {1, 4}}});
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fuzz::TempFolder folder("checkpoint");
  std::vector<std::string_view> parts;
  std::string_view rest = fuzz::text(data, size);
  for (;;) {
    const size_t at = rest.find("KCPPFILE");
    parts.push_back(rest.substr(0, at));
    if (at == std::string_view::npos || parts.size() == 5) break;
    rest.remove_prefix(at + 8);
  }
  trainer_state(parts[0]);
  if (parts.size() < 2) return 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(folder.path, ec)) fs::remove(e.path(), ec);
  const size_t world = parts.size() - 1;
  for (size_t r = 0; r < world; ++r) {
    const std::string_view bytes = parts[r + 1];
    std::FILE* f = std::fopen((folder.path / fmt::format("optimizer-rank{}-of-{}.safetensors", r, world)).c_str(), "wb");
    if (!f || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || std::fclose(f) != 0)
      std::perror("write"), std::abort();
  }
  optimizer_state(folder.path, world);
  return 0;
}
