// kda_varlen_plan: the chunk and sequence tables of one varlen chunked KDA launch (see kda_varlen_plan.h).
#include "ops/kda/kda_varlen_plan.h"

#include <algorithm>
#include <limits>

#include "core/error.h"

namespace bg::ops {

std::vector<int32_t> KdaVarlenPlan::packed() const {
  std::vector<int32_t> out;
  out.reserve(chunks.size() * kKdaPackedChunkInts + seqs.size() * kKdaPackedSeqInts);
  for (const KdaChunkDesc& c : chunks) out.insert(out.end(), {c.token_begin, c.n_tokens});
  for (const KdaSeqDesc& s : seqs) out.insert(out.end(), {s.chunk_begin, s.n_chunks, s.slot, s.step_seq});
  return out;
}

KdaVarlenPlan kda_varlen_plan(std::span<const int64_t> seq_begin, std::span<const int32_t> slots, int64_t min_tokens,
                              int64_t chunk_size) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  BG_CHECK(!seq_begin.empty() && seq_begin[0] == 0, "kda_varlen_plan: seq_begin must start with 0 (size {})",
           seq_begin.size());
  BG_CHECK(slots.size() + 1 == seq_begin.size(), "kda_varlen_plan: {} slots for {} sequences", slots.size(),
           seq_begin.size() - 1);
  BG_CHECK(min_tokens >= 1, "kda_varlen_plan: min_tokens {} must be >= 1", min_tokens);
  BG_CHECK(chunk_size >= 1 && chunk_size <= 1024, "kda_varlen_plan: chunk_size {} outside [1, 1024]", chunk_size);
  BG_CHECK(seq_begin.back() <= kMax, "kda_varlen_plan: {} tokens exceed int32", seq_begin.back());
  KdaVarlenPlan plan;
  for (size_t s = 0; s + 1 < seq_begin.size(); ++s) {
    const int64_t b = seq_begin[s], n = seq_begin[s + 1] - b;
    BG_CHECK(n >= 0, "kda_varlen_plan: sequence {} has {} tokens (seq_begin must not decrease)", s, n);
    BG_CHECK(slots[s] >= 0, "kda_varlen_plan: sequence {} has slot {}", s, slots[s]);
    if (n == 0) continue;
    if (n < min_tokens) {
      plan.short_seqs.push_back(static_cast<int32_t>(s));
      continue;
    }
    KdaSeqDesc d;
    d.chunk_begin = static_cast<int32_t>(plan.chunks.size());
    for (int64_t t = 0; t < n; t += chunk_size) {
      const int64_t len = std::min(chunk_size, n - t);
      plan.chunks.push_back({static_cast<int32_t>(b + t), static_cast<int32_t>(len)});
    }
    BG_CHECK(static_cast<int64_t>(plan.chunks.size()) <= kMax, "kda_varlen_plan: too many chunks");
    d.n_chunks = static_cast<int32_t>(plan.chunks.size()) - d.chunk_begin;
    d.slot = slots[s];
    d.step_seq = static_cast<int32_t>(s);
    plan.seqs.push_back(d);
    plan.n_chunked_tokens += n;
  }
  return plan;
}

}  // namespace bg::ops
