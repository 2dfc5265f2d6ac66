// MLA decode plan (head groups, partitions, workspace layout) and the host model of the device schedule.
#include "ops/mla/mla_decode_plan.h"

#include <algorithm>
#include <cmath>

#include "core/env.h"
#include "core/error.h"

namespace bg::ops {
namespace {

size_t align_up(size_t bytes, size_t alignment) { return (bytes + alignment - 1) / alignment * alignment; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The token-aligned schedule into s (tile_prefix, total_tiles and n_used set) when it pays; s untouched otherwise.
// The same arithmetic as the prep kernel's write_aligned_schedule (mla_decode_cuda.cu).
bool aligned_schedule(const MlaDecodePlan& plan, MlaDecodeSchedule& s) {
  const auto n = static_cast<int64_t>(s.n_splits.size());
  const int64_t total = s.total_tiles, n_used = s.n_used;
  std::vector<int32_t> home(static_cast<size_t>(n)), begin;
  int64_t n_split_even = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t lo = s.tile_prefix[static_cast<size_t>(t)], hi = s.tile_prefix[static_cast<size_t>(t) + 1];
    n_split_even += mla_partition_of(hi - 1, total, n_used) > mla_partition_of(lo, total, n_used) ? 1 : 0;
    home[static_cast<size_t>(t)] = static_cast<int32_t>(mla_home_partition(lo, hi, total, n_used));
  }
  int64_t t = 0, max_aligned = 0;
  for (int64_t g = 0; g <= plan.n_partitions; ++g) {
    while (t < n && home[static_cast<size_t>(t)] < g) ++t;
    begin.push_back(t < n ? s.tile_prefix[static_cast<size_t>(t)] : static_cast<int32_t>(total));
    if (g > 0 && g <= n_used) max_aligned = std::max<int64_t>(max_aligned, begin[g] - begin[g - 1]);
  }
  if (!mla_aligned_schedule_pays(max_aligned, total, n_used, n_split_even)) return false;
  s.aligned = true;
  s.n_splits.assign(static_cast<size_t>(n), 1);
  s.slot_base.assign(static_cast<size_t>(n), 0);
  s.first_partition = home;
  s.partition_begin = std::move(begin);
  return true;
}

}  // namespace

const char* mla_decode_mma_name(MlaDecodeMma mma) {
  switch (mma) {
    case MlaDecodeMma::kWgmma: return "wgmma";
    case MlaDecodeMma::kWgmmaHeadsM: return "wgmma-heads-m";
    case MlaDecodeMma::kMmaSync: break;
  }
  return "mma.sync";
}

MlaDecodeMma mla_decode_mma_from_env() {
  switch (env_choice("BG_MLA_DECODE", {"wgmma", "heads_m", "mmasync"})) {
    case 0: return MlaDecodeMma::kWgmma;
    case 1: return MlaDecodeMma::kWgmmaHeadsM;
    case 2: return MlaDecodeMma::kMmaSync;
    default: return MlaDecodeOptions{}.mma;
  }
}

bool mla_decode_align_from_env() { return env_switch("BG_MLA_DECODE_ALIGN", MlaDecodeOptions{}.align_tokens); }

bool mla_decode_takes(const MlaParams& p) {
  return p.kv_lora_rank == kMlaDecodeLora && p.qk_rope_dim == kMlaDecodeRope;
}

MlaDecodePlan mla_decode_plan(const MlaParams& p, int64_t n_sms, const MlaDecodeOptions& options) {
  constexpr const char* op = "mla_decode_plan";
  BG_CHECK(mla_decode_takes(p), "{}: kv_lora_rank {} / qk_rope_dim {} unsupported (the decode kernel takes {} / {})", op,
           p.kv_lora_rank, p.qk_rope_dim, kMlaDecodeLora, kMlaDecodeRope);
  BG_CHECK(p.n_tokens >= 1 && p.n_tokens <= kMlaDecodeMaxTokens, "{}: n_tokens {} outside [1, {}]", op, p.n_tokens,
           kMlaDecodeMaxTokens);
  BG_CHECK(p.n_heads >= 1 && p.n_heads <= 1024, "{}: n_heads {} outside [1, 1024]", op, p.n_heads);
  BG_CHECK(p.qk_nope_dim >= 1 && p.qk_nope_dim <= 4096, "{}: qk_nope_dim {} outside [1, 4096]", op, p.qk_nope_dim);
  BG_CHECK(p.v_head_dim >= 1 && p.v_head_dim <= 4096, "{}: v_head_dim {} outside [1, 4096]", op, p.v_head_dim);
  BG_CHECK(p.block_size >= 1 && p.block_size <= (1 << 20), "{}: block_size {} outside [1, 2^20]", op, p.block_size);
  BG_CHECK(std::isfinite(p.softmax_scale) && p.softmax_scale > 0.0f, "{}: softmax_scale {} must be positive", op,
           p.softmax_scale);
  BG_CHECK(n_sms >= 1, "{}: n_sms {} must be positive", op, n_sms);
  BG_CHECK(options.n_partitions >= 0 && options.n_partitions <= 1024, "{}: n_partitions {} outside [0, 1024]", op,
           options.n_partitions);
  BG_CHECK(!options.per_token || options.n_partitions == 0, "{}: per_token takes no n_partitions (got {})", op,
           options.n_partitions);
  BG_CHECK(options.min_tiles_per_partition >= 1, "{}: min_tiles_per_partition {} must be positive", op,
           options.min_tiles_per_partition);

  MlaDecodePlan plan;
  plan.params = p;
  plan.mma = options.mma;
  // Heads per CTA: as many as shared memory allows (48), rounded up to the 16 the MMA tiling needs, spread evenly
  // over the groups (K3 96 = 2 x 48 exactly; DeepSeek 128 = 3 x 48 with 16 zero heads in the last group).
  plan.n_groups = ceil_div(p.n_heads, kMlaDecodeMaxGroupHeads);
  plan.group_heads = ceil_div(ceil_div(p.n_heads, plan.n_groups), 16) * 16;
  plan.per_token = options.per_token;
  plan.align_tokens = options.align_tokens && !options.per_token;
  if (plan.per_token) {
    plan.n_partitions = p.n_tokens;
    plan.min_tiles_per_partition = 1;
    plan.max_slots = 0;
  } else {
    plan.n_partitions = options.n_partitions > 0 ? options.n_partitions
                                                 : std::max<int64_t>(1, n_sms / plan.n_groups);
    plan.min_tiles_per_partition = options.min_tiles_per_partition;
    plan.max_slots = 2 * plan.n_partitions;
  }

  const auto n = static_cast<size_t>(p.n_tokens), h = static_cast<size_t>(p.n_heads);
  const auto slots = static_cast<size_t>(plan.max_slots), groups = static_cast<size_t>(plan.n_groups);
  const auto gh = static_cast<size_t>(plan.group_heads);
  MlaDecodeWorkspace& ws = plan.ws;
  size_t offset = 0;
  auto region = [&](size_t bytes) {
    const size_t at = offset;
    offset = align_up(offset + bytes, 256);
    return at;
  };
  ws.q_full = region(n * h * static_cast<size_t>(kMlaDecodeEntry) * 2);
  ws.o_lat = region(n * h * static_cast<size_t>(kMlaDecodeLora) * 2);
  ws.part_o = region(slots * groups * static_cast<size_t>(kMlaDecodeLora) * gh * 4);
  ws.part_ml = region(slots * groups * 2 * gh * 4);
  ws.meta = region(static_cast<size_t>(MlaDecodeMeta::count(p.n_tokens, plan.n_partitions)) * 4);
  ws.total_bytes = offset;
  return plan;
}

MlaDecodeSchedule mla_decode_schedule_cpu(const MlaDecodePlan& plan, const int64_t* positions) {
  const int64_t n = plan.params.n_tokens;
  MlaDecodeSchedule s;
  s.tile_prefix.resize(static_cast<size_t>(n) + 1);
  s.n_splits.resize(static_cast<size_t>(n));
  s.slot_base.resize(static_cast<size_t>(n));
  s.first_partition.resize(static_cast<size_t>(n));
  int64_t total = 0;
  for (int64_t t = 0; t < n; ++t) {
    BG_CHECK(positions[t] >= 0, "mla_decode_schedule_cpu: position {} of token {} is negative", positions[t], t);
    s.tile_prefix[static_cast<size_t>(t)] = static_cast<int32_t>(total);
    total += mla_tiles_of_context(positions[t] + 1);
  }
  s.tile_prefix[static_cast<size_t>(n)] = static_cast<int32_t>(total);
  s.total_tiles = total;
  if (plan.per_token) {
    s.n_used = n;
    s.n_splits.assign(static_cast<size_t>(n), 1);
    s.slot_base.assign(static_cast<size_t>(n), 0);
    for (int64_t t = 0; t < n; ++t) s.first_partition[static_cast<size_t>(t)] = static_cast<int32_t>(t);
    s.partition_begin = s.tile_prefix;  // n_partitions = n_tokens: token t's tiles are partition t
    return s;
  }
  s.n_used = mla_partitions_used(total, plan.n_partitions, plan.min_tiles_per_partition);
  if (plan.align_tokens && aligned_schedule(plan, s)) return s;
  int64_t slots = 0;
  for (int64_t t = 0; t < n; ++t) {
    const auto i = static_cast<size_t>(t);
    const int64_t first = mla_partition_of(s.tile_prefix[i], total, s.n_used);
    const int64_t last = mla_partition_of(s.tile_prefix[i + 1] - 1, total, s.n_used);
    s.n_splits[i] = static_cast<int32_t>(last - first + 1);
    s.first_partition[i] = static_cast<int32_t>(first);
    s.slot_base[i] = static_cast<int32_t>(slots);
    if (s.n_splits[i] > 1) slots += s.n_splits[i];
  }
  for (int64_t g = 0; g <= plan.n_partitions; ++g) {
    s.partition_begin.push_back(static_cast<int32_t>(g < s.n_used ? mla_partition_begin(g, total, s.n_used) : total));
  }
  BG_CHECK(slots <= plan.max_slots, "mla_decode_schedule_cpu: {} partial slots exceed the plan's {}", slots,
           plan.max_slots);
  return s;
}

}  // namespace bg::ops
