// One request's output side: worker token events -> text (detokenized or chat-parsed), stop strings, logprobs,
// finish reason and token counts. Pure logic (no I/O) so it is tested without a server.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/frontend/request_parse.h"
#include "server/frontend/stop_matcher.h"
#include "server/frontend/text_model.h"
#include "server/protocol.h"

namespace bg::frontend {

enum class ApiKind { chat, completion };

struct LogprobEntry {
  std::string bytes;                                   // raw token bytes
  float logprob = 0.0f;
  std::vector<std::pair<std::string, float>> top;      // (raw bytes, logprob), best first
};

// What is new since the previous event.
struct OutputDelta {
  std::string reasoning;
  std::string text;                                    // content (chat) or text (completions)
  std::vector<ToolCallPiece> tool_calls;
  std::vector<LogprobEntry> logprobs;
  bool empty() const { return reasoning.empty() && text.empty() && tool_calls.empty() && logprobs.empty(); }
};

// A whole response, built from deltas (non-streamed responses).
struct FullOutput {
  std::string reasoning;
  std::string text;
  std::vector<ToolCallPiece> tool_calls;               // merged: one entry per call index
  std::vector<LogprobEntry> logprobs;
  void add(const OutputDelta& d);
};

class OutputAssembler {
 public:
  OutputAssembler(const TextModel& model, ApiKind kind, const CommonRequest& req, const ChatParams& chat);

  OutputDelta feed(const proto::TokenEvent& ev);

  bool done() const { return done_; }
  // A stop string ended the output before the worker finished: the caller must cancel the request.
  bool stop_matched() const { return stop_matched_; }
  // "stop" | "length" | "tool_calls" | "abort" | "error" (valid once done()).
  const std::string& finish_reason() const { return finish_reason_; }
  const std::string& error() const { return error_; }
  int32_t error_code() const { return error_code_; }
  int64_t prompt_tokens() const { return prompt_tokens_; }
  int64_t cached_tokens() const { return cached_tokens_; }
  int64_t completion_tokens() const { return completion_tokens_; }

 private:
  void push_token(int32_t token, OutputDelta& out);
  void push_text(const std::string& text, OutputDelta& out);
  void finish(const proto::TokenEvent& ev, OutputDelta& out);
  LogprobEntry make_logprob(const proto::TokenLogprob& lp) const;

  const TextModel& model_;
  ApiKind kind_;
  bool want_logprobs_;
  StopMatcher stops_;
  std::unique_ptr<TextStream> detok_;        // completions
  std::unique_ptr<ChatStreamParser> parser_; // chat
  bool done_ = false;
  bool stop_matched_ = false;
  bool saw_tool_calls_ = false;
  std::string finish_reason_;
  std::string error_;
  int32_t error_code_ = 0;
  int64_t prompt_tokens_ = 0;
  int64_t cached_tokens_ = 0;
  int64_t completion_tokens_ = 0;
};

}  // namespace bg::frontend
