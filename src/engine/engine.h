// One rank's engine: owns the model and the scheduler, turns frontend requests into scheduled work and each step's
// results into token events. Transport-free (the ZeroMQ loop is worker.h); single-threaded: every call comes from
// the worker's loop thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "model/model.h"
#include "sched/scheduler.h"
#include "server/protocol.h"

namespace bg::engine {

struct EngineStats {
  int64_t steps_total = 0;
  int64_t prompt_tokens_total = 0;      // prompts of accepted requests
  int64_t generation_tokens_total = 0;  // sampled tokens
  int64_t computed_tokens_total = 0;    // tokens run through the model (prefill pieces and decodes)
  int64_t last_batch_size = 0;          // sequences in the last step
  int64_t last_batch_tokens = 0;        // tokens in the last step
};

// A final event with finish_reason "error" (rejections: code 400/503; failures: 500).
proto::TokenEvent error_event(const std::string& id, int32_t code, const std::string& message,
                              int64_t prompt_tokens = 0, int64_t completion_tokens = 0);

class Engine {
 public:
  // The state manager is built over the model's backend and geometry with `state_plan` (the planner's sizes).
  Engine(std::unique_ptr<Model> model, const kv::StatePlan& state_plan, const sched::SchedulerConfig& config);

  // Validates and queues a request; a rejection (400 bad input / too long, 503 queue full) becomes its final event.
  void submit(proto::GenerateRequest request);
  // Cancels a waiting or running request at once (its blocks and slot are freed; final event "abort"). Unknown ids
  // are ignored: the request may have finished already.
  void cancel(const std::string& id);
  // Ends every waiting and running request with finish_reason "error" and HTTP status `code` (500: a step failed;
  // 503: the worker or its rank set is going away, the request may be retried).
  void fail_all(const std::string& message, int32_t code);
  bool has_work() const { return scheduler_.has_work(); }
  // schedule -> execute (one forward_batch_sample: the step and its sampling) -> apply samples -> postprocess; the
  // step's events go to the outbox. False when nothing could be scheduled. As a rank of a set it is a collective:
  // with nothing scheduled it still takes part in the step (Model::sync_idle); throws dist::SetStopping once the set
  // stops, dist::RankFailure when it failed.
  bool step();
  // Tokens of warm_up's prefill step: the largest step the scheduler makes (idle_prefill_size when it applies).
  int64_t warm_up_prefill_tokens() const;
  // Runs dummy requests through the model before the first real one: a prefill filling the largest step, then for every
  // decode batch bucket (1, 2, 4, ... up to max_num_seqs) that many short requests of two KV blocks' prompt decoding
  // two tokens. Kernels are then loaded, library handles and scratch set up and the decode graphs of each bucket
  // captured, so the first real requests do not pay for them. Their events are dropped and the counters reset; the
  // prefix cache keeps their (shared) prompts until evicted. Returns the steps run. Not for a rank of a set.
  int64_t warm_up();
  // The events produced since the last call, at most one per request per step, in order.
  std::vector<proto::TokenEvent> take_events();
  // Fills the model, scheduler, memory and counter fields of a status.
  void fill_status(proto::WorkerStatus& status) const;

  Model& model() { return *model_; }
  const kv::StateManager& state() const { return state_; }
  const sched::Scheduler& scheduler() const { return scheduler_; }
  const EngineStats& stats() const { return stats_; }

 private:
  struct Outcome {
    std::string error;               // the request failed in this step
    std::optional<Sampled> sampled;  // the chunk ended the request's input
    std::string finish_reason;
  };
  std::vector<Outcome> execute(const sched::StepPlan& plan);
  void isolate_failure(const sched::StepPlan& plan, const std::string& what, std::vector<Outcome>& outcomes);
  void apply_samples(const sched::StepPlan& plan, std::vector<Outcome>& outcomes);
  void postprocess(const sched::StepPlan& plan, std::vector<Outcome>& outcomes);
  void reject(const proto::GenerateRequest& request, int32_t code, const std::string& message);
  std::string validate(const proto::GenerateRequest& request) const;

  // Declaration order is the lifetime rule (destroyed bottom up): the scheduler's requests hold sequences that hand
  // their memory back to the state manager, whose pools live in the model's backend.
  std::unique_ptr<Model> model_;
  kv::StateManager state_;
  sched::Scheduler scheduler_;
  // The current step's sampling: a row per chunk that samples (row_of_chunk_[chunk], -1 for none) and its result.
  std::vector<ops::RowSampling> rows_;
  std::vector<ops::RowSample> samples_;
  std::vector<int32_t> row_of_chunk_;
  std::vector<proto::TokenEvent> outbox_;
  EngineStats stats_;
  uint64_t n_arrived_ = 0;
};

}  // namespace bg::engine
