// Memory planner arithmetic (docs/SERVING_ENGINE.md "Planner"): bytes per KV token and per state slot, the budget,
// and the split of the budget into state slots and KV blocks.
#include "sched/planner.h"

#include <unistd.h>

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "core/log.h"
#include "formats/json_fields.h"
#include "formats/kimi_k3_config.h"
#include "formats/model_config.h"

#ifdef BG_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace bg::sched {
namespace {

int64_t checkpoint_bytes(const std::filesystem::path& dir) {
  int64_t total = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const bool store_segment = entry.path().filename().string().rfind("store-seg-", 0) == 0;  // batchgen convert
    if (entry.is_regular_file() && (entry.path().extension() == ".safetensors" || store_segment)) {
      total += static_cast<int64_t>(entry.file_size());
    }
  }
  return total;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

double gib(int64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(int64_t{1} << 30); }

void validate_input(const PlannerInput& in) {
  BG_CHECK(in.device == "cpu" || in.device == "cuda", "--device '{}' must be cpu or cuda", in.device);
  BG_CHECK(in.kv_block_size >= 1, "KV block size {} must be >= 1", in.kv_block_size);
  BG_CHECK(in.max_num_seqs >= 0, "--max-num-seqs {} must be >= 1", in.max_num_seqs);
  BG_CHECK(in.max_model_len >= 0, "--max-model-len {} must be >= 1", in.max_model_len);
  BG_CHECK(in.kv_cache_memory_bytes >= 0, "--kv-cache-memory-bytes {} must be > 0", in.kv_cache_memory_bytes);
  BG_CHECK(in.activation_reserve_bytes >= 0, "planner: a negative activation reserve ({})",
           in.activation_reserve_bytes);
  BG_CHECK(in.gpu_memory_utilization > 0.0 && in.gpu_memory_utilization <= 1.0,
           "--gpu-memory-utilization {} must be in (0, 1]", in.gpu_memory_utilization);
  BG_CHECK(in.cpu_budget_bytes > 0, "cpu memory budget {} must be > 0", in.cpu_budget_bytes);
  BG_CHECK(in.host_memory_bytes >= 0, "--host-memory-gb must be >= 0");
  BG_CHECK(in.snapshot_interval >= 0, "--prefix-snapshot-interval {} must be >= 1", in.snapshot_interval);
}

// The host tier must fit in the machine's RAM next to what the worker keeps there anyway (cpu: the KV budget).
void check_host_tier(const PlannerInput& in, int64_t budget_bytes, const MemoryProbe& probe) {
  if (in.host_memory_bytes == 0) return;
  const DeviceMemory ram = probe("cpu");
  const int64_t resident = in.device == "cpu" ? budget_bytes : 0;
  BG_CHECK(in.host_memory_bytes + resident <= ram.total_bytes, "--host-memory-gb {:.2f} does not fit in this "
           "machine's {:.2f} GiB of RAM{}", gib(in.host_memory_bytes), gib(ram.total_bytes),
           resident > 0 ? fmt::format(" next to the {:.2f} GiB KV budget", gib(resident)) : std::string());
}

}  // namespace

ModelGeometry read_model_geometry(const std::filesystem::path& dir, const dist::RankPlace& place,
                                  double resident_experts, int pool_copies) {
  BG_CHECK(std::filesystem::is_directory(dir), "model directory '{}' does not exist", dir.string());
  const auto path = dir / "config.json";
  const auto config = read_json_file(path);
  ModelGeometry g;
  switch (detect_arch(config, path.string())) {
    case Arch::kDeepseekV3: {
      DeepseekV3Config c = parse_deepseek_v3_config(config, path.string());
      g.arch = "deepseek_v3";
      g.state = state_geometry(c);
      g.max_position_embeddings = c.max_position_embeddings;
      break;
    }
    case Arch::kKimiK3: {
      KimiK3Config c = parse_kimi_k3_config(config, path.string());
      g.arch = "kimi_k3";
      g.state = state_geometry(c);
      g.max_position_embeddings = c.max_position_embeddings;
      break;
    }
  }
  g.weight_bytes = checkpoint_bytes(dir);
  if (place.layout.multi_rank()) {
    g.state = tp_state_geometry(g.state, place.layout.tp());  // each TP rank keeps the state of its own heads
  }
  if (place.layout.multi_rank() || resident_experts < 1.0) {
    g.weight_share = rank_weight_bytes(dir, place);
    g.weight_share.experts = resident_expert_bytes(g.weight_share, resident_experts, pool_copies);
    g.weight_bytes = g.weight_share.total();
  }
  return g;
}

