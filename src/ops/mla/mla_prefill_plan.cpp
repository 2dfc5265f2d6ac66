// MLA prefill plan: prefill sequences, passes, segments and work items (mla_prefill_plan.h).
#include "ops/mla/mla_prefill_plan.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace bg::ops {
namespace {

// Positions past this are refused by the prefill path (int32 arithmetic in the kernel, with room for a tile).
constexpr int64_t kMaxPosition = (int64_t{1} << 31) - (int64_t{1} << 16);

size_t align_up(size_t bytes, size_t alignment) { return (bytes + alignment - 1) / alignment * alignment; }

// Adds the items of one segment: every query tile of its sequence that sees at least one of its keys.
void add_items(const MlaPrefillSegment& seg, std::span<const int64_t> positions, int64_t begin, int64_t end,
               MlaPrefillPlan& plan) {
  for (int64_t t0 = begin; t0 < end; t0 += kMlaPrefillTileQ) {
    const int64_t t1 = std::min(end, t0 + kMlaPrefillTileQ);
    const auto [lo, hi] = std::minmax_element(positions.begin() + t0, positions.begin() + t1);
    const int64_t pos_min = *lo, pos_max = *hi;
    if (pos_max < seg.k0) continue;  // every key of the segment is in the future of the whole tile
    MlaPrefillItem it;
    it.q_row0 = static_cast<int32_t>(t0);
    it.n_rows = static_cast<int32_t>(t1 - t0);
    it.g0 = seg.row0;
    it.k0 = seg.k0;
    it.n_keys = static_cast<int32_t>(std::min<int64_t>(seg.len, pos_max + 1 - seg.k0));
    it.mask_from = static_cast<int32_t>(std::max<int64_t>(0, pos_min + 1 - seg.k0));
    it.flags = (seg.k0 > 0 ? kMlaPrefillLoadState : 0) | (seg.k0 + seg.len > pos_max ? kMlaPrefillFinal : 0);
    if ((it.flags & kMlaPrefillFinal) == 0) plan.needs_state = true;
    plan.items.push_back(it);
  }
}

// The cuDNN calls of one pass (MlaPrefillCudnnCall): per segment, its causal piece and its full piece.
void add_cudnn_calls(int64_t pass_index, const MlaPrefillPass& pass, MlaPrefillPlan& plan,
                     std::span<const int64_t> positions, std::span<const int64_t> seq_begin) {
  for (const bool causal : {true, false}) {
    MlaPrefillCudnnCall call;
    call.pass = pass_index;
    call.causal = causal;
    call.piece_begin = static_cast<int64_t>(plan.pieces.size());
    for (int64_t i = pass.segment_begin; i < pass.segment_begin + pass.n_segments; ++i) {
      const MlaPrefillSegment& seg = plan.segments[static_cast<size_t>(i)];
      const int64_t b = seq_begin[static_cast<size_t>(seg.seq)], e = seq_begin[static_cast<size_t>(seg.seq) + 1];
      const int64_t p_first = positions[static_cast<size_t>(b)], p_last = positions[static_cast<size_t>(e - 1)];
      const int64_t seg_end = int64_t{seg.k0} + seg.len;
      // Query positions [lo, hi] of the piece: inside the segment (causal) or after it (full).
      const int64_t lo = std::max(p_first, causal ? int64_t{seg.k0} : seg_end);
      const int64_t hi = causal ? std::min(p_last, seg_end - 1) : p_last;
      if (lo > hi) continue;
      MlaPrefillPiece piece;
      piece.q_row0 = static_cast<int32_t>(b + (lo - p_first));
      piece.n_q = static_cast<int32_t>(hi - lo + 1);
      piece.g0 = seg.row0;
      piece.n_kv = static_cast<int32_t>(causal ? hi - seg.k0 + 1 : seg.len);
      piece.flags = (seg.k0 == 0 ? kMlaPieceFirst : 0) | (causal ? kMlaPieceFinal : 0);
      piece.index = static_cast<int32_t>(call.n_pieces++);
      call.direct = call.direct && piece.flags == (kMlaPieceFirst | kMlaPieceFinal);
      call.max_q = std::max<int64_t>(call.max_q, piece.n_q);
      call.max_kv = std::max<int64_t>(call.max_kv, piece.n_kv);
      plan.pieces.push_back(piece);
    }
    if (call.n_pieces == 0) continue;
    call.batch = mla_prefill_cudnn_batch(call.n_pieces);
    call.kv_row0 = plan.pieces[static_cast<size_t>(call.piece_begin)].g0;
    call.uniform = call.batch == call.n_pieces;
    for (int64_t i = call.piece_begin; i < call.piece_begin + call.n_pieces; ++i) {
      const MlaPrefillPiece& piece = plan.pieces[static_cast<size_t>(i)];
      call.uniform = call.uniform && piece.n_q == call.max_q && piece.n_kv == call.max_kv;
    }
    call.meta = plan.cudnn_bytes;
    plan.cudnn_bytes += static_cast<int64_t>(
        align_up(static_cast<size_t>(mla_prefill_cudnn_ints(call.batch)) * sizeof(int32_t), 256));
    plan.cudnn_calls.push_back(call);
  }
}

}  // namespace

