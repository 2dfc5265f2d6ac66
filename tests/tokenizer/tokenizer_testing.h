// Shared helpers of the tokenizer tests: a small hand-made byte-level vocabulary and file writers.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "server/tokenizer/tokenizer.h"

namespace bg::testing {

// 256 single bytes (id = byte value) followed by `merges` in rank order (ids 256, 257, ...).
inline std::vector<std::pair<std::string, int32_t>> byte_ranks(const std::vector<std::string>& merges) {
  std::vector<std::pair<std::string, int32_t>> ranks;
  for (int b = 0; b < 256; ++b) ranks.emplace_back(std::string(1, static_cast<char>(b)), b);
  for (size_t i = 0; i < merges.size(); ++i) ranks.emplace_back(merges[i], static_cast<int32_t>(256 + i));
  return ranks;
}

inline Tokenizer small_tokenizer(const std::vector<std::string>& merges,
                                 std::vector<std::pair<std::string, int32_t>> specials = {}) {
  TokenizerSpec spec;
  spec.pattern = std::string(kKimiPattern);
  spec.special_tokens = std::move(specials);
  return Tokenizer::from_ranks(byte_ranks(merges), std::move(spec));
}

inline void write_text_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

}  // namespace bg::testing