DeviceMemory probe_device_memory(const std::string& device) {
  if (device == "cpu") {
    const int64_t page = sysconf(_SC_PAGESIZE);
    return {sysconf(_SC_AVPHYS_PAGES) * page, sysconf(_SC_PHYS_PAGES) * page};
  }
  BG_CHECK(device == "cuda", "--device '{}' must be cpu or cuda", device);
#ifdef BG_HAVE_CUDA
  size_t free_bytes = 0, total_bytes = 0;
  cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes);
  BG_CHECK(err == cudaSuccess, "planner: cudaMemGetInfo failed: {}", cudaGetErrorString(err));
  return {static_cast<int64_t>(free_bytes), static_cast<int64_t>(total_bytes)};
#else
  fail("--device cuda: this batchgen was built without CUDA (configure with -DBG_CUDA=ON)");
#endif
}

int64_t memory_budget_bytes(const ModelGeometry& geo, const PlannerInput& in, const DeviceMemory& mem) {
  if (in.kv_cache_memory_bytes > 0) return in.kv_cache_memory_bytes;
  if (in.device == "cpu") {
    // Weights are mmap'd (page cache), so the budget only covers the pools: a fixed cap, at most a quarter of RAM.
    const int64_t budget = std::min(in.cpu_budget_bytes, mem.total_bytes / 4);
    BG_CHECK(budget > 0, "planner: no host memory for the KV cache ({} bytes of RAM)", mem.total_bytes);
    return budget;
  }
  // Ranks sharing one GPU start together and each would see it empty: each takes its share of the total at most.
  const int64_t share = std::min(mem.free_bytes, mem.total_bytes / std::max<int64_t>(in.ranks_per_device, 1));
  const auto usable = static_cast<int64_t>(static_cast<double>(share) * in.gpu_memory_utilization);
  const int64_t budget = usable - geo.weight_bytes - in.activation_reserve_bytes;
  BG_CHECK(budget > 0, "planner: the weights ({:.2f} GiB) and the largest step's activations ({:.2f} GiB) leave "
           "nothing of {:.2f} GiB ({} x {:.2f} GiB free) for the KV cache; raise --gpu-memory-utilization, lower "
           "--idle-prefill-size / --chunked-prefill-size or use more GPUs", gib(geo.weight_bytes),
           gib(in.activation_reserve_bytes), gib(usable), in.gpu_memory_utilization, gib(share));
  return budget;
}

namespace {

// The prefix cache's own room: budget the running sequences leave unused, at most as much again as they take, in
// units of one snapshot interval (its KV blocks and, with KDA layers, one snapshot slot). Without it every snapshot
// would evict another as soon as the running sequences hold all slots. Cached entries are evicted on demand, so the
// sequences can still use this room.
void plan_cache_share(Plan& p, int64_t block_size) {
  const int64_t used = p.pool_bytes(p.state_slots, p.kv_blocks);
  const int64_t share = std::min(p.budget_bytes - used, used - p.pool_bytes(0, 0));
  const int64_t unit_blocks = p.state_bytes_per_seq > 0 ? p.snapshot_interval / block_size : 1;
  const int64_t unit_bytes = p.state_bytes_per_seq + unit_blocks * block_size * p.kv_bytes_per_token;
  const int64_t units = std::max<int64_t>(share, 0) / unit_bytes;
  p.cache_blocks = units * unit_blocks;
  p.cache_slots = p.state_bytes_per_seq > 0 ? units : 0;
  p.kv_blocks += p.cache_blocks;
  p.state_slots += p.cache_slots;
}

}  // namespace

