// tokenizer.json normalizers and pre-tokenizers (see hf_pipeline.h). Split behaviours follow the Rust crate's
// SplitDelimiterBehavior; regexes run in PCRE2 (UTF + UCP), which reads the Oniguruma syntax these files use.
#include "server/tokenizer/hf_pipeline.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "core/error.h"
#include "formats/json_fields.h"
#include "server/tokenizer/regex.h"
#include "server/tokenizer/unicode_text.h"

namespace bg {
namespace {

using nlohmann::json;

// GPT-2's pre-tokenizer pattern, applied by ByteLevel when use_regex is true.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string regex_quote(std::string_view literal) {
  std::string p;
  for (char ch : literal) {
    const auto u = static_cast<unsigned char>(ch);
    const bool alnum = (u >= '0' && u <= '9') || (u >= 'a' && u <= 'z') || (u >= 'A' && u <= 'Z');
    if (u < 0x80 && !alnum) p.push_back('\\');
    p.push_back(ch);
  }
  return p;
}

// A `pattern` field: {"String": literal} or {"Regex": pattern}.
Regex parse_pattern(const json& j, const std::string& where) {
  BG_CHECK(j.is_object() && j.size() == 1, "{}: must be {{\"String\": ...}} or {{\"Regex\": ...}}", where);
  if (j.contains("String")) {
    BG_CHECK(j["String"].is_string() && !j["String"].get<std::string>().empty(), "{}.String: must be a non-empty "
             "string", where);
    return Regex(regex_quote(j["String"].get<std::string>()), Regex::Mode::kUnicode, where);
  }
  BG_CHECK(j.contains("Regex") && j["Regex"].is_string(), "{}: must be {{\"String\": ...}} or {{\"Regex\": ...}}",
           where);
  return Regex(j["Regex"].get<std::string>(), Regex::Mode::kUnicode, where);
}

std::string type_of(const json& j, const std::string& where) {
  BG_CHECK(j.is_object(), "{}: must be an object, not {}", where, j.type_name());
  BG_CHECK(j.contains("type") && j["type"].is_string(), "{}.type: missing", where);
  return j["type"].get<std::string>();
}

// ---- normalizers ----

class SequenceNormalizer : public HfNormalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<HfNormalizer>> parts) : parts_(std::move(parts)) {}
  std::string apply(std::string text) const override {
    for (const auto& p : parts_) text = p->apply(std::move(text));
    return text;
  }

 private:
  std::vector<std::unique_ptr<HfNormalizer>> parts_;
};

class FormNormalizer : public HfNormalizer {
 public:
  explicit FormNormalizer(NormalForm form) : form_(form) {}
  std::string apply(std::string text) const override { return unicode_normalize(text, form_); }

 private:
  NormalForm form_;
};

class LowercaseNormalizer : public HfNormalizer {
 public:
  std::string apply(std::string text) const override { return unicode_lowercase(text); }
};

class ReplaceNormalizer : public HfNormalizer {
 public:
  ReplaceNormalizer(Regex pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  std::string apply(std::string text) const override {
    std::string out;
    size_t done = 0;
    pattern_.for_each_match(text, [&](size_t b, size_t e) {
      out.append(text, done, b - done);
      out += content_;
      done = e;
    });
    out.append(text, done, std::string::npos);
    return out;
  }

 private:
  Regex pattern_;
  std::string content_;
};

class PrependNormalizer : public HfNormalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string apply(std::string text) const override { return text.empty() ? text : prefix_ + text; }

 private:
  std::string prefix_;
};

class StripNormalizer : public HfNormalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  std::string apply(std::string text) const override {
    size_t b = 0, e = text.size();
    while (left_ && b < e) {
      size_t p = b;
      if (!is_unicode_whitespace(next_code_point(text, p))) break;
      b = p;
    }
    while (right_ && e > b) {
      size_t start = 0;
      if (!is_unicode_whitespace(previous_code_point(text, e, start))) break;
      e = start;
    }
    return text.substr(b, e - b);
  }

 private:
  bool left_, right_;
};

class StripAccentsNormalizer : public HfNormalizer {  // removes combining marks (\p{M})
 public:
  std::string apply(std::string text) const override { return marks_.apply(std::move(text)); }

 private:
  ReplaceNormalizer marks_{Regex(R"(\p{M})", Regex::Mode::kUnicode, "StripAccents"), ""};
};

// ---- pre-tokenizers ----

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Span {
  size_t b, e;
  bool match;
};

