// UTF-8 validation and repair for streamed bytes: complete code points pass through, ill-formed sequences become
// U+FFFD (one per maximal subpart, the Unicode / WHATWG rule), an incomplete tail waits for more bytes.
#pragma once

#include <string>
#include <string_view>

namespace bg {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// Byte stream -> valid UTF-8 text, incrementally. Never throws.
class Utf8Assembler {
 public:
  // Appends `bytes` and returns the text that is now final: valid code points, and U+FFFD for every sequence that
  // is provably ill-formed. A tail that may still become a valid code point is held back.
  std::string push(std::string_view bytes);
  // End of stream: the held-back tail (if any) becomes one U+FFFD.
  std::string flush();
  bool has_pending() const { return !pending_.empty(); }

 private:
  std::string pending_;
};

// The whole string repaired at once (= push + flush).
std::string sanitize_utf8(std::string_view bytes);
bool is_valid_utf8(std::string_view bytes);

}  // namespace bg
