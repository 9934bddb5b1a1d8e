// models/: safetensors reading and writing (and every way a file can lie), sharded weight folders,
// config.json of each family and its errors.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/causal_lm.h"
#include "models/config.h"
#include "models/safetensors.h"
#include "ops/ops.h"
#include "test_util.h"

namespace kcpp {
namespace {

namespace fs = std::filesystem;
using models::ModelConfig;
using models::SafetensorsFile;

struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "kcpp-models-XXXXXX").string();
    path = ::mkdtemp(t.data());
  }
  ~TempDir() { fs::remove_all(path); }
};

// The error message of fn(), or "" when it did not throw.
template <typename F> std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR(expr, needle)                                                       \
  do {                                                                                   \
    const std::string msg_ = error_of([&] { (void)(expr); });                           \
    EXPECT_NE(msg_.find(needle), std::string::npos) << "message: '" << msg_ << "'"; \
  } while (0)

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary) << bytes;
}
// A safetensors file from a header and a data area, as written by hand.
std::string file_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

TEST(Safetensors, RoundTripsEveryDtypeAndMetadata) {
  TempDir d;
  Generator gen = test::test_generator();
  const Tensor a = Tensor::randn({3, 5}, DType::f32, Device::cpu(), gen);
  const Tensor b = Tensor::randn({7}, DType::bf16, Device::cpu(), gen);
  const Tensor c = Tensor::randint({2, 2}, -50, 50, DType::i64, Device::cpu(), gen);
  const Tensor e = Tensor::empty({0, 4}, DType::f16, Device::cpu());
  // A strided view is written contiguous.
  const Tensor t = Tensor::randn({4, 6}, DType::f32, Device::cpu(), gen).transpose(0, 1);
  models::save_safetensors(d.path / "m.safetensors", {{"a", a}, {"b", b}, {"c", c}, {"empty", e}, {"t", t}},
                           {{"format", "pt"}});
  const SafetensorsFile f = SafetensorsFile::open(d.path / "m.safetensors");
  EXPECT_EQ(f.entries().size(), 5u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.entry("b").dtype, "BF16");
  EXPECT_EQ(f.view("a").to_f64_vector(), a.to_f64_vector());
  EXPECT_EQ(f.view("b").to_f64_vector(), b.to_f64_vector());
  EXPECT_EQ(f.view("c").to_f64_vector(), c.to_f64_vector());
  EXPECT_EQ(f.view("t").to_f64_vector(), t.to_f64_vector());
  EXPECT_EQ(f.view("empty").shape(), (Shape{0, 4}));
  // Loaded with a conversion; a view is writable (copy-on-write) and leaves the file alone.
  EXPECT_EQ(f.load("b", DType::f32, Device::cpu()).to_f64_vector(), b.to_f64_vector());
  Tensor v = f.view("a");
  static_cast<float*>(v.data())[0] = 123.0f;
  EXPECT_EQ(SafetensorsFile::open(d.path / "m.safetensors").view("a").to_f64_vector(), a.to_f64_vector());
  EXPECT_ERROR(f.view("nope"), "no tensor 'nope'");
}

