// Continuous-batching scheduler of one worker: a bounded waiting queue and the running set; each step it picks
// decode tokens first, then prefill pieces within the token budget, admits waiting requests when the GPU tier allows
// (starting from the prefix cache, or bringing an offloaded request back), and preempts the newest request when a
// decode cannot get a KV block (to the host tier when it has room, else recompute). Every byte of state it hands out
// comes from the kv::StateManager. Single-threaded (the engine's).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kv/state_manager.h"
#include "sched/policies.h"
#include "sched/request.h"

namespace bg::sched {

struct SchedulerConfig {
  int64_t max_num_seqs = 16;           // running at once
  int64_t max_model_len = 0;           // prompt + completion
  int64_t chunked_prefill_size = 512;  // tokens per step (decodes + prefill pieces); >= max_num_seqs
  int64_t max_queue = 1024;            // waiting requests beyond free running places; more are rejected (503)
  double kv_watermark = 0.01;          // fraction of KV blocks admission leaves free for running sequences
  // With a host tier: a request that has run this many steps since it started or came back gives its GPU place to
  // the head of the queue when that one cannot start otherwise (offloaded, to the back of the queue), so more
  // requests progress at once than the GPU holds. 0: never (requests wait for a running one to finish).
  int64_t swap_quantum_steps = 0;
  // --deterministic: a prompt is cut into prefill pieces at fixed positions only (multiples of the piece grid and of
  // the snapshot interval), whatever else runs; a piece the step has no room for waits for the next step. With the
  // state plan's resume_align_tokens at the snapshot interval, a prefix-cache hit resumes on the same grid.
  bool deterministic = false;
  // Tokens per step when the step has no decode token (every running request is still prefilling), so a lone or
  // queued prompt prefills in larger, faster steps while nothing waits on the step's latency; a step with decodes
  // keeps chunked_prefill_size. 0: chunked_prefill_size. Not with --deterministic (its prefill grid is fixed).
  int64_t idle_prefill_size = 0;
};

// Why a request was not accepted: an HTTP-like code (400 too long, 503 queue full) and a message for the client.
struct Rejection {
  int32_t code = 0;
  std::string message;
};

// One request's part of a step: tokens [start, start + n_tokens) of its buffer.
struct Chunk {
  Request* req = nullptr;
  int64_t start = 0;
  int64_t n_tokens = 0;
  bool samples = false;  // the chunk reaches the end of the request's tokens: a token is sampled from its logits
};

struct StepPlan {
  std::vector<Chunk> chunks;  // decodes first (admission order), then prefill pieces
  int64_t n_tokens = 0;
  bool empty() const { return chunks.empty(); }
};

class Scheduler {
 public:
  // Throws bg::Error naming the flag when the config is out of range.
  Scheduler(kv::StateManager& state, const SchedulerConfig& config);

  const SchedulerConfig& config() const { return config_; }
  // Queues a request whose id, prompt and params were validated by the caller. On a rejection (prompt too long: 400,
  // queue full: 503) the request is dropped. Caps request->max_new_tokens by max_model_len.
  std::optional<Rejection> add(std::unique_ptr<Request> request);
  // Removes a waiting or running request at once, freeing its sequence; nullptr for an unknown id.
  std::unique_ptr<Request> cancel(const std::string& id);
  // This step's work. Reserves the KV blocks every chunk needs, preempting when decodes run out of blocks.
  StepPlan schedule();
  // After the forward: the chunk's tokens are in the sequence; what prefill computed goes into the prefix cache.
  void complete(const Chunk& chunk);
  // Removes a running request (finished or failed) and frees its sequence.
  std::unique_ptr<Request> finish(const Request* request);
  // Replaces a running request's sequence by an empty one with KV for n_tokens (it must then recompute from 0; none
  // of it goes into the prefix cache). Throws bg::Error when the memory is not there.
  void reset_sequence(Request& request, int64_t n_tokens);
  // Tokens of a prefill piece of `r` starting at r.n_computed with `budget` tokens left, ending at a multiple of the
  // prefill alignment unless it ends the input, so the pieces compute what one prefill would
  // (kv::StateGeometry::prefill_align_tokens). Models with KDA layers: a piece that reaches a multiple of the snapshot
  // interval ends on the last one it reaches (the prefix cache snapshots the KDA state where a sequence stands after a
  // step), so one step may prefill many intervals of one prompt. Deterministic: never across a multiple of the
  // snapshot interval or of the grid; the piece up to the next such point, or nothing (0) when the budget is smaller.
  int64_t piece_tokens(const Request& r, int64_t budget) const;
  int64_t piece_grid() const { return grid_; }  // deterministic: the fixed piece length (0: off)

  const Request* find(const std::string& id) const;
  std::vector<std::string> ids() const;  // running, then waiting
  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  int64_t n_running() const { return static_cast<int64_t>(running_.size()); }
  // The running request whose sequence holds the most positions (the oldest among equals); nullptr when none runs.
  const Request* longest_running() const;
  int64_t n_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t preemptions_total() const { return preemptions_total_; }
  int64_t recomputes_total() const { return recomputes_total_; }  // preemptions the host tier could not take
  int64_t rotations_total() const { return rotations_total_; }    // quantum swaps to the host tier

 private:
  void rotate();
  bool fits(const Request& r) const;
  void schedule_decodes(StepPlan& plan, TokenBudget& budget);
  void schedule_prefills(StepPlan& plan, TokenBudget& budget);
  void admit_waiting(StepPlan& plan, TokenBudget& budget);
  bool start(Request& r);
  bool reserve_decode_kv(size_t running_idx);
  void preempt(size_t running_idx);
  static void add_chunk(StepPlan& plan, Request& r, int64_t n_tokens);

  kv::StateManager& state_;
  SchedulerConfig config_;
  AdmissionPolicy admission_;
  PreemptionPolicy preemption_;
  int64_t align_ = 1;              // prefill pieces end at multiples of this (the KDA chunk), unless at the input end
  int64_t split_ = 0;              // ... and end on the last multiple of this they reach (the snapshot interval; 0: no
                                   // KDA layers; deterministic: never cross one)
  int64_t grid_ = 0;               // deterministic: pieces never cross a multiple of this either (0: off)
  std::deque<std::unique_ptr<Request>> waiting_;
  std::vector<std::unique_ptr<Request>> running_;  // admission order: the back is the newest
  int64_t preemptions_total_ = 0;
  int64_t recomputes_total_ = 0;
  int64_t rotations_total_ = 0;
};

}  // namespace bg::sched
