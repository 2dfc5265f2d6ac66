// ICU-backed normalization and case mapping over UTF-8 (see unicode_text.h). ICU works in UTF-16: each call converts
// in and out (texts are prompt-sized, so the copies are cheap next to BPE).
#include "server/tokenizer/unicode_text.h"

#include <unicode/uchar.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace bg {
namespace {

std::u16string to_utf16(std::string_view text) {
  UErrorCode status = U_ZERO_ERROR;
  int32_t n = 0;
  u_strFromUTF8(nullptr, 0, &n, text.data(), static_cast<int32_t>(text.size()), &status);
  BG_CHECK(status == U_BUFFER_OVERFLOW_ERROR || U_SUCCESS(status), "unicode: invalid UTF-8 ({})", u_errorName(status));
  std::u16string out(static_cast<size_t>(n), u'\0');
  status = U_ZERO_ERROR;
  u_strFromUTF8(reinterpret_cast<UChar*>(out.data()), n, nullptr, text.data(), static_cast<int32_t>(text.size()),
                &status);
  BG_CHECK(U_SUCCESS(status), "unicode: invalid UTF-8 ({})", u_errorName(status));
  return out;
}

std::string to_utf8(const std::u16string& text) {
  UErrorCode status = U_ZERO_ERROR;
  int32_t n = 0;
  const auto* src = reinterpret_cast<const UChar*>(text.data());
  u_strToUTF8(nullptr, 0, &n, src, static_cast<int32_t>(text.size()), &status);
  BG_CHECK(status == U_BUFFER_OVERFLOW_ERROR || U_SUCCESS(status), "unicode: bad UTF-16 ({})", u_errorName(status));
  std::string out(static_cast<size_t>(n), '\0');
  status = U_ZERO_ERROR;
  u_strToUTF8(out.data(), n, nullptr, src, static_cast<int32_t>(text.size()), &status);
  BG_CHECK(U_SUCCESS(status), "unicode: bad UTF-16 ({})", u_errorName(status));
  return out;
}

const UNormalizer2* normalizer(NormalForm form) {
  UErrorCode status = U_ZERO_ERROR;
  const UNormalizer2* n = nullptr;
  switch (form) {
    case NormalForm::kNfc: n = unorm2_getNFCInstance(&status); break;
    case NormalForm::kNfd: n = unorm2_getNFDInstance(&status); break;
    case NormalForm::kNfkc: n = unorm2_getNFKCInstance(&status); break;
    case NormalForm::kNfkd: n = unorm2_getNFKDInstance(&status); break;
  }
  BG_CHECK(U_SUCCESS(status) && n != nullptr, "unicode: ICU normalizer unavailable ({})", u_errorName(status));
  return n;
}

}  // namespace

std::string unicode_normalize(std::string_view text, NormalForm form) {
  if (text.empty()) return {};
  const std::u16string in = to_utf16(text);
  const UNormalizer2* n = normalizer(form);
  UErrorCode status = U_ZERO_ERROR;
  const auto* src = reinterpret_cast<const UChar*>(in.data());
  const int32_t len = unorm2_normalize(n, src, static_cast<int32_t>(in.size()), nullptr, 0, &status);
  BG_CHECK(status == U_BUFFER_OVERFLOW_ERROR || U_SUCCESS(status), "unicode: normalize failed ({})",
           u_errorName(status));
  std::u16string out(static_cast<size_t>(len), u'\0');
  status = U_ZERO_ERROR;
  unorm2_normalize(n, src, static_cast<int32_t>(in.size()), reinterpret_cast<UChar*>(out.data()), len, &status);
  BG_CHECK(U_SUCCESS(status), "unicode: normalize failed ({})", u_errorName(status));
  return to_utf8(out);
}

namespace {

using CaseFn = int32_t (*)(UChar*, int32_t, const UChar*, int32_t, const char*, UErrorCode*);

std::string map_case(std::string_view text, CaseFn fn) {
  if (text.empty()) return {};
  const std::u16string in = to_utf16(text);
  UErrorCode status = U_ZERO_ERROR;
  const auto* src = reinterpret_cast<const UChar*>(in.data());
  const int32_t len = fn(nullptr, 0, src, static_cast<int32_t>(in.size()), "", &status);
  BG_CHECK(status == U_BUFFER_OVERFLOW_ERROR || U_SUCCESS(status), "unicode: case mapping failed ({})",
           u_errorName(status));
  std::u16string out(static_cast<size_t>(len), u'\0');
  status = U_ZERO_ERROR;
  fn(reinterpret_cast<UChar*>(out.data()), len, src, static_cast<int32_t>(in.size()), "", &status);
  BG_CHECK(U_SUCCESS(status), "unicode: case mapping failed ({})", u_errorName(status));
  return to_utf8(out);
}

}  // namespace

std::string unicode_lowercase(std::string_view text) { return map_case(text, &u_strToLower); }
std::string unicode_uppercase(std::string_view text) { return map_case(text, &u_strToUpper); }

char32_t next_code_point(std::string_view text, size_t& pos) {
  const auto b0 = static_cast<unsigned char>(text[pos]);
  int n = b0 < 0x80 ? 1 : b0 < 0xE0 ? 2 : b0 < 0xF0 ? 3 : 4;
  n = std::min<int>(n, static_cast<int>(text.size() - pos));
  char32_t c = n == 1 ? b0 : n == 2 ? (b0 & 0x1F) : n == 3 ? (b0 & 0x0F) : (b0 & 0x07);
  for (int k = 1; k < n; ++k) c = (c << 6) | (static_cast<unsigned char>(text[pos + k]) & 0x3F);
  pos += static_cast<size_t>(n);
  return c;
}

char32_t previous_code_point(std::string_view text, size_t end, size_t& start) {
  start = end - 1;
  while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
  size_t p = start;
  return next_code_point(text, p);
}

bool is_unicode_whitespace(char32_t c) { return u_isUWhiteSpace(static_cast<UChar32>(c)) != 0; }

bool is_word_char(char32_t c) {
  const auto u = static_cast<UChar32>(c);
  if (c == U'_' || u_hasBinaryProperty(u, UCHAR_ALPHABETIC)) return true;
  const int8_t t = u_charType(u);
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}

}  // namespace bg
