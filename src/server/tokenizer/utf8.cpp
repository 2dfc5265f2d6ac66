// UTF-8 repair (see utf8.h): a scanner over the well-formed byte sequences of Unicode table 3-7.
#include "server/tokenizer/utf8.h"

#include <cstdint>

namespace bg {
namespace {

// Bytes after the lead (0 for ASCII, -1 for a byte that cannot start a sequence), and the allowed range of the first
// continuation byte (narrower after E0, ED, F0, F4 to rule out overlongs, surrogates and code points > U+10FFFF).
struct Lead {
  int n_cont;
  uint8_t lo, hi;
};

Lead classify(uint8_t b) {
  if (b < 0x80) return {0, 0, 0};
  if (b < 0xC2) return {-1, 0, 0};
  if (b < 0xE0) return {1, 0x80, 0xBF};
  if (b == 0xE0) return {2, 0xA0, 0xBF};
  if (b == 0xED) return {2, 0x80, 0x9F};
  if (b < 0xF0) return {2, 0x80, 0xBF};
  if (b == 0xF0) return {3, 0x90, 0xBF};
  if (b < 0xF4) return {3, 0x80, 0xBF};
  if (b == 0xF4) return {3, 0x80, 0x8F};
  return {-1, 0, 0};
}

// Scans `s`, appending final text to `out`; returns the offset of an incomplete (so far valid) tail, or s.size().
size_t scan(std::string_view s, std::string& out) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<uint8_t>(s[i]);
    const Lead lead = classify(b);
    if (lead.n_cont == 0) {
      out.push_back(s[i++]);
      continue;
    }
    if (lead.n_cont < 0) {
      out.append(kReplacementChar);
      ++i;
      continue;
    }
    // Length of the valid prefix of this sequence (lead + continuation bytes in range).
    size_t k = 1;
    bool ill_formed = false;
    while (k <= static_cast<size_t>(lead.n_cont)) {
      if (i + k >= s.size()) break;  // incomplete so far
      const auto c = static_cast<uint8_t>(s[i + k]);
      const uint8_t lo = k == 1 ? lead.lo : uint8_t{0x80};
      const uint8_t hi = k == 1 ? lead.hi : uint8_t{0xBF};
      if (c < lo || c > hi) {
        ill_formed = true;
        break;
      }
      ++k;
    }
    if (ill_formed) {  // the maximal valid subpart [i, i+k) is one replacement; the offending byte is rescanned
      out.append(kReplacementChar);
      i += k;
      continue;
    }
    if (k <= static_cast<size_t>(lead.n_cont)) return i;  // ran out of bytes: may still complete
    out.append(s.substr(i, k));
    i += k;
  }
  return s.size();
}

}  // namespace

std::string Utf8Assembler::push(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  const size_t tail = scan(pending_, out);
  pending_.erase(0, tail);
  return out;
}

std::string Utf8Assembler::flush() {
  std::string out;
  if (!pending_.empty()) out.append(kReplacementChar);  // an incomplete sequence is one maximal subpart
  pending_.clear();
  return out;
}

std::string sanitize_utf8(std::string_view bytes) {
  Utf8Assembler a;
  std::string out = a.push(bytes);
  out += a.flush();
  return out;
}

bool is_valid_utf8(std::string_view bytes) {
  std::string out;
  return scan(bytes, out) == bytes.size() && out == bytes;
}

}  // namespace bg