// Matches and the gaps between them, in order (the Rust crate's Pattern::find_matches), `invert` flipping the flag.
std::vector<Span> find_spans(const Regex& re, const std::string& text, bool invert) {
  std::vector<Span> spans;
  size_t prev = 0;
  re.for_each_match(text, [&](size_t b, size_t e) {
    if (b > prev) spans.push_back({prev, b, invert});
    spans.push_back({b, e, !invert});
    prev = e;
  });
  if (prev < text.size()) spans.push_back({prev, text.size(), invert});
  return spans;
}

// SplitDelimiterBehavior over the spans: which byte ranges become pieces.
std::vector<std::pair<size_t, size_t>> apply_behavior(const std::vector<Span>& spans, Behavior behavior) {
  std::vector<std::pair<size_t, size_t>> out;
  switch (behavior) {
    case Behavior::kRemoved:
      for (const Span& s : spans) {
        if (!s.match) out.emplace_back(s.b, s.e);
      }
      break;
    case Behavior::kIsolated:
      for (const Span& s : spans) out.emplace_back(s.b, s.e);
      break;
    case Behavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Span& s : spans) {
        if (s.match && !previous_match && !out.empty()) {
          out.back().second = s.e;
        } else {
          out.emplace_back(s.b, s.e);
        }
        previous_match = s.match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool previous_match = false;  // walking backwards: "previous" is the span to the right
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous_match && !out.empty()) {
          out.back().first = it->b;
        } else {
          out.emplace_back(it->b, it->e);
        }
        previous_match = it->match;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
    case Behavior::kContiguous: {
      int previous = -1;
      for (const Span& s : spans) {
        if (previous == static_cast<int>(s.match) && !out.empty()) {
          out.back().second = s.e;
        } else {
          out.emplace_back(s.b, s.e);
        }
        previous = static_cast<int>(s.match);
      }
      break;
    }
  }
  return out;
}

void split_all(std::vector<std::string>& pieces, const Regex& re, bool invert, Behavior behavior) {
  std::vector<std::string> out;
  out.reserve(pieces.size());
  for (const std::string& p : pieces) {
    for (const auto& [b, e] : apply_behavior(find_spans(re, p, invert), behavior)) {
      if (e > b) out.push_back(p.substr(b, e - b));
    }
  }
  pieces = std::move(out);
}

class SplitPreTokenizer : public HfPreTokenizer {
 public:
  SplitPreTokenizer(Regex re, bool invert, Behavior behavior)
      : re_(std::move(re)), invert_(invert), behavior_(behavior) {}
  void apply(std::vector<std::string>& pieces) const override { split_all(pieces, re_, invert_, behavior_); }

 private:
  Regex re_;
  bool invert_;
  Behavior behavior_;
};

class ByteLevelPreTokenizer : public HfPreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space), use_regex_(use_regex) {}
  void apply(std::vector<std::string>& pieces) const override {
    if (add_prefix_space_) {
      for (std::string& p : pieces) {
        if (p.empty() || p[0] != ' ') p.insert(0, 1, ' ');
      }
    }
    if (use_regex_) split_all(pieces, re_, false, Behavior::kIsolated);
  }

 private:
  bool add_prefix_space_, use_regex_;
  Regex re_{kGpt2Pattern, Regex::Mode::kUnicode, "ByteLevel pre-tokenizer pattern"};
};

class SequencePreTokenizer : public HfPreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<HfPreTokenizer>> parts) : parts_(std::move(parts)) {}
  void apply(std::vector<std::string>& pieces) const override {
    for (const auto& p : parts_) p->apply(pieces);
  }

 private:
  std::vector<std::unique_ptr<HfPreTokenizer>> parts_;
};

Behavior parse_behavior(const std::string& s, const std::string& where) {
  if (s == "Removed") return Behavior::kRemoved;
  if (s == "Isolated") return Behavior::kIsolated;
  if (s == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (s == "MergedWithNext") return Behavior::kMergedWithNext;
  if (s == "Contiguous") return Behavior::kContiguous;
  fail("{}: unknown behavior '{}' (Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)", where, s);
}

const json& list_field(const json& j, const char* key, const std::string& where) {
  BG_CHECK(j.contains(key) && j[key].is_array(), "{}.{}: must be an array", where, key);
  return j[key];
}

}  // namespace