Plan make_plan(const ModelGeometry& geo, const PlannerInput& in, const MemoryProbe& probe) {
  validate_input(in);
  BG_CHECK(geo.state.n_mla_layers > 0 && geo.state.entry_dim() > 0, "planner: model has no MLA KV cache ({} layers "
           "x {})", geo.state.n_mla_layers, geo.state.entry_dim());
  Plan p;
  p.device = in.device;
  p.act_bytes = in.device == "cpu" ? 4 : 2;
  p.kv_bytes_per_token = geo.state.kv_bytes_per_token(p.act_bytes);
  p.state_bytes_per_seq = geo.state.state_bytes_per_seq(p.act_bytes);
  p.kv_block_size = in.kv_block_size;
  p.weight_bytes = geo.weight_bytes;
  p.budget_bytes = memory_budget_bytes(geo, in, in.kv_cache_memory_bytes > 0 ? DeviceMemory{} : probe(in.device));
  p.activation_reserve_bytes = in.kv_cache_memory_bytes > 0 || in.device == "cpu" ? 0 : in.activation_reserve_bytes;
  check_host_tier(in, p.budget_bytes, probe);
  p.host_bytes = in.host_memory_bytes;
  p.prefix_cache = in.prefix_cache;
  p.deterministic = in.deterministic;
  p.state_codec = in.state_codec;
  // Snapshots sit on block boundaries and KDA chunk boundaries.
  const int64_t unit = std::lcm(in.kv_block_size, geo.state.prefill_align_tokens);
  p.snapshot_interval =
      in.snapshot_interval > 0 ? in.snapshot_interval : ceil_div(kDefaultSnapshotInterval, unit) * unit;
  BG_CHECK(!geo.state.has_state() || p.snapshot_interval % unit == 0, "--prefix-snapshot-interval {} must be a "
           "multiple of {} (the KV block size {} and the KDA chunk {})", p.snapshot_interval, unit, in.kv_block_size,
           geo.state.prefill_align_tokens);
  const int64_t block_bytes = in.kv_block_size * p.kv_bytes_per_token;

  // max_model_len: as asked (within the model's context), else the context capped by what one sequence can hold.
  if (in.max_model_len > 0) {
    BG_CHECK(in.max_model_len <= geo.max_position_embeddings, "--max-model-len {} exceeds the model's context "
             "(max_position_embeddings {})", in.max_model_len, geo.max_position_embeddings);
    p.max_model_len = in.max_model_len;
  } else {
    const int64_t fit_blocks = (p.budget_bytes - p.pool_bytes(1, 0)) / block_bytes;
    p.max_model_len = std::min(geo.max_position_embeddings, std::max<int64_t>(fit_blocks, 0) * in.kv_block_size);
  }
  const int64_t blocks_per_seq = ceil_div(std::max<int64_t>(p.max_model_len, 1), in.kv_block_size);
  const int64_t one_seq_bytes = p.pool_bytes(1, blocks_per_seq);
  BG_CHECK(p.max_model_len >= 1 && one_seq_bytes <= p.budget_bytes,
           "planner: one sequence of {} tokens needs {:.3f} GiB ({} B state + {} B/token KV) but the KV budget is "
           "{:.3f} GiB; lower --max-model-len or raise --kv-cache-memory-bytes / --gpu-memory-utilization",
           std::max<int64_t>(p.max_model_len, in.kv_block_size), gib(one_seq_bytes), p.state_bytes_per_seq,
           p.kv_bytes_per_token, gib(p.budget_bytes));

  // Sequences: as many as asked while state slots still leave room for one full-length sequence's KV.
  const int64_t asked = in.max_num_seqs > 0 ? in.max_num_seqs
                                            : (in.device == "cpu" ? kDefaultMaxNumSeqsCpu : kDefaultMaxNumSeqsCuda);
  p.max_num_seqs = asked;
  if (p.state_bytes_per_seq > 0) {
    const int64_t fit = (p.budget_bytes - p.pool_bytes(0, blocks_per_seq)) / p.state_bytes_per_seq - kPoolPadding;
    p.max_num_seqs = std::min(asked, fit);
    if (p.max_num_seqs < asked) {
      log::warn("planner: state slots for only {} sequences fit in the KV budget; max-num-seqs lowered from {}",
                p.max_num_seqs, asked);
    }
    p.state_slots = p.max_num_seqs;
  }
  // KV blocks: the rest of the budget, but never more than every sequence at full length needs.
  p.kv_blocks = std::min((p.budget_bytes - p.state_bytes()) / block_bytes - kPoolPadding,
                         p.max_num_seqs * blocks_per_seq);
  if (p.prefix_cache) plan_cache_share(p, in.kv_block_size);
  return p;
}

