// Jinja lexer: the source is preprocessed as @huggingface/jinja does (trailing newline, lstrip_blocks, trim_blocks,
// `generation` tags) keeping each character's source line, then tokenized.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>

#include "core/error.h"
#include "server/chat/jinja/jinja_ast.h"
#include "server/chat/jinja/jinja_lex.h"
#include "server/tokenizer/unicode_text.h"

namespace bg::jinja {
namespace {

struct Source {
  std::string text;
  std::vector<int> line;  // source line of each byte of text
};

bool starts_with_at(const std::string& s, size_t i, std::string_view p) { return s.compare(i, p.size(), p) == 0; }

// The textual rewrites @huggingface/jinja applies before lexing (with lstrip_blocks and trim_blocks on, as
// transformers renders chat templates).
Source preprocess(const std::string& raw) {
  Source in;
  int line = 1;
  for (char c : raw) {
    in.text.push_back(c);
    in.line.push_back(line);
    if (c == '\n') ++line;
  }
  if (!in.text.empty() && in.text.back() == '\n') {
    in.text.pop_back();
    in.line.pop_back();
  }
  Source out;
  auto copy = [&](size_t i) {
    out.text.push_back(in.text[i]);
    out.line.push_back(in.line[i]);
  };
  // lstrip_blocks: spaces/tabs from a line start up to a `{%`, `{#` or `{-`.
  Source a;
  for (size_t i = 0; i < in.text.size();) {
    if (i == 0 || in.text[i - 1] == '\n') {
      size_t j = i;
      while (j < in.text.size() && (in.text[j] == ' ' || in.text[j] == '\t')) ++j;
      if (j + 1 < in.text.size() && in.text[j] == '{' &&
          (in.text[j + 1] == '#' || in.text[j + 1] == '%' || in.text[j + 1] == '-')) {
        i = j;
      }
    }
    a.text.push_back(in.text[i]);
    a.line.push_back(in.line[i]);
    ++i;
  }
  in = std::move(a);
  // trim_blocks: the newline right after `#}`, `%}` or `-}`.
  for (size_t i = 0; i < in.text.size(); ++i) {
    copy(i);
    if (in.text[i] == '}' && i > 0 && (in.text[i - 1] == '#' || in.text[i - 1] == '%' || in.text[i - 1] == '-') &&
        i + 1 < in.text.size() && in.text[i + 1] == '\n') {
      ++i;
    }
  }
  return out;
}

// transformers' `{% generation %}` / `{% endgeneration %}` markers are dropped (with {%- -%} trimming around them).
void drop_generation_tags(Source& s) {
  for (size_t i = 0; (i = s.text.find("{%", i)) != std::string::npos;) {
    size_t j = i + 2;
    const bool lstrip = j < s.text.size() && s.text[j] == '-';
    if (lstrip) ++j;
    while (j < s.text.size() && std::isspace(static_cast<unsigned char>(s.text[j]))) ++j;
    size_t word = 0;
    if (starts_with_at(s.text, j, "generation")) word = 10;
    if (starts_with_at(s.text, j, "endgeneration")) word = 13;
    if (word == 0) {
      i += 2;
      continue;
    }
    j += word;
    while (j < s.text.size() && std::isspace(static_cast<unsigned char>(s.text[j]))) ++j;
    const bool rstrip = j < s.text.size() && s.text[j] == '-';
    if (rstrip) ++j;
    if (!starts_with_at(s.text, j, "%}")) {
      i += 2;
      continue;
    }
    j += 2;
    size_t b = i, e = j;
    if (lstrip) {
      while (b > 0 && std::isspace(static_cast<unsigned char>(s.text[b - 1]))) --b;
    }
    if (rstrip) {
      while (e < s.text.size() && std::isspace(static_cast<unsigned char>(s.text[e]))) ++e;
    }
    s.text.erase(b, e - b);
    s.line.erase(s.line.begin() + static_cast<std::ptrdiff_t>(b), s.line.begin() + static_cast<std::ptrdiff_t>(e));
    i = b;
  }
}

class Lexer {
 public:
  Lexer(const Source& s, const std::string& name) : s_(s), name_(name) {}
  std::vector<Token> run();

