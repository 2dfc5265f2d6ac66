// Generation: context-length checks, submit, event loop step, cancellation and per-request metrics.
#include "server/frontend/generation.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/log.h"
#include "server/frontend/api_error.h"

namespace bg::frontend {

using Clock = std::chrono::steady_clock;

namespace {

const char* prompt_param(ApiKind kind) { return kind == ApiKind::chat ? "messages" : "prompt"; }

// Fills in max_tokens against the context length; 400 when the prompt (plus an explicit max_tokens) does not fit.
int64_t resolve_max_tokens(const GenerationInput& in, int64_t max_model_len) {
  const auto n_prompt = static_cast<int64_t>(in.prompt.size());
  if (n_prompt >= max_model_len) {
    throw ApiError(400, fmt::format("This model's maximum context length is {} tokens, but the prompt has {} tokens. "
                                    "Please shorten the prompt.", max_model_len, n_prompt),
                   prompt_param(in.kind), "context_length_exceeded");
  }
  const int64_t remaining = max_model_len - n_prompt;
  if (in.common.max_tokens) {
    if (*in.common.max_tokens > remaining) {
      throw ApiError(400, fmt::format("This model's maximum context length is {} tokens. However, you requested {} "
                                      "tokens ({} in the prompt, {} for the completion). Please reduce the prompt or "
                                      "max_tokens.", max_model_len, n_prompt + *in.common.max_tokens, n_prompt,
                                      *in.common.max_tokens),
                     "max_tokens", "context_length_exceeded");
    }
    return *in.common.max_tokens;
  }
  return in.default_max_tokens > 0 ? std::min(in.default_max_tokens, remaining) : remaining;
}

void check_ids(const std::vector<int32_t>& ids, int64_t vocab, const char* param) {
  for (int32_t id : ids) {
    if (id >= vocab) throw ApiError(400, fmt::format("token id {} is outside the vocabulary (size {})", id, vocab), param);
  }
}

}  // namespace

Generation::Generation(ServingContext& ctx, GenerationInput in, std::string id, Clock::time_point arrival)
    : ctx_(ctx),
      id_(std::move(id)),
      prompt_len_(in.prompt.size()),
      logprobs_(in.common.logprobs),
      asm_(ctx.model, in.kind, in.common, in.chat),
      arrival_(arrival),
      last_token_(arrival) {
  if (!ctx.link.all_ready()) {
    std::string why;
    for (const RankState& s : ctx.link.ranks()) {
      if (!s.ready() && why.empty()) why = fmt::format("{}: {}", s.name(), s.not_ready_reason());
    }
    throw ApiError(503, "the model is not ready to serve (" + why + ")", "", "model_not_ready");
  }
  if (in.prompt.empty()) throw ApiError(400, "the prompt is empty", prompt_param(in.kind));
  const int64_t vocab = ctx.model.vocab_size();
  check_ids(in.prompt, vocab, prompt_param(in.kind));
  check_ids(in.common.sampling.stop_token_ids, vocab, "stop_token_ids");

  proto::GenerateRequest req;
  req.id = id_;
  req.params = in.common.sampling;
  req.params.max_tokens = resolve_max_tokens(in, ctx.link.max_model_len());
  req.params.top_logprobs = in.common.logprobs ? in.common.top_logprobs : -1;
  for (int32_t t : in.extra_stop_ids) {
    if (std::find(req.params.stop_token_ids.begin(), req.params.stop_token_ids.end(), t) ==
        req.params.stop_token_ids.end()) {
      req.params.stop_token_ids.push_back(t);
    }
  }
  req.prompt = std::move(in.prompt);
  events_ = ctx.link.submit(req);
  ctx.metrics.add_in_flight(1);
  log::debug("frontend: {} submitted ({} prompt tokens, {:.2f} ms after its request arrived)", id_, prompt_len_,
             std::chrono::duration<double, std::milli>(Clock::now() - arrival_).count());
}

Generation::~Generation() {
  if (!finished_) {
    ctx_.link.cancel(id_);
    finish_metrics();
  }
}

std::optional<OutputDelta> Generation::next(std::chrono::milliseconds timeout) {
  if (finished_) return std::nullopt;
  std::optional<proto::TokenEvent> ev = events_->pop(timeout);
  if (!ev) return std::nullopt;
  on_event(*ev);
  OutputDelta d = asm_.feed(*ev);
  if (asm_.done()) {
    // A stop string ended the text before the worker did: free the sequence at the worker now.
    if (asm_.stop_matched()) ctx_.link.cancel(id_);
    finish_metrics();
  }
  return d;
}

void Generation::set_notify(std::function<void()> notify) { events_->set_notify(std::move(notify)); }

void Generation::on_event(const proto::TokenEvent& ev) {
  if (ev.tokens.empty()) return;
  const auto now = Clock::now();
  if (!got_first_token_) {
    got_first_token_ = true;
    ctx_.metrics.observe_ttft(std::chrono::duration<double>(now - arrival_).count());
  } else {
    // Several tokens in one event share the gap (a step that produced more than one).
    const double gap = std::chrono::duration<double>(now - last_token_).count() / static_cast<double>(ev.tokens.size());
    for (size_t i = 0; i < ev.tokens.size(); ++i) ctx_.metrics.observe_itl(gap);
  }
  last_token_ = now;
}

void Generation::cancel_by_client() {
  if (finished_) return;
  log::info("frontend: client went away; cancelling {}", id_);
  ctx_.link.cancel(id_);
  ctx_.metrics.count_cancel_by_client();
  finish_metrics();
}

void Generation::finish_metrics() {
  if (finished_) return;
  finished_ = true;
  ctx_.metrics.add_in_flight(-1);
  ctx_.metrics.add_tokens(static_cast<int64_t>(prompt_len_), asm_.completion_tokens());
  ctx_.metrics.count_finish(asm_.done() ? asm_.finish_reason() : "cancelled");
  ctx_.metrics.observe_e2e(std::chrono::duration<double>(Clock::now() - arrival_).count());
}

}  // namespace bg::frontend
