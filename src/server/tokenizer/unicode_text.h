// Unicode text operations the Hugging Face tokenizer pipeline needs on UTF-8 strings: normalization forms and
// lower-casing (ICU), code point iteration, and the character classes added-token matching uses.
#pragma once

#include <string>
#include <string_view>

namespace bg {

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };

// `text` must be valid UTF-8 (the tokenizer only normalizes text that is). Throws bg::Error on an ICU failure.
std::string unicode_normalize(std::string_view text, NormalForm form);
// Full Unicode lower-casing (root locale), as Rust's str::to_lowercase and JavaScript's toLowerCase.
std::string unicode_lowercase(std::string_view text);
std::string unicode_uppercase(std::string_view text);

// The code point at `pos` (valid UTF-8); advances pos past it.
char32_t next_code_point(std::string_view text, size_t& pos);
// The last code point before `end` and its start offset (valid UTF-8, end > 0).
char32_t previous_code_point(std::string_view text, size_t end, size_t& start);

bool is_unicode_whitespace(char32_t c);  // the White_Space property (Rust's char::is_whitespace)
bool is_word_char(char32_t c);           // alphanumeric or '_' (Rust's char::is_alphanumeric() || c == '_')

}  // namespace bg
