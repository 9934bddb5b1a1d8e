#include "train/corpus.h"

#include <random>

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

}  // namespace kcpp::train
