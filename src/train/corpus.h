// The main job's embedded data: a corpus generated from a small English grammar (seeded, so every
// run and machine sees the same text; nothing to download), a byte-level tokenizer (a token per
// byte, plus BOS and EOS) and the batches drawn from the token stream.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kcpp::train {

// About `bytes` of sentences ("the small robot carries a red box to the old harbor.") from the
// seeded grammar: subjects, verbs, objects, places and a few clause shapes.
std::string generated_corpus(size_t bytes, uint64_t seed = 2026);

// Byte-level tokens: 0..255 are the bytes; 256 is BOS, 257 EOS.
struct ByteTokenizer {
  static constexpr int64_t kBos = 256, kEos = 257, kVocab = 258;
  std::vector<int64_t> encode(std::string_view text, bool bos = true) const;
  std::string decode(const std::vector<int64_t>& ids) const;  // BOS / EOS dropped
};

// Training batches from a token stream: each row is `seq` consecutive tokens from a start drawn
// uniformly in [0, tokens - seq - 1].  The limits are the stream's: a window is at most
// max_seq(tokens) long and a batch holds at most max_batch(tokens, seq) of them (no more tokens
// than the stream has).
class TokenWindows {
 public:
  static int64_t max_seq(size_t tokens);
  static int64_t max_batch(size_t tokens, int64_t seq);

  // Over `tokens` (not copied: they must outlive this), and over `labels` (the target of each token;
  // empty: the tokens themselves) when given.  Throws kcpp::Error, naming the limit, when `seq` or
  // `batch` is not positive or past the limits, or when `labels` is not as long as `tokens`.
  TokenWindows(std::span<const int64_t> tokens, int64_t seq, int64_t batch, std::span<const int64_t> labels = {});

  int64_t seq() const { return seq_; }
  int64_t batch() const { return batch_; }
  // batch x seq ids, row by row, each row's start drawn from `rng`; the same windows of the labels
  // into `labels` when given (the ids again when there are none).
  std::vector<int64_t> next(std::mt19937_64& rng, std::vector<int64_t>* labels = nullptr) const;
  // Advances `rng` as `batches` calls of next() would, copying nothing (a resumed run's data position).
  void skip(std::mt19937_64& rng, int64_t batches) const;
  // Copies the window at `start` into out[0, seq); throws kcpp::Error when it is not inside the stream.
  void copy_window(int64_t start, int64_t* out) const;

 private:
  std::span<const int64_t> tokens_, labels_;
  int64_t seq_, batch_;
};

}  // namespace kcpp::train
