// A compiled PCRE2 pattern (shared, immutable, thread-safe) and the leftmost-first scan over a subject that the
// tokenizer uses to split text into pre-tokens and to find special-token strings.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace bg {

class Regex {
 public:
  enum class Mode {
    kUnicode,  // UTF + UCP (\p{..}, \s are Unicode-aware); invalid UTF-8 in the subject is allowed and never matches
    kBytes,    // bytes, no Unicode semantics (literal alternations)
  };
  // Throws bg::Error naming `what` and the PCRE2 message and offset on a bad pattern.
  Regex(const std::string& pattern, Mode mode, std::string_view what);

  // Calls on_match(begin, end) for each successive non-overlapping match, left to right. Throws bg::Error on a
  // PCRE2 runtime error (e.g. a resource limit), never on an unmatched or ill-formed subject.
  void for_each_match(std::string_view subject, const std::function<void(size_t, size_t)>& on_match) const;

  // The first match at or after `from`; false when there is none.
  bool find(std::string_view subject, size_t from, size_t& begin, size_t& end) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
};

}  // namespace bg
