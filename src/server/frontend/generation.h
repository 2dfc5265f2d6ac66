// One generation from submit to finish: prompt checks against the context length, the worker request, the output
// assembler, cancellation (stop string matched, client gone) and the latency/token metrics of the request.
#pragma once

#include <chrono>
#include <functional>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "server/frontend/metrics.h"
#include "server/frontend/openai_format.h"
#include "server/frontend/output_assembler.h"
#include "server/frontend/worker_link.h"

namespace bg::frontend {

// What a handler hands over after parsing and tokenizing.
struct GenerationInput {
  ApiKind kind = ApiKind::completion;
  CommonRequest common;
  ChatParams chat;
  std::vector<int32_t> prompt;
  std::vector<int32_t> extra_stop_ids;   // the chat format's end-of-turn ids
  int64_t default_max_tokens = 0;        // 0: up to the context length
};

// Shared by all handlers.
struct ServingContext {
  const TextModel& model;
  WorkerLink& link;
  Metrics& metrics;
  std::string served_model_name;
  ParseOptions parse;
};

class Generation {
 public:
  // Validates against the workers' context length and submits; throws ApiError (400 too long, 503 not ready).
  Generation(ServingContext& ctx, GenerationInput in, std::string id, std::chrono::steady_clock::time_point arrival);
  ~Generation();
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // Waits up to `timeout` (0: does not wait) for the next worker event; nullopt on timeout or when done.
  std::optional<OutputDelta> next(std::chrono::milliseconds timeout);
  // Called (from the worker link's thread) whenever an event arrives for this generation.
  void set_notify(std::function<void()> notify);
  bool done() const { return asm_.done(); }
  // The client went away: cancel at the worker now.
  void cancel_by_client();

  const OutputAssembler& output() const { return asm_; }
  Usage usage() const {
    return Usage{static_cast<int64_t>(prompt_len_), asm_.completion_tokens(), asm_.cached_tokens()};
  }
  bool logprobs() const { return logprobs_; }

 private:
  void on_event(const proto::TokenEvent& ev);
  void finish_metrics();

  ServingContext& ctx_;
  std::string id_;
  size_t prompt_len_ = 0;
  bool logprobs_ = false;
  OutputAssembler asm_;
  std::shared_ptr<RequestEvents> events_;
  std::chrono::steady_clock::time_point arrival_;
  std::chrono::steady_clock::time_point last_token_;
  bool got_first_token_ = false;
  bool finished_ = false;   // metrics recorded, worker side settled or cancelled
};

}  // namespace bg::frontend