bool mla_prefill_takes(const MlaParams& p) {
  return p.qk_nope_dim >= 1 && p.qk_nope_dim <= kMlaPrefillNope && p.qk_rope_dim >= 0 &&
         p.qk_rope_dim <= kMlaPrefillRope && p.v_head_dim >= 1 && p.v_head_dim <= kMlaPrefillV &&
         p.kv_lora_rank >= 1 && p.n_heads >= 1;
}

MlaPrefillPlan mla_prefill_plan(std::span<const int64_t> positions, std::span<const int64_t> seq_begin,
                                const MlaPrefillOptions& options) {
  constexpr const char* op = "mla_prefill_plan";
  BG_CHECK(options.min_tokens >= 1, "{}: min_tokens {} must be positive", op, options.min_tokens);
  BG_CHECK(options.max_pass_rows >= kMlaPrefillTileK && options.max_pass_rows <= (int64_t{1} << 30),
           "{}: max_pass_rows {} outside [{}, 2^30]", op, options.max_pass_rows, kMlaPrefillTileK);
  const auto n_tokens = static_cast<int64_t>(positions.size());
  BG_CHECK(n_tokens < (int64_t{1} << 31), "{}: {} tokens exceed the int32 row range", op, n_tokens);
  BG_CHECK(!seq_begin.empty() && seq_begin.front() == 0 && seq_begin.back() == n_tokens,
           "{}: sequence ranges must start at 0 and end at the {} tokens", op, n_tokens);
  for (size_t s = 1; s < seq_begin.size(); ++s) {
    BG_CHECK(seq_begin[s] >= seq_begin[s - 1], "{}: sequence {} ends before it begins", op, s - 1);
  }

  MlaPrefillPlan plan;
  const auto n_seqs = static_cast<int64_t>(seq_begin.size()) - 1;
  std::vector<int64_t> context(static_cast<size_t>(n_seqs), 0);
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t b = seq_begin[static_cast<size_t>(s)], e = seq_begin[static_cast<size_t>(s) + 1];
    bool takes = e - b >= options.min_tokens;
    int64_t pos_max = -1;
    for (int64_t t = b; t < e && takes; ++t) {
      const int64_t pos = positions[static_cast<size_t>(t)];
      takes = pos >= 0 && pos < kMaxPosition;
      pos_max = std::max(pos_max, pos);
    }
    if (takes) {
      plan.prefill_seqs.push_back(static_cast<int32_t>(s));
      context[static_cast<size_t>(s)] = pos_max + 1;
    } else if (e > b) {
      if (e - b > 1) plan.absorbed_single_tokens = false;
      if (!plan.absorbed_runs.empty() && plan.absorbed_runs.back().second == b) {
        plan.absorbed_runs.back().second = e;
      } else {
        plan.absorbed_runs.emplace_back(b, e);
      }
    }
  }
  if (plan.prefill_seqs.empty()) return plan;

  // The cuDNN form needs every prefill sequence's tokens at consecutive positions.
  bool cudnn_form = true;
  for (int32_t s : plan.prefill_seqs) {
    const int64_t b = seq_begin[static_cast<size_t>(s)], e = seq_begin[static_cast<size_t>(s) + 1];
    for (int64_t t = b + 1; t < e && cudnn_form; ++t) {
      cudnn_form = positions[static_cast<size_t>(t)] == positions[static_cast<size_t>(b)] + (t - b);
    }
  }
  // Cut the concatenated contexts into passes of at most max_pass_rows rows.
  MlaPrefillPass pass;
  auto close_pass = [&] {
    pass.n_segments = static_cast<int64_t>(plan.segments.size()) - pass.segment_begin;
    pass.item_begin = static_cast<int64_t>(plan.items.size());
    for (int64_t i = pass.segment_begin; i < pass.segment_begin + pass.n_segments; ++i) {
      const MlaPrefillSegment& seg = plan.segments[static_cast<size_t>(i)];
      add_items(seg, positions, seq_begin[static_cast<size_t>(seg.seq)], seq_begin[static_cast<size_t>(seg.seq) + 1],
                plan);
    }
    pass.n_items = static_cast<int64_t>(plan.items.size()) - pass.item_begin;
    if (cudnn_form) add_cudnn_calls(static_cast<int64_t>(plan.passes.size()), pass, plan, positions, seq_begin);
    // Heaviest tiles first, so the causal tail does not leave SMs idle at the end of the launch.
    std::stable_sort(plan.items.begin() + pass.item_begin, plan.items.end(),
                     [](const MlaPrefillItem& a, const MlaPrefillItem& b) { return a.n_keys > b.n_keys; });
    plan.max_pass_rows = std::max(plan.max_pass_rows, pass.rows);
    plan.passes.push_back(pass);
    pass = MlaPrefillPass{};
    pass.segment_begin = static_cast<int64_t>(plan.segments.size());
  };
  for (int32_t s : plan.prefill_seqs) {
    const int64_t ctx = context[static_cast<size_t>(s)];
    for (int64_t k = 0; k < ctx;) {
      const int64_t take = std::min(ctx - k, options.max_pass_rows - pass.rows);
      plan.segments.push_back(
          {s, static_cast<int32_t>(k), static_cast<int32_t>(take), static_cast<int32_t>(pass.rows)});
      k += take;
      pass.rows += take;
      if (pass.rows == options.max_pass_rows) close_pass();
    }
  }
  if (pass.rows > 0) close_pass();
  return plan;
}

