// Jinja lexer internals (jinja_lex.cpp -> jinja_parse.cpp): the token kinds of @huggingface/jinja's lexer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bg::jinja {

enum class Tok : uint8_t {
  kText, kNumber, kString, kIdent, kEquals, kOpenParen, kCloseParen, kOpenStmt, kCloseStmt, kOpenExpr, kCloseExpr,
  kOpenBracket, kCloseBracket, kOpenBrace, kCloseBrace, kComma, kDot, kColon, kPipe, kAdditive, kMultiplicative,
  kPower, kComparison, kUnary, kComment,
};

struct Token {
  Tok type;
  std::string value;
  int line;
};

// The source preprocessed (trailing newline, lstrip_blocks, trim_blocks, `generation` tags) and tokenized; every token
// carries its source line. Throws bg::Error "<name>:<line>: syntax error: ..." on a lexical error.
std::vector<Token> lex_template(const std::string& source, const std::string& name);

}  // namespace bg::jinja
