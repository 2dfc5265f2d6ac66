// Frontend <-> worker messages. Transport: ZeroMQ. The frontend binds a ROUTER socket; each worker (one per rank)
// connects a DEALER whose routing id is "rank-<r>". Every message is one frame holding a MessagePack map
// (nlohmann::json::to_msgpack) with a "type" key:
//   frontend -> worker: "generate" (GenerateRequest), "cancel" (Cancel), "status_request" {}, "shutdown" {}
//   worker -> frontend: "status" (WorkerStatus; sent on connect, when the phase changes, on request and at least once
//                       a second), "tokens" (TokenEvent; every step that produced tokens for a request, and exactly
//                       one event with a non-empty finish_reason per request, after which the id is forgotten)
// Text never crosses this boundary: the frontend tokenizes, applies the chat format, detokenizes and checks stop
// strings (cancelling the request when one matches).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace bg::proto {

struct SamplingParams {
  float temperature = 1.0f;                // 0: greedy
  float top_p = 1.0f;                      // (0, 1]
  int32_t top_k = 0;                       // 0: off
  std::optional<uint64_t> seed;            // absent: the worker draws one
  int64_t max_tokens = 16;                 // > 0; the worker also stops at the model's context length
  std::vector<int32_t> stop_token_ids;     // in addition to the model's eos unless ignore_eos
  bool ignore_eos = false;
  int32_t top_logprobs = -1;               // -1: no logprobs; 0..20: logprob of the sampled token + this many top
};

struct GenerateRequest {
  std::string id;                          // unique among the frontend's live requests
  std::vector<int32_t> prompt;             // token ids, non-empty
  SamplingParams params;
};

struct Cancel {
  std::string id;
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;                                // of the sampled token, from the unmodified distribution
  std::vector<std::pair<int32_t, float>> top;          // best first
};

struct TokenEvent {
  std::string id;
  std::vector<int32_t> tokens;             // new tokens since the last event (may be empty on the final event)
  std::vector<TokenLogprob> logprobs;      // one per token when requested, else empty
  std::string finish_reason;               // "" (more to come) | "stop" | "length" | "abort" | "error"
  std::string error;                       // with finish_reason "error" (or a rejection): what went wrong
  int32_t error_code = 0;                  // HTTP-like status for rejections: 400 (too long), 429/503 (full), 500
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;               // prompt tokens reused from the worker's prefix cache
  int64_t completion_tokens = 0;           // total so far
};

struct WorkerStatus {
  int32_t rank = 0;
  std::string phase = "starting";          // "starting" | "loading" | "ready" | "failed"
  std::string error;                       // with phase "failed"
  // model (valid once ready)
  std::string arch;
  int64_t vocab_size = 0;
  int64_t max_model_len = 0;
  int64_t eos_token_id = -1;
  // scheduler
  int64_t max_num_seqs = 0;
  int64_t running = 0;
  int64_t waiting = 0;
  int64_t last_batch_size = 0;             // sequences in the last step
  int64_t last_batch_tokens = 0;           // tokens in the last step
  // memory
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_free = 0;
  int64_t kv_block_tokens = 0;
  int64_t kv_bytes = 0;
  int64_t state_slots_total = 0;
  int64_t state_slots_free = 0;
  int64_t state_bytes = 0;
  int64_t kv_bytes_used = 0;               // GPU KV blocks in use (sequences + prefix cache)
  int64_t state_bytes_used = 0;            // GPU state slots in use (sequences + snapshots)
  int64_t kv_blocks_cached = 0;            // GPU KV blocks held only by the prefix cache
  int64_t state_slots_cached = 0;          // GPU state slots holding prefix-cache snapshots
  int64_t host_bytes_total = 0;            // host tier
  int64_t host_kv_bytes = 0;
  int64_t host_state_bytes = 0;
  int64_t seqs_offloaded = 0;              // preempted sequences waiting in the host tier
  int64_t longest_seq_tokens = 0;          // the running sequence with the most positions: its positions
  int64_t longest_seq_gpu_bytes = 0;       // ... and the GPU bytes its KV blocks and state slot take
  // counters since start
  int64_t prompt_tokens_total = 0;
  int64_t generation_tokens_total = 0;
  int64_t preemptions_total = 0;
  int64_t steps_total = 0;
  int64_t prefix_cache_lookups_total = 0;        // sequences started with the prefix cache on
  int64_t prefix_cache_hits_total = 0;           // ... that reused at least one token
  int64_t prefix_cache_lookup_tokens_total = 0;  // their input tokens
  int64_t prefix_cache_hit_tokens_total = 0;     // tokens reused (prefill saved)
  int64_t offloads_total = 0;                    // sequences moved to the host tier
  int64_t restores_total = 0;                    // ... and brought back
  int64_t rotations_total = 0;                   // requests that yielded their GPU place (--swap-quantum-steps)
  int64_t expert_copies_total = 0;               // streamed experts copied into the pool (--resident-experts)
  int64_t expert_pool_hits_total = 0;            // routed streamed experts already in the pool
  int64_t expert_bytes_copied_total = 0;         // host -> backend bytes of those copies
  int64_t expert_prefetches_total = 0;           // ... of them copied ahead for the next MoE layer
  int64_t expert_prefetch_hits_total = 0;        // prefetched experts the next layer used
};

void to_json(nlohmann::json& j, const SamplingParams& v);
void from_json(const nlohmann::json& j, SamplingParams& v);
void to_json(nlohmann::json& j, const GenerateRequest& v);
void from_json(const nlohmann::json& j, GenerateRequest& v);
void to_json(nlohmann::json& j, const Cancel& v);
void from_json(const nlohmann::json& j, Cancel& v);
void to_json(nlohmann::json& j, const TokenLogprob& v);
void from_json(const nlohmann::json& j, TokenLogprob& v);
void to_json(nlohmann::json& j, const TokenEvent& v);
void from_json(const nlohmann::json& j, TokenEvent& v);
void to_json(nlohmann::json& j, const WorkerStatus& v);
void from_json(const nlohmann::json& j, WorkerStatus& v);

// A message: its type and body (the body's keys sit beside "type" in the one map).
struct Message {
  std::string type;
  nlohmann::json body = nlohmann::json::object();
};

// Message -> one MessagePack frame.
std::string encode(const std::string& type, const nlohmann::json& body);
template <typename T>
std::string encode(const std::string& type, const T& value) {
  return encode(type, nlohmann::json(value));
}
// One frame -> Message. Throws bg::Error on malformed MessagePack, a non-map, or a missing/non-string "type".
Message decode(std::span<const std::byte> frame);
[[noreturn]] void throw_bad_body(const std::string& type, const char* what);
// body -> T; throws bg::Error naming the message type and the bad field.
template <typename T>
T body_as(const Message& m) {
  try {
    return m.body.get<T>();
  } catch (const nlohmann::json::exception& e) {
    throw_bad_body(m.type, e.what());
  }
}

}  // namespace bg::proto
