#include "train/corpus.h"

#include <algorithm>
#include <random>

#include "core/error.h"

namespace kcpp::train {

namespace {
const std::vector<std::string> kAdjectives = {"small", "old", "bright", "quiet", "red", "tired", "clever", "wooden",
                                              "green", "busy", "cold", "gentle"};
const std::vector<std::string> kSubjects = {"robot", "fox", "sailor", "teacher", "river", "kitten", "baker", "engine",
                                            "gardener", "owl", "train", "child"};
const std::vector<std::string> kVerbs = {"carries", "finds", "paints", "watches", "follows", "builds", "opens", "hides",
                                         "counts", "sings to", "remembers", "cleans"};
const std::vector<std::string> kObjects = {"box", "lantern", "map", "song", "boat", "letter", "garden", "clock",
                                           "bridge", "window", "basket", "key"};
const std::vector<std::string> kPlaces = {"harbor", "forest", "market", "station", "library", "valley", "kitchen",
                                          "tower", "field", "school", "bakery", "island"};
const std::vector<std::string> kTimes = {"at dawn", "in the evening", "every morning", "after the rain", "before noon",
                                         "at night"};
}  // namespace

std::string generated_corpus(size_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](const std::vector<std::string>& v) -> const std::string& {
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
  };
  std::string out;
  out.reserve(bytes + 128);
  while (out.size() < bytes) {
    const std::string subject = "the " + pick(kAdjectives) + " " + pick(kSubjects);
    std::string s;
    switch (std::uniform_int_distribution<int>(0, 3)(rng)) {
      case 0: s = subject + " " + pick(kVerbs) + " a " + pick(kAdjectives) + " " + pick(kObjects) + " to the " + pick(kPlaces) + "."; break;
      case 1: s = subject + " " + pick(kVerbs) + " the " + pick(kObjects) + " " + pick(kTimes) + "."; break;
      case 2: s = pick(kTimes) + ", " + subject + " walks to the " + pick(kPlaces) + " and " + pick(kVerbs) + " a " + pick(kObjects) + "."; break;
      default: s = subject + " and the " + pick(kSubjects) + " meet at the " + pick(kPlaces) + "."; break;
    }
    s[0] = static_cast<char>(s[0] - 'a' + 'A');
    out += s;
    out += std::uniform_int_distribution<int>(0, 4)(rng) == 0 ? "\n" : " ";
  }
  return out;
}

std::vector<int64_t> ByteTokenizer::encode(std::string_view text, bool bos) const {
  std::vector<int64_t> ids;
  ids.reserve(text.size() + 1);
  if (bos) ids.push_back(kBos);
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string s;
  for (int64_t t : ids)
    if (t >= 0 && t < 256) s.push_back(static_cast<char>(t));
  return s;
}

int64_t TokenWindows::max_seq(size_t tokens) { return std::max<int64_t>(0, static_cast<int64_t>(tokens) - 1); }

int64_t TokenWindows::max_batch(size_t tokens, int64_t seq) {
  return seq > 0 ? static_cast<int64_t>(tokens) / seq : 0;
}

TokenWindows::TokenWindows(std::span<const int64_t> tokens, int64_t seq, int64_t batch, std::span<const int64_t> labels)
    : tokens_(tokens), labels_(labels), seq_(seq), batch_(batch) {
  const size_t n = tokens.size();
  KCPP_CHECK(labels.empty() || labels.size() == n, "training data: {} labels for {} tokens", labels.size(), n);
  KCPP_CHECK(seq > 0 && batch > 0, "training data: sequences of {} tokens, {} per batch: both must be positive", seq, batch);
  KCPP_CHECK(seq <= max_seq(n), "training data: sequences of {} tokens do not fit in the {} tokens of the data; the longest "
             "allowed is {}", seq, n, max_seq(n));
  KCPP_CHECK(batch <= max_batch(n, seq), "training data: a batch of {} sequences of {} tokens needs more tokens than the {} of "
             "the data; the largest batch allowed at that length is {}", batch, seq, n, max_batch(n, seq));
}

std::vector<int64_t> TokenWindows::next(std::mt19937_64& rng, std::vector<int64_t>* labels) const {
  std::uniform_int_distribution<int64_t> start(0, static_cast<int64_t>(tokens_.size()) - seq_ - 1);
  std::vector<int64_t> ids(static_cast<size_t>(batch_ * seq_));
  if (labels) labels->resize(ids.size());
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t at = start(rng);
    copy_window(at, ids.data() + b * seq_);
    if (labels) {
      const std::span<const int64_t> from = labels_.empty() ? tokens_ : labels_;
      std::copy(from.begin() + at, from.begin() + at + seq_, labels->begin() + b * seq_);
    }
  }
  return ids;
}

void TokenWindows::skip(std::mt19937_64& rng, int64_t batches) const {
  std::uniform_int_distribution<int64_t> start(0, static_cast<int64_t>(tokens_.size()) - seq_ - 1);
  for (int64_t i = 0; i < batches * batch_; ++i) (void)start(rng);
}

void TokenWindows::copy_window(int64_t start, int64_t* out) const {
  KCPP_CHECK(start >= 0 && start <= static_cast<int64_t>(tokens_.size()) - seq_,
             "training data: a window of {} tokens at {} is outside the {} tokens of the data", seq_, start, tokens_.size());
  std::copy(tokens_.begin() + start, tokens_.begin() + start + seq_, out);
}

}  // namespace kcpp::train