int64_t Plan::pool_bytes(int64_t n_slots, int64_t n_blocks) const {
  const int64_t slots = state_bytes_per_seq > 0 && n_slots > 0 ? n_slots + kPoolPadding : 0;
  return slots * state_bytes_per_seq + (n_blocks + kPoolPadding) * kv_block_size * kv_bytes_per_token;
}

LoadOptions Plan::load_options() const {
  LoadOptions o;
  o.device = device;
  o.deterministic = deterministic;
  return o;
}

kv::StatePlan Plan::state_plan() const {
  kv::StatePlan s;
  s.kv_block_tokens = kv_block_size;
  s.kv_blocks = kv_blocks;
  s.state_slots = state_slots;
  s.host_bytes = host_bytes;
  s.prefix_cache = prefix_cache;
  s.snapshot_interval = snapshot_interval;
  s.state_codec = state_codec;
  if (deterministic) s.resume_align_tokens = s.snapshot_interval;
  return s;
}

std::string Plan::describe() const {
  return fmt::format("planner ({}): weights {:.3f} GiB on this rank; step activations {:.3f} GiB; KV + state budget "
                     "{:.3f} GiB -> {} sequences (state {} B each), {} KV blocks x {} tokens ({} B/token, {:.3f} GiB), "
                     "max_model_len {}; host tier {:.3f} GiB; prefix cache {} (its own room: {} blocks, {} slots){}",
                     device, gib(weight_bytes), gib(activation_reserve_bytes), gib(budget_bytes), max_num_seqs,
                     state_bytes_per_seq, kv_blocks, kv_block_size,
                     kv_bytes_per_token, gib(kv_bytes()), max_model_len, gib(host_bytes), prefix_cache ? "on" : "off",
                     cache_blocks, cache_slots,
                     prefix_cache && state_bytes_per_seq > 0
                         ? fmt::format(" (KDA snapshots every {} tokens)", snapshot_interval) : std::string());
}

// The set agrees on the running sequences' room (the prefix cache's own room stays this rank's: with TP, where ranks
// mirror their leader's pools, the cache is off and that room is 0).
void Plan::agree(int64_t n_seqs, int64_t n_kv_blocks, int64_t model_len) {
  BG_CHECK(n_seqs >= 1 && n_kv_blocks >= 1 && model_len >= 1 && n_seqs <= max_num_seqs &&
               n_kv_blocks <= running_kv_blocks() && model_len <= max_model_len,
           "planner: the rank set agreed on {} sequences, {} KV blocks, max_model_len {}, beyond this rank's plan",
           n_seqs, n_kv_blocks, model_len);
  max_num_seqs = n_seqs;
  kv_blocks = n_kv_blocks + cache_blocks;
  max_model_len = model_len;
  if (state_slots > 0) state_slots = n_seqs + cache_slots;
}

}  // namespace bg::sched
