// base64 encode/decode for tiktoken.model lines (see base64.h).
#include "server/tokenizer/base64.h"

#include <array>
#include <cstdint>

namespace bg {
namespace {

constexpr std::string_view kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

constexpr std::array<int8_t, 256> decode_table() {
  std::array<int8_t, 256> t{};
  for (auto& v : t) v = -1;
  for (size_t i = 0; i < kAlphabet.size(); ++i) t[static_cast<unsigned char>(kAlphabet[i])] = static_cast<int8_t>(i);
  return t;
}

}  // namespace

std::string base64_encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t v = static_cast<uint32_t>(static_cast<unsigned char>(bytes[i])) << 16;
    if (i + 1 < bytes.size()) v |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[i + 1])) << 8;
    if (i + 2 < bytes.size()) v |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[i + 2]));
    out.push_back(kAlphabet[(v >> 18) & 63]);
    out.push_back(kAlphabet[(v >> 12) & 63]);
    out.push_back(i + 1 < bytes.size() ? kAlphabet[(v >> 6) & 63] : '=');
    out.push_back(i + 2 < bytes.size() ? kAlphabet[v & 63] : '=');
  }
  return out;
}

std::optional<std::string> base64_decode(std::string_view text) {
  static constexpr std::array<int8_t, 256> kTable = decode_table();
  if (text.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    uint32_t v = 0;
    int n_pad = 0;
    for (size_t k = 0; k < 4; ++k) {
      const char ch = text[i + k];
      if (ch == '=') {
        // Padding only in the last quantum, only in its last two places, and nothing but padding after it.
        if (!last || k < 2) return std::nullopt;
        ++n_pad;
        v <<= 6;
        continue;
      }
      const int8_t d = kTable[static_cast<unsigned char>(ch)];
      if (d < 0 || n_pad > 0) return std::nullopt;
      v = (v << 6) | static_cast<uint32_t>(d);
    }
    out.push_back(static_cast<char>((v >> 16) & 0xFF));
    if (n_pad < 2) out.push_back(static_cast<char>((v >> 8) & 0xFF));
    if (n_pad < 1) out.push_back(static_cast<char>(v & 0xFF));
  }
  return out;
}

}  // namespace bg
