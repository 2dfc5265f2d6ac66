// The engine's view of a model: load a checkpoint directory, make sequences, run tokens through them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kv/sequence.h"

namespace bg::dist {
struct RankContext;
}

namespace bg {

struct ModelInfo {
  std::string arch;  // "deepseek_v3" | "kimi_k3"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t n_layers = 0;
  int64_t max_position_embeddings = 0;
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;
};

// Named intermediate values ("layer" after decoder layer l, "final_norm", ...) for layer-by-layer diffs.
// data: [n_tokens, dim] fp32, valid during the call.
using TapFn = std::function<void(std::string_view name, int64_t layer, const float* data, int64_t n_tokens,
                                 int64_t dim)>;

struct LoadOptions {
  int64_t max_sequences = 4;      // sequences alive at once (pool slots)
  int64_t max_total_tokens = 0;   // KV capacity in tokens over all sequences (0: max_sequences x max positions)
  int64_t kv_block_size = 64;     // tokens per MLA cache block
  std::string device = "cpu";     // "cpu" | "cuda"
  bool cuda_graphs = true;        // CUDA: replay decode steps (forward_batch, one token per sequence) as graphs
  int64_t max_graph_batch = 64;   // largest decode batch run as a graph (a power of two; larger runs eagerly)
  // One rank of a set (null: a single rank). The model loads its share of the weights, runs tensor-parallel
  // attention over ranks->tp and the expert exchange over ranks->world, and agrees every step with the other ranks.
  std::shared_ptr<dist::RankContext> ranks = nullptr;
};

// One sequence's part of a batched step: `tokens` run after what `seq` already holds (a prefill chunk or one decode
// token). Sequences in one batch are distinct.
struct BatchEntry {
  Sequence* seq = nullptr;
  std::span<const int32_t> tokens;
};

// What the sequence pools hold now (for admission, preemption and /metrics).
struct MemoryUsage {
  int64_t kv_block_tokens = 0;   // tokens per MLA KV block
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_free = 0;
  int64_t kv_bytes = 0;          // whole KV pool
  int64_t state_slots_total = 0; // KDA state slots (0 without KDA layers)
  int64_t state_slots_free = 0;
  int64_t state_bytes = 0;       // whole state pool
};

// Diagnostic hook on every MoE layer's routing: sees the router's ids [n_tokens, top_k] and weights [n_tokens, top_k]
// and may replace them (return true to apply the changed values). Used to compare the bf16 GPU path with the fp32
// reference under the same expert choices, which near-tied routers would otherwise flip. Synchronises once per MoE
// layer; never set while serving.
using RouteHook = std::function<bool(int64_t layer, int64_t n_tokens, int64_t top_k, std::vector<int32_t>& ids,
                                     std::vector<float>& weights)>;

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelInfo& info() const = 0;
  // A new empty sequence; throws when the pools are full.
  virtual std::unique_ptr<Sequence> new_sequence() = 0;
  // Runs `tokens` after what `seq` already holds (prefill of any length, or one decode step) and writes logits
  // [tokens.size(), vocab] (every row). Throws on invalid ids or when the context would exceed the model's limit.
  virtual void forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* tap = nullptr) = 0;
  // One step over several sequences; writes only each entry's last-token logits: [batch.size(), vocab]. Results equal
  // running each entry alone through forward(). Entries with empty tokens are not allowed.
  virtual void forward_batch(std::span<const BatchEntry> batch, float* last_logits);
  virtual MemoryUsage memory_usage() const = 0;
  // Benchmarks only (`batchgen bench`): makes the empty sequence `seq` look as if it had processed n_tokens tokens
  // without running them — its KV blocks and KDA state filled with seeded random values, n_past = n_tokens — so
  // decode steps at long contexts can be timed without prefilling (model/fabricate_context.h). The default throws.
  virtual void fabricate_context(Sequence& seq, int64_t n_tokens, uint64_t seed);
  // Benchmarks: attaches a per-op profiler to the model's backend (backend.h OpProfiler; not owned, null detaches).
  // The default throws.
  virtual void set_op_profiler(OpProfiler* profiler);
  void set_route_hook(RouteHook hook) { route_hook_ = std::move(hook); }
  // CUDA graphs captured for decode steps so far (0 on the CPU or with graphs off).
  virtual int64_t n_graphs_captured() const { return 0; }
  // True when this model is one rank of a set: forward / forward_batch are collectives (every rank must step
  // together; a rank without work calls sync_idle), and a failed step cannot be retried alone.
  virtual bool collective() const { return false; }
  // A rank with nothing to run takes part in the next step agreement: runs an empty step (padding only) when another
  // rank has work, nothing when none has. stop = true votes to end the set. Returns false once any rank voted stop.
  // Single rank: returns !stop.
  virtual bool sync_idle(bool stop) { return !stop; }

 protected:
  RouteHook route_hook_;
};

// Reads config.json, picks the architecture, binds and validates every tensor.
std::unique_ptr<Model> load_model(const std::filesystem::path& dir, const LoadOptions& options = {});

}  // namespace bg
