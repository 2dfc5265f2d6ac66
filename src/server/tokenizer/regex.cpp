// PCRE2 glue for Regex (see regex.h): compile (+ JIT when the library has it), match, error messages.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "server/tokenizer/regex.h"

#include <pcre2.h>

#include "core/error.h"

namespace bg {
namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  const int n = pcre2_get_error_message(code, buf, sizeof(buf));
  return n < 0 ? std::string("unknown PCRE2 error") : std::string(reinterpret_cast<const char*>(buf));
}

}  // namespace

struct Regex::Code {
  pcre2_code* code = nullptr;
  std::string what;
  ~Code() { pcre2_code_free(code); }
};

Regex::Regex(const std::string& pattern, Mode mode, std::string_view what) {
  auto c = std::make_shared<Code>();
  c->what = std::string(what);
  uint32_t options = 0;
  if (mode == Mode::kUnicode) options = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF;
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  c->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &err, &err_offset,
                          nullptr);
  BG_CHECK(c->code != nullptr, "{}: bad pattern at offset {}: {}", what, err_offset, pcre2_message(err));
  // JIT is only a speed-up: the interpreter gives identical matches when the library was built without it.
  (void)pcre2_jit_compile(c->code, PCRE2_JIT_COMPLETE);
  code_ = std::move(c);
}

using MatchData = std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)>;

bool Regex::find(std::string_view subject, size_t from, size_t& begin, size_t& end) const {
  MatchData md(pcre2_match_data_create_from_pattern(code_->code, nullptr), &pcre2_match_data_free);
  BG_CHECK(md != nullptr, "{}: out of memory", code_->what);
  const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), from, 0,
                             md.get(), nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  BG_CHECK(rc >= 0, "{}: match failed at offset {}: {}", code_->what, from, pcre2_message(rc));
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
  begin = ov[0];
  end = ov[1];
  return true;
}

void Regex::for_each_match(std::string_view subject, const std::function<void(size_t, size_t)>& on_match) const {
  MatchData md(pcre2_match_data_create_from_pattern(code_->code, nullptr), &pcre2_match_data_free);
  BG_CHECK(md != nullptr, "{}: out of memory", code_->what);
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t offset = 0;
  while (offset < subject.size()) {
    const int rc = pcre2_match(code_->code, s, subject.size(), offset, 0, md.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    BG_CHECK(rc >= 0, "{}: match failed at offset {}: {}", code_->what, offset, pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    const size_t b = ov[0], e = ov[1];
    if (e > b) on_match(b, e);
    // An empty match (none of the tokenizer patterns has one) must not stall the scan.
    offset = e > b ? e : e + 1;
  }
}

}  // namespace bg
