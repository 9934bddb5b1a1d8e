// models/: safetensors reading and writing (and every way a file can lie), sharded weight folders,
// config.json of each family and its errors.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "models/causal_lm.h"
#include "models/config.h"
#include "models/safetensors.h"
#include "ops/nn/decode_persistent.h"
#include "ops/ops.h"
#include "core/platform.h"
#include "test_util.h"
#include "tolerances.h"

namespace kcpp {
namespace {

namespace fs = std::filesystem;
using models::ModelConfig;
using test::error_of;
using models::SafetensorsFile;

struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "kcpp-models-XXXXXX").string();
    path = ::mkdtemp(t.data());
  }
  ~TempDir() { fs::remove_all(path); }
};


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
  EXPECT_EQ(w.unused(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(w.load("a", DType::f32, Device::cpu()).to_f64_vector(), a.to_f64_vector());
  EXPECT_EQ(w.unused(), (std::vector<std::string>{"b"}));  // what no load asked for
  EXPECT_TRUE(w.same("a", "a"));
  EXPECT_FALSE(w.same("a", "b"));
  const std::vector<int64_t> want = {3, 4};
  EXPECT_ERROR(w.load("a", DType::f32, Device::cpu(), &want), "weight 'a' has shape [4, 3], the config needs [3, 4]");
  EXPECT_ERROR(w.load("c", DType::f32, Device::cpu()), "missing weight 'c'");
  std::ofstream(d.path / "model.safetensors.index.json") << R"({"weight_map": {"a": "model-00002-of-00002.safetensors"}})";
  EXPECT_ERROR(models::WeightStore::open_folder(d.path), "weight_map says 'a' is in model-00002-of-00002.safetensors");
  std::ofstream(d.path / "model.safetensors.index.json") << R"({"weight_map": {"a": "../etc/passwd"}})";
  EXPECT_ERROR(models::WeightStore::open_folder(d.path), "is not a file in the folder");
  // A NUL in the name: the OS opened what comes before it (fuzz finding: kept in
  // tests/fuzz/corpus/weight_index/regression-nul-in-file-name).
  std::ofstream(d.path / "model.safetensors.index.json")
      << R"({"weight_map": {"a": "model-00001-of-00002.safetensors\u0000.json"}})";
  EXPECT_ERROR(models::WeightStore::open_folder(d.path),
               R"(weight_map.a = "model-00001-of-00002.safetensors\u0000.json" is not a file in the folder)");
  std::ofstream(d.path / "model.safetensors.index.json") << R"({"weight_map": {"a": "."}})";
  EXPECT_ERROR(models::WeightStore::open_folder(d.path), R"(weight_map.a = "." is not a file in the folder)");
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
  EXPECT_ERROR(ModelConfig::from_json(with("vocab_size", 0)), "'vocab_size' must be in [1, 16777216], is 0");
  EXPECT_ERROR(ModelConfig::from_json(with("num_key_value_heads", 5)), "is not a multiple of num_key_value_heads 5");
  EXPECT_ERROR(ModelConfig::from_json(with("rms_norm_eps", "small")), "'rms_norm_eps' must be a number");
  EXPECT_ERROR(ModelConfig::from_json(with("hidden_act", "relu")), "hidden_act 'relu' is not supported");
  EXPECT_ERROR(ModelConfig::from_json(with("rope_scaling", nlohmann::json{{"rope_type", "yarn"}, {"factor", 4.0}})),
               "rope_type 'yarn' is not supported");
  EXPECT_ERROR(ModelConfig::from_json(with("tie_word_embeddings", 1)), "'tie_word_embeddings' must be true or false");
  TempDir d;
  EXPECT_ERROR(ModelConfig::from_folder(d.path), "config.json does not exist");
  fs::create_directory(d.path / "config.json");
  EXPECT_ERROR(ModelConfig::from_folder(d.path), "config.json is a folder, not a file");
  fs::remove(d.path / "config.json");
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

// The mixture-of-experts keys (mixtral, qwen3_moe, qwen2_moe): read as Transformers 5 writes them, each
// out of range a named error, written back; a model saved with the fused expert tensors loads again.
TEST(ModelConfig, MixtureOfExpertsKeys) {
  const fs::path fx = fs::path(test::fixtures_dir());
  const ModelConfig mx = ModelConfig::from_folder(fx / "mixtral"), qm = ModelConfig::from_folder(fx / "qwen3_moe");
  EXPECT_EQ(mx.num_experts, 4);
  EXPECT_EQ(mx.num_experts_per_tok, 2);
  EXPECT_EQ(mx.moe_intermediate_size, mx.intermediate_size);
  EXPECT_TRUE(mx.norm_topk_prob);
  EXPECT_TRUE(mx.output_router_logits);
  EXPECT_DOUBLE_EQ(mx.router_aux_loss_coef, 0.1);
  EXPECT_TRUE(mx.moe_layer(0) && mx.moe_layer(1));
  EXPECT_EQ(qm.moe_intermediate_size, 16);
  EXPECT_FALSE(qm.norm_topk_prob);
  EXPECT_TRUE(qm.qk_norm);
  EXPECT_FALSE(qm.moe_layer(0));  // mlp_only_layers [0]
  EXPECT_TRUE(qm.moe_layer(1));
  // Qwen2-MoE: decoder_sparse_step 2 makes layers 1, 3, 5 sparse, mlp_only_layers [3] takes 3 back;
  // the shared expert; q/k/v biases (qkv_bias); its own sliding rule (even layers below
  // max_window_layers 3: 0 and 2).
  const ModelConfig q2 = ModelConfig::from_folder(fx / "qwen2_moe");
  EXPECT_EQ(q2.num_experts, 5);
  EXPECT_EQ(q2.num_experts_per_tok, 3);
  EXPECT_EQ(q2.moe_intermediate_size, 20);
  EXPECT_EQ(q2.shared_expert_intermediate_size, 28);
  EXPECT_EQ(q2.intermediate_size, 44);
  EXPECT_FALSE(q2.norm_topk_prob);
  EXPECT_TRUE(q2.qkv_bias_only);
  EXPECT_FALSE(q2.attention_bias || q2.qk_norm);
  EXPECT_TRUE(q2.tie_word_embeddings);
  EXPECT_EQ(mx.shared_expert_intermediate_size, 0);
  EXPECT_EQ(qm.shared_expert_intermediate_size, 0);
  for (int64_t i = 0; i < 6; ++i) {
    EXPECT_EQ(q2.moe_layer(i), i == 1 || i == 5) << i;
    EXPECT_EQ(q2.attention_window(i), i == 0 || i == 2 ? 3 : 0) << i;
  }
  for (const ModelConfig& c : {mx, qm, q2}) EXPECT_EQ(ModelConfig::from_json(c.to_json()).to_json(), c.to_json());
  auto with = [&](const fs::path& dir, const std::string& key, const nlohmann::json& v) {
    std::ifstream in(dir / "config.json");
    nlohmann::json j = nlohmann::json::parse(in);
    j[key] = v;
    return j;
  };
  EXPECT_ERROR(ModelConfig::from_json(with(fx / "mixtral", "num_local_experts", 0)), "'num_local_experts' must be in [1, 65536], is 0");
  EXPECT_ERROR(ModelConfig::from_json(with(fx / "mixtral", "num_experts_per_tok", 5)), "'num_experts_per_tok' must be in [1, 4], is 5");
  EXPECT_ERROR(ModelConfig::from_json(with(fx / "mixtral", "router_aux_loss_coef", -1)), "'router_aux_loss_coef' must be a finite number >= 0");
  EXPECT_ERROR(ModelConfig::from_json(with(fx / "mixtral", "router_jitter_noise", 0.1)), "'router_jitter_noise' 0.1 is not supported");
  EXPECT_ERROR(ModelConfig::from_json(with(fx / "qwen3_moe", "moe_intermediate_size", 0)), "'moe_intermediate_size' must be in [1, ");
  EXPECT_ERROR(ModelConfig::from_json(with(fx / "qwen3_moe", "decoder_sparse_step", 0)), "'decoder_sparse_step' must be in [1, ");
  EXPECT_ERROR(ModelConfig::from_json(with(fx / "qwen3_moe", "mlp_only_layers", nlohmann::json::array({2}))),
               "'mlp_only_layers' must be in [0, 1], is 2");
  EXPECT_ERROR(ModelConfig::from_json(with(fx / "qwen3_moe", "output_router_logits", "yes")), "'output_router_logits' must be true or false");
  ModelConfig dense = ModelConfig::from_folder(fx / "llama");
  dense.num_experts = 4;
  EXPECT_ERROR(dense.validate(), "model_type 'llama' has no experts");
  ModelConfig shared = qm;
  shared.shared_expert_intermediate_size = 8;
  EXPECT_ERROR(shared.validate(), "model_type 'qwen3_moe' has no shared expert");

  // Qwen2-MoE's keys: each out of range named; what its configuration class does without them.
  const fs::path q2d = fx / "qwen2_moe";
  EXPECT_ERROR(ModelConfig::from_json(with(q2d, "shared_expert_intermediate_size", 0)),
               "'shared_expert_intermediate_size' must be in [1, 16777216], is 0");
  EXPECT_ERROR(ModelConfig::from_json(with(q2d, "num_experts", 0)), "'num_experts' must be in [1, 65536], is 0");
  EXPECT_ERROR(ModelConfig::from_json(with(q2d, "num_experts_per_tok", 6)), "'num_experts_per_tok' must be in [1, 5], is 6");
  EXPECT_ERROR(ModelConfig::from_json(with(q2d, "qkv_bias", "yes")), "'qkv_bias' must be true or false");
  EXPECT_ERROR(ModelConfig::from_json(with(q2d, "mlp_only_layers", nlohmann::json::array({6}))), "'mlp_only_layers' must be in [0, 5], is 6");
  EXPECT_ERROR(ModelConfig::from_json(with(q2d, "sliding_window", 0)), "'sliding_window' must be >= 1, is 0");
  EXPECT_ERROR(ModelConfig::from_json(with(q2d, "rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e4}, {"partial_rotary_factor", 0.5}})),
               "'partial_rotary_factor' 0.5 is not supported for qwen2_moe");
  EXPECT_ERROR(ModelConfig::from_json(with(q2d, "rope_parameters", {{"rope_type", "yarn"}, {"rope_theta", 1e4}, {"factor", 4.0}})),
               "rope_type 'yarn' is not supported");
  EXPECT_FALSE(ModelConfig::from_json(with(q2d, "qkv_bias", false)).qkv_bias_only);
  // Keys Qwen2-MoE's modeling code does not read change nothing.
  EXPECT_FALSE(ModelConfig::from_json(with(q2d, "attention_bias", true)).attention_bias);
  EXPECT_EQ(ModelConfig::from_json(with(q2d, "num_local_experts", 9)).num_experts, 5);
  {  // No layer_types: Qwen2MoeConfig's rule gives the fixture's; without use_sliding_window no window
     // (Transformers sets sliding_window to 0), and listing a sliding layer then is an error.
    nlohmann::json j = with(q2d, "layer_types", nullptr);
    j.erase("layer_types");
    EXPECT_EQ(ModelConfig::from_json(j).layer_types, q2.layer_types);
    j["max_window_layers"] = 28;
    const ModelConfig all = ModelConfig::from_json(j);
    for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(all.attention_window(i), i % 2 == 0 ? 3 : 0) << i;
    j["use_sliding_window"] = false;
    j["sliding_window"] = 0;
    const ModelConfig none = ModelConfig::from_json(j);
    EXPECT_FALSE(none.sliding_window.has_value());
    for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(none.attention_window(i), 0) << i;
    EXPECT_ERROR(ModelConfig::from_json(with(q2d, "use_sliding_window", false)),
                 "layer 0 is 'sliding_attention' but the config sets no sliding window (sliding_window with use_sliding_window true)");
  }
  {  // A Transformers 4 config of the hub's Qwen1.5-MoE layout: rope_theta at the top, a window that
     // use_sliding_window false turns off, num_experts; the dense MLPs none (decoder_sparse_step 1).
    const nlohmann::json old = nlohmann::json::parse(R"({
      "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
      "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632,
      "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe", "num_attention_heads": 16,
      "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
      "sliding_window": 32768, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.40.0",
      "use_cache": true, "use_sliding_window": false, "vocab_size": 151936, "decoder_sparse_step": 1,
      "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
      "norm_topk_prob": false, "output_router_logits": false, "router_aux_loss_coef": 0.001})");
    const ModelConfig c = ModelConfig::from_json(old);
    EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
    EXPECT_EQ(c.head_dim, 128);
    EXPECT_FALSE(c.sliding_window.has_value());
    EXPECT_EQ(c.num_experts, 60);
    EXPECT_EQ(c.shared_expert_intermediate_size, 5632);
    EXPECT_TRUE(c.qkv_bias_only);
    for (int64_t i = 0; i < 24; ++i) EXPECT_TRUE(c.moe_layer(i) && c.attention_window(i) == 0) << i;
    EXPECT_EQ(ModelConfig::from_json(c.to_json()).to_json(), c.to_json());
  }
  {  // Transformers' defaults when the keys are absent.
    nlohmann::json j = with(q2d, "model_type", "qwen2_moe");
    for (const char* k : {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                          "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "qkv_bias", "router_aux_loss_coef",
                          "output_router_logits", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
      j.erase(k);
    const ModelConfig d = ModelConfig::from_json(j);
    EXPECT_EQ(d.num_experts, 60);
    EXPECT_EQ(d.num_experts_per_tok, 4);
    EXPECT_EQ(d.moe_intermediate_size, 1408);
    EXPECT_EQ(d.shared_expert_intermediate_size, 5632);
    EXPECT_FALSE(d.norm_topk_prob || d.output_router_logits || d.sliding_window.has_value());
    EXPECT_TRUE(d.qkv_bias_only);
    EXPECT_DOUBLE_EQ(d.router_aux_loss_coef, 0.001);
    for (int64_t i = 0; i < 6; ++i) EXPECT_TRUE(d.moe_layer(i)) << i;
  }

  // Saved with Transformers 5's fused expert tensors, read back (strict: every tensor used).
  for (const char* family : {"mixtral", "qwen3_moe", "qwen2_moe"}) {
    SCOPED_TRACE(family);
    TempDir d;
    const auto a = models::CausalLM::from_folder(fx / family, DType::f32, Device::cpu());
    a->save(d.path);
    EXPECT_TRUE(SafetensorsFile::open(d.path / "model.safetensors").contains("model.layers.1.mlp.experts.gate_up_proj"));
    models::LoadOptions strict;
    strict.strict = true;
    const auto b = models::CausalLM::from_folder(d.path, DType::f32, Device::cpu(), strict);
    const Tensor ids = Tensor::from_i64(std::vector<int64_t>{3, 14, 15, 92, 65}, {1, 5});
    EXPECT_EQ(b->forward(ids).to_f64_vector(), a->forward(ids).to_f64_vector());
  }
}

// Llama 4 (llama4_text): Llama4TextConfig's keys as the fixture writes them, its defaults and derived
// lists (moe_layers, no_rope_layers, layer_types), every unsupported or out-of-range value a named
// error, the config written back and read again.
TEST(ModelConfig, Llama4Keys) {
  const fs::path dir = fs::path(test::fixtures_dir()) / "llama4_text";
  const ModelConfig c = ModelConfig::from_folder(dir);
  EXPECT_TRUE(c.is_llama4());
  EXPECT_EQ(c.num_experts, 4);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_intermediate_size, 20);
  EXPECT_EQ(c.intermediate_size_mlp, 44);
  EXPECT_TRUE(c.l2_qk_norm && c.attn_temperature_tuning);
  EXPECT_FALSE(c.qk_norm || c.multimodal);
  EXPECT_DOUBLE_EQ(c.floor_scale, 2.0);
  EXPECT_DOUBLE_EQ(c.attn_scale, 0.5);
  EXPECT_EQ(c.rope_scaling.type, models::RopeScaling::Type::Llama3);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(c.moe_layer(i), i == 1 || i == 3) << i;
    EXPECT_EQ(c.rope_layer(i), i != 2) << i;
    EXPECT_EQ(c.attention_chunk(i), i != 2 ? 3 : 0) << i;
    EXPECT_EQ(c.attention_window(i), 0) << i;
  }
  EXPECT_EQ(ModelConfig::from_json(c.to_json()).to_json(), c.to_json());
  EXPECT_TRUE(c.to_json()["floor_scale"].is_number_integer()) << "Llama4TextConfig types floor_scale as an int";

  // Llama4TextConfig's defaults: 16 experts, top-1, every layer MoE, NoPE every fourth layer, chunks
  // of 8192 on the RoPE layers, head_dim 128, theta 500000.
  const nlohmann::json minimal = {{"model_type", "llama4_text"}, {"vocab_size", 300}, {"hidden_size", 64}, {"intermediate_size", 32},
                                  {"num_hidden_layers", 8}, {"num_attention_heads", 4}};
  const ModelConfig d = ModelConfig::from_json(minimal);
  EXPECT_EQ(d.num_experts, 16);
  EXPECT_EQ(d.num_experts_per_tok, 1);
  EXPECT_EQ(d.intermediate_size_mlp, 16384);
  EXPECT_EQ(d.head_dim, 128);
  EXPECT_EQ(d.max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(d.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(d.rms_norm_eps, 1e-5);
  EXPECT_EQ(d.bos_token_id, std::vector<int64_t>{1});
  EXPECT_EQ(d.eos_token_id, std::vector<int64_t>{2});
  EXPECT_TRUE(d.l2_qk_norm && d.attn_temperature_tuning);
  EXPECT_DOUBLE_EQ(d.floor_scale, 8192.0);
  EXPECT_DOUBLE_EQ(d.attn_scale, 0.1);
  for (int64_t i = 0; i < 8; ++i) {
    EXPECT_TRUE(d.moe_layer(i)) << i;
    EXPECT_EQ(d.rope_layer(i), i != 3 && i != 7) << i;
    EXPECT_EQ(d.attention_chunk(i), i != 3 && i != 7 ? 8192 : 0) << i;
  }
  auto with = [&](const std::string& key, const nlohmann::json& v) {
    nlohmann::json j = minimal;
    j[key] = v;
    return j;
  };
  const ModelConfig step = ModelConfig::from_json(with("interleave_moe_layer_step", 2));
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(step.moe_layer(i), i % 2 == 1) << i;
  nlohmann::json listed = with("moe_layers", nlohmann::json::array({0, 5}));
  listed["interleave_moe_layer_step"] = 2;  // moe_layers overrides it
  const ModelConfig ml = ModelConfig::from_json(listed);
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(ml.moe_layer(i), i == 0 || i == 5) << i;
  const ModelConfig nope = ModelConfig::from_json(with("no_rope_layers", nlohmann::json::array({0, 1, 1, 1, 1, 1, 1, 0})));
  EXPECT_FALSE(nope.rope_layer(0) || nope.rope_layer(7));
  EXPECT_TRUE(nope.rope_layer(3));
  EXPECT_EQ(nope.attention_chunk(0), 0);
  EXPECT_EQ(nope.attention_chunk(3), 8192);
  EXPECT_TRUE(ModelConfig::from_json(with("attn_temperature_tuning", 4)).attn_temperature_tuning);  // as Meta's configs write it
  EXPECT_FALSE(ModelConfig::from_json(with("attn_temperature_tuning", 0)).attn_temperature_tuning);
  EXPECT_FALSE(ModelConfig::from_json(with("attn_temperature_tuning", false)).attn_temperature_tuning);
  const ModelConfig unchunked = ModelConfig::from_json(with("attention_chunk_size", nullptr));
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(unchunked.attention_chunk(i), 0) << i;

  EXPECT_ERROR(ModelConfig::from_json(with("router_jitter_noise", 0.1)), "'router_jitter_noise' 0.1 is not supported");
  EXPECT_ERROR(ModelConfig::from_json(with("attention_dropout", 0.1)), "'attention_dropout' 0.1 is not supported (0 only");
  EXPECT_ERROR(ModelConfig::from_json(with("attention_bias", true)), "'attention_bias' true is not supported for llama4_text");
  EXPECT_ERROR(ModelConfig::from_json(with("num_local_experts", 0)), "'num_local_experts' must be in [1, 65536], is 0");
  EXPECT_ERROR(ModelConfig::from_json(with("num_experts_per_tok", 17)), "'num_experts_per_tok' must be in [1, 16], is 17");
  EXPECT_ERROR(ModelConfig::from_json(with("intermediate_size_mlp", 0)), "'intermediate_size_mlp' must be in [1, 16777216], is 0");
  EXPECT_ERROR(ModelConfig::from_json(with("interleave_moe_layer_step", 0)), "'interleave_moe_layer_step' must be in [1, ");
  EXPECT_ERROR(ModelConfig::from_json(with("moe_layers", nlohmann::json::array({8}))), "'moe_layers' must be in [0, 7], is 8");
  EXPECT_ERROR(ModelConfig::from_json(with("moe_layers", "all")), "'moe_layers' must be a list of integers");
  EXPECT_ERROR(ModelConfig::from_json(with("no_rope_layers", nlohmann::json::array({1, 2, 1, 1, 1, 1, 1, 1}))),
               "'no_rope_layers' entries must be 1 (RoPE) or 0 (NoPE), holds 2");
  EXPECT_ERROR(ModelConfig::from_json(with("no_rope_layers", nlohmann::json::array({1, 0}))), "'no_rope_layers' must hold one entry per layer");
  EXPECT_ERROR(ModelConfig::from_json(with("attention_chunk_size", 0)), "'attention_chunk_size' must be >= 1, is 0");
  EXPECT_ERROR(ModelConfig::from_json(with("floor_scale", 0)), "'floor_scale' must be a finite number > 0");
  EXPECT_ERROR(ModelConfig::from_json(with("attn_scale", -1.0)), "'attn_scale' must be a finite number > 0");
  EXPECT_ERROR(ModelConfig::from_json(with("moe_intermediate_size", 8)), "'moe_intermediate_size' is not a llama4_text key");
  EXPECT_ERROR(ModelConfig::from_json(with("partial_rotary_factor", 0.5)), "'partial_rotary_factor' 0.5 is not supported for llama4_text");
  nlohmann::json types = with("layer_types", std::vector<std::string>(8, "sliding_attention"));
  EXPECT_ERROR(ModelConfig::from_json(types), "llama4_text layers are 'full_attention' or 'chunked_attention'");
  types = with("layer_types", std::vector<std::string>(8, "chunked_attention"));
  types["attention_chunk_size"] = nullptr;
  EXPECT_ERROR(ModelConfig::from_json(types), "layer 0 is 'chunked_attention' but 'attention_chunk_size' is null");
  EXPECT_ERROR(ModelConfig::from_json({{"model_type", "llama4"}}), "model_type 'llama4' needs a 'text_config' object");
  EXPECT_ERROR(ModelConfig::from_json({{"model_type", "llama4"}, {"text_config", {{"model_type", "llama"}}}}),
               "text_config's model_type is 'llama'");
}

// A llama4 folder (Llama4ForConditionalGeneration): the language model from text_config and the
// "language_model." weights, the vision tower's left unread without a word (strict too); the logits
// are the text model's.  Saved, it is a llama4_text folder Transformers' Llama4ForCausalLM reads (the
// experts in the checkpoint's [E, H, 2I] / [E, I, H]), read back strictly with equal logits.
TEST(ModelConfig, Llama4MultimodalFolderAndSave) {
  const fs::path src = fs::path(test::fixtures_dir()) / "llama4_text";
  nlohmann::json text;
  {
    std::ifstream in(src / "config.json");
    text = nlohmann::json::parse(in);
  }
  TempDir d;
  {
    std::ofstream out(d.path / "config.json");
    out << nlohmann::json{{"model_type", "llama4"}, {"text_config", text}, {"vision_config", {{"hidden_size", 8}}}}.dump();
  }
  const auto f = SafetensorsFile::open(src / "model.safetensors");
  std::vector<std::pair<std::string, Tensor>> all;
  for (const auto& [name, e] : f.entries()) all.emplace_back("language_model." + name, f.view(name));
  all.emplace_back("vision_model.patch_embedding.weight", Tensor::zeros({8, 3}, DType::f32, Device::cpu()));
  all.emplace_back("multi_modal_projector.linear_1.weight", Tensor::zeros({32, 8}, DType::f32, Device::cpu()));
  models::save_safetensors(d.path / "model.safetensors", all);
  models::LoadOptions strict;
  strict.strict = true;
  const auto mm = models::CausalLM::from_folder(d.path, DType::f32, Device::cpu(), strict);
  EXPECT_TRUE(mm->config().multimodal);
  EXPECT_TRUE(mm->unused_weights().empty());
  const SafetensorsFile e = SafetensorsFile::open(src / "expected.safetensors");
  const Tensor logits = mm->forward(e.view("input_ids"));
  EXPECT_TRUE(test::close_l2(logits, e.view("logits").to_f64_vector(), 1e-5));
  // A missing language-model weight is named with its prefix.
  std::erase_if(all, [](const auto& p) { return p.first == "language_model.model.layers.1.feed_forward.router.weight"; });
  models::save_safetensors(d.path / "model.safetensors", all);
  EXPECT_ERROR(models::CausalLM::from_folder(d.path, DType::f32, Device::cpu()),
               "missing weight 'language_model.model.layers.1.feed_forward.router.weight'");

  TempDir saved;
  mm->save(saved.path);
  const auto sf = SafetensorsFile::open(saved.path / "model.safetensors");
  EXPECT_EQ(sf.view("model.layers.1.feed_forward.experts.gate_up_proj").shape(), (Shape{4, 32, 40}));
  EXPECT_EQ(sf.view("model.layers.3.feed_forward.experts.down_proj").shape(), (Shape{4, 20, 32}));
  std::ifstream in(saved.path / "config.json");
  const nlohmann::json sj = nlohmann::json::parse(in);
  EXPECT_EQ(sj["model_type"], "llama4_text");
  EXPECT_EQ(sj["architectures"][0], "Llama4ForCausalLM");
  const auto back = models::CausalLM::from_folder(saved.path, DType::f32, Device::cpu(), strict);
  EXPECT_EQ(back->forward(e.view("input_ids")).to_f64_vector(), logits.to_f64_vector());
}

// Activation checkpointing recomputes each Llama 4 layer (its temperature scales and L2 norms
// included) in the backward: the same loss and gradients.
TEST(CausalLM, Llama4CheckpointedGradientsEqualTheKeptOnes) {
  const fs::path dir = fs::path(test::fixtures_dir()) / "llama4_text";
  const auto model = models::CausalLM::from_folder(dir, DType::f32, Device::cpu());
  const SafetensorsFile e = SafetensorsFile::open(dir / "expected.safetensors");
  test::expect_checkpointing_changes_nothing(*model, e.view("input_ids"), e.view("labels"));
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
  // Every missing weight is named, not only the first.
  std::erase_if(without, [](const auto& p) { return p.first == "model.layers.0.self_attn.k_proj.weight"; });
  models::save_safetensors(d.path / "model.safetensors", without);
  EXPECT_ERROR(models::CausalLM::from_folder(d.path, DType::f32, Device::cpu()),
               "missing weights 'model.layers.0.self_attn.k_proj.weight', 'model.layers.1.mlp.down_proj.weight' (config.json: "
               "llama with 2 layers");
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
  models::LoadOptions strict;
  strict.strict = true;  // every tensor of the fixture is used
  const auto model = models::CausalLM::from_folder(dir, DType::f32, Device::cpu(), strict);
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
  // Into storage that already holds the positions (as generate_batch allocates it), chunks of several
  // tokens after a cached prefix go through the fused prefill layers: the same logits.
  {
    const ModelConfig& c = model->config();
    models::CausalLM::KVCache cache;
    for (size_t l = 0; l < static_cast<size_t>(c.num_hidden_layers); ++l) {
      cache.k.push_back(Tensor::zeros({ids.size(0), c.num_key_value_heads, 9, c.head_dim}, DType::f32, Device::cpu()));
      cache.v.push_back(Tensor::zeros({ids.size(0), c.num_key_value_heads, 9, c.head_dim}, DType::f32, Device::cpu()));
    }
    const Tensor first = model->forward(ids.narrow(1, 0, 3).contiguous(), &cache);
    const Tensor rest = model->forward(ids.narrow(1, 3, 4).contiguous(), &cache);
    EXPECT_EQ(cache.length, 7);
    EXPECT_EQ(cache.k[0].size(2), 9) << "the storage was used as given";
    EXPECT_TRUE(test::close_l2(ops::cat({first, rest}, 1), logits.to_f64_vector(), 1e-5));
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
    EXPECT_ERROR(model->generate({200}, 1), "token id 200 (position 0) is outside the model's vocabulary of 97 ids");
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

// Each generated token of a greedy run is the argmax of the logits a full forward of the whole
// sequence (no cache) gives at the position before it.
void expect_greedy_continuation(models::CausalLM& model, const std::vector<int64_t>& ids, size_t prompt, const std::string& what) {
  const int64_t n = static_cast<int64_t>(ids.size()), v = model.config().vocab_size;
  const auto lv = model.forward(Tensor::from_i64(ids, {1, n}, DType::i64, Device::cpu())).to_f64_vector();
  for (size_t t = prompt; t < ids.size(); ++t) {
    const auto row = lv.begin() + static_cast<int64_t>(t - 1) * v;
    EXPECT_EQ(ids[t], std::max_element(row, row + v) - row) << what << ": token " << t;
  }
}

// Batched generation: prompts of different lengths decode together and each gives what it gives alone
// and what a full forward confirms (greedy); the stream sees every token; a stop token ends its row only.
TEST_P(Families, BatchedGenerationMatchesEachPromptAlone) {
  const fs::path dir = fs::path(test::fixtures_dir()) / GetParam();
  const auto model = models::CausalLM::from_folder(dir, DType::f32, Device::cpu());
  const SafetensorsFile e = SafetensorsFile::open(dir / "expected.safetensors");
  std::vector<int64_t> base;
  for (double x : e.view("greedy.prompt").to_f64_vector()) base.push_back(static_cast<int64_t>(x));
  const std::vector<std::vector<int64_t>> prompts = {base, {base[0]}, {5, 9, 11, 3, 7, 2, 40, 41, 42, 13, 17}, base};
  const std::vector<int64_t> none;
  const int64_t steps = 8;
  std::vector<std::vector<int64_t>> streamed(prompts.size());
  models::CausalLM::GenerationStats st;
  const auto got = model->generate_batch(prompts, steps, models::Sampling(), &none,
                                         [&](size_t r, int64_t t) { streamed[r].push_back(t); }, &st);
  ASSERT_EQ(got.size(), prompts.size());
  for (size_t p = 0; p < prompts.size(); ++p) {
    const std::string what = fmt::format("prompt {}", p);
    EXPECT_EQ(got[p].ids, model->generate(prompts[p], steps, models::Sampling(), &none)) << what;
    EXPECT_EQ(got[p].reason, models::StopReason::MaxNewTokens) << what;
    EXPECT_EQ(streamed[p], std::vector<int64_t>(got[p].ids.begin() + static_cast<int64_t>(prompts[p].size()), got[p].ids.end())) << what;
    expect_greedy_continuation(*model, got[p].ids, prompts[p].size(), what);
  }
  // Each row's first token comes from its prefill; the batched steps made the rest.
  EXPECT_EQ(st.decode_tokens, static_cast<int64_t>(prompts.size()) * (steps - 1));
  EXPECT_GT(st.first_token_seconds, 0.0);
  EXPECT_EQ(st.prefills, 1) << "four short prompts fit one padded prefill";
  // Row 1's third new token as the stop: each row stops where it stops alone.
  const std::vector<int64_t> stops = {got[1].ids[prompts[1].size() + 2]};
  const auto stopped = model->generate_batch(prompts, steps, models::Sampling(), &stops);
  for (size_t p = 0; p < prompts.size(); ++p) {
    models::StopReason why{};
    EXPECT_EQ(stopped[p].ids, model->generate(prompts[p], steps, models::Sampling(), &stops, &why)) << p;
    EXPECT_EQ(stopped[p].reason, why) << p;
  }
  EXPECT_EQ(stopped[1].reason, models::StopReason::StopToken);
  // Sampled rows: reproducible, row 0 as the prompt alone (seed + 0).
  const models::Sampling s{0.8, 20, 0.9, 7};
  const auto a = model->generate_batch(prompts, 5, s, &none), b = model->generate_batch(prompts, 5, s, &none);
  for (size_t p = 0; p < prompts.size(); ++p) EXPECT_EQ(a[p].ids, b[p].ids) << p;
  EXPECT_EQ(a[0].ids, model->generate(prompts[0], 5, s, &none));
  EXPECT_ERROR(model->generate_batch({base, {}}, 1), "prompt 1 has no tokens");
  EXPECT_ERROR(model->generate_batch({base, {3, 200}}, 1), "prompt 1's token id 200 (position 1) is outside");
}

// Rows that outgrow the cache's first allocation (the longest prompt + 256 positions) and reach the
// context length: the storage doubles with every row's keys kept.
TEST(CausalLMGeneration, LongRowsGrowTheCacheAndStopAtTheContext) {
  ModelConfig c = ModelConfig::from_folder(fs::path(test::fixtures_dir()) / "llama");
  c.max_position_embeddings = 330;
  const auto model = models::CausalLM::random(c, DType::f32, Device::cpu(), 11, 0.5);
  const std::vector<std::vector<int64_t>> prompts = {{3, 4, 5}, {7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26}};
  const std::vector<int64_t> none;
  const auto got = model->generate_batch(prompts, 320, models::Sampling(), &none);
  EXPECT_EQ(got[0].ids.size(), 323u);
  EXPECT_EQ(got[0].reason, models::StopReason::MaxNewTokens);
  EXPECT_EQ(got[1].ids.size(), 330u);
  EXPECT_EQ(got[1].reason, models::StopReason::ContextLength);
  for (size_t p = 0; p < prompts.size(); ++p) expect_greedy_continuation(*model, got[p].ids, prompts[p].size(), fmt::format("row {}", p));
}

// On the GPU a batch size's decode step runs eagerly once, is captured as a CUDA graph and then
// replayed (KCPP_DECODE_GRAPHS=0 turns that off), its steps pipelined (each queued from the last
// one's picks on the device).  The ids equal those of eager steps exactly, as rows stop at different
// steps and the batch shrinks (a capture per size), as rows outgrow the storage, in f32 and bf16,
// with sliding windows; in f32 each token is also the greedy pick of a full forward.
TEST(CausalLMGeneration, GraphDecodeEqualsEagerStepsOnTheGpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "skipped: no CUDA device";
  const std::vector<std::vector<int64_t>> prompts = {{3, 4, 5}, {7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}, {20}, {5, 6}};
  for (const char* family : {"llama", "qwen3", "mistral_swa", "gemma", "phi3"})
    for (DType dt : {DType::f32, DType::bf16}) {
      const std::string what = fmt::format("{} {}", family, dtype_name(dt));
      const auto model = models::CausalLM::from_folder(fs::path(test::fixtures_dir()) / family, dt, Device::cuda(0));
      const std::vector<int64_t> none;
      const auto first = model->generate_batch(prompts, 24, models::Sampling(), &none);
      // Row 2's fifth new token ends every row that makes it: rows finish at different steps.
      const std::vector<int64_t> stops = {first[2].ids[prompts[2].size() + 4]};
      ::setenv("KCPP_DECODE_GRAPHS", "0", 1);
      const auto eager = model->generate_batch(prompts, 24, models::Sampling(), &stops);
      ::unsetenv("KCPP_DECODE_GRAPHS");
      models::CausalLM::GenerationStats st;
      const auto graphed = model->generate_batch(prompts, 24, models::Sampling(), &stops, {}, &st);
      if (model->config().head_dim % 8 == 0) {  // else no CUDA decode kernel
        EXPECT_GT(st.graph_replays, 0) << what;
      }
      for (size_t p = 0; p < prompts.size(); ++p) {
        EXPECT_EQ(graphed[p].ids, eager[p].ids) << what << " row " << p;
        EXPECT_EQ(graphed[p].reason, eager[p].reason) << what << " row " << p;
        if (dt == DType::f32) expect_greedy_continuation(*model, graphed[p].ids, prompts[p].size(), what);
      }
    }
  // Rows that outgrow the storage (the longest prompt + 256 positions): the pipelined steps stop
  // short of the doubling, which the next step makes, then go on.
  ModelConfig c = ModelConfig::from_folder(fs::path(test::fixtures_dir()) / "llama");
  c.max_position_embeddings = 400;
  const auto model = models::CausalLM::random(c, DType::bf16, Device::cuda(0), 11, 0.5);
  const std::vector<int64_t> none;
  const std::vector<std::vector<int64_t>> rows = {{3, 4, 5}, {7, 8}};
  ::setenv("KCPP_DECODE_GRAPHS", "0", 1);
  const auto eager = model->generate_batch(rows, 300, models::Sampling(), &none);
  ::unsetenv("KCPP_DECODE_GRAPHS");
  models::CausalLM::GenerationStats st;
  const auto graphed = model->generate_batch(rows, 300, models::Sampling(), &none, {}, &st);
  EXPECT_GT(st.graph_replays, 0) << "long rows";
  for (size_t p = 0; p < rows.size(); ++p) {
    EXPECT_EQ(graphed[p].ids, eager[p].ids) << "long row " << p;
    EXPECT_EQ(graphed[p].reason, eager[p].reason) << "long row " << p;
  }
  // A capacity (16 + 100 keys) that the decode attention splits when sized by it: the captured steps
  // take its one-block path for short rows (f32, where the merge orders' roundings cannot part ties).
  const auto f32 = models::CausalLM::random(c, DType::f32, Device::cuda(0), 11, 0.5);
  const std::vector<std::vector<int64_t>> medium = {{3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3}};
  ::setenv("KCPP_DECODE_GRAPHS", "0", 1);
  const auto medium_eager = f32->generate_batch(medium, 100, models::Sampling(), &none);
  ::unsetenv("KCPP_DECODE_GRAPHS");
  const auto medium_graphed = f32->generate_batch(medium, 100, models::Sampling(), &none, {}, &st);
  EXPECT_GT(st.graph_replays, 0) << "medium row";
  EXPECT_EQ(medium_graphed[0].ids, medium_eager[0].ids) << "medium row";
  expect_greedy_continuation(*f32, medium_graphed[0].ids, medium[0].size(), "medium row");
}

// Logits of a few ragged decode steps (one given token a row) after each prompt is prefilled into
// its own row of the cache, as generate_batch runs them.
std::vector<Tensor> ragged_step_logits(models::CausalLM& model, const std::vector<std::vector<int64_t>>& prompts, int64_t steps) {
  const ModelConfig& c = model.config();
  const Device dev = model.device();
  const int64_t rows = static_cast<int64_t>(prompts.size()), layers = c.num_hidden_layers;
  int64_t capacity = 64;  // the prompts and the steps fit
  for (const auto& p : prompts) capacity = std::max(capacity, static_cast<int64_t>(p.size()) + steps);
  models::CausalLM::KVCache cache;
  for (int64_t l = 0; l < layers; ++l) {
    cache.k.push_back(Tensor::zeros({rows, c.num_key_value_heads, capacity, c.head_dim}, model.dtype(), dev));
    cache.v.push_back(Tensor::zeros({rows, c.num_key_value_heads, capacity, c.head_dim}, model.dtype(), dev));
  }
  for (size_t p = 0; p < prompts.size(); ++p) {
    models::CausalLM::KVCache one;
    for (int64_t l = 0; l < layers; ++l) {
      one.k.push_back(cache.k[static_cast<size_t>(l)].narrow(0, static_cast<int64_t>(p), 1));
      one.v.push_back(cache.v[static_cast<size_t>(l)].narrow(0, static_cast<int64_t>(p), 1));
    }
    const int64_t len = static_cast<int64_t>(prompts[p].size());
    (void)model.next_token_logits(Tensor::from_i64(prompts[p], {1, len}, DType::i64, dev), &one);
    cache.rows.push_back(len);
  }
  std::vector<Tensor> out;
  for (int64_t t = 0; t < steps; ++t) {
    std::vector<int64_t> ids;
    for (int64_t r = 0; r < rows; ++r) ids.push_back((5 + 7 * t + 3 * r) % c.vocab_size);
    out.push_back(model.next_token_logits(Tensor::from_i64(ids, {rows, 1}, DType::i64, dev), &cache));
  }
  return out;
}

// A decode step's layers through the fused decode ops (the fused projections where they apply:
// bf16 / f16 on CUDA, up to 4 rows as the tests' KCPP_GEMV allows) against the same step layer by
// layer (KCPP_DECODE_FUSED=0) and with the fused elementwise ops but separate projections
// (KCPP_DECODE_FUSED=1).  The paths round the same intermediates to the dtype and differ only in the
// order of f32 sums (a norm's sum of squares), which moves an element of a rounded intermediate by
// at most one unit of the dtype: the logits agree within a few units of roundoff in relative L2
// (composite_rel_l2), on 1 and 3 rows, every family, both devices where there is a GPU.
TEST(CausalLMGeneration, FusedDecodeStepMatchesTheUnfusedStep) {
  std::vector<Device> devices{Device::cpu()};
  if (cuda_device_count() > 0) devices.push_back(Device::cuda(0));
  const std::vector<std::vector<int64_t>> prompts = {{3, 4, 5}, {7, 8, 9, 10, 11, 12, 13}, {20}};
  for (const Device dev : devices)
    for (const char* family : {"llama", "qwen3", "mistral_swa", "gemma", "phi3"})
      for (DType dt : {DType::f32, DType::bf16})
        for (size_t rows : {size_t{1}, size_t{3}}) {
          const std::string what = fmt::format("{} {} {} rows={}", dev.str(), family, dtype_name(dt), rows);
          const auto model = models::CausalLM::from_folder(fs::path(test::fixtures_dir()) / family, dt, dev);
          const std::vector<std::vector<int64_t>> ps(prompts.begin(), prompts.begin() + static_cast<int64_t>(rows));
          const auto fused = ragged_step_logits(*model, ps, 3);
          ::setenv("KCPP_DECODE_FUSED", "1", 1);
          const auto elementwise = ragged_step_logits(*model, ps, 3);
          ::setenv("KCPP_DECODE_FUSED", "0", 1);
          const auto layered = ragged_step_logits(*model, ps, 3);
          ::unsetenv("KCPP_DECODE_FUSED");
          for (size_t t = 0; t < fused.size(); ++t) {
            const std::vector<double> ref = layered[t].to_f64_vector();
            EXPECT_TRUE(test::close_l2(fused[t], ref, test::composite_rel_l2(dt))) << what << " step " << t;
            EXPECT_TRUE(test::close_l2(elementwise[t], ref, test::composite_rel_l2(dt))) << what << " step " << t << " (KCPP_DECODE_FUSED=1)";
          }
        }
}

// The persistent decode step (ops/nn/decode_persistent.h) against the same step layer by layer
// (KCPP_DECODE_FUSED=0) and through the fused ops (its switch KCPP_DECODE_PERSISTENT=1 unset), on a GPU that runs it
// (compute capability 9.0, a build with sm_90a).  The fixtures' families it covers, and random
// models reaching what the fixtures do not: K above a stage's 1024 elements with a partial last
// piece, several groups of seven rows a block, five query heads a kv head, head dims 64 and 128,
// Gemma's norms and activation, a sliding window of 37, and a 200-token row whose keys split over
// several blocks.  1 and 3 rows, bf16.  The paths round the same intermediates and differ in the
// order of f32 sums: the logits agree within composite_rel_l2.  Each call must have run the kernel.
TEST(CausalLMGeneration, PersistentDecodeStepMatchesTheLayeredStep) {
  const PlatformInfo pl = detect_platform();
  if (pl.gpus.empty() || pl.gpus[0].cc_major != 9 || pl.cuda_archs_compiled.find("90a") == std::string::npos)
    GTEST_SKIP() << "needs a compute capability 9.0 GPU and a build with sm_90a";
  const Device dev = Device::cuda(0);
  auto resized = [](const char* family, int64_t hidden, int64_t inter, int64_t hq, int64_t hkv, int64_t d, int64_t window) {
    models::ModelConfig c = models::ModelConfig::from_folder(fs::path(test::fixtures_dir()) / family);
    c.hidden_size = hidden, c.intermediate_size = inter, c.num_attention_heads = hq, c.num_key_value_heads = hkv;
    c.head_dim = d, c.vocab_size = 211;
    c.sliding_window = window > 0 ? std::optional<int64_t>(window) : std::nullopt;
    return c;
  };
  struct Case {
    std::string name;
    std::unique_ptr<models::CausalLM> model;
  };
  std::vector<Case> cases;
  for (const char* family : {"llama", "qwen3", "mistral_swa", "gemma"})
    cases.push_back({family, models::CausalLM::from_folder(fs::path(test::fixtures_dir()) / family, DType::bf16, dev)});
  cases.push_back({"qwen3 1280/2600, 10/2 heads of 128", models::CausalLM::random(resized("qwen3", 1280, 2600, 10, 2, 128, 0), DType::bf16, dev, 11, 0.05)});
  cases.push_back({"llama 1536/4096, 16/4 heads of 64", models::CausalLM::random(resized("llama", 1536, 4096, 16, 4, 64, 0), DType::bf16, dev, 12, 0.05)});
  cases.push_back({"gemma 512/1536, 8/8 heads of 32", models::CausalLM::random(resized("gemma", 512, 1536, 8, 8, 32, 0), DType::bf16, dev, 13, 0.05)});
  cases.push_back({"mistral 768/2048, 12/4 heads of 64, window 37", models::CausalLM::random(resized("mistral", 768, 2048, 12, 4, 64, 37), DType::bf16, dev, 14, 0.05)});
  std::vector<int64_t> long_prompt(200);
  for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = static_cast<int64_t>(3 + 5 * i) % 97;
  const std::vector<std::vector<int64_t>> prompts = {long_prompt, {7, 8, 9, 10, 11, 12, 13}, {20}};
  for (Case& c : cases)
    for (size_t rows : {size_t{1}, size_t{3}}) {
      const std::string what = fmt::format("{} rows={}", c.name, rows);
      const std::vector<std::vector<int64_t>> ps(prompts.begin(), prompts.begin() + static_cast<int64_t>(rows));
      const int64_t before = ops::decode_persistent_runs();
      ::setenv("KCPP_DECODE_PERSISTENT", "1", 1);
      const auto persistent = ragged_step_logits(*c.model, ps, 3);
      EXPECT_EQ(ops::decode_persistent_runs() - before, 3) << what << ": the persistent kernel did not run every step";
      ::unsetenv("KCPP_DECODE_PERSISTENT");
      const auto fused = ragged_step_logits(*c.model, ps, 3);
      ::setenv("KCPP_DECODE_FUSED", "0", 1);
      const auto layered = ragged_step_logits(*c.model, ps, 3);
      ::unsetenv("KCPP_DECODE_FUSED");
      for (size_t t = 0; t < persistent.size(); ++t) {
        EXPECT_TRUE(test::close_l2(persistent[t], layered[t].to_f64_vector(), test::composite_rel_l2(DType::bf16))) << what << " step " << t;
        EXPECT_TRUE(test::close_l2(persistent[t], fused[t].to_f64_vector(), test::composite_rel_l2(DType::bf16))) << what << " step " << t << " (fused)";
      }
    }
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
  // The MLP on the halves of the fused gate_up in place (the default, above; the reference GLU on
  // strided views) and on contiguous copies (KCPP_MLP_PACKED=0): the same bits.
  const test::ScopedEnv packed("KCPP_MLP_PACKED", "0");
  const auto pr = model->loss_and_gradients(e.view("input_ids"), e.view("labels"));
  EXPECT_EQ(pr.loss.to_f64_vector(), r.loss.to_f64_vector());
  for (const auto& [name, grad] : r.grads) EXPECT_EQ(pr.grads.at(name).to_f64_vector(), grad.to_f64_vector()) << name;
}

// The *_swa fixtures: sliding windows (3 or 4) shorter than the sequence, per family's rules.
INSTANTIATE_TEST_SUITE_P(Transformers, Families,
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "mistral_swa", "phi3_swa",
                                           "qwen2_swa", "qwen3_swa", "mixtral", "qwen3_moe", "qwen2_moe", "llama4_text"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace kcpp

namespace kcpp {
namespace {

// ---- config.json: every value in its range (issue 21) --------------------------------------------------

// llama3() with `key` set to `v` (a discarded value erases it); `key` "a.b" reaches into an object.
nlohmann::json llama3_with(const std::string& key, const nlohmann::json& v) {
  nlohmann::json j = llama3();
  const size_t dot = key.find('.');
  nlohmann::json& at = dot == std::string::npos ? j : j[key.substr(0, dot)];
  const std::string k = dot == std::string::npos ? key : key.substr(dot + 1);
  if (v.is_discarded()) at.erase(k);
  else at[k] = v;
  return j;
}
#define EXPECT_CONFIG_ERROR(key, value, needle) \
  EXPECT_ERROR(ModelConfig::from_json(llama3_with(key, value)), needle)

TEST(ModelConfigRanges, SizesMustBePositiveAndBounded) {
  EXPECT_CONFIG_ERROR("vocab_size", -3, "config.json: 'vocab_size' must be in [1, 16777216], is -3");
  EXPECT_CONFIG_ERROR("hidden_size", 0, "'hidden_size' must be in [1, 16777216], is 0");
  EXPECT_CONFIG_ERROR("intermediate_size", int64_t{1} << 25, "'intermediate_size' must be in [1, 16777216], is 33554432");
  EXPECT_CONFIG_ERROR("num_hidden_layers", 0, "'num_hidden_layers' must be in [1, 16777216], is 0");
  nlohmann::json mistral = llama3_with("model_type", "mistral");  // whose per-layer windows are listed
  mistral["num_hidden_layers"] = -1;
  EXPECT_ERROR(ModelConfig::from_json(mistral), "'num_hidden_layers' must be in [1, 16777216], is -1");
  EXPECT_CONFIG_ERROR("num_attention_heads", -32, "'num_attention_heads' must be in [1, 16777216], is -32");
  // Past int64: named, never wrapped to a negative number.
  EXPECT_CONFIG_ERROR("vocab_size", nlohmann::json(uint64_t{18446744073709551615u}),
                      "'vocab_size' is 18446744073709551615, past any size");
  EXPECT_CONFIG_ERROR("vocab_size", 1.5, "'vocab_size' must be an integer, is 1.5");
}

TEST(ModelConfigRanges, HeadsMustDivide) {
  // hidden_size / num_attention_heads is the head size when head_dim is not given.
  EXPECT_CONFIG_ERROR("num_attention_heads", 24, "hidden_size 4096 is not a multiple of num_attention_heads 24");
  EXPECT_CONFIG_ERROR("num_key_value_heads", 5, "num_attention_heads 32 is not a multiple of num_key_value_heads 5");
  EXPECT_CONFIG_ERROR("num_key_value_heads", 64, "'num_key_value_heads' must be in [1, 32], is 64");
  EXPECT_CONFIG_ERROR("num_key_value_heads", 0, "'num_key_value_heads' must be in [1, 32], is 0");
  // With head_dim given, hidden_size need not be heads x head_dim (Gemma 7B: 16 x 256 over 3072).
  EXPECT_EQ(ModelConfig::from_json(llama3_with("head_dim", 256)).head_dim, 256);
  EXPECT_CONFIG_ERROR("head_dim", 0, "'head_dim' must be in [1, 16777216], is 0");
  EXPECT_CONFIG_ERROR("head_dim", -128, "'head_dim' must be in [1, 16777216], is -128");
  EXPECT_CONFIG_ERROR("head_dim", 1 << 20, "num_attention_heads x head_dim must be at most 16777216, is 32 x 1048576");
  EXPECT_CONFIG_ERROR("partial_rotary_factor", 0.0, "'partial_rotary_factor' must be in (0, 1]");
  EXPECT_CONFIG_ERROR("partial_rotary_factor", 1.5, "'partial_rotary_factor' must be in (0, 1]");
}

TEST(ModelConfigRanges, PositionsEpsAndRopeTheta) {
  EXPECT_CONFIG_ERROR("max_position_embeddings", -1, "'max_position_embeddings' must be in [1, 2147483647], is -1");
  EXPECT_CONFIG_ERROR("max_position_embeddings", 0, "'max_position_embeddings' must be in [1, 2147483647], is 0");
  EXPECT_CONFIG_ERROR("rms_norm_eps", 0.0, "'rms_norm_eps' must be a finite number > 0, is 0");
  EXPECT_CONFIG_ERROR("rms_norm_eps", -1e-6, "'rms_norm_eps' must be a finite number > 0, is -1e-06");
  EXPECT_CONFIG_ERROR("rms_norm_eps", std::nan(""), "'rms_norm_eps' must be a finite number > 0, is nan");
  EXPECT_CONFIG_ERROR("rope_theta", 0.0, "'rope_theta' must be a finite number > 0, is 0");
  EXPECT_CONFIG_ERROR("rope_theta", -10000.0, "'rope_theta' must be a finite number > 0, is -10000");
  EXPECT_CONFIG_ERROR("rope_theta", HUGE_VAL, "'rope_theta' must be a finite number > 0, is inf");
  // Transformers 5's place for it.
  nlohmann::json v5 = llama3();
  v5.erase("rope_theta");
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", -1.0}};
  EXPECT_ERROR(ModelConfig::from_json(v5), "'rope_theta' must be a finite number > 0, is -1");
}

TEST(ModelConfigRanges, RopeScalingFactors) {
  EXPECT_CONFIG_ERROR("rope_scaling.factor", 0.5, "rope_scaling: 'factor' must be a finite number >= 1, is 0.5");
  EXPECT_CONFIG_ERROR("rope_scaling.factor", std::nan(""), "rope_scaling: 'factor' must be a finite number >= 1, is nan");
  EXPECT_CONFIG_ERROR("rope_scaling.low_freq_factor", 0.0, "rope_scaling: 'low_freq_factor' must be a finite number > 0, is 0");
  EXPECT_CONFIG_ERROR("rope_scaling.high_freq_factor", 0.5, "'high_freq_factor' (0.5) must exceed 'low_freq_factor' (1)");
  EXPECT_CONFIG_ERROR("rope_scaling.original_max_position_embeddings", 0,
                      "rope_scaling: 'original_max_position_embeddings' must be in [1, 2147483647], is 0");
  const nlohmann::json linear = {{"rope_type", "linear"}, {"factor", -2.0}};
  EXPECT_CONFIG_ERROR("rope_scaling", linear, "rope_scaling: 'factor' must be a finite number >= 1, is -2");
  const nlohmann::json dynamic = {{"rope_type", "dynamic"}, {"factor", 2.0}, {"original_max_position_embeddings", -5}};
  EXPECT_CONFIG_ERROR("rope_scaling", dynamic, "'original_max_position_embeddings' must be >= 1, is -5");
}

TEST(ModelConfigRanges, TokenIdsInsideTheVocabulary) {
  EXPECT_CONFIG_ERROR("bos_token_id", -1, "'bos_token_id' must be in [0, 128255], is -1");
  EXPECT_CONFIG_ERROR("eos_token_id", nlohmann::json({128001, 128256}), "'eos_token_id' must be in [0, 128255], is 128256");
  EXPECT_CONFIG_ERROR("pad_token_id", 128256, "'pad_token_id' must be in [-128256, 128255], is 128256");
  EXPECT_EQ(ModelConfig::from_json(llama3_with("pad_token_id", -1)).pad_token_id, -1);  // torch's padding_idx -1
}

TEST(ModelConfigRanges, SlidingWindowKeys) {
  nlohmann::json m = llama3_with("model_type", "mistral");
  m["sliding_window"] = 0;
  EXPECT_ERROR(ModelConfig::from_json(m), "'sliding_window' must be >= 1, is 0");
  m["sliding_window"] = -4096;
  EXPECT_ERROR(ModelConfig::from_json(m), "'sliding_window' must be >= 1, is -4096");
  nlohmann::json q = llama3_with("model_type", "qwen2");
  q["sliding_window"] = -1;  // wrong even where use_sliding_window leaves it unused
  EXPECT_ERROR(ModelConfig::from_json(q), "'sliding_window' must be >= 1, is -1");
  q["sliding_window"] = 8;
  q["max_window_layers"] = -1;
  EXPECT_ERROR(ModelConfig::from_json(q), "'max_window_layers' must be >= 0, is -1");
  q["max_window_layers"] = 28;
  q["layer_types"] = {"full_attention"};
  EXPECT_ERROR(ModelConfig::from_json(q), "'layer_types' must list one type per layer (32), lists 1");
  q["layer_types"] = std::vector<std::string>(32, "local");
  EXPECT_ERROR(ModelConfig::from_json(q), "'layer_types' entry 0 is 'local', must be 'full_attention' or 'sliding_attention'");
  // As Transformers, whose mask then finds no window: a sliding layer needs use_sliding_window.
  q["layer_types"] = std::vector<std::string>(32, "sliding_attention");
  EXPECT_ERROR(ModelConfig::from_json(q), "layer 0 is 'sliding_attention' but the config sets no sliding window");
}

// A config built in code is checked when a model is made from it.
TEST(ModelConfigRanges, RandomModelsValidateTheirConfig) {
  ModelConfig c = ModelConfig::from_json(llama3());
  c.hidden_size = 0;
  EXPECT_ERROR(models::CausalLM::random(c, DType::f32, Device::cpu(), 1), "config: 'hidden_size' must be in [1, 16777216], is 0");
  c = ModelConfig::from_json(llama3());
  c.rope_theta = -1;
  EXPECT_ERROR(models::CausalLM::random(c, DType::f32, Device::cpu(), 1), "config: 'rope_theta' must be a finite number > 0, is -1");
}

// ---- sliding-window attention per family (Transformers 5's configuration classes) -------------------

std::vector<int64_t> windows(const ModelConfig& c) {
  std::vector<int64_t> w;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) w.push_back(c.attention_window(i));
  return w;
}

TEST(SlidingWindow, EachFamilysRules) {
  auto config = [](const char* family, const nlohmann::json& extra) {
    nlohmann::json j = llama3();
    j["model_type"] = family;
    j["num_hidden_layers"] = 4;
    for (const auto& [k, v] : extra.items()) j[k] = v;
    return ModelConfig::from_json(j);
  };
  const nlohmann::json none = nlohmann::json::object();
  // Mistral: every layer; 4096 when the key is absent (MistralConfig's default), none when null.
  EXPECT_EQ(windows(config("mistral", {{"sliding_window", 5}})), (std::vector<int64_t>{5, 5, 5, 5}));
  EXPECT_EQ(windows(config("mistral", none)), (std::vector<int64_t>{4096, 4096, 4096, 4096}));
  EXPECT_EQ(windows(config("mistral", {{"sliding_window", nullptr}})), (std::vector<int64_t>{0, 0, 0, 0}));
  // Phi-3: every layer; none when absent.
  EXPECT_EQ(windows(config("phi3", {{"sliding_window", 2047}})), (std::vector<int64_t>{2047, 2047, 2047, 2047}));
  EXPECT_EQ(windows(config("phi3", none)), (std::vector<int64_t>{0, 0, 0, 0}));
  // Qwen2 / Qwen3: only with use_sliding_window, from layer max_window_layers on, or as layer_types says.
  for (const char* q : {"qwen2", "qwen3"}) {
    SCOPED_TRACE(q);
    EXPECT_EQ(windows(config(q, {{"sliding_window", 131072}, {"max_window_layers", 1}})), (std::vector<int64_t>{0, 0, 0, 0}));
    EXPECT_EQ(windows(config(q, {{"use_sliding_window", true}, {"sliding_window", 7}, {"max_window_layers", 1}})),
              (std::vector<int64_t>{0, 7, 7, 7}));
    EXPECT_EQ(windows(config(q, {{"use_sliding_window", true}})), (std::vector<int64_t>{0, 0, 0, 0}));  // max_window_layers 28
    EXPECT_EQ(windows(config(q, {{"use_sliding_window", true}, {"max_window_layers", 0}})),
              (std::vector<int64_t>{4096, 4096, 4096, 4096}));
    const nlohmann::json types = {"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
    const ModelConfig listed = config(q, {{"use_sliding_window", true}, {"sliding_window", 6}, {"layer_types", types}});
    EXPECT_EQ(windows(listed), (std::vector<int64_t>{6, 0, 6, 0}));
    EXPECT_EQ(windows(ModelConfig::from_json(listed.to_json())), windows(listed));  // written back as Transformers reads it
  }
  // Llama and Gemma have none, whatever the config says.
  EXPECT_EQ(windows(config("llama", {{"sliding_window", 5}})), (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(windows(config("gemma", {{"sliding_window", 5}, {"head_dim", 128}})), (std::vector<int64_t>{0, 0, 0, 0}));
  // Every family's config written back reads to the same windows.
  for (const char* f : {"mistral", "phi3"})
    for (const nlohmann::json& e : {nlohmann::json{{"sliding_window", 9}}, nlohmann::json{{"sliding_window", nullptr}}}) {
      const ModelConfig c = config(f, e);
      EXPECT_EQ(windows(ModelConfig::from_json(c.to_json())), windows(c)) << f << " " << e.dump();
    }
}

// The fixtures' windows: what Transformers built the expected logits with (tests/fixtures/make_fixtures.py).
TEST(SlidingWindow, FixturesLayers) {
  auto of = [](const char* f) { return windows(ModelConfig::from_folder(fs::path(test::fixtures_dir()) / f)); };
  EXPECT_EQ(of("mistral_swa"), (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(of("phi3_swa"), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(of("qwen2_swa"), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(of("qwen3_swa"), (std::vector<int64_t>{4, 0}));
  for (const char* f : {"mistral_swa", "phi3_swa", "qwen2_swa", "qwen3_swa"}) {  // written back, read the same
    const ModelConfig c = ModelConfig::from_folder(fs::path(test::fixtures_dir()) / f);
    EXPECT_EQ(ModelConfig::from_json(c.to_json()).to_json(), c.to_json()) << f;
    EXPECT_EQ(windows(ModelConfig::from_json(c.to_json())), of(f)) << f;
  }
  for (const char* f : {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"}) EXPECT_EQ(of(f), (std::vector<int64_t>{0, 0})) << f;
}

// ---- weights the model does not use (issue 21) ---------------------------------------------------------

// A copy of a fixture folder with config.json's keys changed.
void copy_fixture(const char* family, const fs::path& to, const nlohmann::json& changes) {
  const fs::path src = fs::path(test::fixtures_dir()) / family;
  fs::copy_file(src / "model.safetensors", to / "model.safetensors");
  std::ifstream in(src / "config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  for (const auto& [k, v] : changes.items()) j[k] = v;
  std::ofstream(to / "config.json") << j.dump();
}

TEST(UnusedWeights, ReportedOrRefusedWhenStrict) {
  TempDir d;
  copy_fixture("llama", d.path, {{"num_hidden_layers", 1}});  // the file holds 2 layers
  std::vector<std::string> warnings;
  models::LoadOptions warn;
  warn.warn = [&](const std::string& w) { warnings.push_back(w); };
  const auto m = models::CausalLM::from_folder(d.path, DType::f32, Device::cpu(), warn);
  const std::vector<std::string> layer1 = {
      "model.layers.1.input_layernorm.weight",  "model.layers.1.mlp.down_proj.weight",
      "model.layers.1.mlp.gate_proj.weight",    "model.layers.1.mlp.up_proj.weight",
      "model.layers.1.post_attention_layernorm.weight", "model.layers.1.self_attn.k_proj.weight",
      "model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.q_proj.weight",
      "model.layers.1.self_attn.v_proj.weight"};
  EXPECT_EQ(m->unused_weights(), layer1);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("9 tensors of the weight files are not used by the model (config.json: llama with 1 layers): "
                             "'model.layers.1.input_layernorm.weight', 'model.layers.1.mlp.down_proj.weight'"),
            std::string::npos)
      << warnings[0];
  EXPECT_EQ(m->forward(Tensor::from_i64(std::vector<int64_t>{1, 2, 3}, {1, 3}, DType::i64, Device::cpu())).shape(), (Shape{1, 3, 97}));
  models::LoadOptions strict;
  strict.strict = true;
  EXPECT_ERROR(models::CausalLM::from_folder(d.path, DType::f32, Device::cpu(), strict),
               "9 tensors of the weight files are not used by the model (config.json: llama with 1 layers): "
               "'model.layers.1.input_layernorm.weight'");
  EXPECT_ERROR(models::CausalLM::from_folder(d.path, DType::f32, Device::cpu(), strict), "or load without strict");
}

// The same through a sharded folder; a tied model's lm_head.weight as Transformers 5 takes it: tied
// when equal to the embeddings, else used untied, with a warning.
TEST(UnusedWeights, ShardedFoldersAndTiedHeads) {
  const fs::path src = fs::path(test::fixtures_dir()) / "qwen2";  // tie_word_embeddings: true
  const SafetensorsFile f = SafetensorsFile::open(src / "model.safetensors");
  auto write = [&](const fs::path& dir, const Tensor& head) {
    fs::copy_file(src / "config.json", dir / "config.json", fs::copy_options::overwrite_existing);
    std::vector<std::pair<std::string, Tensor>> first, second;
    nlohmann::json map;
    for (const auto& [name, e] : f.entries()) {
      const bool one = name.find("layers.1.") == std::string::npos;
      (one ? first : second).emplace_back(name, f.view(name));
      map[name] = one ? "a.safetensors" : "b.safetensors";
    }
    second.emplace_back("model.layers.5.mlp.down_proj.weight", Tensor::zeros({3}, DType::f32, Device::cpu()));
    second.emplace_back("lm_head.weight", head);
    map["model.layers.5.mlp.down_proj.weight"] = map["lm_head.weight"] = "b.safetensors";
    models::save_safetensors(dir / "a.safetensors", first);
    models::save_safetensors(dir / "b.safetensors", second);
    std::ofstream(dir / "model.safetensors.index.json") << nlohmann::json{{"weight_map", map}}.dump();
  };
  std::vector<std::string> warnings;
  models::LoadOptions opt;
  opt.warn = [&](const std::string& w) { warnings.push_back(w); };
  TempDir d;
  write(d.path, f.view("model.embed_tokens.weight"));
  const auto tied = models::CausalLM::from_folder(d.path, DType::f32, Device::cpu(), opt);
  EXPECT_EQ(tied->unused_weights(), (std::vector<std::string>{"model.layers.5.mlp.down_proj.weight"}));
  EXPECT_TRUE(tied->config().tie_word_embeddings);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("1 tensor of the weight files is not used by the model"), std::string::npos) << warnings[0];

  Generator gen = test::test_generator();
  write(d.path, Tensor::randn({97, 32}, DType::f32, Device::cpu(), gen));
  warnings.clear();
  const auto untied = models::CausalLM::from_folder(d.path, DType::f32, Device::cpu(), opt);
  EXPECT_FALSE(untied->config().tie_word_embeddings);
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_NE(warnings[0].find("the head is used untied, as Transformers does"), std::string::npos) << warnings[0];
  // The same as the config saying so.
  TempDir d2;
  fs::copy(d.path, d2.path, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(d2.path / "config.json"));
  cfg["tie_word_embeddings"] = false;
  std::ofstream(d2.path / "config.json") << cfg.dump();
  const auto said = models::CausalLM::from_folder(d2.path, DType::f32, Device::cpu(), opt);
  const Tensor ids = SafetensorsFile::open(src / "expected.safetensors").view("input_ids");
  EXPECT_EQ(untied->forward(ids).to_f64_vector(), said->forward(ids).to_f64_vector());
  EXPECT_FALSE(test::close_l2(untied->forward(ids), tied->forward(ids).to_f64_vector(), 1e-3));
}

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

namespace kcpp {
namespace {

// A one-layer Llama of 50 ids and a context of 8 tokens, random weights.
std::unique_ptr<models::CausalLM> tiny_model() {
  const nlohmann::json j = {{"model_type", "llama"}, {"vocab_size", 50}, {"hidden_size", 16}, {"intermediate_size", 24},
                            {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"num_key_value_heads", 1},
                            {"max_position_embeddings", 8}, {"rms_norm_eps", 1e-5}};
  return models::CausalLM::random(models::ModelConfig::from_json(j), DType::f32, Device::cpu(), 5);
}

// Generation ends at the context length (max_position_embeddings) with the reason, however many
// tokens were asked for; a prompt longer than the context is refused.
TEST(CausalLM, GenerationStopsAtTheContextLength) {
  const auto model = tiny_model();
  const std::vector<int64_t> none;
  models::StopReason why{};
  auto out = model->generate({1, 2, 3}, 2'000'000'000, models::Sampling(), &none, &why);
  EXPECT_EQ(out.size(), 8u);
  EXPECT_EQ(why, models::StopReason::ContextLength);
  out = model->generate({1, 2, 3}, 2, models::Sampling(), &none, &why);
  EXPECT_EQ(out.size(), 5u);
  EXPECT_EQ(why, models::StopReason::MaxNewTokens);
  out = model->generate({1, 2, 3, 4, 5, 6, 7, 8}, 1, models::Sampling(), &none, &why);
  EXPECT_EQ(out.size(), 8u);
  EXPECT_EQ(why, models::StopReason::ContextLength);
  out = model->generate({1, 2, 3}, 5, models::Sampling(), &out, &why);  // every token of the previous output stops it
  EXPECT_EQ(out.size(), 4u);
  EXPECT_EQ(why, models::StopReason::StopToken);
  EXPECT_ERROR(model->generate(std::vector<int64_t>(9, 1), 1),
               "the prompt has 9 tokens, more than the model's context length of 8 (max_position_embeddings");
}

// Each sampling option out of its range is an error naming it and the value (temperature 0 is greedy).
TEST(CausalLM, SamplingOptionsOutOfRangeAreNamedErrors) {
  const auto model = tiny_model();
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  auto with = [&](double temperature, int64_t top_k, double top_p) {
    return error_of([&] { model->generate({1}, 1, models::Sampling{temperature, top_k, top_p, 0}); });
  };
  EXPECT_EQ(with(0.0, 0, 1.0), "");
  EXPECT_EQ(with(0.7, 5, 0.5), "");
  EXPECT_NE(with(-1.0, 0, 1.0).find("temperature is -1; it must be 0 (greedy) or a positive number"), std::string::npos);
  EXPECT_NE(with(nan, 0, 1.0).find("temperature is nan"), std::string::npos);
  EXPECT_NE(with(inf, 0, 1.0).find("temperature is inf"), std::string::npos);
  EXPECT_NE(with(0.7, -5, 1.0).find("top_k is -5"), std::string::npos);
  EXPECT_NE(with(0.7, 0, 0.0).find("top_p is 0; it must be above 0 and at most 1"), std::string::npos);
  EXPECT_NE(with(0.7, 0, 1.5).find("top_p is 1.5"), std::string::npos);
  EXPECT_NE(with(0.7, 0, nan).find("top_p is nan"), std::string::npos);
  EXPECT_NE(with(0.0, 0, 0.0).find("top_p is 0"), std::string::npos);  // checked when greedy too
  EXPECT_ERROR(model->generate({1}, -1), "max_new_tokens is -1");
  // A temperature near 0 samples the greedy choice (no inf - inf in the softmax).
  const std::vector<int64_t> none;
  EXPECT_EQ(model->generate({1, 2}, 4, models::Sampling{1e-300, 0, 1.0, 3}, &none),
            model->generate({1, 2}, 4, models::Sampling(), &none));
}

// NaN or infinite logits (broken weights, a bad config) are an error saying so, not token 0.
TEST(CausalLM, NonFiniteLogitsAreAnError) {
  for (double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    const auto model = tiny_model();
    for (auto& [name, p] : model->parameters())
      if (name == "model.norm.weight") p.copy_(Tensor::full(p.shape(), bad, DType::f32, Device::cpu()));
    for (const models::Sampling& s : {models::Sampling(), models::Sampling{0.8, 10, 0.9, 1}})
      EXPECT_ERROR(model->generate({1, 2}, 3, s), "the model produced non-finite logits");
  }
}

// A prompt id outside the vocabulary names the id, where it is and the vocabulary's size, and the
// message carries no source location in a release build.
TEST(CausalLM, PromptIdOutsideTheVocabularyIsNamed) {
  const auto model = tiny_model();
  const std::string msg = error_of([&] { model->generate({3, 50}, 1); });
  EXPECT_NE(msg.find("the prompt's token id 50 (position 1) is outside the model's vocabulary of 50 ids (0 to 49)"),
            std::string::npos)
      << msg;
  EXPECT_NE(error_of([&] { model->generate({-1}, 1); }).find("token id -1 (position 0)"), std::string::npos);
#ifdef NDEBUG
  if (!std::getenv("KCPP_DEBUG")) {
    EXPECT_EQ(msg.find(".cpp:"), std::string::npos) << msg;
  }
#endif
  EXPECT_ERROR(model->generate({}, 1), "the prompt has no tokens");
}

}  // namespace
}  // namespace kcpp