TEST(Safetensors, BadFilesAreErrorsNamingFileAndTensor) {
  TempDir d;
  const fs::path p = d.path / "bad.safetensors";
  auto open_bytes = [&](const std::string& bytes) {
    write_bytes(p, bytes);
    return SafetensorsFile::open(p);
  };
  const std::string ok_header = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  const std::string data16(16, '\0');
  EXPECT_NO_THROW(open_bytes(file_bytes(ok_header, data16)));
  EXPECT_ERROR(open_bytes("abc"), "too short");
  EXPECT_ERROR(open_bytes(file_bytes(ok_header, data16).substr(0, 30)), "runs past the end of the file");
  EXPECT_ERROR(open_bytes(file_bytes(ok_header, data16.substr(0, 8))), "tensor 'w': data_offsets end 16 is past the data");
  EXPECT_ERROR(open_bytes(file_bytes("{not json", "")), "the header is not JSON");
  EXPECT_ERROR(open_bytes(file_bytes(R"({"w":{"dtype":"F32","shape":[3,2],"data_offsets":[0,16]}})", data16)),
               "tensor 'w': data_offsets [0, 16] hold 16 bytes but F32 [3,2] x 6 needs 24");
  EXPECT_ERROR(open_bytes(file_bytes(R"({"w":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", data16)),
               "tensor 'w': unknown dtype 'F33'");
  EXPECT_ERROR(open_bytes(file_bytes(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data16)),
               "shape must hold non-negative integers");
  EXPECT_ERROR(open_bytes(file_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", data16)), "run backwards");
  EXPECT_ERROR(open_bytes(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                     data16)),
               "two tensors overlap");
  EXPECT_ERROR(open_bytes(file_bytes(R"({"w":{"dtype":"F32","shape":[2]}})", data16)), "tensor 'w': expected");
  std::string huge(8, '\xff');
  EXPECT_ERROR(open_bytes(huge + "xx"), "over the format's limit");
  EXPECT_ERROR(SafetensorsFile::open(d.path / "missing.safetensors"), "missing.safetensors: cannot open");
  // Readable but not loadable: an F8 tensor is listed, and load() names it.
  const SafetensorsFile f8 = open_bytes(file_bytes(R"({"q":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}})", data16.substr(0, 4)));
  EXPECT_TRUE(f8.contains("q"));
  EXPECT_ERROR(f8.load("q", DType::f32, Device::cpu()), "tensor 'q': safetensors dtype 'F8_E4M3' has no runtime type");
}

// A dimension past int64 would become a negative size in the tensor's shape (found by tests/fuzz).
TEST(Safetensors, DimensionsPastInt64AreErrors) {
  TempDir d;
  const fs::path p = d.path / "big.safetensors";
  for (const char* dim : {"9223372036854775808", "18446744073709551615"}) {
    write_bytes(p, file_bytes(fmt::format(R"({{"w":{{"dtype":"F32","shape":[{},0],"data_offsets":[0,0]}}}})", dim), ""));
    EXPECT_ERROR(SafetensorsFile::open(p), "shape must hold non-negative integers below 2^63");
  }
}

// An empty tensor at an unaligned offset is copied out as nothing (memcpy into an empty tensor's null
// data was undefined behaviour; the debug preset's UB sanitizer reports it; found by tests/fuzz).
TEST(Safetensors, EmptyTensorAtAnUnalignedOffset) {
  TempDir d;
  const fs::path p = d.path / "empty.safetensors";
  write_bytes(p, file_bytes(R"({"e":{"dtype":"F32","shape":[4611686018427387904,0],"data_offsets":[1,1]}})", std::string(1, '\0')));
  const Tensor t = SafetensorsFile::open(p).view("e");
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.shape(), (Shape{int64_t{1} << 62, 0}));
}

// A BOOL byte other than 0 or 1 is not a bool: reading it would be undefined behaviour (found by tests/fuzz).
TEST(Safetensors, BoolBytesOtherThanZeroOrOneAreErrors) {
  TempDir d;
  const fs::path p = d.path / "bool.safetensors";
  write_bytes(p, file_bytes(R"({"ok":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]},"bad":{"dtype":"BOOL","shape":[3],"data_offsets":[2,5]}})",
                            std::string("\x01\x00\x00\x33\x01", 5)));
  const SafetensorsFile f = SafetensorsFile::open(p);
  const Tensor ok = f.load("ok", DType::f32, Device::cpu());
  EXPECT_EQ(ok.data_ptr<float>()[0], 1.0f);
  EXPECT_EQ(ok.data_ptr<float>()[1], 0.0f);
  EXPECT_ERROR(f.view("bad"), "tensor 'bad': BOOL element 1 is the byte 51, not 0 or 1");
  EXPECT_ERROR(f.load("bad", DType::f32, Device::cpu()), "not 0 or 1");
}

