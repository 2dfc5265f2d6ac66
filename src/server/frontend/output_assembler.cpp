// Token events -> output deltas: chat parsing or detokenizing, stop strings on content, logprobs, finish reasons.
#include "server/frontend/output_assembler.h"

namespace bg::frontend {

void FullOutput::add(const OutputDelta& d) {
  reasoning += d.reasoning;
  text += d.text;
  for (const ToolCallPiece& p : d.tool_calls) {
    ToolCallPiece* call = nullptr;
    for (ToolCallPiece& c : tool_calls) {
      if (c.index == p.index) call = &c;
    }
    if (call == nullptr) {
      tool_calls.push_back(ToolCallPiece{p.index, "", "", ""});
      call = &tool_calls.back();
    }
    if (!p.id.empty()) call->id = p.id;
    if (!p.name.empty()) call->name += p.name;
    call->arguments += p.arguments;
  }
  logprobs.insert(logprobs.end(), d.logprobs.begin(), d.logprobs.end());
}

OutputAssembler::OutputAssembler(const TextModel& model, ApiKind kind, const CommonRequest& req,
                                 const ChatParams& chat)
    : model_(model), kind_(kind), want_logprobs_(req.logprobs), stops_(req.stop) {
  if (kind == ApiKind::chat) {
    parser_ = model.chat_parser(chat);
  } else {
    detok_ = model.detokenizer();
  }
}

LogprobEntry OutputAssembler::make_logprob(const proto::TokenLogprob& lp) const {
  LogprobEntry e;
  e.bytes = model_.token_bytes(lp.token);
  e.logprob = lp.logprob;
  for (const auto& [id, logprob] : lp.top) e.top.emplace_back(model_.token_bytes(id), logprob);
  return e;
}

void OutputAssembler::push_text(const std::string& text, OutputDelta& out) {
  out.text += stops_.push(text);
  if (stops_.stopped()) {
    done_ = true;
    stop_matched_ = true;
    finish_reason_ = "stop";
  }
}

void OutputAssembler::push_token(int32_t token, OutputDelta& out) {
  if (kind_ == ApiKind::chat) {
    ChatPiece piece = parser_->push(token);
    out.reasoning += piece.reasoning;
    if (!piece.tool_calls.empty()) saw_tool_calls_ = true;
    out.tool_calls.insert(out.tool_calls.end(), piece.tool_calls.begin(), piece.tool_calls.end());
    push_text(piece.content, out);
  } else {
    push_text(detok_->push(token), out);
  }
}

void OutputAssembler::finish(const proto::TokenEvent& ev, OutputDelta& out) {
  if (kind_ == ApiKind::chat) {
    ChatPiece piece = parser_->finish();
    out.reasoning += piece.reasoning;
    if (!piece.tool_calls.empty()) saw_tool_calls_ = true;
    out.tool_calls.insert(out.tool_calls.end(), piece.tool_calls.begin(), piece.tool_calls.end());
    push_text(piece.content, out);
  } else {
    push_text(detok_->flush(), out);
  }
  if (done_) {
    stop_matched_ = false;  // the worker has finished already: nothing to cancel
    return;
  }
  out.text += stops_.flush();
  done_ = true;
  finish_reason_ = ev.finish_reason;
  if (finish_reason_ == "error") {
    error_ = ev.error.empty() ? "the worker failed this request" : ev.error;
    error_code_ = ev.error_code != 0 ? ev.error_code : 500;
  } else if (finish_reason_ == "stop" && saw_tool_calls_) {
    finish_reason_ = "tool_calls";
  }
}

OutputDelta OutputAssembler::feed(const proto::TokenEvent& ev) {
  OutputDelta out;
  if (done_) return out;
  if (ev.prompt_tokens > 0) prompt_tokens_ = ev.prompt_tokens;
  if (ev.cached_tokens > 0) cached_tokens_ = ev.cached_tokens;
  for (size_t i = 0; i < ev.tokens.size() && !done_; ++i) {
    ++completion_tokens_;
    if (want_logprobs_ && i < ev.logprobs.size()) out.logprobs.push_back(make_logprob(ev.logprobs[i]));
    push_token(ev.tokens[i], out);
  }
  if (!ev.finish_reason.empty() && !done_) finish(ev, out);
  return out;
}

}  // namespace bg::frontend