 private:
  [[noreturn]] void error(const std::string& msg) const {
    fail("{}:{}: syntax error: {}", name_, line_at(pos_), msg);
  }
  int line_at(size_t p) const { return s_.line.empty() ? 1 : s_.line[std::min(p, s_.line.size() - 1)]; }
  bool at(std::string_view p) const { return starts_with_at(s_.text, pos_, p); }
  bool space_at(size_t p) const {
    if (p >= s_.text.size()) return false;
    size_t q = p;
    return js_space(next_code_point(s_.text, q));
  }
  void skip_space() {
    while (space_at(pos_)) next_code_point(s_.text, pos_);
  }
  void push(Tok t, std::string v) { out_.push_back({t, std::move(v), line_at(pos_)}); }
  void strip_last_text();
  std::string read_string(char quote);
  std::string read_digits() {
    const size_t b = pos_;
    while (pos_ < s_.text.size() && std::isdigit(static_cast<unsigned char>(s_.text[pos_]))) ++pos_;
    return s_.text.substr(b, pos_ - b);
  }
  bool read_operator();

  const Source& s_;
  const std::string& name_;
  size_t pos_ = 0;
  std::vector<Token> out_;
  int curly_depth_ = 0;
};

void Lexer::strip_last_text() {
  if (out_.empty() || out_.back().type != Tok::kText) return;
  std::string& t = out_.back().value;
  size_t e = t.size();
  while (e > 0) {
    size_t start = 0;
    if (!js_space(previous_code_point(t, e, start))) break;
    e = start;
  }
  t.resize(e);
  if (t.empty()) out_.pop_back();
}

std::string Lexer::read_string(char quote) {
  ++pos_;  // opening quote
  std::string v;
  while (true) {
    if (pos_ >= s_.text.size()) error("unterminated string literal");
    const char c = s_.text[pos_];
    if (c == quote) break;
    if (c != '\\') {
      v.push_back(c);
      ++pos_;
      continue;
    }
    if (++pos_ >= s_.text.size()) error("unexpected end of input in an escape");
    const char e = s_.text[pos_++];
    switch (e) {
      case 'n': v.push_back('\n'); break;
      case 't': v.push_back('\t'); break;
      case 'r': v.push_back('\r'); break;
      case 'b': v.push_back('\b'); break;
      case 'f': v.push_back('\f'); break;
      case 'v': v.push_back('\v'); break;
      case '\'': case '"': case '\\': v.push_back(e); break;
      case 'x': case 'u': {
        const size_t n = e == 'x' ? 2 : 4;
        if (pos_ + n > s_.text.size()) error("bad hexadecimal escape");
        uint32_t cp = 0;
        const auto r = std::from_chars(s_.text.data() + pos_, s_.text.data() + pos_ + n, cp, 16);
        if (r.ec != std::errc() || r.ptr != s_.text.data() + pos_ + n) error("bad hexadecimal escape");
        if (cp >= 0xD800 && cp < 0xE000) error("escape of a lone surrogate");
        pos_ += n;
        if (cp < 0x80) {
          v.push_back(static_cast<char>(cp));
        } else if (cp < 0x800) {
          v.push_back(static_cast<char>(0xC0 | (cp >> 6)));
          v.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
        } else {
          v.push_back(static_cast<char>(0xE0 | (cp >> 12)));
          v.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
          v.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
        }
        break;
      }
      default: error(fmt::format("unknown escape \\{}", e));
    }
  }
  ++pos_;  // closing quote
  return v;
}

bool Lexer::read_operator() {
  static const std::pair<std::string_view, Tok> kTable[] = {
      {"{%", Tok::kOpenStmt},    {"%}", Tok::kCloseStmt},    {"{{", Tok::kOpenExpr},        {"}}", Tok::kCloseExpr},
      {"(", Tok::kOpenParen},    {")", Tok::kCloseParen},    {"{", Tok::kOpenBrace},        {"}", Tok::kCloseBrace},
      {"[", Tok::kOpenBracket},  {"]", Tok::kCloseBracket},  {",", Tok::kComma},            {".", Tok::kDot},
      {":", Tok::kColon},        {"|", Tok::kPipe},          {"<=", Tok::kComparison},      {">=", Tok::kComparison},
      {"==", Tok::kComparison},  {"!=", Tok::kComparison},   {"<", Tok::kComparison},       {">", Tok::kComparison},
      {"+", Tok::kAdditive},     {"-", Tok::kAdditive},      {"~", Tok::kAdditive},         {"**", Tok::kPower},
      {"*", Tok::kMultiplicative}, {"//", Tok::kMultiplicative}, {"/", Tok::kMultiplicative}, {"%", Tok::kMultiplicative},
      {"=", Tok::kEquals},
  };
  for (const auto& [seq, type] : kTable) {
    if (seq == "}}" && curly_depth_ > 0) continue;  // inside an object literal
    if (!at(seq)) continue;
    push(type, std::string(seq));
    if (type == Tok::kOpenExpr) curly_depth_ = 0;
    if (type == Tok::kOpenBrace) ++curly_depth_;
    if (type == Tok::kCloseBrace) --curly_depth_;
    pos_ += seq.size();
    return true;
  }
  return false;
}

std::vector<Token> Lexer::run() {
  const std::string& src = s_.text;
  while (pos_ < src.size()) {
    const Tok last = out_.empty() ? Tok::kCloseStmt : out_.back().type;
    if (out_.empty() || last == Tok::kCloseStmt || last == Tok::kCloseExpr || last == Tok::kComment) {
      const size_t b = pos_;
      while (pos_ < src.size() &&
             !(src[pos_] == '{' && pos_ + 1 < src.size() && (src[pos_ + 1] == '%' || src[pos_ + 1] == '{' ||
                                                               src[pos_ + 1] == '#'))) {
        ++pos_;
      }
      if (pos_ > b) {
        out_.push_back({Tok::kText, src.substr(b, pos_ - b), line_at(b)});
        continue;
      }
    }
    if (at("{#")) {
      pos_ += 2;
      const bool strip_before = pos_ < src.size() && src[pos_] == '-';
      const size_t end = src.find("#}", pos_);
      if (end == std::string::npos) error("missing end of comment tag");
      const bool strip_after = end > pos_ && src[end - 1] == '-';
      if (strip_before) strip_last_text();
      push(Tok::kComment, "");
      pos_ = end + 2;
      if (strip_after) skip_space();
      continue;
    }
    if (at("{%-") || at("{{-")) {
      strip_last_text();
      const bool stmt = at("{%-");
      push(stmt ? Tok::kOpenStmt : Tok::kOpenExpr, stmt ? "{%" : "{{");
      if (!stmt) curly_depth_ = 0;
      pos_ += 3;
      continue;
    }
    skip_space();
    if (pos_ >= src.size()) break;
    if (at("-%}") || at("-}}")) {
      const bool stmt = at("-%}");
      push(stmt ? Tok::kCloseStmt : Tok::kCloseExpr, stmt ? "%}" : "}}");
      pos_ += 3;
      skip_space();
      continue;
    }
    const char c = src[pos_];
    if ((c == '-' || c == '+') && !out_.empty()) {
      const Tok prev = out_.back().type;
      if (prev == Tok::kText) error(fmt::format("unexpected character '{}'", c));
      if (prev != Tok::kIdent && prev != Tok::kNumber && prev != Tok::kString && prev != Tok::kCloseParen &&
          prev != Tok::kCloseBracket) {
        ++pos_;  // unary sign, glued to a number that follows
        std::string num = read_digits();
        if (!num.empty() && pos_ + 1 < src.size() && src[pos_] == '.' && std::isdigit(static_cast<unsigned char>(src[pos_ + 1]))) {
          ++pos_;
          num += "." + read_digits();
        }
        push(num.empty() ? Tok::kUnary : Tok::kNumber, std::string(1, c) + num);
        continue;
      }
    }
    if (read_operator()) continue;
    if (c == '\'' || c == '"') {
      const int line = line_at(pos_);
      out_.push_back({Tok::kString, read_string(c), line});
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      std::string num = read_digits();
      if ((out_.empty() || out_.back().type != Tok::kDot) && pos_ + 1 < src.size() && src[pos_] == '.' &&
          std::isdigit(static_cast<unsigned char>(src[pos_ + 1]))) {
        ++pos_;
        num += "." + read_digits();
      }
      push(Tok::kNumber, num);
      continue;
    }
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') {
      const size_t b = pos_;
      while (pos_ < src.size() && (std::isalnum(static_cast<unsigned char>(src[pos_])) || src[pos_] == '_')) ++pos_;
      push(Tok::kIdent, src.substr(b, pos_ - b));
      continue;
    }
    error(fmt::format("unexpected character '{}'", c));
  }
  return out_;
}

}  // namespace

std::vector<Token> lex_template(const std::string& source, const std::string& name) {
  Source s = preprocess(source);
  drop_generation_tags(s);
  return Lexer(s, name).run();
}

}  // namespace bg::jinja