TEST(Safetensors, ShardedFolderAndShapeChecks) {
  TempDir d;
  Generator gen = test::test_generator();
  const Tensor a = Tensor::randn({4, 3}, DType::bf16, Device::cpu(), gen), b = Tensor::randn({5}, DType::f32, Device::cpu(), gen);
  models::save_safetensors(d.path / "model-00001-of-00002.safetensors", {{"a", a}});
  models::save_safetensors(d.path / "model-00002-of-00002.safetensors", {{"b", b}});
  std::ofstream(d.path / "model.safetensors.index.json")
      << R"({"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})";
  const auto w = models::WeightStore::open_folder(d.path);
  EXPECT_EQ(w.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(w.load("a", DType::f32, Device::cpu()).to_f64_vector(), a.to_f64_vector());
  const std::vector<int64_t> want = {3, 4};
  EXPECT_ERROR(w.load("a", DType::f32, Device::cpu(), &want), "weight 'a' has shape [4, 3], the config needs [3, 4]");
  EXPECT_ERROR(w.load("c", DType::f32, Device::cpu()), "missing weight 'c'");
  std::ofstream(d.path / "model.safetensors.index.json") << R"({"weight_map": {"a": "model-00002-of-00002.safetensors"}})";
  EXPECT_ERROR(models::WeightStore::open_folder(d.path), "weight_map says 'a' is in model-00002-of-00002.safetensors");
  std::ofstream(d.path / "model.safetensors.index.json") << R"({"weight_map": {"a": "../etc/passwd"}})";
  EXPECT_ERROR(models::WeightStore::open_folder(d.path), "is not a file in the folder");
  TempDir empty;
  EXPECT_ERROR(models::WeightStore::open_folder(empty.path), "no model.safetensors or model.safetensors.index.json");
}

// ---- config.json -------------------------------------------------------------------------------------

nlohmann::json llama3() {
  return nlohmann::json::parse(R"({
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu", "tie_word_embeddings": false,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"})");
}

