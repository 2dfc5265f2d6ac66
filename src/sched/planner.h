// Memory planner: from a checkpoint's config.json and a memory budget, how many sequences (KDA state slots), how many
// MLA KV blocks and which max_model_len one worker runs with. Pure arithmetic over ModelGeometry + PlannerInput.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include "dist/parallel_layout.h"
#include "kv/state_manager.h"
#include "model/model.h"
#include "model/rank_share.h"

namespace bg::sched {

// What the planner needs to know about a checkpoint (read from config.json and the shard sizes, no weights loaded).
struct ModelGeometry {
  std::string arch;                     // "deepseek_v3" | "kimi_k3"
  StateGeometry state;                  // kv::state_geometry of the config: what the loaded model reports too
  int64_t max_position_embeddings = 0;
  int64_t weight_bytes = 0;             // the weights this rank holds (one rank: the *.safetensors files)
  RankWeightBytes weight_share;         // several ranks: its experts / TP share / replicated parts
};

// Reads `dir`/config.json (deepseek_v3 / kimi_k2 / kimi_k3) and sizes the shards; as one rank of a set, the KDA
// state holds this rank's heads only and the weights are its share (rank_share.h). With resident_experts below 1
// the experts count as the resident ones plus the streamed-expert pool, `pool_copies` times for MXFP4 experts
// (resident_expert_bytes: 2 for the CUDA backend). Throws bg::Error.
ModelGeometry read_model_geometry(const std::filesystem::path& dir, const dist::RankPlace& place = {},
                                  double resident_experts = 1.0, int pool_copies = 1);

// Device memory as seen before loading: bytes free and total (host RAM for "cpu").
struct DeviceMemory {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
};
// Probes memory of a device ("cpu" | "cuda"). Replaceable in tests.
using MemoryProbe = std::function<DeviceMemory(const std::string& device)>;
// The real probe: sysconf for "cpu", cudaMemGetInfo for "cuda" (an error in a build without CUDA).
DeviceMemory probe_device_memory(const std::string& device);

struct PlannerInput {
  std::string device = "cpu";            // "cpu" | "cuda"
  int64_t kv_block_size = 64;            // tokens per KV block
  int64_t max_num_seqs = 0;              // 0: 16 on cpu, 256 on cuda; an upper bound lowered to what fits
  int64_t max_model_len = 0;             // 0: max_position_embeddings capped by memory
  int64_t kv_cache_memory_bytes = 0;     // > 0: the KV + state budget, exactly (overrides the two below)
  double gpu_memory_utilization = 0.9;   // cuda: fraction of free device memory for weights + KV + state
                                         // + the step's activations
  int64_t activation_reserve_bytes = 0;  // cuda: device memory the largest step needs beyond the weights and the
                                         // pools (measured by the worker's profile step), kept out of the budget
  int64_t ranks_per_device = 1;          // cuda: ranks sharing this rank's GPU (ll rank sets); each plans with at
                                         // most total / ranks_per_device of it, whatever the others hold yet
  int64_t cpu_budget_bytes = int64_t{2} << 30;  // cpu: at most this, and at most a quarter of RAM
  int64_t host_memory_bytes = 0;         // the host tier (pinned on cuda); 0: none
  bool prefix_cache = true;
  int64_t snapshot_interval = 0;         // tokens between KDA snapshots; 0: the default (kDefaultSnapshotInterval,
                                         // rounded up to a multiple of the KV block size)
  kv::StateCodec state_codec = kv::StateCodec::kF32;
  bool deterministic = false;            // --deterministic: batch-invariant kernels, prefix hits on the prefill grid
};

inline constexpr int64_t kDefaultSnapshotInterval = 512;

inline constexpr int64_t kDefaultMaxNumSeqsCpu = 16;
// Each pool keeps this many units (a KV block, a state slot) that no sequence owns, for padding batch entries.
inline constexpr int64_t kPoolPadding = 1;
inline constexpr int64_t kDefaultMaxNumSeqsCuda = 256;

struct Plan {
  std::string device;
  int64_t act_bytes = 4;                 // bytes per cached value: 4 (fp32) on cpu, 2 (bf16) on cuda
  int64_t kv_bytes_per_token = 0;        // n_mla_layers x entry_dim x act_bytes
  int64_t state_bytes_per_seq = 0;       // KdaStateGeometry::slot_words(act_bytes) x 4
  int64_t budget_bytes = 0;              // KV + state
  int64_t activation_reserve_bytes = 0;  // kept for the step's activations (PlannerInput)
  int64_t max_num_seqs = 0;
  int64_t max_model_len = 0;
  int64_t kv_block_size = 0;
  int64_t kv_blocks = 0;                 // the running sequences' + cache_blocks
  int64_t state_slots = 0;               // max_num_seqs + cache_slots with KDA layers, 0 without
  int64_t cache_blocks = 0;              // of kv_blocks: room the prefix cache keeps beyond the running sequences
  int64_t cache_slots = 0;               // of state_slots: room for KDA snapshots
  int64_t host_bytes = 0;                // host tier
  bool prefix_cache = true;
  int64_t snapshot_interval = 0;
  kv::StateCodec state_codec = kv::StateCodec::kF32;
  bool deterministic = false;

  // Bytes of pools holding n_slots state slots and n_blocks KV blocks for sequences, padding included.
  int64_t pool_bytes(int64_t n_slots, int64_t n_blocks) const;
  int64_t kv_bytes() const { return pool_bytes(0, kv_blocks); }
  int64_t state_bytes() const { return pool_bytes(state_slots, 0) - pool_bytes(0, 0); }
  int64_t weight_bytes = 0;              // this rank's weights (from the geometry)
  LoadOptions load_options() const;      // device, deterministic
  // What the engine's kv::StateManager is built with; deterministic: prefix hits resume at multiples of the snapshot
  // interval, where the uncached prefill also cut (StatePlan::resume_align_tokens).
  kv::StatePlan state_plan() const;
  std::string describe() const;          // one log line
  // KV blocks for running sequences (kv_blocks less the prefix cache's own room).
  int64_t running_kv_blocks() const { return kv_blocks - cache_blocks; }
  // Adopts the rank set's agreement (the minimum over every rank's plan): sequences, running sequences' KV blocks,
  // max_model_len.
  void agree(int64_t n_seqs, int64_t n_kv_blocks, int64_t model_len);
};

// The plan for `geo` within the budget; throws bg::Error when one sequence of max_model_len does not fit, when
// --max-model-len exceeds the model's context, or when an input is out of range.
Plan make_plan(const ModelGeometry& geo, const PlannerInput& in, const MemoryProbe& probe = probe_device_memory);

// The KV + state budget for `in` on a device with `mem` (see PlannerInput); throws when nothing is left.
int64_t memory_budget_bytes(const ModelGeometry& geo, const PlannerInput& in, const DeviceMemory& mem);

}  // namespace bg::sched
