// Shared helpers of the chat tests: the tokenizers make-random writes (Kimi K3 tiny, DeepSeek-V3 tiny), loaded once,
// and token-stream builders / delta accumulators for the output parsers.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "server/chat/chat_format.h"
#include "server/tokenizer/tokenizer_writer.h"

namespace bg::testing {

// Writes the files into a fresh directory under the test binary's temp dir and loads them.
inline Tokenizer load_written(const std::string& name, const TokenizerFileLayout& layout) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("bg_chat_tok_" + name + "_" +
                                                                              std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  write_tokenizer_files(dir, layout);
  Tokenizer tok = Tokenizer::load(dir);
  std::filesystem::remove_all(dir);
  return tok;
}

inline const Tokenizer& k3_tokenizer() {
  static const Tokenizer tok = load_written("k3", kimi_tokenizer_layout(1024));
  return tok;
}

inline const Tokenizer& ds_tokenizer() {
  static const Tokenizer tok = load_written("ds", deepseek_v3_tokenizer_layout(512, 0, 1));
  return tok;
}

inline ChatOptions options(bool thinking, std::string effort = "", bool add_generation_prompt = true) {
  ChatOptions o;
  o.thinking = thinking;
  o.reasoning_effort = std::move(effort);
  o.add_generation_prompt = add_generation_prompt;
  return o;
}

// A generated stream: text pieces (BPE-encoded) and special tokens by name.
struct Special {
  std::string name;
};
using Piece = std::variant<std::string, Special>;

inline std::vector<int32_t> stream(const Tokenizer& tok, const std::vector<Piece>& pieces) {
  std::vector<int32_t> ids;
  for (const auto& p : pieces) {
    if (const auto* s = std::get_if<Special>(&p)) {
      ids.push_back(tok.special_id(s->name).value());
    } else {
      const auto e = tok.encode(std::get<std::string>(p));
      ids.insert(ids.end(), e.begin(), e.end());
    }
  }
  return ids;
}

struct ParsedCall {
  std::string id, name, arguments;
};

// Everything a client assembles from the deltas; `n_deltas_with_name` counts deltas that (re)state a call's name.
struct Parsed {
  std::string reasoning, content;
  std::vector<ParsedCall> calls;
  int n_name_deltas = 0;

  void add(const ChatDelta& d) {
    reasoning += d.reasoning;
    content += d.content;
    for (const auto& t : d.tool_calls) {
      if (t.index >= static_cast<int>(calls.size())) calls.resize(static_cast<size_t>(t.index) + 1);
      ParsedCall& c = calls[static_cast<size_t>(t.index)];
      if (!t.name.empty()) {
        ++n_name_deltas;
        c.id = t.id;
        c.name = t.name;
      }
      c.arguments += t.arguments;
    }
  }
};

inline Parsed parse_all(ChatOutputParser& parser, const std::vector<int32_t>& ids) {
  Parsed out;
  for (int32_t id : ids) out.add(parser.push(id));
  out.add(parser.finish());
  return out;
}

}  // namespace bg::testing