TEST(ModelConfig, ReadsEachFamily) {
  const ModelConfig l = ModelConfig::from_json(llama3());
  EXPECT_EQ(l.head_dim, 128);
  EXPECT_EQ(l.num_key_value_heads, 8);
  EXPECT_EQ(l.rope_scaling.type, models::RopeScaling::Type::Llama3);
  EXPECT_EQ(l.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(l.eos_token_id, (std::vector<int64_t>{128001, 128008, 128009}));
  // to_json reads back to the same config.
  const ModelConfig again = ModelConfig::from_json(l.to_json());
  EXPECT_EQ(again.to_json(), l.to_json());

  nlohmann::json g = llama3();
  g["model_type"] = "gemma";
  g["head_dim"] = 256;
  g["hidden_act"] = "gelu";
  g.erase("tie_word_embeddings");
  g.erase("rope_scaling");
  const ModelConfig gm = ModelConfig::from_json(g);
  EXPECT_EQ(gm.norm_offset, 1.0);
  EXPECT_TRUE(gm.scale_embeddings);
  EXPECT_TRUE(gm.tie_word_embeddings);
  EXPECT_EQ(gm.hidden_act, "gelu_pytorch_tanh");
  EXPECT_EQ(gm.head_dim, 256);

  nlohmann::json q = llama3();
  q["model_type"] = "qwen2";
  EXPECT_TRUE(ModelConfig::from_json(q).qkv_bias_only);
  q["model_type"] = "qwen3";
  EXPECT_TRUE(ModelConfig::from_json(q).qk_norm);
  q["model_type"] = "phi3";
  q["partial_rotary_factor"] = 0.75;
  const ModelConfig phi = ModelConfig::from_json(q);
  EXPECT_TRUE(phi.fused_qkv && phi.fused_gate_up);
  EXPECT_EQ(phi.rotary_dim(), 96);
}

// Gemma reads its activation from hidden_activation alone, so to_json writes it there too.
TEST(ModelConfig, GemmaActivationReadsBack) {
  nlohmann::json g = llama3();
  g["model_type"] = "gemma";
  g["hidden_activation"] = "gelu";
  g.erase("rope_scaling");
  const ModelConfig c = ModelConfig::from_json(g);
  EXPECT_EQ(c.hidden_act, "gelu");
  EXPECT_EQ(ModelConfig::from_json(c.to_json()).hidden_act, "gelu");
}

TEST(ModelConfig, BadConfigsNameTheKey) {
  auto with = [](const char* key, const nlohmann::json& v) {
    nlohmann::json j = llama3();
    if (v.is_discarded()) j.erase(key);
    else j[key] = v;
    return j;
  };
  const nlohmann::json erase = nlohmann::json::value_t::discarded;
  EXPECT_ERROR(ModelConfig::from_json(with("model_type", "gpt5")), "unknown model_type 'gpt5' (supported: llama");
  EXPECT_ERROR(ModelConfig::from_json(with("model_type", erase)), "missing key 'model_type'");
  EXPECT_ERROR(ModelConfig::from_json(with("hidden_size", erase)), "missing key 'hidden_size'");
  EXPECT_ERROR(ModelConfig::from_json(with("hidden_size", "4096")), "'hidden_size' must be an integer");
  EXPECT_ERROR(ModelConfig::from_json(with("vocab_size", 0)), "'vocab_size' must be positive");
  EXPECT_ERROR(ModelConfig::from_json(with("num_key_value_heads", 5)), "is not a multiple of num_key_value_heads 5");
  EXPECT_ERROR(ModelConfig::from_json(with("rms_norm_eps", "small")), "'rms_norm_eps' must be a number");
  EXPECT_ERROR(ModelConfig::from_json(with("hidden_act", "relu")), "hidden_act 'relu' is not supported");
  EXPECT_ERROR(ModelConfig::from_json(with("rope_scaling", nlohmann::json{{"rope_type", "yarn"}, {"factor", 4.0}})),
               "rope_type 'yarn' is not supported");
  EXPECT_ERROR(ModelConfig::from_json(with("tie_word_embeddings", 1)), "'tie_word_embeddings' must be true or false");
  TempDir d;
  EXPECT_ERROR(ModelConfig::from_folder(d.path), "config.json: cannot read");
  std::ofstream(d.path / "config.json") << "{\"model_type\": ";
  EXPECT_ERROR(ModelConfig::from_folder(d.path), "config.json: not JSON");
  std::ofstream(d.path / "config.json") << llama3().dump();
  EXPECT_EQ(ModelConfig::from_folder(d.path).vocab_size, 128256);
}

// The Transformers fixtures (tests/fixtures/make_fixtures.py, Transformers 5): each family's
// config.json parses as Transformers wrote it, and every weight the decoder will need is there with
// the shape the config implies.
TEST(ModelConfig, ReadsTheTransformersFixtures) {
  for (const char* family : {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"}) {
    SCOPED_TRACE(family);
    const fs::path dir = fs::path(test::fixtures_dir()) / family;
    const ModelConfig c = ModelConfig::from_folder(dir);
    EXPECT_EQ(c.model_type, family);
    EXPECT_EQ(c.vocab_size, 97);
    EXPECT_EQ(c.num_hidden_layers, 2);
    const auto w = models::WeightStore::open_folder(dir);
    const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
    auto shape_of = [&](const std::string& name) {
      return w.load(name, DType::f32, Device::cpu()).shape();
    };
    EXPECT_EQ(shape_of("model.embed_tokens.weight"), (Shape{97, 32}));
    EXPECT_EQ(w.contains("lm_head.weight"), !c.tie_word_embeddings);
    if (c.fused_qkv) {
      EXPECT_EQ(shape_of("model.layers.0.self_attn.qkv_proj.weight"), (Shape{q + 2 * kv, 32}));
      EXPECT_EQ(shape_of("model.layers.1.mlp.gate_up_proj.weight"), (Shape{2 * 64, 32}));
    } else {
      EXPECT_EQ(shape_of("model.layers.0.self_attn.q_proj.weight"), (Shape{q, 32}));
      EXPECT_EQ(shape_of("model.layers.0.self_attn.k_proj.weight"), (Shape{kv, 32}));
      EXPECT_EQ(shape_of("model.layers.1.mlp.gate_proj.weight"), (Shape{64, 32}));
    }
    EXPECT_EQ(w.contains("model.layers.0.self_attn.q_proj.bias"), c.qkv_bias_only);
    EXPECT_EQ(w.contains("model.layers.0.self_attn.q_norm.weight"), c.qk_norm);
    const SafetensorsFile e = SafetensorsFile::open(dir / "expected.safetensors");
    EXPECT_EQ(e.entry("logits").shape, (std::vector<int64_t>{2, 7, 97}));
    EXPECT_TRUE(e.contains("grad.model.embed_tokens.weight"));
    // config.json round trip through to_json.
    EXPECT_EQ(ModelConfig::from_json(c.to_json()).to_json(), c.to_json());
  }
  const ModelConfig llama = ModelConfig::from_folder(fs::path(test::fixtures_dir()) / "llama");
  EXPECT_EQ(llama.rope_scaling.type, models::RopeScaling::Type::Llama3);
  EXPECT_EQ(llama.rope_scaling.original_max_position_embeddings, 16);
  EXPECT_EQ(ModelConfig::from_folder(fs::path(test::fixtures_dir()) / "gemma").hidden_act, "gelu_pytorch_tanh");
}

// A model folder whose weights are missing or mis-shaped: the error names the folder / file and the
// tensor (and both shapes).
TEST(ModelConfig, MissingOrMisShapedWeightsNameTheTensor) {
  const fs::path src = fs::path(test::fixtures_dir()) / "llama";
  const auto f = SafetensorsFile::open(src / "model.safetensors");
  TempDir d;
  fs::copy_file(src / "config.json", d.path / "config.json");
  std::vector<std::pair<std::string, Tensor>> all;
  for (const auto& [name, e] : f.entries()) all.emplace_back(name, f.view(name));
  auto without = all;
  std::erase_if(without, [](const auto& p) { return p.first == "model.layers.1.mlp.down_proj.weight"; });
  models::save_safetensors(d.path / "model.safetensors", without);
  EXPECT_ERROR(models::CausalLM::from_folder(d.path, DType::f32, Device::cpu()),
               "missing weight 'model.layers.1.mlp.down_proj.weight'");
  auto reshaped = all;
  for (auto& [name, t] : reshaped)
    if (name == "model.norm.weight") t = Tensor::zeros({31}, DType::f32, Device::cpu());
  models::save_safetensors(d.path / "model.safetensors", reshaped);
  EXPECT_ERROR(models::CausalLM::from_folder(d.path, DType::f32, Device::cpu()),
               "weight 'model.norm.weight' has shape [31], the config needs [32]");
}

// The forward pass and the loss of every family against Transformers (f32, eager attention):
// logits and loss within 1e-5 relative (issue 5's bar), with the reference layers.
class Families : public ::testing::TestWithParam<const char*> {};

TEST_P(Families, LogitsAndLossMatchTransformers) {
  const fs::path dir = fs::path(test::fixtures_dir()) / GetParam();
  const auto model = models::CausalLM::from_folder(dir, DType::f32, Device::cpu());
  const SafetensorsFile e = SafetensorsFile::open(dir / "expected.safetensors");
  const Tensor ids = e.view("input_ids"), labels = e.view("labels");
  const Tensor logits = model->forward(ids);
  EXPECT_TRUE(test::close_l2(logits, e.view("logits").to_f64_vector(), 1e-5));
  EXPECT_TRUE(test::close_l2(model->loss(ids, labels), e.view("loss").to_f64_vector(), 1e-5));
  // The KV cache: the prompt, then the rest one token at a time, gives the full pass's logits.
  {
    models::CausalLM::KVCache cache;
    const auto full = logits.to_f64_vector();
    const Tensor first = model->forward(ids.narrow(1, 0, 4).contiguous(), &cache);
    std::vector<Tensor> parts = {first};
    for (int64_t t = 4; t < 7; ++t) parts.push_back(model->forward(ids.narrow(1, t, 1).contiguous(), &cache));
    EXPECT_EQ(cache.length, 7);
    EXPECT_TRUE(test::close_l2(ops::cat(parts, 1), full, 1e-5));
  }
  // generate() with the cache = Transformers' greedy generate().
  {
    std::vector<int64_t> prompt;
    for (double x : e.view("greedy.prompt").to_f64_vector()) prompt.push_back(static_cast<int64_t>(x));
    const auto want = e.view("greedy.ids").to_f64_vector();
    const std::vector<int64_t> none;
    const auto got = model->generate(prompt, static_cast<int64_t>(want.size() - prompt.size()), models::Sampling(), &none);
    EXPECT_EQ(std::vector<double>(got.begin(), got.end()), want);
    // Sampling is reproducible by seed and stays in the vocabulary.
    models::Sampling s{0.8, 20, 0.9, 7};
    const auto a = model->generate(prompt, 5, s, &none), b = model->generate(prompt, 5, s, &none);
    EXPECT_EQ(a, b);
    for (int64_t t : a) EXPECT_TRUE(t >= 0 && t < 97);
    EXPECT_ERROR(model->generate({200}, 1), "outside the vocabulary");
  }
  // Greedy continuation (the whole sequence recomputed each step) = Transformers' generate().
  std::vector<int64_t> seq;
  for (double x : e.view("greedy.prompt").to_f64_vector()) seq.push_back(static_cast<int64_t>(x));
  const auto want = e.view("greedy.ids").to_f64_vector();
  while (seq.size() < want.size()) {
    const int64_t n = static_cast<int64_t>(seq.size());
    const auto lv = model->forward(Tensor::from_i64(seq, {1, n}, DType::i64, Device::cpu())).to_f64_vector();
    const int64_t v = model->config().vocab_size;
    seq.push_back(std::max_element(lv.begin() + (n - 1) * v, lv.begin() + n * v) - (lv.begin() + (n - 1) * v));
  }
  EXPECT_EQ(std::vector<double>(seq.begin(), seq.end()), want);
}

// Every parameter's gradient of the loss against Transformers' (f32): within 1e-5 relative, the
// issue's bar, and no parameter missed or invented.
TEST_P(Families, GradientsMatchTransformers) {
  const fs::path dir = fs::path(test::fixtures_dir()) / GetParam();
  const auto model = models::CausalLM::from_folder(dir, DType::f32, Device::cpu());
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
}

INSTANTIATE_TEST_SUITE_P(Transformers, Families, ::testing::Values("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace kcpp

namespace kcpp {
namespace {

// Dynamic NTK RoPE scaling (Transformers' _compute_dynamic_ntk_parameters): past the original
// context, base' = base * (factor * seq / original - (factor - 1)) ^ (rotary_dim / (rotary_dim - 2)).
// A model with dynamic scaling equals, at a length within the original context, the same weights
// with no scaling, and past it, the same weights with rope_theta = base'.
TEST(CausalLM, DynamicRopeScalingFollowsTheSequenceLength) {
  nlohmann::json j = {{"model_type", "llama"}, {"vocab_size", 50}, {"hidden_size", 32}, {"intermediate_size", 48},
                      {"num_hidden_layers", 1}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                      {"max_position_embeddings", 8}, {"rope_theta", 10000.0}, {"rms_norm_eps", 1e-5},
                      {"rope_scaling", {{"rope_type", "dynamic"}, {"factor", 2.0}}}};
  const models::ModelConfig dynamic = models::ModelConfig::from_json(j);
  j.erase("rope_scaling");
  const models::ModelConfig plain = models::ModelConfig::from_json(j);
  const int64_t seq = 20, rd = 8;  // head_dim 32 / 4 = 8
  j["rope_theta"] = 10000.0 * std::pow(2.0 * seq / 8.0 - 1.0, static_cast<double>(rd) / (rd - 2));
  const models::ModelConfig stretched = models::ModelConfig::from_json(j);
  auto dyn = models::CausalLM::random(dynamic, DType::f32, Device::cpu(), 3);
  auto pl = models::CausalLM::random(plain, DType::f32, Device::cpu(), 3);
  auto st = models::CausalLM::random(stretched, DType::f32, Device::cpu(), 3);
  Generator gen = test::test_generator();
  const Tensor long_ids = Tensor::randint({1, seq}, 0, 50, DType::i64, Device::cpu(), gen);
  const Tensor short_ids = long_ids.narrow(1, 0, 6).contiguous();
  EXPECT_TRUE(test::close_l2(dyn->forward(short_ids), pl->forward(short_ids).to_f64_vector(), 1e-6));
  EXPECT_TRUE(test::close_l2(dyn->forward(long_ids), st->forward(long_ids).to_f64_vector(), 1e-6));
  EXPECT_FALSE(test::close_l2(dyn->forward(long_ids), pl->forward(long_ids).to_f64_vector(), 1e-4));
}

}  // namespace
}  // namespace kcpp
