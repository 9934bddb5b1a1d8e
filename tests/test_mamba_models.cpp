// Mamba and Falcon-Mamba (models/mamba.h) against the Transformers fixtures (tests/fixtures/mamba,
// falcon_mamba; make_fixtures.py): logits, loss, the conv + SSM state cache, greedy generation and
// every gradient, with the reference slots, in f32 within 1e-5 relative; bf16 with
// residual_in_fp32 against Transformers' bf16; on CUDA, the fused decoding step against the slots'.
#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "models/mamba.h"
#include "models/safetensors.h"
#include "ops/nn/mamba_decode.h"
#include "ops/ops.h"
#include "test_util.h"

namespace kcpp {
namespace {

namespace fs = std::filesystem;
using models::SafetensorsFile;


class MambaFamilies : public ::testing::TestWithParam<const char*> {};

TEST_P(MambaFamilies, LogitsLossAndGenerationMatchTransformers) {
  const fs::path dir = fs::path(test::fixtures_dir()) / GetParam();
  models::LoadOptions strict;
  strict.strict = true;  // every tensor of the fixture is used
  const auto model = models::MambaLM::from_folder(dir, DType::f32, Device::cpu(), strict);
  const SafetensorsFile e = SafetensorsFile::open(dir / "expected.safetensors");
  const Tensor ids = e.view("input_ids"), labels = e.view("labels");
  const Tensor logits = model->forward(ids);
  EXPECT_TRUE(test::close_l2(logits, e.view("logits").to_f64_vector(), 1e-5));
  EXPECT_TRUE(test::close_l2(model->loss(ids, labels), e.view("loss").to_f64_vector(), 1e-5));
  // The cache: a prompt of 4, then one token at a time, then two at once, gives the full pass's logits.
  {
    models::MambaLM::Cache cache;
    std::vector<Tensor> parts = {model->forward(ids.narrow(1, 0, 4).contiguous(), &cache)};
    parts.push_back(model->forward(ids.narrow(1, 4, 1).contiguous(), &cache));
    parts.push_back(model->forward(ids.narrow(1, 5, 2).contiguous(), &cache));
    EXPECT_EQ(cache.length, 7);
    EXPECT_TRUE(test::close_l2(ops::cat(parts, 1), logits.to_f64_vector(), 1e-5));
  }
  std::vector<int64_t> prompt;
  for (double x : e.view("greedy.prompt").to_f64_vector()) prompt.push_back(static_cast<int64_t>(x));
  const auto want = e.view("greedy.ids").to_f64_vector();
  const std::vector<int64_t> none;
  const auto got = model->generate(prompt, static_cast<int64_t>(want.size() - prompt.size()), models::Sampling(), &none);
  EXPECT_EQ(std::vector<double>(got.begin(), got.end()), want);
  models::Sampling s{0.8, 20, 0.9, 7};
  EXPECT_EQ(model->generate(prompt, 5, s, &none), model->generate(prompt, 5, s, &none));
  // The timings: one prefill to the first token, then one step a token.
  models::CausalLM::GenerationStats st;
  EXPECT_EQ(model->generate(prompt, 5, models::Sampling(), &none, nullptr, &st).size(), prompt.size() + 5);
  EXPECT_EQ(st.prefills, 1);
  EXPECT_EQ(st.decode_tokens, 4);
  EXPECT_GT(st.first_token_seconds, 0.0);
  EXPECT_EQ(st.first_token_seconds, st.prefill_seconds);
  EXPECT_GE(st.decode_seconds, 0.0);
  EXPECT_ERROR(model->generate({200}, 1), "token id 200 (position 0) is outside the model's vocabulary of 97 ids");
}

// Several prompts of different lengths decoded together: each row makes the tokens it makes alone
// (greedy; sampled with its seed, sampling.seed + row), a row that stops early stops as alone and the
// others go on (also once the batch keeps only its live rows); tokens reach on_token as picked.
TEST_P(MambaFamilies, BatchedGenerationMatchesEachPromptAlone) {
  const fs::path dir = fs::path(test::fixtures_dir()) / GetParam();
  const auto model = models::MambaLM::from_folder(dir, DType::f32, Device::cpu());
  const std::vector<std::vector<int64_t>> prompts = {{1, 5, 9, 13, 2}, {7}, {40, 41, 42, 43, 44, 45, 46, 47, 48}};
  const std::vector<int64_t> none;
  models::CausalLM::GenerationStats st;
  std::vector<std::vector<int64_t>> seen(prompts.size());
  const auto got = model->generate_batch(prompts, 6, models::Sampling(), &none,
                                         [&](size_t row, int64_t token) { seen.at(row).push_back(token); }, &st);
  ASSERT_EQ(got.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(got[i].ids, model->generate(prompts[i], 6, models::Sampling(), &none)) << "prompt " << i;
    EXPECT_EQ(got[i].reason, models::StopReason::MaxNewTokens);
    EXPECT_EQ(seen[i], std::vector<int64_t>(got[i].ids.begin() + static_cast<int64_t>(prompts[i].size()), got[i].ids.end()));
  }
  EXPECT_EQ(st.prefills, 3);
  EXPECT_EQ(st.decode_tokens, 15);
  const models::Sampling s{0.8, 20, 0.9, 7};
  const auto sampled = model->generate_batch(prompts, 6, s, &none);
  for (size_t i = 0; i < prompts.size(); ++i) {
    models::Sampling alone = s;
    alone.seed = s.seed + i;
    EXPECT_EQ(sampled[i].ids, model->generate(prompts[i], 6, alone, &none)) << "prompt " << i << ", sampled";
  }
  // Row 1's second new token ends it.
  const std::vector<int64_t> stops = {got[1].ids[prompts[1].size() + 1]};
  const auto stopped = model->generate_batch(prompts, 6, models::Sampling(), &stops);
  EXPECT_EQ(stopped[1].reason, models::StopReason::StopToken);
  for (size_t i = 0; i < prompts.size(); ++i) {
    models::StopReason why{};
    EXPECT_EQ(stopped[i].ids, model->generate(prompts[i], 6, models::Sampling(), &stops, &why)) << "prompt " << i << ", stopped";
    EXPECT_EQ(stopped[i].reason, why) << "prompt " << i;
  }
  // Rows 1 and 2 end at their first new token: the batch goes on with row 0's state alone.
  const std::vector<int64_t> early = {got[1].ids[prompts[1].size()], got[2].ids[prompts[2].size()]};
  models::CausalLM::GenerationStats est;
  const auto shrunk = model->generate_batch(prompts, 6, models::Sampling(), &early, {}, &est);
  for (size_t i = 0; i < prompts.size(); ++i) {
    models::StopReason why{};
    EXPECT_EQ(shrunk[i].ids, model->generate(prompts[i], 6, models::Sampling(), &early, &why)) << "prompt " << i << ", shrunk";
    EXPECT_EQ(shrunk[i].reason, why) << "prompt " << i;
  }
  EXPECT_EQ(shrunk[1].reason, models::StopReason::StopToken);
  EXPECT_EQ(shrunk[2].reason, models::StopReason::StopToken);
  EXPECT_EQ(est.decode_tokens, static_cast<int64_t>(shrunk[0].ids.size() - prompts[0].size()) - 1);
  EXPECT_TRUE(model->generate_batch(prompts, 0)[2].ids == prompts[2]);
  EXPECT_ERROR(model->generate_batch({{1, 2}, {}}, 2), "prompt 1 has no tokens");
  EXPECT_ERROR(model->generate_batch({{1, 2}, {3, 200}}, 2), "prompt 1's token id 200 (position 1)");
  EXPECT_ERROR(model->generate_batch({}, 2), "no prompts");
}

TEST_P(MambaFamilies, GradientsMatchTransformers) {
  const fs::path dir = fs::path(test::fixtures_dir()) / GetParam();
  const auto model = models::MambaLM::from_folder(dir, DType::f32, Device::cpu());
  const SafetensorsFile e = SafetensorsFile::open(dir / "expected.safetensors");
  const auto r = model->loss_and_gradients(e.view("input_ids"), e.view("labels"));
  EXPECT_TRUE(test::close_l2(r.loss, e.view("loss").to_f64_vector(), 1e-5));
  size_t expected = 0;
  for (const auto& [name, entry] : e.entries()) {
    if (name.rfind("grad.", 0) != 0) continue;
    ++expected;
    const std::string param = name.substr(5);
    const auto it = r.grads.find(param);
    if (it == r.grads.end()) {
      ADD_FAILURE() << "no gradient for " << param;
      continue;
    }
    EXPECT_TRUE(test::close_l2(it->second, e.view(name).to_f64_vector(), 1e-5)) << param;
  }
  EXPECT_EQ(r.grads.size(), expected);
  EXPECT_EQ(model->parameters().size(), expected);
}

// Activation checkpointing recomputes each layer in the backward: the same loss and gradients, bit
// for bit (the same slots run the same forward again).
TEST_P(MambaFamilies, CheckpointedGradientsEqualTheKeptOnes) {
  const fs::path dir = fs::path(test::fixtures_dir()) / GetParam();
  const auto model = models::MambaLM::from_folder(dir, DType::f32, Device::cpu());
  const SafetensorsFile e = SafetensorsFile::open(dir / "expected.safetensors");
  test::expect_checkpointing_changes_nothing(*model, e.view("input_ids"), e.view("labels"));
}

double rel_l2(const Tensor& out, const std::vector<double>& ref) {
  EXPECT_EQ(out.numel(), static_cast<int64_t>(ref.size()));
  return test::rel_l2_error(out, ref);
}

// In bf16 with residual_in_fp32 (the fixtures' config, as the released models'), against what
// Transformers computes for the same weights in bf16 (bf16.* in the fixture; its A_log, D and dt bias
// rounded to bf16 where ours stay f32):
// - closer to it than the same model with the residual kept in bf16 (the flag off in a copy of the
//   folder): the logits, the loss, and the gradients the residual stream carries alone — the
//   embedding's (layer 0's branch of the backward), the final norm's and the head's — and the sum of
//   every gradient's error;
// - the logits, loss and every gradient within twice Transformers' own bf16 error against its f32
//   results (the project's bound for a same-precision reference).
TEST_P(MambaFamilies, Bf16KeepsTheResidualInF32AsTransformers) {
  const fs::path dir = fs::path(test::fixtures_dir()) / GetParam();
  const auto model = models::MambaLM::from_folder(dir, DType::bf16, Device::cpu());
  ASSERT_TRUE(model->config().residual_in_fp32);
  std::string tmpl = (fs::temp_directory_path() / "kcpp-mamba-bf16-XXXXXX").string();
  const fs::path off_dir = ::mkdtemp(tmpl.data());
  std::unique_ptr<models::MambaLM> model_off;
  try {
    fs::copy(dir, off_dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    nlohmann::json cfg;
    std::ifstream(off_dir / "config.json") >> cfg;
    cfg["residual_in_fp32"] = false;
    std::ofstream(off_dir / "config.json") << cfg.dump();
    model_off = models::MambaLM::from_folder(off_dir, DType::bf16, Device::cpu());
  } catch (...) {
    fs::remove_all(off_dir);
    throw;
  }
  fs::remove_all(off_dir);

  const SafetensorsFile e = SafetensorsFile::open(dir / "expected.safetensors");
  const Tensor ids = e.view("input_ids"), labels = e.view("labels");
  const Tensor logits = model->forward(ids);
  const auto hf_logits = e.view("bf16.logits").to_f64_vector();
  EXPECT_LT(rel_l2(logits, hf_logits), rel_l2(model_off->forward(ids), hf_logits)) << "logits";
  const auto on = model->loss_and_gradients(ids, labels), off = model_off->loss_and_gradients(ids, labels);
  const double hf_loss = e.view("bf16.loss").to_f64_vector()[0];
  EXPECT_LT(std::abs(on.loss.to_f64_vector()[0] - hf_loss), std::abs(off.loss.to_f64_vector()[0] - hf_loss)) << "loss";
  double sum_on = 0, sum_off = 0;
  for (const auto& [name, entry] : e.entries()) {
    if (name.rfind("bf16.grad.", 0) != 0) continue;
    const std::string param = name.substr(10);
    ASSERT_TRUE(on.grads.count(param) && off.grads.count(param)) << param;
    const auto ref = e.view(name).to_f64_vector();
    const double a = rel_l2(on.grads.at(param), ref), b = rel_l2(off.grads.at(param), ref);
    sum_on += a, sum_off += b;
    if (param == "backbone.embeddings.weight" || param == "backbone.norm_f.weight" || param == "lm_head.weight") {
      EXPECT_LT(a, b) << param;
    }
  }
  EXPECT_LT(sum_on, sum_off) << "the gradients' summed error";

  // Ours against the f32 reference, within twice Transformers' bf16 result's distance to it.
  auto within_hf_bf16 = [&](const Tensor& x, const std::string& name) {
    const std::vector<double> f32 = e.view(name).to_f64_vector();
    const double ours = rel_l2(x, f32), theirs = rel_l2(e.view("bf16." + name), f32);
    EXPECT_LE(ours, 2 * theirs) << name << ": ours " << ours << ", Transformers' bf16 " << theirs;
  };
  within_hf_bf16(logits, "logits");
  const double loss = e.view("loss").to_f64_vector()[0];
  EXPECT_NEAR(on.loss.to_f64_vector()[0], loss, std::max(2 * std::abs(hf_loss - loss), 1e-4));
  size_t n = 0;
  for (const auto& [name, entry] : e.entries()) {
    if (name.rfind("bf16.grad.", 0) != 0) continue;
    ++n;
    within_hf_bf16(on.grads.at(name.substr(10)), name.substr(5));
  }
  EXPECT_EQ(n, on.grads.size());
  // Checkpointing recomputes the f32 residual stream alike.
  test::expect_checkpointing_changes_nothing(*model, ids, labels);
  // Decoding with the cache (its widened final-norm weight and A made once) follows the full pass, to
  // bf16's rounding of the scan's and the step's outputs.
  models::MambaLM::Cache cache;
  std::vector<Tensor> parts = {model->forward(ids.narrow(1, 0, 4).contiguous(), &cache)};
  for (int64_t p = 4; p < ids.size(1); ++p) parts.push_back(model->forward(ids.narrow(1, p, 1).contiguous(), &cache));
  EXPECT_TRUE(cache.final_weight_f32.defined() && cache.A.size() == 2);
  EXPECT_TRUE(test::close_l2(ops::cat(parts, 1), logits.to_f64_vector(), test::composite_rel_l2(DType::bf16)));
}

// On CUDA in bf16 a one-token step runs as the fused ops
// (ops/nn/mamba_decode.h): its logits and both states follow the slots' steps (KCPP_DECODE_FUSED=0)
// and the full pass, to bf16's rounding; as saved (biases, the f32 residual) and as the released
// models are (no in_proj / out_proj biases) with the residual in the dtype.
TEST_P(MambaFamilies, FusedDecodeStepsFollowTheSlots) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  const fs::path dir = fs::path(test::fixtures_dir()) / GetParam();
  const Tensor ids = SafetensorsFile::open(dir / "expected.safetensors").view("input_ids");
  const test::ScopedEnv on("KCPP_MAMBA_DECODE_FUSED", "1");  // the default, whatever the caller's environment
  const models::MambaConfig cfg = models::MambaConfig::from_folder(dir);
  ASSERT_TRUE(ops::mamba_decode_fused(
      dev, DType::bf16, {ids.size(0), cfg.hidden_size, cfg.time_step_rank, cfg.state_size, cfg.conv_kernel}));
  std::string tmpl = (fs::temp_directory_path() / "kcpp-mamba-fused-XXXXXX").string();
  const fs::path plain_dir = ::mkdtemp(tmpl.data());
  fs::copy(dir, plain_dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  {
    nlohmann::json cfg;
    std::ifstream(plain_dir / "config.json") >> cfg;
    cfg["use_bias"] = false, cfg["residual_in_fp32"] = false;
    std::ofstream(plain_dir / "config.json") << cfg.dump();
  }
  for (const fs::path& folder : {dir, plain_dir}) {
    SCOPED_TRACE(folder.string());
    const auto model = models::MambaLM::from_folder(folder, DType::bf16, dev);
    auto decode = [&](models::MambaLM::Cache& cache) {
      std::vector<Tensor> parts = {model->forward(ids.narrow(1, 0, 4).contiguous(), &cache)};
      for (int64_t p = 4; p < ids.size(1); ++p) parts.push_back(model->forward(ids.narrow(1, p, 1).contiguous(), &cache));
      return ops::cat(parts, 1).to(DType::f32);
    };
    models::MambaLM::Cache fused, slots;
    const Tensor got = decode(fused);
    Tensor want;
    {
      const test::ScopedEnv off("KCPP_DECODE_FUSED", "0");
      want = decode(slots);
    }
    EXPECT_EQ(fused.fused_steps, ids.size(1) - 4);
    EXPECT_EQ(slots.fused_steps, 0);
    const double tol = test::composite_rel_l2(DType::bf16);
    EXPECT_TRUE(test::close_l2(got, want.to_f64_vector(), tol)) << "against the slots' steps";
    EXPECT_TRUE(test::close_l2(got, model->forward(ids).to(DType::f32).to_f64_vector(), tol)) << "against the full pass";
    ASSERT_EQ(fused.ssm.size(), slots.ssm.size());
    for (size_t li = 0; li < fused.ssm.size(); ++li) {
      EXPECT_TRUE(test::close_l2(fused.ssm[li], slots.ssm[li].to_f64_vector(), tol)) << "SSM state of layer " << li;
      EXPECT_TRUE(test::close_l2(fused.conv[li], slots.conv[li].to_f64_vector(), tol)) << "convolution state of layer " << li;
    }
  }
  fs::remove_all(plain_dir);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MambaFamilies, ::testing::Values("mamba", "falcon_mamba"));

TEST(MambaConfig, ReadsTheFixturesAndNamesBadKeys) {
  const auto c = models::MambaConfig::from_folder(fs::path(test::fixtures_dir()) / "falcon_mamba");
  EXPECT_EQ(c.model_type, "falcon_mamba");
  EXPECT_EQ(c.intermediate_size, 48);
  EXPECT_EQ(c.time_step_rank, 3);
  ASSERT_TRUE(c.mixer_rms_eps.has_value());
  EXPECT_FALSE(models::MambaConfig::from_folder(fs::path(test::fixtures_dir()) / "mamba").mixer_rms_eps.has_value());
  EXPECT_TRUE(models::is_mamba_folder(fs::path(test::fixtures_dir()) / "mamba"));
  EXPECT_FALSE(models::is_mamba_folder(fs::path(test::fixtures_dir()) / "llama"));
  const nlohmann::json base = {{"model_type", "mamba"}, {"hidden_size", 32}, {"vocab_size", 50}};
  EXPECT_EQ(models::MambaConfig::from_json(base).time_step_rank, 2);  // "auto": ceil(32 / 16)
  auto with = [&](const char* key, nlohmann::json v) {
    nlohmann::json j = base;
    j[key] = std::move(v);
    return j;
  };
  EXPECT_ERROR(models::MambaConfig::from_json(with("model_type", "llama")), "model_type 'llama' is not a Mamba family");
  EXPECT_ERROR(models::MambaConfig::from_json(with("state_size", 0)), "'state_size' must be in [1, 16777216], is 0");
  EXPECT_ERROR(models::MambaConfig::from_json(with("conv_kernel", "4")), "'conv_kernel' must be an integer");
  EXPECT_ERROR(models::MambaConfig::from_json(with("intermediate_size", 33)), "'intermediate_size' is 33");
  EXPECT_ERROR(models::MambaConfig::from_json(with("time_step_rank", "big")), "'time_step_rank' must be an integer or \"auto\"");
  EXPECT_ERROR(models::MambaConfig::from_json(with("layer_norm_epsilon", -1.0)), "'layer_norm_epsilon' must be finite and positive");
  EXPECT_ERROR(models::MambaConfig::from_json(with("hidden_act", "gelu")), "'hidden_act' is 'gelu'");
  EXPECT_ERROR(models::MambaConfig::from_json(with("eos_token_id", 50)), "token id 50 (eos_token_id) is outside the vocabulary");
}

// A hidden_size near 2^63 overflowed computing the defaults (expand x hidden_size, ceil(hidden_size /
// 16)) before it was checked, and a bos_token_id list did not survive to_json (fuzz findings: kept in
// tests/fuzz/corpus/config/regression-mamba-*).
TEST(MambaConfig, HugeSizesAreNamedAndIdListsWriteBack) {
  const nlohmann::json base = {{"model_type", "mamba"}, {"hidden_size", 32}, {"vocab_size", 50}};
  for (const nlohmann::json& j : {nlohmann::json{{"model_type", "mamba"}, {"hidden_size", INT64_MAX}},
                                  nlohmann::json{{"model_type", "mamba"}, {"hidden_size", INT64_MAX}, {"expand", 1},
                                                 {"intermediate_size", INT64_MAX}}})
    EXPECT_ERROR(models::MambaConfig::from_json(j), "'hidden_size' must be in [1, 16777216], is 9223372036854775807");
  nlohmann::json ids = base;
  ids["bos_token_id"] = {0, 1};
  ids["eos_token_id"] = {2, 3};
  const auto c = models::MambaConfig::from_json(ids);
  const auto back = models::MambaConfig::from_json(c.to_json());
  EXPECT_EQ(back.bos_token_id, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(back.eos_token_id, (std::vector<int64_t>{2, 3}));
}

// Integers past int64 (JSON gives them unsigned) are refused by name, not wrapped negative: the reader
// ModelConfig uses (models/config_json.h).
TEST(MambaConfig, IntegersPastInt64AreNamed) {
  const nlohmann::json base = {{"model_type", "mamba"}, {"hidden_size", 32}, {"vocab_size", 50}};
  nlohmann::json big = base;
  big["num_hidden_layers"] = uint64_t{1} << 63;
  EXPECT_ERROR(models::MambaConfig::from_json(big), "'num_hidden_layers' is 9223372036854775808, past any size this library handles");
  nlohmann::json ids = base;
  ids["eos_token_id"] = {1, uint64_t{1} << 63};
  EXPECT_ERROR(models::MambaConfig::from_json(ids), "'eos_token_id' must hold token ids, holds 9223372036854775808");
}

}  // namespace
}  // namespace kcpp
