// train/: AdamW against its definition, and a model trained, saved as a Hugging Face folder and
// read back.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <fstream>
#include <numeric>
#include <random>
#include <tuple>

#include "models/causal_lm.h"
#include "models/chat_template.h"
#include "models/mamba.h"
#include "models/safetensors.h"
#include "models/tokenizer.h"
#include "test_util.h"
#include "train/adamw.h"
#include "train/adamw_kernels.h"
#include "train/corpus.h"
#include "train/data_parallel.h"
#include "train/schedule.h"
#include "train/text_data.h"
#include "train/trainer.h"

namespace kcpp {
namespace {

namespace fs = std::filesystem;

// Two steps on a 3-element parameter (no decay: a "bias") and a decayed one, checked against the
// update written out in f64, with clipping active on the second step.
TEST(AdamW, MatchesItsDefinition) {
  train::AdamWOptions o;
  o.lr = 0.1, o.beta1 = 0.8, o.beta2 = 0.95, o.eps = 1e-6, o.weight_decay = 0.5, o.max_grad_norm = 1.0;
  const std::vector<double> p0 = {0.5, -1.0, 2.0}, w0 = {1.5};
  Tensor p = Tensor::from_f64(p0, {3}, DType::f32), w = Tensor::from_f64(w0, {1}, DType::bf16);
  train::AdamW opt({{"layer.bias", p}, {"layer.weight", w}}, o);
  const std::vector<std::vector<double>> gp = {{0.1, 0.2, -0.3}, {2.0, -1.0, 0.5}}, gw = {{0.4}, {-3.0}};
  std::vector<double> ep = p0, ew = w0, mp(3, 0), vp(3, 0), mw(1, 0), vw(1, 0), master = w0;
  for (int t = 1; t <= 2; ++t) {
    double total = 0;
    for (double g : gp[t - 1]) total += g * g;
    for (double g : gw[t - 1]) total += g * g;
    const double norm = std::sqrt(total), clip = norm > 1.0 ? 1.0 / (norm + 1e-6) : 1.0;
    const double bc1 = 1 - std::pow(0.8, t), bc2 = 1 - std::pow(0.95, t);
    for (int i = 0; i < 3; ++i) {
      const double g = gp[t - 1][i] * clip;
      mp[i] = 0.8 * mp[i] + 0.2 * g, vp[i] = 0.95 * vp[i] + 0.05 * g * g;
      ep[i] -= 0.1 * (mp[i] / bc1) / (std::sqrt(vp[i] / bc2) + 1e-6);  // a bias: no decay
    }
    const double g = gw[t - 1][0] * clip;
    mw[0] = 0.8 * mw[0] + 0.2 * g, vw[0] = 0.95 * vw[0] + 0.05 * g * g;
    master[0] = master[0] * (1 - 0.1 * 0.5) - 0.1 * (mw[0] / bc1) / (std::sqrt(vw[0] / bc2) + 1e-6);
    opt.step({{"layer.bias", Tensor::from_f64(gp[t - 1], {3}, DType::f32)}, {"layer.weight", Tensor::from_f64(gw[t - 1], {1}, DType::bf16)}});
    const double n = opt.grad_norm();
    EXPECT_NEAR(n, norm, 1e-2 * norm);  // the bf16 gradient is rounded
    EXPECT_TRUE(test::close_l2(p, ep, 1e-6)) << "step " << t;
  }
  // The bf16 weight is its f32 master rounded once (the gradient itself was rounded to bf16 too).
  EXPECT_NEAR(w.item(), master[0], 1e-2);
  EXPECT_THROW(train::AdamW({{"x", Tensor()}}, o), Error);
}

// The CUDA multi-tensor update against the CPU one, element for element: more parameters than one
// launch takes (kAdamWBatch), sizes around the vector width and the chunk, f32 and bf16 parameters
// (two groups), a gradient whose pointer is not vector-aligned (the scalar path), clipping active.
// The squared norm is bitwise the same in a second run (fixed-order reduction).
TEST(AdamW, CudaMultiTensorMatchesTheCpu) {
  KCPP_REQUIRE_DEVICE(Device::cuda(0));
  const std::vector<int64_t> sizes = {1, 3, 4, 5, 7, 8191, 8192, 8193, 20001, 3 * 8192 + 5, 100003};
  auto run = [&](Device dev, std::vector<double>* norms) {
    Generator gen(11);
    std::vector<std::pair<std::string, Tensor>> params;
    std::vector<std::pair<std::string, Tensor>> host_params;
    for (int i = 0; i < 2 * train::kAdamWBatch + 3; ++i) {
      const int64_t n = sizes[i % sizes.size()];
      const DType dt = i % 3 == 0 ? DType::f32 : DType::bf16;
      const std::string name = fmt::format("layer.{}.{}", i, i % 4 == 0 ? "bias" : "weight");
      params.emplace_back(name, Tensor::randn({n}, dt, Device::cpu(), gen).to(dev));
    }
    train::AdamWOptions o;
    o.lr = 0.05, o.weight_decay = 0.1, o.max_grad_norm = 5.0;
    train::AdamW opt(params, o);
    for (int step = 0; step < 3; ++step) {
      std::map<std::string, Tensor> grads;
      for (size_t i = 0; i < params.size(); ++i) {
        const Tensor& p = params[i].second;
        Tensor g = Tensor::randn({p.numel() + 1}, p.dtype(), Device::cpu(), gen).to(dev);
        // Every fifth gradient starts one element into its storage: not aligned for vectors.
        grads[params[i].first] = i % 5 == 0 ? g.narrow(0, 1, p.numel()) : g.narrow(0, 0, p.numel());
      }
      opt.step(grads);
      norms->push_back(opt.grad_norm());
    }
    std::vector<std::vector<double>> out;
    for (auto& [name, p] : params) out.push_back(p.to(Device::cpu()).to_f64_vector());
    return out;
  };
  std::vector<double> cpu_norms, cuda_norms, again;
  const auto cpu = run(Device::cpu(), &cpu_norms), cuda = run(Device::cuda(0), &cuda_norms);
  run(Device::cuda(0), &again);
  EXPECT_GT(cpu_norms[0], 5.0);  // clipping is active
  for (size_t s = 0; s < cpu_norms.size(); ++s) {
    EXPECT_NEAR(cuda_norms[s], cpu_norms[s], 1e-12 * cpu_norms[s]) << "step " << s;
    EXPECT_EQ(cuda_norms[s], again[s]) << "step " << s << ": the squared norm is not deterministic";
  }
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_EQ(cuda[i].size(), cpu[i].size());
    // f32: the same operations in f32 (FMA contraction may differ); bf16: one rounding apart at most.
    const double tol = i % 3 == 0 ? 1e-5 : 1.0 / 128;
    for (size_t e = 0; e < cpu[i].size(); ++e)
      ASSERT_NEAR(cuda[i][e], cpu[i][e], tol * std::max(1.0, std::abs(cpu[i][e]))) << "parameter " << i << " element " << e;
  }
}

// Each AdamW option outside its range is an error naming it and its value.
TEST(AdamW, OptionsOutOfRangeAreNamed) {
  auto message = [](auto set) {
    train::AdamWOptions o;
    set(o);
    try {
      train::AdamW({{"w", Tensor::zeros({2}, DType::f32)}}, o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(message([](auto&) {}), "");
  EXPECT_NE(message([](auto& o) { o.lr = -1; }).find("AdamW: lr is -1; the learning rate must be"), std::string::npos);
  EXPECT_NE(message([](auto& o) { o.lr = std::nan(""); }).find("AdamW: lr is nan"), std::string::npos);
  EXPECT_NE(message([](auto& o) { o.lr = INFINITY; }).find("AdamW: lr is inf"), std::string::npos);
  EXPECT_NE(message([](auto& o) { o.beta1 = 1; }).find("AdamW: beta1 is 1; it must be in [0, 1)"), std::string::npos);
  EXPECT_NE(message([](auto& o) { o.beta2 = -0.5; }).find("AdamW: beta2 is -0.5"), std::string::npos);
  EXPECT_NE(message([](auto& o) { o.eps = 0; }).find("AdamW: eps is 0"), std::string::npos);
  EXPECT_NE(message([](auto& o) { o.weight_decay = -1; }).find("AdamW: weight_decay is -1"), std::string::npos);
  EXPECT_NE(message([](auto& o) { o.max_grad_norm = -1; }).find("AdamW: max_grad_norm is -1"), std::string::npos);
}

// A few AdamW steps on one batch lower the loss; the model saved as a Hugging Face folder reads back
// to the same logits.
TEST(Training, StepsLowerTheLossAndCheckpointsReadBack) {
  const fs::path dir = fs::path(test::fixtures_dir()) / "llama";
  auto model = models::CausalLM::from_folder(dir, DType::f32, Device::cpu());
  const auto e = models::SafetensorsFile::open(dir / "expected.safetensors");
  const Tensor ids = e.view("input_ids"), labels = e.view("labels");
  train::AdamWOptions o;
  o.lr = 1e-2, o.weight_decay = 0.01, o.max_grad_norm = 1.0;
  train::AdamW opt(model->parameters(), o);
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    const auto r = model->loss_and_gradients(ids, labels);
    (step == 0 ? first : last) = r.loss.item();
    opt.step(r.grads);
  }
  EXPECT_LT(last, 0.5 * first) << "loss " << first << " -> " << last;
  std::string tmpl = (fs::temp_directory_path() / "kcpp-ckpt-XXXXXX").string();
  const fs::path out = ::mkdtemp(tmpl.data());
  model->save(out);
  auto again = models::CausalLM::from_folder(out, DType::f32, Device::cpu());
  EXPECT_TRUE(test::close_l2(again->forward(ids), model->forward(ids).to_f64_vector(), 1e-7));
  fs::remove_all(out);
}

// Gradient accumulation: a batch split into two micro-batches of one row with different numbers of
// labelled tokens (5 and 3) gives the whole batch's gradients (Transformers-checked above): the sum
// over tokens divided by the labelled tokens of both, not the mean of the two means.
TEST(Training, AccumulationEqualsTheWholeBatch) {
  const fs::path dir = fs::path(test::fixtures_dir()) / "qwen2";
  auto model = models::CausalLM::from_folder(dir, DType::f32, Device::cpu());
  const auto e = models::SafetensorsFile::open(dir / "expected.safetensors");
  const Tensor ids = e.view("input_ids");
  auto lv = e.view("labels").to_f64_vector();
  lv[7 + 3] = lv[7 + 4] = -100;  // row 1: two more ignored
  const Tensor labels = Tensor::from_f64(lv, {2, 7}, DType::i64);
  std::vector<train::MicroBatch> micro;
  for (int64_t r = 0; r < 2; ++r) micro.push_back({ids.narrow(0, r, 1).contiguous(), labels.narrow(0, r, 1).contiguous()});
  const auto acc = train::accumulate_gradients(*model, micro);
  EXPECT_EQ(acc.tokens, 8);
  const auto whole = model->loss_and_gradients(ids, labels);
  EXPECT_NEAR(acc.loss, whole.loss.item(), 1e-6 * std::abs(whole.loss.item()));
  for (const auto& [name, g] : acc.grads) EXPECT_TRUE(test::close_l2(g, whole.grads.at(name).to_f64_vector(), 1e-6)) << name;
  EXPECT_EQ(acc.grads.size(), model->parameters().size());
  // The mean of the two micro-batch means is a different number: the test can tell them apart.
  const double mean_of_means = 0.5 * (model->loss(micro[0].input_ids, micro[0].labels).item() +
                                      model->loss(micro[1].input_ids, micro[1].labels).item());
  EXPECT_GT(std::abs(mean_of_means - acc.loss), 1e-4);
}

// Activation checkpointing changes what is kept, not what is computed: the same loss and gradients.
TEST(Training, CheckpointingGivesTheSameGradients) {
  for (const char* family : {"qwen3", "phi3"}) {
    const fs::path dir = fs::path(test::fixtures_dir()) / family;
    auto model = models::CausalLM::from_folder(dir, DType::f32, Device::cpu());
    const auto e = models::SafetensorsFile::open(dir / "expected.safetensors");
    const auto plain = model->loss_and_gradients(e.view("input_ids"), e.view("labels"));
    model->checkpoint_layers = true;
    const auto ckpt = model->loss_and_gradients(e.view("input_ids"), e.view("labels"));
    EXPECT_EQ(ckpt.loss.item(), plain.loss.item()) << family;
    for (const auto& [name, g] : plain.grads)
      EXPECT_EQ(ckpt.grads.at(name).to_f64_vector(), g.to_f64_vector()) << family << " " << name;
  }
}


// The data loader's windows stay inside the token stream: every row is a run of the stream, the
// longest window and the largest batch are the stream's limits, and past them is a named error.
TEST(TokenWindows, EveryWindowIsInsideTheStream) {
  std::vector<int64_t> tokens(10);
  std::iota(tokens.begin(), tokens.end(), 0);
  EXPECT_EQ(train::TokenWindows::max_seq(tokens.size()), 9);
  EXPECT_EQ(train::TokenWindows::max_batch(tokens.size(), 3), 3);
  std::mt19937_64 rng(4);
  for (int64_t seq : {1, 5, 9}) {
    const train::TokenWindows w(tokens, seq, train::TokenWindows::max_batch(tokens.size(), seq));
    for (int draw = 0; draw < 50; ++draw) {
      const std::vector<int64_t> ids = w.next(rng);
      ASSERT_EQ(static_cast<int64_t>(ids.size()), w.batch() * seq);
      for (int64_t b = 0; b < w.batch(); ++b)
        for (int64_t i = 0; i < seq; ++i) {
          const int64_t t = ids[static_cast<size_t>(b * seq + i)];
          ASSERT_EQ(t, ids[static_cast<size_t>(b * seq)] + i) << "row " << b << " is not a run of the stream";
          ASSERT_TRUE(t >= 0 && t < 10);
        }
    }
  }
  auto message = [&](int64_t seq, int64_t batch) {
    try {
      (void)train::TokenWindows(tokens, seq, batch);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(10, 1).find("sequences of 10 tokens do not fit in the 10 tokens of the data; the longest allowed is 9"),
            std::string::npos);
  EXPECT_NE(message(400042, 1).find("the longest allowed is 9"), std::string::npos);
  EXPECT_NE(message(3, 4).find("the largest batch allowed at that length is 3"), std::string::npos);
  EXPECT_NE(message(0, 1).find("must be positive"), std::string::npos);
  EXPECT_NE(message(3, -1).find("must be positive"), std::string::npos);
  // skip() leaves the generator where next() would.
  std::mt19937_64 drawn(9), skipped(9);
  const train::TokenWindows three(tokens, 3, 2);
  for (int i = 0; i < 5; ++i) (void)three.next(drawn);
  three.skip(skipped, 5);
  EXPECT_EQ(three.next(drawn), three.next(skipped));
  // Labels come from the same windows as the ids.
  std::vector<int64_t> targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) targets[i] = i % 3 ? 100 + tokens[i] : -100;
  const train::TokenWindows labelled(tokens, 4, 2, targets);
  for (int draw = 0; draw < 20; ++draw) {
    std::vector<int64_t> labels;
    const std::vector<int64_t> ids = labelled.next(rng, &labels);
    ASSERT_EQ(labels.size(), ids.size());
    for (size_t i = 0; i < ids.size(); ++i) ASSERT_EQ(labels[i], targets[static_cast<size_t>(ids[i])]);
  }
  EXPECT_NE(test::error_of([&] { (void)train::TokenWindows(tokens, 4, 1, std::span<const int64_t>(targets).first(9)); })
                .find("9 labels for 10 tokens"), std::string::npos);
  const train::TokenWindows w(tokens, 4, 1);
  int64_t out[4];
  w.copy_window(6, out);
  EXPECT_EQ(out[3], 9);
  EXPECT_THROW(w.copy_window(7, out), Error);
  EXPECT_THROW(w.copy_window(-1, out), Error);
}

// The rates of Transformers' get_scheduler (5.24) over 12 steps of SGD at lr 1, read after each
// step; kcpp's factor(t) is the rate of the step after t others.
TEST(LrSchedule, MatchesTransformersSchedulers) {
  const std::vector<std::tuple<const char*, int64_t, int64_t, std::vector<double>>> cases = {
      {"linear", 3, 10, {0.0, 1.0 / 3, 2.0 / 3, 1.0, 0.857142857143, 0.714285714286, 0.571428571429, 0.428571428571,
                         0.285714285714, 0.142857142857, 0.0, 0.0}},
      {"cosine", 3, 10, {0.0, 1.0 / 3, 2.0 / 3, 1.0, 0.950484433951, 0.811744900929, 0.611260466978, 0.388739533022,
                         0.188255099071, 0.049515566049, 0.0, 0.049515566049}},
      {"constant_with_warmup", 4, 10, {0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0}},
      {"cosine", 0, 7, {1.0, 0.950484433951, 0.811744900929, 0.611260466978, 0.388739533022, 0.188255099071, 0.049515566049,
                        0.0, 0.049515566049}},
      {"linear", 0, 1, {1.0, 0.0, 0.0}},
      {"constant", 0, 0, {1.0, 1.0, 1.0}},
  };
  for (const auto& [name, warmup, total, rates] : cases) {
    const train::LrSchedule s = train::LrSchedule::make(name, warmup, total);
    for (size_t t = 0; t < rates.size(); ++t)
      EXPECT_NEAR(s.factor(static_cast<int64_t>(t)), rates[t], 1e-12) << name << " warmup " << warmup << " step " << t;
  }
  EXPECT_ERROR(train::LrSchedule::make("cosine_with_restarts", 0, 10), "not one of constant, constant_with_warmup, linear, cosine");
  EXPECT_ERROR(train::LrSchedule::make("constant", 5, 10), "use constant_with_warmup");
  EXPECT_ERROR(train::LrSchedule::make("linear", 10, 10), "the warmup must end before the schedule does");
  EXPECT_ERROR(train::LrSchedule::make("cosine", 0, 0), "the warmup must end before the schedule does");
  EXPECT_ERROR(train::LrSchedule::make("linear", -1, 10), "give 0 or more");
}

// Training text: a .jsonl file's documents by line (blank lines skipped) in TRL's formats, another
// file whole; the token stream of each format (EOS after text and completions, the prompt's tokens
// untrained, conversations through the chat template); every malformed line named with its number.
TEST(TextData, DocumentsAndTheirErrors) {
  std::string tmpl = (fs::temp_directory_path() / "kcpp-data-XXXXXX").string();
  const fs::path dir = ::mkdtemp(tmpl.data());
  auto write = [&](const char* name, const std::string& text) {
    std::ofstream(dir / name, std::ios::binary) << text;
    return dir / name;
  };
  using Kind = train::TextDocument::Kind;
  const auto docs = train::read_text_documents(write("a.jsonl", "{\"text\": \"ab\"}\n\n  \n{\"text\": \"c\", \"id\": 3}\n"
                                                                "{\"prompt\": \"q\", \"completion\": \"r\"}\n"
                                                                "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n"));
  ASSERT_EQ(docs.docs.size(), 4u);
  EXPECT_EQ(docs.docs[0].text, "ab");
  EXPECT_EQ(docs.docs[1].line, 4);
  EXPECT_EQ(docs.docs[2].kind, Kind::PromptCompletion);
  EXPECT_EQ(docs.docs[2].completion, "r");
  EXPECT_EQ(docs.docs[3].kind, Kind::Messages);
  EXPECT_EQ(docs.docs[3].line, 6);
  const train::ByteTokenizer bytes;
  train::Encoder enc;
  enc.encode = [&](std::string_view t, bool special) { return bytes.encode(t, special); };
  enc.chat = [](const nlohmann::ordered_json& m) { return train::ChatText{"<" + m[0]["content"].get<std::string>() + ">", {{1, 3}}}; };
  enc.eos = 257;
  const train::TokenStream s = train::tokenize_documents(docs, enc, "a.jsonl");
  EXPECT_EQ(s.ids, (std::vector<int64_t>{256, 'a', 'b', 257, 256, 'c', 257, 256, 'q', 'r', 257, '<', 'h', 'i', '>'}));
  EXPECT_EQ(s.labels, (std::vector<int64_t>{256, 'a', 'b', 257, 256, 'c', 257, -100, -100, 'r', 257, '<', 'h', 'i', '>'}));
  enc.eos.reset();
  const train::TextDocuments two{{docs.docs[0], docs.docs[1]}};
  const train::TokenStream plain_stream = train::tokenize_documents(two, enc, "a.jsonl");
  EXPECT_EQ(plain_stream.ids, (std::vector<int64_t>{256, 'a', 'b', 256, 'c'}));
  EXPECT_TRUE(plain_stream.labels.empty()) << "without a prompt to mask, the labels are the ids";
  const auto plain = train::read_text_documents(write("b.txt", "line one\n{\"text\": 1}\n"));
  ASSERT_EQ(plain.docs.size(), 1u);
  EXPECT_EQ(plain.docs[0].text, "line one\n{\"text\": 1}\n");
  const auto other = train::read_text_documents(write("c.jsonl", "{\"content\": \"x\"}\n"), "content", true);
  EXPECT_EQ(other.docs[0].text, "x");

  EXPECT_ERROR(train::read_text_documents(dir / "missing.txt"), "the text " + (dir / "missing.txt").string() + " does not exist");
  EXPECT_ERROR(train::read_text_documents(dir), "the text " + dir.string() + " is a folder, not a file");
  EXPECT_ERROR(train::read_text_documents(write("e.txt", "")), "e.txt: no text to train on");
  EXPECT_ERROR(train::read_text_documents(write("f.jsonl", "{\"text\": \"\"}\n")), "f.jsonl: no text to train on (no 'text' with text)");
  EXPECT_ERROR(train::read_text_documents(write("g.jsonl", "{\"text\": \"a\"}\n{\"text\": \n")), "g.jsonl:2: not a JSON value");
  EXPECT_ERROR(train::read_text_documents(write("h.jsonl", "[\"a\"]\n")), "h.jsonl:1: a JSON array, not an object");
  EXPECT_ERROR(train::read_text_documents(write("i.jsonl", "{\"txt\": \"a\"}\n")),
               "i.jsonl:1: no 'text' field, nor 'prompt' and 'completion', nor 'messages'");
  EXPECT_ERROR(train::read_text_documents(write("i2.jsonl", "{\"prompt\": \"a\"}\n"), "text", true), "i2.jsonl:1: no 'text' field");
  EXPECT_ERROR(train::read_text_documents(write("j.jsonl", "{\"text\": [1]}\n")), "j.jsonl:1: 'text' is a JSON array, not a string");
  EXPECT_ERROR(train::read_text_documents(write("k.jsonl", "{\"prompt\": \"a\"}\n")), "k.jsonl:1: a prompt-completion line needs both");
  EXPECT_ERROR(train::read_text_documents(write("l.jsonl", "{\"messages\": [{\"content\": \"a\"}]}\n")),
               "l.jsonl:1: messages[0] is not an object with a string 'role'");
  EXPECT_ERROR(train::read_text_documents(write("m.jsonl", "{\"messages\": []}\n")), "m.jsonl:1: 'messages' must be a non-empty list");
  train::Encoder no_chat = enc;
  no_chat.chat = nullptr;
  EXPECT_ERROR(train::tokenize_documents(docs, no_chat, "a.jsonl"), "a.jsonl:6: a conversation ('messages') needs the model's chat template");
  train::Encoder failing = enc;
  failing.encode = [](std::string_view t, bool) -> std::vector<int64_t> {
    if (t == "c") throw Error("the text to encode is not valid UTF-8");
    return {1};
  };
  EXPECT_ERROR(train::tokenize_documents(docs, failing, "d.jsonl"), "d.jsonl:4: the text to encode is not valid UTF-8");
  fs::remove_all(dir);
}

// Assistant-only loss: the tokens that overlap what the template's {% generation %} blocks rendered,
// as Transformers' apply_chat_template(..., return_assistant_tokens_mask=True) (5.24) marks them on
// the same template, conversation and tokenizer (the gpt2 fixture).
TEST(TextData, AssistantOnlyLossAsTransformersMasks) {
  const models::Tokenizer tok = models::Tokenizer::from_file(fs::path(test::fixtures_dir()) / "tokenizers" / "gpt2.json");
  const models::ChatTemplate tmpl = models::ChatTemplate::parse(
      "{% for m in messages %}{% if m.role == 'assistant' %}A:{% generation %} {{ m.content }}.{% endgeneration %}\n{% else %}"
      "{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}");
  train::TextDocument conversation;
  conversation.kind = train::TextDocument::Kind::Messages;
  conversation.messages = nlohmann::ordered_json::parse(
      R"([{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello you"},
          {"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}])");
  train::Encoder enc;
  enc.encode = [&](std::string_view t, bool special) { return tok.encode(t, special); };
  enc.token_bytes = [&](int64_t id) { return tok.token_bytes(id); };
  enc.chat = [&](const nlohmann::ordered_json& m) {
    auto r = tmpl.render_with_generation(m, false);
    return train::ChatText{r.text, r.generation};
  };
  enc.assistant_only = true;
  const train::TokenStream s = train::tokenize_documents(train::TextDocuments{{conversation}}, enc, "chat.jsonl");
  const std::vector<int64_t> ids = {85, 83, 342, 26, 221, 72, 73, 473, 199, 33, 26, 416, 356, 437, 14,
                                    85, 83, 342, 26, 298, 31, 199, 33, 26, 221, 66, 89, 69, 14};
  const std::vector<int> mask = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1};
  ASSERT_EQ(s.ids, ids);
  ASSERT_EQ(s.labels.size(), ids.size());
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(s.labels[i], mask[i] ? ids[i] : -100) << "token " << i;

  // A template that marks nothing, and a generation block inside a macro, are errors naming why.
  const models::ChatTemplate unmarked = models::ChatTemplate::parse("{% for m in messages %}{{ m.content }}{% endfor %}");
  enc.chat = [&](const nlohmann::ordered_json& m) { return train::ChatText{unmarked.render(m, false), {}}; };
  EXPECT_ERROR(train::tokenize_documents(train::TextDocuments{{conversation}}, enc, "chat.jsonl"),
               "chat.jsonl:1: the chat template marked none of this conversation as the assistant's");
  const models::ChatTemplate in_macro = models::ChatTemplate::parse(
      "{% macro a(m) %}{% generation %}{{ m.content }}{% endgeneration %}{% endmacro %}{% for m in messages %}{{ a(m) }}{% endfor %}");
  EXPECT_ERROR(in_macro.render_with_generation(conversation.messages, false), "a generation block inside a set, filter or macro block");
  EXPECT_EQ(in_macro.render(conversation.messages, false), "hi therehello youand?bye");
  // Tokens that do not spell the text back (an NFKC normalizer folds the ligature) cannot be placed.
  nlohmann::json folding = nlohmann::json::parse(std::ifstream(fs::path(test::fixtures_dir()) / "tokenizers" / "gpt2.json"));
  folding["normalizer"] = {{"type", "NFKC"}};
  const models::Tokenizer nfkc = models::Tokenizer::from_json_text(folding.dump(), "nfkc");
  enc.encode = [&](std::string_view t, bool special) { return nfkc.encode(t, special); };
  enc.token_bytes = [&](int64_t id) { return nfkc.token_bytes(id); };
  enc.chat = [&](const nlohmann::ordered_json&) { return train::ChatText{"A: \xef\xac\x81ne", {{2, 8}}}; };
  EXPECT_ERROR(train::tokenize_documents(train::TextDocuments{{conversation}}, enc, "chat.jsonl"),
               "does not spell the rendered conversation back at byte 3");
}

// A Mamba model's step: two micro-batches with different numbers of labelled tokens give the whole
// batch's AdamW update (the same parameters after the step, within f32 rounding); steps lower the
// loss; save() writes a folder that loads back to the same logits.
TEST(Training, MambaStepsAccumulateAndSave) {
  const fs::path dir = fs::path(test::fixtures_dir()) / "mamba";
  auto split = models::MambaLM::from_folder(dir, DType::f32, Device::cpu());
  auto whole = models::MambaLM::from_folder(dir, DType::f32, Device::cpu());
  const auto e = models::SafetensorsFile::open(dir / "expected.safetensors");
  const Tensor ids = e.view("input_ids");
  ASSERT_EQ(ids.size(0), 2);
  const int64_t s = ids.size(1);
  auto lv = ids.to_f64_vector();
  lv[static_cast<size_t>(s) + 2] = lv[static_cast<size_t>(s) + 3] = -100;  // row 1: two fewer labelled tokens
  const Tensor labels = Tensor::from_f64(lv, {2, s}, DType::i64);
  train::AdamWOptions o;
  o.lr = 1e-2, o.weight_decay = 0.01, o.max_grad_norm = 1.0;
  train::AdamW opt_split(split->parameters(), o), opt_whole(whole->parameters(), o);
  std::vector<train::MicroBatch> micro;
  for (int64_t r = 0; r < 2; ++r) micro.push_back({ids.narrow(0, r, 1).contiguous(), labels.narrow(0, r, 1).contiguous()});
  const auto a = train::train_step(*split, opt_split, micro);
  const auto b = train::train_step(*whole, opt_whole, {{ids, labels}});
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_NEAR(a.loss, b.loss, 1e-6 * std::abs(b.loss));
  const auto ps = split->parameters(), pw = whole->parameters();
  ASSERT_EQ(ps.size(), pw.size());
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(test::close_l2(ps[i].second, pw[i].second.to_f64_vector(), 1e-6)) << ps[i].first;
  double last = b.loss;
  for (int step = 0; step < 10; ++step) last = train::train_step(*whole, opt_whole, {{ids, labels}}).loss;
  EXPECT_LT(last, 0.9 * b.loss) << "loss " << b.loss << " -> " << last;
  std::string tmpl = (fs::temp_directory_path() / "kcpp-mamba-XXXXXX").string();
  const fs::path out = ::mkdtemp(tmpl.data());
  whole->save(out);
  auto again = models::MambaLM::from_folder(out, DType::f32, Device::cpu());
  EXPECT_TRUE(test::close_l2(again->forward(ids), whole->forward(ids).to_f64_vector(), 1e-7));
  fs::remove_all(out);
}

// trainer_state.json of a checkpoint: each value of its type and range, or an error naming the key
// (fuzz findings: a float past int64 cast to an integer, a negative step count; kept in
// tests/fuzz/corpus/checkpoint/regression-*).
TEST(Checkpoint, TrainerStateValuesAreTypedAndNamed) {
  train::TrainerState s;
  s.steps_done = 12, s.seed = 18446744073709551615u, s.batch = 16, s.seq = 64, s.lr = 3e-3, s.dtype = "bf16";
  s.data = "data.jsonl", s.data_tokens = 4096, s.data_sha256 = std::string(64, 'a');
  s.lr_scheduler = "cosine", s.warmup_steps = 10, s.schedule_steps = 100;
  const train::TrainerState back = train::TrainerState::parse(s.dump(), "ckpt");
  EXPECT_EQ(back.steps_done, 12);
  EXPECT_EQ(back.seed, 18446744073709551615u);
  EXPECT_EQ(back.batch, 16);
  EXPECT_EQ(back.seq, 64);
  EXPECT_EQ(back.lr, 3e-3);
  EXPECT_EQ(back.dtype, "bf16");
  EXPECT_EQ(back.data, "data.jsonl");
  EXPECT_EQ(back.data_tokens, 4096);
  EXPECT_EQ(back.data_sha256, std::string(64, 'a'));
  EXPECT_EQ(back.lr_scheduler, "cosine");
  EXPECT_EQ(back.warmup_steps, 10);
  EXPECT_EQ(back.schedule_steps, 100);
  const std::string ok = R"("steps_done": 2, "seed": 1)";
  // Absent: 0 or empty (refused by the caller's match), the embedded corpus and a constant rate.
  const train::TrainerState old = train::TrainerState::parse("{" + ok + "}", "ckpt");
  EXPECT_EQ(old.batch, 0);
  EXPECT_EQ(old.data, "");
  EXPECT_EQ(old.lr_scheduler, "constant");
  const std::pair<std::string, std::string> cases[] = {
      {R"({"steps_done": -3, "seed": 1})", "ckpt: trainer_state.json: 'steps_done' must be a whole number, 0 or more, is -3"},
      {R"({"steps_done": 2.5, "seed": 1})", "ckpt: trainer_state.json is not one kcpp train wrote"},
      {R"({"steps_done": 2})", "ckpt: trainer_state.json is not one kcpp train wrote"},
      {"{" + ok + R"(, "seq": 922337203685477580864})", "'seq' must be a whole number, 0 or more, is 9.223372036854776e+20"},
      {"{" + ok + R"(, "batch": "16"})", "'batch' must be a whole number, 0 or more, is \"16\""},
      {"{" + ok + R"(, "batch": 9223372036854775808})", "'batch' must be a whole number, 0 or more"},
      {R"({"steps_done": 2, "seed": -1})", "'seed' must be a whole number, 0 or more, is -1"},
      {"{" + ok + R"(, "lr": "fast"})", "'lr' must be a finite number"},
      {"{" + ok + R"(, "lr": null})", "'lr' must be a finite number, is null"},
      {"{" + ok + R"(, "dtype": 16})", "'dtype' must be a string, is 16"},
      {"{" + ok + R"(, "data": ["a.jsonl"]})", "'data' must be a string, is [\"a.jsonl\"]"},
      {"{" + ok + R"(, "data_tokens": 1e300})", "'data_tokens' must be a whole number, 0 or more, is 1e+300"},
      {"{" + ok + R"(, "data_sha256": null})", "'data_sha256' must be a string, is null"},
      {"{" + ok + R"(, "lr_scheduler": 1})", "'lr_scheduler' must be a string, is 1"},
      {"{" + ok + R"(, "warmup_steps": "10"})", "'warmup_steps' must be a whole number, 0 or more, is \"10\""},
      {"{" + ok + R"(, "schedule_steps": -5})", "'schedule_steps' must be a whole number, 0 or more, is -5"},
      {"[]", "ckpt: trainer_state.json is not one kcpp train wrote"},
  };
  for (const auto& [text, needle] : cases) EXPECT_ERROR(train::TrainerState::parse(text, "ckpt"), needle);
}

// The optimizer state's metadata: a step count that is not a whole number was std::stoll's
// std::invalid_argument, a slice beginning near 2^63 an overflow (fuzz findings, kept in
// tests/fuzz/corpus/checkpoint/regression-*); both are now named errors.
TEST(Checkpoint, OptimizerStateMetadataIsChecked) {
  auto params = [] {
    return std::vector<std::pair<std::string, Tensor>>{{"w", Tensor::zeros({2, 3}, DType::f32, Device::cpu())}};
  };
  train::AdamW saved(params(), {});
  std::string tmpl = (fs::temp_directory_path() / "kcpp-ckpt-XXXXXX").string();
  const fs::path dir = ::mkdtemp(tmpl.data());
  train::save_optimizer_state(dir, saved);
  const fs::path file = dir / "optimizer-rank0-of-1.safetensors";
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& [name, t] : saved.state_tensors()) tensors.emplace_back(name, t);
  auto with_meta = [&](std::map<std::string, std::string> meta) {
    meta["format"] = "kcpp AdamW state";
    models::save_safetensors(file, tensors, meta);
  };
  for (const char* steps : {"two", "", "2 ", "-1", "99999999999999999999"}) {
    with_meta({{"steps", steps}});
    train::AdamW opt(params(), {});
    EXPECT_ERROR(train::load_optimizer_state(dir, opt), fmt::format("the step count '{}' is not a whole number of steps", steps));
  }
  with_meta({{"steps", "7"}});
  train::AdamW opt(params(), {});
  train::load_optimizer_state(dir, opt);
  EXPECT_EQ(opt.steps(), 7);
  with_meta({{"steps", "7"}, {"slices", R"({"w": [9223372036854775807, 6]})"}});
  EXPECT_ERROR(train::load_optimizer_state(dir, opt), "AdamW: the saved 'w.exp_avg' is of a parameter of 6 elements (6 from element 9223372036854775807");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kcpp