std::unique_ptr<HfNormalizer> parse_hf_normalizer(const json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, where);
  const JsonFields f(j, where);
  if (type == "Sequence") {
    std::vector<std::unique_ptr<HfNormalizer>> parts;
    const json& list = list_field(j, "normalizers", where);
    for (size_t i = 0; i < list.size(); ++i) {
      auto p = parse_hf_normalizer(list[i], fmt::format("{}.normalizers[{}]", where, i));
      BG_CHECK(p != nullptr, "{}.normalizers[{}]: must not be null", where, i);
      parts.push_back(std::move(p));
    }
    return std::make_unique<SequenceNormalizer>(std::move(parts));
  }
  if (type == "NFC") return std::make_unique<FormNormalizer>(NormalForm::kNfc);
  if (type == "NFD") return std::make_unique<FormNormalizer>(NormalForm::kNfd);
  if (type == "NFKC") return std::make_unique<FormNormalizer>(NormalForm::kNfkc);
  if (type == "NFKD") return std::make_unique<FormNormalizer>(NormalForm::kNfkd);
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "StripAccents") return std::make_unique<StripAccentsNormalizer>();
  if (type == "Strip") {
    return std::make_unique<StripNormalizer>(f.get_bool("strip_left", true), f.get_bool("strip_right", true));
  }
  if (type == "Prepend") return std::make_unique<PrependNormalizer>(f.get_string("prepend"));
  if (type == "Replace") {
    BG_CHECK(j.contains("pattern"), "{}.pattern: missing", where);
    return std::make_unique<ReplaceNormalizer>(parse_pattern(j["pattern"], where + ".pattern"),
                                               f.get_string("content"));
  }
  fail("{}: unsupported normalizer type '{}' (supported: Sequence, NFC, NFD, NFKC, NFKD, Lowercase, Strip, "
       "StripAccents, Replace, Prepend)", where, type);
}

std::unique_ptr<HfPreTokenizer> parse_hf_pre_tokenizer(const json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, where);
  const JsonFields f(j, where);
  if (type == "Sequence") {
    std::vector<std::unique_ptr<HfPreTokenizer>> parts;
    const json& list = list_field(j, "pretokenizers", where);
    for (size_t i = 0; i < list.size(); ++i) {
      auto p = parse_hf_pre_tokenizer(list[i], fmt::format("{}.pretokenizers[{}]", where, i));
      BG_CHECK(p != nullptr, "{}.pretokenizers[{}]: must not be null", where, i);
      parts.push_back(std::move(p));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(parts));
  }
  if (type == "Split") {
    BG_CHECK(j.contains("pattern"), "{}.pattern: missing", where);
    return std::make_unique<SplitPreTokenizer>(parse_pattern(j["pattern"], where + ".pattern"),
                                               f.get_bool("invert", false),
                                               parse_behavior(f.get_string("behavior"), where + ".behavior"));
  }
  if (type == "ByteLevel") {
    (void)f.get_bool("trim_offsets", true);  // offsets only: no effect on ids
    return std::make_unique<ByteLevelPreTokenizer>(f.get_bool("add_prefix_space", true), f.get_bool("use_regex", true));
  }
  if (type == "Digits") {
    const Behavior b = f.get_bool("individual_digits", false) ? Behavior::kIsolated : Behavior::kContiguous;
    return std::make_unique<SplitPreTokenizer>(Regex("[0-9]", Regex::Mode::kUnicode, where), false, b);
  }
  if (type == "WhitespaceSplit") {
    return std::make_unique<SplitPreTokenizer>(Regex(R"(\s+)", Regex::Mode::kUnicode, where), false,
                                               Behavior::kRemoved);
  }
  fail("{}: unsupported pre-tokenizer type '{}' (supported: Sequence, Split, ByteLevel, Digits, WhitespaceSplit)",
       where, type);
}

bool hf_pre_tokenizer_is_byte_level(const json& j) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) return false;
  if (j["type"] == "ByteLevel") return true;
  if (j["type"] == "Sequence" && j.contains("pretokenizers") && j["pretokenizers"].is_array()) {
    for (const json& p : j["pretokenizers"]) {
      if (hf_pre_tokenizer_is_byte_level(p)) return true;
    }
  }
  return false;
}

const std::vector<std::string>& byte_level_chars() {
  static const std::vector<std::string> chars = [] {
    // Printable Latin-1 bytes map to themselves; the other 68 bytes to U+0100.. in byte order.
    std::vector<std::string> out(256);
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + next++);
      std::string s;
      if (c < 0x80) {
        s.push_back(static_cast<char>(c));
      } else {
        s.push_back(static_cast<char>(0xC0 | (c >> 6)));
        s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
      }
      out[b] = s;
    }
    return out;
  }();
  return chars;
}

int byte_level_byte(char32_t c) {
  static const std::array<int, 0x200> inverse = [] {
    std::array<int, 0x200> inv{};
    inv.fill(-1);
    const auto& chars = byte_level_chars();
    for (int b = 0; b < 256; ++b) {
      size_t pos = 0;
      inv[next_code_point(chars[b], pos)] = b;
    }
    return inv;
  }();
  return c < inverse.size() ? inverse[c] : -1;
}

}  // namespace bg
