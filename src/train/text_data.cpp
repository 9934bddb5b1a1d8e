#include "train/text_data.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace kcpp::train {

TextDocuments read_text_documents(const std::filesystem::path& file, const std::string& field) {
  std::ifstream in(file, std::ios::binary);
  KCPP_CHECK(in.good(), "{}: cannot open the training data", file.string());
  TextDocuments docs;
  const bool jsonl = file.extension() == ".jsonl";
  if (!jsonl) {
    std::stringstream ss;
    ss << in.rdbuf();
    KCPP_CHECK(!in.bad(), "{}: cannot read the training data", file.string());
    docs.texts.push_back(ss.str());
    docs.lines.push_back(1);
  } else {
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      KCPP_CHECK(!j.is_discarded(), "{}:{}: not a JSON value (a .jsonl file holds one JSON object a line)", file.string(), n);
      KCPP_CHECK(j.is_object(), "{}:{}: a JSON {}, not an object with a '{}' string", file.string(), n, j.type_name(), field);
      const auto it = j.find(field);
      KCPP_CHECK(it != j.end(), "{}:{}: no '{}' field (the text field is chosen with --text-field)", file.string(), n, field);
      KCPP_CHECK(it->is_string(), "{}:{}: '{}' is a JSON {}, not a string", file.string(), n, field, it->type_name());
      docs.texts.push_back(it->get<std::string>());
      docs.lines.push_back(n);
    }
    KCPP_CHECK(!in.bad(), "{}: cannot read the training data", file.string());
  }
  size_t bytes = 0;
  for (const std::string& t : docs.texts) bytes += t.size();
  KCPP_CHECK(bytes > 0, "{}: no text to train on{}", file.string(), jsonl ? fmt::format(" (no '{}' with text)", field) : "");
  return docs;
}

std::vector<int64_t> tokenize_documents(const TextDocuments& docs, const Encode& encode, std::optional<int64_t> eos,
                                        const std::string& origin) {
  std::vector<int64_t> tokens;
  for (size_t i = 0; i < docs.texts.size(); ++i) {
    try {
      const std::vector<int64_t> ids = encode(docs.texts[i]);
      tokens.insert(tokens.end(), ids.begin(), ids.end());
    } catch (const Error& e) {
      KCPP_FAIL("{}:{}: {}", origin, docs.lines[i], e.what());
    }
    if (eos) tokens.push_back(*eos);
  }
  return tokens;
}

}  // namespace kcpp::train