bool mla_prefill_cudnn_fits(const MlaPrefillPlan& plan, int64_t n_tokens, int64_t n_heads) {
  if (plan.cudnn_calls.empty() || n_heads < 1) return false;
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  return n_tokens * n_heads * kMlaPrefillQk <= kMax && plan.max_pass_rows * n_heads * kMlaPrefillQk <= kMax;
}

MlaPrefillWorkspace mla_prefill_workspace(const MlaParams& p, const MlaPrefillPlan& plan) {
  BG_CHECK(mla_prefill_takes(p), "mla_prefill_workspace: head dims nope {} / rope {} / v {} not taken", p.qk_nope_dim,
           p.qk_rope_dim, p.v_head_dim);
  constexpr size_t kAlign = 256, kBf16 = 2, kF32 = 4;
  const auto rows = static_cast<size_t>(plan.max_pass_rows), n = static_cast<size_t>(p.n_tokens),
             h = static_cast<size_t>(p.n_heads);
  const bool padded = p.qk_nope_dim != kMlaPrefillNope || p.qk_rope_dim != kMlaPrefillRope;
  MlaPrefillWorkspace ws;
  size_t at = 0;
  auto region = [&](size_t bytes) {
    const size_t offset = at;
    at = align_up(at + bytes, kAlign);
    return offset;
  };
  ws.segments = region(plan.segments.size() * sizeof(MlaPrefillSegment));
  ws.items = region(plan.items.size() * sizeof(MlaPrefillItem));
  ws.pieces = region(plan.pieces.size() * sizeof(MlaPrefillPiece));
  ws.cudnn = region(static_cast<size_t>(plan.cudnn_bytes));
  ws.meta_bytes = at;
  ws.n_heads = p.n_heads;
  ws.n_tokens = p.n_tokens;
  ws.q_pad = region(padded ? n * h * kMlaPrefillQk * kBf16 : 0);
  ws.c_kv = region(rows * static_cast<size_t>(p.kv_lora_rank) * kBf16);
  ws.k_pe = region(rows * kMlaPrefillRope * kBf16);
  // k_nope, or k_nope | k_pe per head [rows, heads, 192] when the cuDNN form exists (cuDNN reads K whole).
  const bool cudnn = !plan.cudnn_calls.empty();
  ws.k_nope = region(rows * h * (cudnn ? kMlaPrefillQk : kMlaPrefillNope) * kBf16);
  ws.v = region(rows * h * kMlaPrefillV * kBf16);
  ws.state_o = region(plan.needs_state ? n * h * kMlaPrefillV * kF32 : 0);
  ws.state_ml = region(plan.needs_state ? n * h * 2 * kF32 : 0);
  ws.o_part = region(plan.needs_state && cudnn ? n * h * kMlaPrefillV * kBf16 : 0);
  ws.total_bytes = at;
  return ws;
}

