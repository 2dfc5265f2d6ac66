// The engine's view of a model: load a checkpoint directory, run tokens through sequences whose state a
// kv::StateManager holds (the model reads the pools its sequences point to and owns none).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "kv/sequence.h"
#include "model/arch_table.h"
#include "kv/state_geometry.h"
#include "kv/state_manager.h"

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
  std::string device = "cpu";     // "cpu" | "cuda"
  bool cuda_graphs = true;        // CUDA: replay decode steps (forward_batch, one token per sequence) as graphs
  int64_t max_graph_batch = 64;   // largest decode batch run as a graph (a power of two; larger runs eagerly)
  // One rank of a set (null: a single rank). The model loads its share of the weights, runs tensor-parallel
  // attention over ranks->tp and the expert exchange over ranks->world, and agrees every step with the other ranks.
  std::shared_ptr<dist::RankContext> ranks = nullptr;
  std::string weight_store = "";           // attach to this weightd store instead of reading the files (docs/WEIGHTS.md)
  std::string distributed_weight_config = "";  // fetch what the node lacks from the peers this config names
  bool deterministic = false;  // batch-invariant kernels (BackendOptions::deterministic, docs/DETERMINISM.md)
  bool background_plans = false;  // BackendOptions::background_plans (a serving worker sets it)
  // Fraction of each MoE layer's experts (on this rank) kept in backend memory; the others stream from host memory
  // when routed (docs/WEIGHTS.md, "Streamed experts"). expert_trace: routing counts that pick the resident ones.
  double resident_experts = 1.0;
  std::string expert_trace = "";
};

// One sequence's part of a batched step: `tokens` run after what `seq` already holds (a prefill chunk or one decode
// token), with KV reserved for them (kv::StateManager::reserve). Sequences in one batch are distinct and belong to
// the same kv::StateManager.
struct BatchEntry {
  Sequence* seq = nullptr;
  std::span<const int32_t> tokens;
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
  // The shape of one sequence's state (kv::state_geometry of the config); a kv::StateManager for this model is
  // built from it over backend().
  virtual const StateGeometry& state_geometry() const = 0;
  virtual Backend& backend() const = 0;
  // Runs `tokens` after what `seq` already holds (prefill of any length, or one decode step) and writes logits
  // [tokens.size(), vocab] (every row). Throws on invalid ids or when the context would exceed the model's limit.
  virtual void forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* tap = nullptr) = 0;
  // One step over several sequences; writes only each entry's last-token logits: [batch.size(), vocab]. Results equal
  // running each entry alone through forward(). Entries with empty tokens are not allowed.
  virtual void forward_batch(std::span<const BatchEntry> batch, float* last_logits);
  // forward_batch's step, then its sampling: out[i] for rows[i] (rows[i].row is a batch index) by Backend::sample_rows,
  // so on CUDA only the ids, finite flags and asked-for logprobs leave the device. The default (models without a
  // backend step, e.g. test fakes) runs forward_batch into host memory and then ops::sample_rows_cpu.
  virtual void forward_batch_sample(std::span<const BatchEntry> batch, std::span<const ops::RowSampling> rows,
                                    std::span<ops::RowSample> out);
  void set_route_hook(RouteHook hook) { route_hook_ = std::move(hook); }
  // CUDA graphs captured for decode steps so far (0 on the CPU or with graphs off).
  virtual int64_t n_graphs_captured() const { return 0; }
  // Streamed experts (LoadOptions::resident_experts < 1) since load: experts copied into the pool, routed streamed
  // experts found already there, bytes copied. All 0 when every expert is resident.
  struct ExpertStreamCounters {
    int64_t copies = 0, hits = 0, bytes_copied = 0, prefetches = 0, prefetch_hits = 0;
  };
  virtual ExpertStreamCounters expert_stream_counters() const { return {}; }
  // True when this model is one rank of a set: forward / forward_batch are collectives (every rank must step
  // together; a rank without work calls sync_idle), and a failed step cannot be retried alone.
  virtual bool collective() const { return false; }
  // A rank with nothing to run takes part in the next step agreement: runs an empty step (padding only) when another
  // rank has work, nothing when none has. stop = true votes to end the set. Returns false once any rank voted stop.
  // Single rank: returns !stop. `pools`: this rank's (kv::StateManager::step_pools), where an empty step's padding
  // entries write.
  virtual bool sync_idle(bool stop, const StepPools& pools) {
    (void)pools;
    return !stop;
  }

 protected:
  RouteHook route_hook_;
};

// Reads config.json, picks the architecture, binds and validates every tensor.
std::unique_ptr<Model> load_model(const std::filesystem::path& dir, const LoadOptions& options = {});

// How a model binds its weights for `options`: the W4A16 expert blocks of a weight store built with --expert-layout
// w4a16 are bound deferred, so only what a rank uses is ever unpacked (its resident experts when prepared, a
// streamed one when first copied); on CUDA with BG_STORE_W4A16_DIRECT=1 the blocks go to the GPU as they are
// (docs/WEIGHTS.md; not yet run on a GPU).
BindOptions bind_options(const LoadOptions& options);

// State for running sequences of `model` by hand (tools, tests; the engine builds its own from the planner):
// `max_sequences` state slots and KV blocks for `max_tokens` tokens over all of them, no prefix cache, no host tier.
// Destroy its sequences before it, and it before the model.
std::unique_ptr<kv::StateManager> make_state(Model& model, int64_t max_sequences, int64_t max_tokens);

}  // namespace bg
