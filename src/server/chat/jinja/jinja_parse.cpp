// Jinja parser: recursive descent over the lexer's tokens (jinja_lex.cpp) with the operator precedence of
// @huggingface/jinja; nesting deeper than Limits::max_nesting is a syntax error, not a stack overflow.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>

#include "core/error.h"
#include "server/chat/jinja/jinja.h"
#include "server/chat/jinja/jinja_ast.h"
#include "server/chat/jinja/jinja_lex.h"
#include "server/tokenizer/unicode_text.h"

namespace bg::jinja {
namespace {

class Parser {
 public:
  Parser(std::vector<Token> tokens, const std::string& name, int max_nesting)
      : t_(std::move(tokens)), name_(name), max_nesting_(max_nesting) {}

  std::vector<NodePtr> program() {
    std::vector<NodePtr> body;
    while (cur_ < t_.size()) body.push_back(any());
    return body;
  }

 private:
  struct Depth {  // bounds recursion: every nested construct passes through one of these
    explicit Depth(Parser& p) : p_(p) {
      if (++p_.depth_ > p_.max_nesting_) p_.error(fmt::format("nested deeper than {} levels", p_.max_nesting_));
    }
    ~Depth() { --p_.depth_; }
    Parser& p_;
  };

  [[noreturn]] void error(const std::string& msg) const {
    const int line = cur_ < t_.size() ? t_[cur_].line : t_.empty() ? 1 : t_.back().line;
    fail("{}:{}: syntax error: {}", name_, line, msg);
  }
  bool is(Tok type, size_t ahead = 0) const { return cur_ + ahead < t_.size() && t_[cur_ + ahead].type == type; }
  bool is_ident(std::string_view v, size_t ahead = 0) const { return is(Tok::kIdent, ahead) && t_[cur_ + ahead].value == v; }
  bool is_stmt(std::initializer_list<std::string_view> names) const {
    if (!is(Tok::kOpenStmt) || !is(Tok::kIdent, 1)) return false;
    for (auto n : names) {
      if (t_[cur_ + 1].value == n) return true;
    }
    return false;
  }
  const Token& expect(Tok type, const char* what) {
    if (!is(type)) error(fmt::format("expected {}", what));
    return t_[cur_++];
  }
  void expect_ident(std::string_view v) {
    if (!is_ident(v)) error(fmt::format("expected '{}'", v));
    ++cur_;
  }
  void end_tag(std::string_view v) {
    expect(Tok::kOpenStmt, "'{%'");
    expect_ident(v);
    expect(Tok::kCloseStmt, "'%}'");
  }
  NodePtr node(NodeKind k, int line) {
    auto n = std::make_unique<Node>();
    n->kind = k;
    n->line = line;
    return n;
  }
  int line() const { return cur_ < t_.size() ? t_[cur_].line : (t_.empty() ? 1 : t_.back().line); }
  std::vector<NodePtr> block_until(std::initializer_list<std::string_view> ends) {
    std::vector<NodePtr> body;
    while (!is_stmt(ends)) {
      if (cur_ >= t_.size()) error(fmt::format("missing '{{% {} %}}'", *ends.begin()));
      body.push_back(any());
    }
    return body;
  }

  NodePtr any();
  NodePtr statement();
  NodePtr if_statement();
  NodePtr for_statement();
  NodePtr set_statement();
  NodePtr macro_statement();
  NodePtr call_statement();
  NodePtr expression_sequence(bool primary_only);
  std::vector<NodePtr> arguments(bool parameters);
  NodePtr expr();
  NodePtr logical_or();
  NodePtr logical_and();
  NodePtr logical_not();
  NodePtr comparison();
  NodePtr additive();
  NodePtr multiplicative();
  NodePtr power();
  NodePtr test();
  NodePtr filter();
  NodePtr unary_sign();
  NodePtr call_member();
  NodePtr call(NodePtr callee);
  NodePtr member(NodePtr object);
  NodePtr primary();
  NodePtr binary(Tok type_or_ident, NodePtr left, const std::string& op, NodePtr right, int ln);

