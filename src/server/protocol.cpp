// Frontend <-> worker message encoding: MessagePack maps through nlohmann::json, every field type-checked on decode.
#include "server/protocol.h"

#include "core/error.h"

namespace bg::proto {

using nlohmann::json;

namespace {

// Reads an optional field: absent keeps the default; present with the wrong type throws (json's type_error).
template <typename T>
void opt(const json& j, const char* key, T& out) {
  auto it = j.find(key);
  if (it != j.end() && !it->is_null()) out = it->template get<T>();
}

template <typename T>
void req(const json& j, const char* key, T& out) {
  auto it = j.find(key);
  if (it == j.end()) throw json::out_of_range::create(403, std::string("missing field '") + key + "'", &j);
  out = it->template get<T>();
}

void expect_object(const json& j, const char* what) {
  if (!j.is_object()) throw json::type_error::create(302, std::string(what) + " must be a map", &j);
}

}  // namespace

void to_json(json& j, const SamplingParams& v) {
  j = json{{"temperature", v.temperature}, {"top_p", v.top_p},       {"top_k", v.top_k},
           {"max_tokens", v.max_tokens},   {"stop_token_ids", v.stop_token_ids}, {"ignore_eos", v.ignore_eos},
           {"top_logprobs", v.top_logprobs}};
  if (v.seed) j["seed"] = *v.seed;
}
void from_json(const json& j, SamplingParams& v) {
  expect_object(j, "params");
  opt(j, "temperature", v.temperature);
  opt(j, "top_p", v.top_p);
  opt(j, "top_k", v.top_k);
  opt(j, "max_tokens", v.max_tokens);
  opt(j, "stop_token_ids", v.stop_token_ids);
  opt(j, "ignore_eos", v.ignore_eos);
  opt(j, "top_logprobs", v.top_logprobs);
  if (auto it = j.find("seed"); it != j.end() && !it->is_null()) v.seed = it->get<uint64_t>();
}

void to_json(json& j, const GenerateRequest& v) { j = json{{"id", v.id}, {"prompt", v.prompt}, {"params", v.params}}; }
void from_json(const json& j, GenerateRequest& v) {
  expect_object(j, "generate");
  req(j, "id", v.id);
  req(j, "prompt", v.prompt);
  opt(j, "params", v.params);
}

void to_json(json& j, const Cancel& v) { j = json{{"id", v.id}}; }
void from_json(const json& j, Cancel& v) {
  expect_object(j, "cancel");
  req(j, "id", v.id);
}

void to_json(json& j, const TokenLogprob& v) { j = json{{"token", v.token}, {"logprob", v.logprob}, {"top", v.top}}; }
void from_json(const json& j, TokenLogprob& v) {
  expect_object(j, "logprob");
  req(j, "token", v.token);
  req(j, "logprob", v.logprob);
  opt(j, "top", v.top);
}

void to_json(json& j, const TokenEvent& v) {
  j = json{{"id", v.id},
           {"tokens", v.tokens},
           {"logprobs", v.logprobs},
           {"finish_reason", v.finish_reason},
           {"error", v.error},
           {"error_code", v.error_code},
           {"prompt_tokens", v.prompt_tokens},
           {"cached_tokens", v.cached_tokens},
           {"completion_tokens", v.completion_tokens}};
}
void from_json(const json& j, TokenEvent& v) {
  expect_object(j, "tokens");
  req(j, "id", v.id);
  opt(j, "tokens", v.tokens);
  opt(j, "logprobs", v.logprobs);
  opt(j, "finish_reason", v.finish_reason);
  opt(j, "error", v.error);
  opt(j, "error_code", v.error_code);
  opt(j, "prompt_tokens", v.prompt_tokens);
  opt(j, "cached_tokens", v.cached_tokens);
  opt(j, "completion_tokens", v.completion_tokens);
}

#define BG_STATUS_FIELDS(X)                                                                                           \
  X(rank) X(phase) X(error) X(arch) X(vocab_size) X(max_model_len) X(eos_token_id) X(max_num_seqs) X(running)       \
  X(waiting) X(last_batch_size) X(last_batch_tokens) X(kv_blocks_total) X(kv_blocks_free) X(kv_block_tokens)        \
  X(kv_bytes) X(state_slots_total) X(state_slots_free) X(state_bytes) X(prompt_tokens_total)                        \
  X(generation_tokens_total) X(preemptions_total) X(steps_total) X(kv_blocks_cached) X(state_slots_cached)         \
  X(host_bytes_total) X(host_kv_bytes) X(host_state_bytes) X(seqs_offloaded) X(prefix_cache_lookups_total)          \
  X(prefix_cache_hits_total) X(prefix_cache_lookup_tokens_total) X(prefix_cache_hit_tokens_total) X(offloads_total) \
  X(restores_total) X(kv_bytes_used) X(state_bytes_used) X(rotations_total) X(expert_copies_total)                 \
  X(expert_pool_hits_total) X(expert_bytes_copied_total) X(expert_prefetches_total) X(expert_prefetch_hits_total)   \
  X(longest_seq_tokens) X(longest_seq_gpu_bytes)

void to_json(json& j, const WorkerStatus& v) {
  j = json::object();
#define BG_PUT(f) j[#f] = v.f;
  BG_STATUS_FIELDS(BG_PUT)
#undef BG_PUT
}
void from_json(const json& j, WorkerStatus& v) {
  expect_object(j, "status");
#define BG_GET(f) opt(j, #f, v.f);
  BG_STATUS_FIELDS(BG_GET)
#undef BG_GET
}
#undef BG_STATUS_FIELDS

std::string encode(const std::string& type, const json& body) {
  json m = body.is_null() ? json::object() : body;
  BG_CHECK(m.is_object(), "protocol: body of '{}' must be a map", type);
  m["type"] = type;
  std::vector<uint8_t> bytes = json::to_msgpack(m);
  return std::string(bytes.begin(), bytes.end());
}

Message decode(std::span<const std::byte> frame) {
  json m;
  try {
    m = json::from_msgpack(reinterpret_cast<const uint8_t*>(frame.data()),
                           reinterpret_cast<const uint8_t*>(frame.data()) + frame.size());
  } catch (const json::exception& e) {
    fail("protocol: malformed message ({} bytes): {}", frame.size(), e.what());
  }
  BG_CHECK(m.is_object(), "protocol: message is not a map");
  auto it = m.find("type");
  BG_CHECK(it != m.end() && it->is_string(), "protocol: message has no string 'type'");
  Message out;
  out.type = it->get<std::string>();
  m.erase("type");
  out.body = std::move(m);
  return out;
}

void throw_bad_body(const std::string& type, const char* what) {
  fail("protocol: bad '{}' message: {}", type, what);
}

}  // namespace bg::proto