std::vector<std::byte> mla_prefill_meta(const MlaPrefillPlan& plan, const MlaPrefillWorkspace& ws) {
  std::vector<std::byte> meta(ws.meta_bytes);
  std::memcpy(meta.data() + ws.segments, plan.segments.data(), plan.segments.size() * sizeof(MlaPrefillSegment));
  std::memcpy(meta.data() + ws.items, plan.items.data(), plan.items.size() * sizeof(MlaPrefillItem));
  std::memcpy(meta.data() + ws.pieces, plan.pieces.data(), plan.pieces.size() * sizeof(MlaPrefillPiece));
  // Offsets past int32 are not written: mla_prefill_cuda does not take the cuDNN form then (mla_prefill_cudnn_fits).
  const int64_t h = ws.n_heads;
  if (!mla_prefill_cudnn_fits(plan, ws.n_tokens, h)) return meta;
  for (const MlaPrefillCudnnCall& call : plan.cudnn_calls) {
    const int64_t n = call.n_pieces, stride = mla_prefill_cudnn_stride(call.batch);
    std::vector<int32_t> a(static_cast<size_t>(mla_prefill_cudnn_ints(call.batch)), 0);  // padding lengths stay 0
    int32_t* len_q = a.data();
    int32_t* len_kv = len_q + stride;
    int32_t* q_off = len_kv + stride;
    int32_t* k_off = q_off + stride;
    int32_t* v_off = k_off + stride;
    int32_t* o_off = v_off + stride;
    const auto piece = [&](int64_t i) { return plan.pieces[static_cast<size_t>(call.piece_begin + i)]; };
    const int64_t q_base = piece(0).q_row0;
    for (int64_t i = 0; i <= call.batch; ++i) {
      const bool end = i >= n;
      const MlaPrefillPiece d = piece(end ? n - 1 : i);
      const int64_t q_row = d.q_row0 - q_base + (end ? d.n_q : 0), k_row = d.g0 + (end ? d.n_kv : 0);
      if (!end) {
        len_q[i] = d.n_q;
        len_kv[i] = d.n_kv;
      }
      q_off[i] = static_cast<int32_t>(q_row * h * kMlaPrefillQk);
      k_off[i] = static_cast<int32_t>(k_row * h * kMlaPrefillQk);
      v_off[i] = static_cast<int32_t>(k_row * h * kMlaPrefillV);
      o_off[i] = static_cast<int32_t>(q_row * h * kMlaPrefillV);
    }
    std::memcpy(meta.data() + ws.cudnn + static_cast<size_t>(call.meta), a.data(), a.size() * sizeof(int32_t));
  }
  return meta;
}

double mla_prefill_flops(const MlaParams& p, std::span<const int64_t> positions, const MlaPrefillPlan& plan,
                         std::span<const int64_t> seq_begin) {
  double pairs = 0.0;
  for (int32_t s : plan.prefill_seqs) {
    for (int64_t t = seq_begin[static_cast<size_t>(s)]; t < seq_begin[static_cast<size_t>(s) + 1]; ++t) {
      pairs += static_cast<double>(positions[static_cast<size_t>(t)] + 1);
    }
  }
  return 2.0 * pairs * static_cast<double>(p.n_heads) *
         static_cast<double>(p.qk_nope_dim + p.qk_rope_dim + p.v_head_dim);
}

}  // namespace bg::ops