  std::vector<Token> t_;
  const std::string& name_;
  int max_nesting_;
  size_t cur_ = 0;
  int depth_ = 0;
};

NodePtr Parser::any() {
  Depth d(*this);
  const Token& tok = t_[cur_];
  switch (tok.type) {
    case Tok::kComment: ++cur_; return node(NodeKind::kComment, tok.line);
    case Tok::kText: {
      auto n = node(NodeKind::kText, tok.line);
      n->str = tok.value;
      ++cur_;
      return n;
    }
    case Tok::kOpenStmt: return statement();
    case Tok::kOpenExpr: {
      ++cur_;
      NodePtr e = expr();
      expect(Tok::kCloseExpr, "'}}'");
      return e;
    }
    default: error("unexpected token '" + tok.value + "'");
  }
}

NodePtr Parser::statement() {
  expect(Tok::kOpenStmt, "'{%'");
  if (!is(Tok::kIdent)) error("expected a statement name after '{%'");
  const std::string name = t_[cur_].value;
  const int ln = line();
  ++cur_;
  if (name == "set") return set_statement();
  if (name == "if") {
    NodePtr n = if_statement();
    end_tag("endif");
    return n;
  }
  if (name == "for") {
    NodePtr n = for_statement();
    end_tag("endfor");
    return n;
  }
  if (name == "macro") {
    NodePtr n = macro_statement();
    end_tag("endmacro");
    return n;
  }
  if (name == "call") return call_statement();
  if (name == "break" || name == "continue") {
    expect(Tok::kCloseStmt, "'%}'");
    return node(name == "break" ? NodeKind::kBreak : NodeKind::kContinue, ln);
  }
  if (name == "filter") {
    auto n = node(NodeKind::kFilterBlock, ln);
    NodePtr f = primary();
    if (f->kind == NodeKind::kIdentifier && is(Tok::kOpenParen)) f = call(std::move(f));
    n->a.push_back(std::move(f));
    expect(Tok::kCloseStmt, "'%}'");
    n->body = block_until({"endfilter"});
    end_tag("endfilter");
    return n;
  }
  error("unknown statement '" + name + "'");
}

NodePtr Parser::if_statement() {
  auto n = node(NodeKind::kIf, line());
  n->a.push_back(expr());
  expect(Tok::kCloseStmt, "'%}'");
  n->body = block_until({"elif", "else", "endif"});
  if (is_stmt({"elif"})) {
    cur_ += 2;
    Depth d(*this);
    n->alt.push_back(if_statement());
  } else if (is_stmt({"else"})) {
    cur_ += 2;
    expect(Tok::kCloseStmt, "'%}'");
    n->alt = block_until({"endif"});
  }
  return n;
}

NodePtr Parser::for_statement() {
  auto n = node(NodeKind::kFor, line());
  NodePtr target = expression_sequence(true);
  if (target->kind != NodeKind::kIdentifier && target->kind != NodeKind::kTuple) {
    error("expected a name or a tuple of names as the loop variable");
  }
  if (!is_ident("in")) error("expected 'in' after the loop variable");
  ++cur_;
  n->a.push_back(std::move(target));
  n->a.push_back(expr());
  expect(Tok::kCloseStmt, "'%}'");
  n->body = block_until({"endfor", "else"});
  if (is_stmt({"else"})) {
    cur_ += 2;
    expect(Tok::kCloseStmt, "'%}'");
    n->alt = block_until({"endfor"});
  }
  return n;
}

NodePtr Parser::set_statement() {
  auto n = node(NodeKind::kSet, line());
  n->a.push_back(expression_sequence(false));
  if (is(Tok::kEquals)) {
    ++cur_;
    n->a.push_back(expression_sequence(false));
  } else {
    expect(Tok::kCloseStmt, "'%}'");
    n->body = block_until({"endset"});
    expect(Tok::kOpenStmt, "'{%'");
    expect_ident("endset");
  }
  expect(Tok::kCloseStmt, "'%}'");
  return n;
}

NodePtr Parser::macro_statement() {
  auto n = node(NodeKind::kMacro, line());
  NodePtr name = primary();
  if (name->kind != NodeKind::kIdentifier) error("expected a macro name");
  n->str = name->str;
  n->a = arguments(true);
  expect(Tok::kCloseStmt, "'%}'");
  n->body = block_until({"endmacro"});
  return n;
}

NodePtr Parser::call_statement() {
  auto n = node(NodeKind::kCallBlock, line());
  std::vector<NodePtr> caller_params;
  if (is(Tok::kOpenParen)) caller_params = arguments(true);
  NodePtr callee = primary();
  if (callee->kind != NodeKind::kIdentifier) error("expected a macro name after 'call'");
  auto c = node(NodeKind::kCall, callee->line);
  c->a.push_back(std::move(callee));
  for (auto& arg : arguments(false)) c->a.push_back(std::move(arg));
  expect(Tok::kCloseStmt, "'%}'");
  n->a.push_back(std::move(c));
  for (auto& p : caller_params) n->a.push_back(std::move(p));
  n->body = block_until({"endcall"});
  end_tag("endcall");
  return n;
}

NodePtr Parser::expression_sequence(bool primary_only) {
  const int ln = line();
  NodePtr first = primary_only ? primary() : expr();
  if (!is(Tok::kComma)) return first;
  auto tuple = node(NodeKind::kTuple, ln);
  tuple->a.push_back(std::move(first));
  while (is(Tok::kComma)) {
    ++cur_;
    tuple->a.push_back(primary_only ? primary() : expr());
  }
  return tuple;
}

std::vector<NodePtr> Parser::arguments(bool parameters) {
  expect(Tok::kOpenParen, "'('");
  std::vector<NodePtr> args;
  bool saw_keyword = false;
  while (!is(Tok::kCloseParen)) {
    if (cur_ >= t_.size()) error("missing ')'");
    const int ln = line();
    const bool kw_spread = is(Tok::kPower);
    const bool spread = is(Tok::kMultiplicative) && t_[cur_].value == "*";
    if (parameters && (kw_spread || spread)) error("argument unpacking in a parameter list");
    NodePtr arg;
    if (kw_spread || spread) {
      ++cur_;
      arg = node(kw_spread ? NodeKind::kKwSpread : NodeKind::kSpread, ln);
      arg->a.push_back(expr());
    } else {
      arg = expr();
      if (is(Tok::kEquals)) {
        ++cur_;
        if (arg->kind != NodeKind::kIdentifier) error("expected a name before '='");
        auto kw = node(NodeKind::kKwArg, ln);
        kw->str = arg->str;
        kw->a.push_back(expr());
        arg = std::move(kw);
        saw_keyword = true;
      } else if (saw_keyword) {
        error(parameters ? "a parameter without default follows one with a default"
                         : "a positional argument follows a keyword argument");
      }
      if (parameters && arg->kind != NodeKind::kIdentifier && arg->kind != NodeKind::kKwArg) {
        error("expected a parameter name");
      }
    }
    args.push_back(std::move(arg));
    if (is(Tok::kComma)) ++cur_;
  }
  ++cur_;
  return args;
}

NodePtr Parser::binary(Tok, NodePtr left, const std::string& op, NodePtr right, int ln) {
  auto n = node(NodeKind::kBinary, ln);
  n->str = op;
  n->a.push_back(std::move(left));
  n->a.push_back(std::move(right));
  return n;
}

NodePtr Parser::expr() {
  Depth d(*this);
  const int ln = line();
  NodePtr a = logical_or();
  if (!is_ident("if")) return a;
  ++cur_;
  NodePtr cond = logical_or();
  if (is_ident("else")) {
    ++cur_;
    auto n = node(NodeKind::kTernary, ln);
    n->a.push_back(std::move(cond));
    n->a.push_back(std::move(a));
    n->a.push_back(expr());
    return n;
  }
  auto n = node(NodeKind::kSelect, ln);
  n->a.push_back(std::move(a));
  n->a.push_back(std::move(cond));
  return n;
}

NodePtr Parser::logical_or() {
  NodePtr left = logical_and();
  while (is_ident("or")) {
    const int ln = line();
    ++cur_;
    left = binary(Tok::kIdent, std::move(left), "or", logical_and(), ln);
  }
  return left;
}

NodePtr Parser::logical_and() {
  NodePtr left = logical_not();
  while (is_ident("and")) {
    const int ln = line();
    ++cur_;
    left = binary(Tok::kIdent, std::move(left), "and", logical_not(), ln);
  }
  return left;
}

NodePtr Parser::logical_not() {
  if (!is_ident("not")) return comparison();
  Depth d(*this);
  auto n = node(NodeKind::kUnary, line());
  ++cur_;
  n->str = "not";
  n->a.push_back(logical_not());
  return n;
}

NodePtr Parser::comparison() {
  NodePtr left = additive();
  while (true) {
    const int ln = line();
    std::string op;
    if (is_ident("not") && is_ident("in", 1)) {
      op = "not in";
      cur_ += 2;
    } else if (is_ident("in")) {
      op = "in";
      ++cur_;
    } else if (is(Tok::kComparison)) {
      op = t_[cur_++].value;
    } else {
      return left;
    }
    left = binary(Tok::kComparison, std::move(left), op, additive(), ln);
  }
}

NodePtr Parser::additive() {
  NodePtr left = multiplicative();
  while (is(Tok::kAdditive)) {
    const int ln = line();
    const std::string op = t_[cur_++].value;
    left = binary(Tok::kAdditive, std::move(left), op, multiplicative(), ln);
  }
  return left;
}

NodePtr Parser::multiplicative() {
  NodePtr left = power();
  while (is(Tok::kMultiplicative)) {
    const int ln = line();
    const std::string op = t_[cur_++].value;
    left = binary(Tok::kMultiplicative, std::move(left), op, power(), ln);
  }
  return left;
}

NodePtr Parser::power() {
  NodePtr left = test();
  while (is(Tok::kPower)) {
    const int ln = line();
    ++cur_;
    left = binary(Tok::kPower, std::move(left), "**", test(), ln);
  }
  return left;
}

NodePtr Parser::test() {
  NodePtr operand = filter();
  while (is_ident("is")) {
    auto n = node(NodeKind::kTest, line());
    ++cur_;
    if (is_ident("not")) {
      n->flag = true;
      ++cur_;
    }
    NodePtr name = primary();
    if (name->kind != NodeKind::kIdentifier) error("expected a test name after 'is'");
    n->str = name->str;
    n->a.push_back(std::move(operand));
    operand = std::move(n);
  }
  return operand;
}

NodePtr Parser::filter() {
  NodePtr operand = unary_sign();
  while (is(Tok::kPipe)) {
    auto n = node(NodeKind::kFilter, line());
    ++cur_;
    NodePtr f = primary();
    if (f->kind != NodeKind::kIdentifier) error("expected a filter name after '|'");
    if (is(Tok::kOpenParen)) f = call(std::move(f));
    n->a.push_back(std::move(operand));
    n->a.push_back(std::move(f));
    operand = std::move(n);
  }
  return operand;
}

NodePtr Parser::unary_sign() {
  if ((is(Tok::kUnary) || is(Tok::kAdditive)) && (t_[cur_].value == "-" || t_[cur_].value == "+")) {
    Depth d(*this);
    auto n = node(NodeKind::kUnary, line());
    n->str = t_[cur_++].value;
    n->a.push_back(unary_sign());
    return n;
  }
  return call_member();
}

NodePtr Parser::call_member() {
  NodePtr m = member(primary());
  return is(Tok::kOpenParen) ? call(std::move(m)) : std::move(m);
}

NodePtr Parser::call(NodePtr callee) {
  Depth d(*this);
  auto n = node(NodeKind::kCall, line());
  n->a.push_back(std::move(callee));
  for (auto& arg : arguments(false)) n->a.push_back(std::move(arg));
  NodePtr e = member(std::move(n));
  return is(Tok::kOpenParen) ? call(std::move(e)) : std::move(e);
}

NodePtr Parser::member(NodePtr object) {
  while (is(Tok::kDot) || is(Tok::kOpenBracket)) {
    Depth d(*this);
    auto n = node(NodeKind::kMember, line());
    const bool computed = is(Tok::kOpenBracket);
    ++cur_;
    n->flag = computed;
    n->a.push_back(std::move(object));
    if (!computed) {
      NodePtr prop = primary();
      if (prop->kind != NodeKind::kIdentifier && prop->kind != NodeKind::kInt) {
        error("expected a name or an integer after '.'");
      }
      n->a.push_back(std::move(prop));
    } else {
      std::vector<NodePtr> parts;
      bool slice = false;
      while (!is(Tok::kCloseBracket)) {
        if (cur_ >= t_.size()) error("missing ']'");
        if (is(Tok::kColon)) {
          parts.push_back(node(NodeKind::kNone, line()));
          ++cur_;
          slice = true;
        } else {
          parts.push_back(expr());
          if (is(Tok::kColon)) {
            ++cur_;
            slice = true;
          }
        }
      }
      ++cur_;
      if (parts.empty()) error("expected an index or a slice inside '[]'");
      if (slice) {
        if (parts.size() > 3) error("a slice has at most 3 parts");
        auto s = node(NodeKind::kSlice, n->line);
        for (auto& p : parts) s->a.push_back(std::move(p));
        while (s->a.size() < 3) s->a.push_back(node(NodeKind::kNone, n->line));
        n->a.push_back(std::move(s));
      } else {
        n->a.push_back(std::move(parts[0]));
      }
    }
    object = std::move(n);
  }
  return object;
}

NodePtr Parser::primary() {
  if (cur_ >= t_.size()) error("unexpected end of template");
  Depth d(*this);
  const Token& tok = t_[cur_++];
  switch (tok.type) {
    case Tok::kNumber: {
      const bool is_float = tok.value.find('.') != std::string::npos;
      auto n = node(is_float ? NodeKind::kFloat : NodeKind::kInt, tok.line);
      if (is_float) {
        n->f = std::stod(tok.value);
      } else {
        const char* b = tok.value.data() + (tok.value[0] == '+' ? 1 : 0);
        const auto r = std::from_chars(b, tok.value.data() + tok.value.size(), n->i);
        if (r.ec != std::errc()) error("integer literal '" + tok.value + "' out of range");
      }
      return n;
    }
    case Tok::kString: {
      auto n = node(NodeKind::kString, tok.line);
      n->str = tok.value;
      while (is(Tok::kString)) n->str += t_[cur_++].value;  // adjacent literals concatenate
      return n;
    }
    case Tok::kIdent: {
      auto n = node(NodeKind::kIdentifier, tok.line);
      n->str = tok.value;
      return n;
    }
    case Tok::kOpenParen: {
      NodePtr e = expression_sequence(false);
      expect(Tok::kCloseParen, "')'");
      return e;
    }
    case Tok::kOpenBracket: {
      auto n = node(NodeKind::kArray, tok.line);
      while (!is(Tok::kCloseBracket)) {
        if (cur_ >= t_.size()) error("missing ']'");
        n->a.push_back(expr());
        if (is(Tok::kComma)) ++cur_;
      }
      ++cur_;
      return n;
    }
    case Tok::kOpenBrace: {
      auto n = node(NodeKind::kObject, tok.line);
      while (!is(Tok::kCloseBrace)) {
        if (cur_ >= t_.size()) error("missing '}'");
        n->a.push_back(expr());
        expect(Tok::kColon, "':' between a key and its value");
        n->a.push_back(expr());
        if (is(Tok::kComma)) ++cur_;
      }
      ++cur_;
      return n;
    }
    default: --cur_; error("unexpected '" + tok.value + "'");
  }
}

}  // namespace

std::unique_ptr<Program> parse_template(const std::string& source, const std::string& name, int max_nesting) {
  std::vector<Token> tokens = lex_template(source, name);
  auto program = std::make_unique<Program>();
  program->body = Parser(std::move(tokens), name, max_nesting).program();
  return program;
}

}  // namespace bg::jinja
