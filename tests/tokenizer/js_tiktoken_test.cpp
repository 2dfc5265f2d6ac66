// Comparison with an independent implementation on a published vocabulary: js-tiktoken's o200k_base ranks and ids
// for tests/tokenizer/corpus.json, produced by the CTest fixture tokenizer_js_reference (tests/tokenizer/js).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "server/tokenizer/tokenizer.h"

namespace bg {
namespace {

namespace fs = std::filesystem;

const fs::path kDataDir = fs::path(BG_BINARY_DIR) / "tokenizer_js";

struct Reference {
  Tokenizer tok;
  nlohmann::json cases;
};

// Loaded once for the JsTiktoken cases; nullptr (after a test failure) when the fixture has not run.
const Reference* reference() {
  static const Reference* ref = []() -> const Reference* {
    const fs::path expected = kDataDir / "o200k_expected.json";
    if (!fs::exists(expected) || !fs::exists(kDataDir / "o200k_base" / "tiktoken.model")) return nullptr;
    std::ifstream in(expected);
    nlohmann::json j = nlohmann::json::parse(in);
    TokenizerSpec spec;
    spec.pattern = std::string(kO200kPattern);
    for (const auto& [text, id] : j["special_tokens"].items()) spec.special_tokens.emplace_back(text, id.get<int32_t>());
    auto ranks = read_tiktoken_model(kDataDir / "o200k_base" / "tiktoken.model");
    EXPECT_EQ(ranks.size(), j["n_ranks"].get<size_t>());
    return new Reference{Tokenizer::from_ranks(std::move(ranks), std::move(spec)), std::move(j["cases"])};
  }();
  if (ref == nullptr) {
    ADD_FAILURE() << "no js-tiktoken reference data in " << kDataDir.string()
                  << ": run `ctest -R tokenizer_js_reference` first (it needs node + npm; scripts/install-deps.sh)";
  }
  return ref;
}

std::string show(const std::string& text) { return text.size() > 60 ? text.substr(0, 60) + "..." : text; }

TEST(JsTiktoken, O200kIdsMatch) {
  const Reference* ref = reference();
  if (ref == nullptr) return;
  ASSERT_GT(ref->cases.size(), 50u);
  for (const auto& c : ref->cases) {
    const std::string text = c["text"];
    EXPECT_EQ(ref->tok.encode(text), c["ids"].get<std::vector<int32_t>>()) << "text: " << show(text);
  }
}

TEST(JsTiktoken, O200kSpecialIdsMatch) {
  const Reference* ref = reference();
  if (ref == nullptr) return;
  for (const auto& c : ref->cases) {
    const std::string text = c["text"];
    EXPECT_EQ(ref->tok.encode_with_special(text), c["ids_special"].get<std::vector<int32_t>>())
        << "text: " << show(text);
  }
}

TEST(JsTiktoken, O200kRoundTrip) {
  const Reference* ref = reference();
  if (ref == nullptr) return;
  for (const auto& c : ref->cases) {
    const std::string text = c["text"];
    EXPECT_EQ(ref->tok.decode(ref->tok.encode(text)), text) << "text: " << show(text);
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 500; ++i) {
    std::string s(rng() % 200, '\0');
    for (char& ch : s) ch = static_cast<char>(rng() % 4 == 0 ? rng() % 256 : 32 + rng() % 95);  // some invalid bytes
    EXPECT_EQ(ref->tok.decode(ref->tok.encode(s)), s);
  }
}

}  // namespace
}  // namespace bg
