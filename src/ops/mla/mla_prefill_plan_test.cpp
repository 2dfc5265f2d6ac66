// MLA prefill plan (CPU): which sequences take the path, passes cut at the row budget, segments covering every
// context exactly once in order, work items with the right masks and state flags, and bad layouts refused.
#include "ops/mla/mla_prefill_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "core/error.h"

namespace bg::ops {
namespace {

struct Step {
  std::vector<int64_t> positions, seq_begin{0};
  // A sequence whose tokens are positions [first, first + n).
  void add(int64_t first, int64_t n) {
    for (int64_t p = first; p < first + n; ++p) positions.push_back(p);
    seq_begin.push_back(static_cast<int64_t>(positions.size()));
  }
};

// Every pass's segments tile its rows, every prefill sequence's context is covered once in increasing order, and
// each query tile gets exactly one final item, after all its other items.
void check_plan(const Step& st, const MlaPrefillPlan& plan, int64_t max_rows) {
  std::map<int32_t, int64_t> covered;  // sequence -> next position expected
  std::map<int32_t, int> finals;       // q_row0 -> final items seen
  for (size_t pi = 0; pi < plan.passes.size(); ++pi) {
    const MlaPrefillPass& pass = plan.passes[pi];
    EXPECT_LE(pass.rows, max_rows);
    EXPECT_GT(pass.n_items, 0);
    int64_t row = 0;
    for (int64_t i = pass.segment_begin; i < pass.segment_begin + pass.n_segments; ++i) {
      const MlaPrefillSegment& seg = plan.segments[static_cast<size_t>(i)];
      EXPECT_EQ(seg.row0, row);
      EXPECT_EQ(seg.k0, covered[seg.seq]);
      covered[seg.seq] += seg.len;
      row += seg.len;
    }
    EXPECT_EQ(row, pass.rows);
    for (int64_t i = pass.item_begin; i < pass.item_begin + pass.n_items; ++i) {
      const MlaPrefillItem& it = plan.items[static_cast<size_t>(i)];
      EXPECT_GE(it.n_keys, 1);
      EXPECT_LE(it.n_rows, kMlaPrefillTileQ);
      EXPECT_EQ(finals[it.q_row0], 0) << "an item after the tile's final one";
      if ((it.flags & kMlaPrefillFinal) != 0) ++finals[it.q_row0];
      EXPECT_EQ((it.flags & kMlaPrefillLoadState) != 0, it.k0 > 0);
      // Keys before mask_from are visible to every row of the tile.
      const auto b = st.positions.begin() + it.q_row0;
      EXPECT_EQ(it.mask_from, std::max<int64_t>(0, *std::min_element(b, b + it.n_rows) + 1 - it.k0));
      EXPECT_EQ(it.k0 + it.n_keys - 1 <= *std::max_element(b, b + it.n_rows), true);
      if (i > pass.item_begin) {
        EXPECT_LE(it.n_keys, plan.items[static_cast<size_t>(i - 1)].n_keys);
      }
    }
  }
  for (int32_t s : plan.prefill_seqs) {
    const auto b = st.seq_begin[static_cast<size_t>(s)], e = st.seq_begin[static_cast<size_t>(s) + 1];
    EXPECT_EQ(covered[s], st.positions[static_cast<size_t>(e) - 1] + 1);
    for (int64_t t = b; t < e; t += kMlaPrefillTileQ) {
      EXPECT_EQ(finals[static_cast<int32_t>(t)], 1) << t;
    }
  }
}

TEST(MlaPrefillPlan, FreshPromptIsOnePassWithoutState) {
  Step st;
  st.add(0, 4096);
  const MlaPrefillPlan plan = mla_prefill_plan(st.positions, st.seq_begin);
  ASSERT_EQ(plan.passes.size(), 1u);
  EXPECT_EQ(plan.items.size(), 32u);
  EXPECT_FALSE(plan.needs_state);
  EXPECT_TRUE(plan.absorbed_runs.empty());
  EXPECT_EQ(plan.items.front().n_keys, 4096);  // heaviest first
  EXPECT_EQ(plan.items.back().n_keys, 128);
  EXPECT_EQ(plan.items.back().mask_from, 1);
  check_plan(st, plan, 16384);
}

TEST(MlaPrefillPlan, LongContextIsCutIntoPassesWithState) {
  Step st;
  st.add(60000, 8192);  // a chunk after a 60k prefix
  const MlaPrefillOptions options{64, 16384};
  const MlaPrefillPlan plan = mla_prefill_plan(st.positions, st.seq_begin, options);
  EXPECT_EQ(plan.passes.size(), 5u);  // 68192 rows
  EXPECT_EQ(plan.max_pass_rows, 16384);
  EXPECT_TRUE(plan.needs_state);
  check_plan(st, plan, 16384);
}

TEST(MlaPrefillPlan, MixedStepKeepsShortSequencesOnTheAbsorbedKernel) {
  Step st;
  st.add(500, 1);    // decode
  st.add(900, 1);    // decode
  st.add(0, 200);    // prefill
  st.add(10, 63);    // below min_tokens
  st.add(7000, 1);   // decode
  st.add(100, 64);   // prefill (exactly min_tokens)
  const MlaPrefillOptions options{64, 256};
  const MlaPrefillPlan plan = mla_prefill_plan(st.positions, st.seq_begin, options);
  EXPECT_EQ(plan.prefill_seqs, (std::vector<int32_t>{2, 5}));
  const std::vector<std::pair<int64_t, int64_t>> runs{{0, 2}, {202, 266}};
  EXPECT_EQ(plan.absorbed_runs, runs);
  EXPECT_FALSE(plan.absorbed_single_tokens);  // the 63-token piece
  check_plan(st, plan, 256);
  // By default every sequence of two or more tokens takes the path; only single tokens stay absorbed.
  const MlaPrefillPlan by_default = mla_prefill_plan(st.positions, st.seq_begin);
  EXPECT_EQ(by_default.prefill_seqs, (std::vector<int32_t>{2, 3, 5}));
  const std::vector<std::pair<int64_t, int64_t>> singles{{0, 2}, {265, 266}};
  EXPECT_EQ(by_default.absorbed_runs, singles);
  EXPECT_TRUE(by_default.absorbed_single_tokens);
}

TEST(MlaPrefillPlan, DecodeOnlyStepIsEmpty) {
  Step st;
  for (int s = 0; s < 8; ++s) st.add(100 * s, 1);
  const MlaPrefillPlan plan = mla_prefill_plan(st.positions, st.seq_begin);
  EXPECT_TRUE(plan.empty());
  ASSERT_EQ(plan.absorbed_runs.size(), 1u);
  EXPECT_EQ(plan.absorbed_runs[0], (std::pair<int64_t, int64_t>{0, 8}));
}

TEST(MlaPrefillPlan, WorkspaceHoldsStateOnlyWhenNeeded) {
  Step st;
  st.add(0, 1000);
  const MlaParams p{1000, 96, 512, 128, 64, 128, 64, 0.07f};
  const MlaPrefillPlan one = mla_prefill_plan(st.positions, st.seq_begin);
  const MlaPrefillPlan cut = mla_prefill_plan(st.positions, st.seq_begin, {64, 256});
  const MlaPrefillWorkspace a = mla_prefill_workspace(p, one), b = mla_prefill_workspace(p, cut);
  EXPECT_EQ(a.state_o, a.state_ml);  // empty regions
  EXPECT_GE(b.total_bytes - b.state_o, size_t{1000} * 96 * 128 * 4);
  EXPECT_EQ(a.q_pad, a.c_kv);  // production dims read q in place
  EXPECT_GE(a.v - a.k_nope, size_t{1000} * 96 * 128 * 2);
  const std::vector<std::byte> meta = mla_prefill_meta(one, a);
  EXPECT_EQ(meta.size(), a.meta_bytes);
  EXPECT_DOUBLE_EQ(mla_prefill_flops(p, st.positions, one, st.seq_begin), 2.0 * 500500.0 * 96 * 320);
}

TEST(MlaPrefillPlan, CudnnCallsCarryRaggedArrays) {
  // A fresh 300-token prompt, a decode token, a 200-token chunk after a 700-token prefix: one pass of two whole
  // contexts (1200 rows), the decode token absorbed: one causal call of two pieces, written in place.
  Step st;
  st.add(0, 300);
  st.add(50, 1);
  st.add(700, 200);
  const int64_t h = 96;
  const MlaParams p{501, h, 512, 128, 64, 128, 64, 0.07f};
  const MlaPrefillPlan plan = mla_prefill_plan(st.positions, st.seq_begin);
  ASSERT_EQ(plan.passes.size(), 1u);
  ASSERT_EQ(plan.cudnn_calls.size(), 1u);
  const MlaPrefillCudnnCall& call = plan.cudnn_calls[0];
  EXPECT_TRUE(call.causal);
  EXPECT_TRUE(call.direct);
  EXPECT_EQ(call.n_pieces, 2);
  EXPECT_EQ(call.max_q, 300);
  EXPECT_EQ(call.max_kv, 900);
  EXPECT_FALSE(call.uniform);  // 300 / 300 and 200 / 900
  EXPECT_EQ(call.kv_row0, 0);
  ASSERT_EQ(plan.pieces.size(), 2u);
  EXPECT_EQ(plan.pieces[1].q_row0, 301);
  EXPECT_EQ(plan.pieces[1].n_q, 200);
  EXPECT_EQ(plan.pieces[1].g0, 300);
  EXPECT_EQ(plan.pieces[1].n_kv, 900);
  EXPECT_EQ(plan.pieces[1].flags, kMlaPieceFirst | kMlaPieceFinal);
  EXPECT_TRUE(mla_prefill_cudnn_fits(plan, 501, h));

  const MlaPrefillWorkspace ws = mla_prefill_workspace(p, plan);
  EXPECT_GE(ws.v - ws.k_nope, size_t{1200} * h * 192 * 2);  // k_nope | k_pe per head for cuDNN
  const std::vector<std::byte> meta = mla_prefill_meta(plan, ws);
  std::vector<int32_t> a(static_cast<size_t>(mla_prefill_cudnn_ints(2)));
  std::memcpy(a.data(), meta.data() + ws.cudnn + static_cast<size_t>(call.meta), a.size() * 4);
  EXPECT_EQ(mla_prefill_cudnn_stride(2), 4);
  const std::vector<int32_t> want{300, 200, 0, 0,                       // seq_len_q
                                  300, 900, 0, 0,                       // seq_len_kv
                                  0, 301 * h * 192, 501 * h * 192, 0,   // q offsets (from row 0)
                                  0, 300 * h * 192, 1200 * h * 192, 0,  // k
                                  0, 300 * h * 128, 1200 * h * 128, 0,  // v
                                  0, 301 * h * 128, 501 * h * 128, 0};  // out
  EXPECT_EQ(a, want);
  // Offsets past int32 are not taken.
  EXPECT_FALSE(mla_prefill_cudnn_fits(plan, 501, int64_t{1} << 24));
}

TEST(MlaPrefillPlan, CudnnBatchRoundsUpWithEmptyEntries) {
  EXPECT_EQ(mla_prefill_cudnn_batch(1), 1);
  EXPECT_EQ(mla_prefill_cudnn_batch(2), 2);
  EXPECT_EQ(mla_prefill_cudnn_batch(3), 4);
  EXPECT_EQ(mla_prefill_cudnn_batch(33), 64);
  EXPECT_EQ(mla_prefill_cudnn_batch(64), 64);
  // Three fresh prompts: one causal call of three pieces launched with batch 4; the fourth entry is an empty sequence
  // whose offsets are those of the end.
  Step st;
  st.add(0, 10);
  st.add(0, 20);
  st.add(0, 30);
  const int64_t h = 2;
  const MlaParams p{60, h, 512, 128, 64, 128, 64, 0.07f};
  const MlaPrefillPlan plan = mla_prefill_plan(st.positions, st.seq_begin);
  ASSERT_EQ(plan.cudnn_calls.size(), 1u);
  const MlaPrefillCudnnCall& call = plan.cudnn_calls[0];
  EXPECT_EQ(call.n_pieces, 3);
  EXPECT_EQ(call.batch, 4);
  EXPECT_FALSE(call.uniform);
  const MlaPrefillWorkspace ws = mla_prefill_workspace(p, plan);
  const std::vector<std::byte> meta = mla_prefill_meta(plan, ws);
  ASSERT_EQ(mla_prefill_cudnn_stride(4), 8);
  std::vector<int32_t> a(static_cast<size_t>(mla_prefill_cudnn_ints(4)));
  ASSERT_LE(ws.cudnn + static_cast<size_t>(call.meta) + a.size() * 4, meta.size());
  std::memcpy(a.data(), meta.data() + ws.cudnn + static_cast<size_t>(call.meta), a.size() * 4);
  const std::vector<int32_t> want{10, 20, 30, 0, 0, 0, 0, 0,                                           // seq_len_q
                                  10, 20, 30, 0, 0, 0, 0, 0,                                           // seq_len_kv
                                  0, 10 * h * 192, 30 * h * 192, 60 * h * 192, 60 * h * 192, 0, 0, 0,  // q
                                  0, 10 * h * 192, 30 * h * 192, 60 * h * 192, 60 * h * 192, 0, 0, 0,  // k
                                  0, 10 * h * 128, 30 * h * 128, 60 * h * 128, 60 * h * 128, 0, 0, 0,  // v
                                  0, 10 * h * 128, 30 * h * 128, 60 * h * 128, 60 * h * 128, 0, 0, 0};  // out
  EXPECT_EQ(a, want);
}

TEST(MlaPrefillPlan, CudnnPiecesAcrossPasses) {
  // Passes of 1000 rows: the prompt of 300 and the first 700 keys of the chunk's context, then its last 200 keys.
  Step st;
  st.add(0, 300);
  st.add(700, 200);
  const MlaPrefillPlan plan = mla_prefill_plan(st.positions, st.seq_begin, {2, 1000});
  ASSERT_EQ(plan.passes.size(), 2u);
  EXPECT_TRUE(plan.needs_state);
  // Pass 0: the prompt's causal piece (first and final) and the chunk's full piece over keys 0..699 (first only);
  // pass 1: the chunk's causal piece over keys 700..899 (final only).
  ASSERT_EQ(plan.cudnn_calls.size(), 3u);
  const auto& c = plan.cudnn_calls;
  EXPECT_TRUE(c[0].causal && c[0].direct && c[0].pass == 0 && c[0].n_pieces == 1);
  EXPECT_TRUE(!c[1].causal && !c[1].direct && c[1].pass == 0 && c[1].n_pieces == 1);
  EXPECT_TRUE(c[2].causal && !c[2].direct && c[2].pass == 1 && c[2].n_pieces == 1);
  const MlaPrefillPiece full = plan.pieces[static_cast<size_t>(c[1].piece_begin)];
  EXPECT_EQ(full.q_row0, 300);
  EXPECT_EQ(full.n_q, 200);
  EXPECT_EQ(full.g0, 300);
  EXPECT_EQ(full.n_kv, 700);
  EXPECT_EQ(full.flags, kMlaPieceFirst);
  const MlaPrefillPiece diag = plan.pieces[static_cast<size_t>(c[2].piece_begin)];
  EXPECT_EQ(diag.q_row0, 300);
  EXPECT_EQ(diag.n_q, 200);
  EXPECT_EQ(diag.g0, 0);
  EXPECT_EQ(diag.n_kv, 200);  // keys 700..899: the last query (position 899) sees them all
  EXPECT_EQ(diag.flags, kMlaPieceFinal);
  // Each of these calls has one piece (batch 1): uniform, K and V from its first gathered row.
  for (const MlaPrefillCudnnCall& call : c) {
    EXPECT_TRUE(call.uniform);
    EXPECT_EQ(call.kv_row0, plan.pieces[static_cast<size_t>(call.piece_begin)].g0);
  }
  EXPECT_EQ(c[1].kv_row0, 300);

  // A 2500-token fresh prompt over passes of 1000 rows: queries inside each segment are causal pieces, those after
  // it full pieces; every query gets exactly one final piece and one first piece.
  Step fresh;
  fresh.add(0, 2500);
  const MlaPrefillPlan p3 = mla_prefill_plan(fresh.positions, fresh.seq_begin, {2, 1000});
  std::vector<int> first(2500, 0), final(2500, 0), seen(2500, 0);
  for (const MlaPrefillPiece& piece : p3.pieces) {
    for (int32_t r = piece.q_row0; r < piece.q_row0 + piece.n_q; ++r) {
      first[static_cast<size_t>(r)] += (piece.flags & kMlaPieceFirst) != 0;
      final[static_cast<size_t>(r)] += (piece.flags & kMlaPieceFinal) != 0;
      // Bottom-right causal: row i of the piece sees n_kv - n_q + 1 + i keys; a full piece all of them.
      const bool causal = (piece.flags & kMlaPieceFinal) != 0;
      seen[static_cast<size_t>(r)] += causal ? piece.n_kv - piece.n_q + 1 + (r - piece.q_row0) : piece.n_kv;
    }
  }
  for (int r = 0; r < 2500; ++r) {
    ASSERT_EQ(first[static_cast<size_t>(r)], 1) << r;
    ASSERT_EQ(final[static_cast<size_t>(r)], 1) << r;
    ASSERT_EQ(seen[static_cast<size_t>(r)], r + 1) << r;  // every key up to its own position, once
  }

  // Tokens at non-consecutive positions have no cuDNN form.
  Step gap;
  gap.positions = {0, 1, 2, 5};
  gap.seq_begin = {0, 4};
  EXPECT_TRUE(mla_prefill_plan(gap.positions, gap.seq_begin).cudnn_calls.empty());
}

TEST(MlaPrefillPlan, CudnnCallsKnowWhenEveryPieceHasTheSameLengths) {
  // Two fresh 64-token prompts: one call of batch 2, every piece 64 / 64 (an exact cuDNN plan can take it).
  Step two;
  two.add(0, 64);
  two.add(0, 64);
  const MlaPrefillPlan p2 = mla_prefill_plan(two.positions, two.seq_begin);
  ASSERT_EQ(p2.cudnn_calls.size(), 1u);
  EXPECT_TRUE(p2.cudnn_calls[0].uniform);
  EXPECT_EQ(p2.cudnn_calls[0].batch, 2);
  // Three equal prompts launch with batch 4: the empty fourth entry makes the call not uniform.
  Step three = two;
  three.add(0, 64);
  EXPECT_FALSE(mla_prefill_plan(three.positions, three.seq_begin).cudnn_calls[0].uniform);
  // Equal query runs over different contexts are not uniform either.
  Step ctx;
  ctx.add(0, 64);
  ctx.add(64, 64);
  EXPECT_FALSE(mla_prefill_plan(ctx.positions, ctx.seq_begin).cudnn_calls[0].uniform);
  // A 128-token chunk after a 128-token prefix: one piece of 128 queries over 256 keys, uniform.
  Step chunk;
  chunk.add(128, 128);
  const MlaPrefillCudnnCall c = mla_prefill_plan(chunk.positions, chunk.seq_begin).cudnn_calls[0];
  EXPECT_TRUE(c.uniform);
  EXPECT_EQ(c.max_q, 128);
  EXPECT_EQ(c.max_kv, 256);
  // Passes of 128 rows over a fresh 64-token prompt and a 64-token chunk after a 64-token prefix: pass 0 holds the
  // prompt and the chunk's first 64 keys (the chunk's queries come after them: a full piece from gathered row 64),
  // pass 1 the chunk's own keys. Every call has one 64 / 64 piece.
  Step mixed;
  mixed.add(0, 64);
  mixed.add(64, 64);
  const MlaPrefillPlan pm = mla_prefill_plan(mixed.positions, mixed.seq_begin, {2, 128});
  ASSERT_EQ(pm.cudnn_calls.size(), 3u);
  for (const MlaPrefillCudnnCall& call : pm.cudnn_calls) {
    EXPECT_TRUE(call.uniform);
    EXPECT_EQ(call.batch, 1);
    EXPECT_EQ(call.max_q, 64);
    EXPECT_EQ(call.max_kv, 64);
  }
  EXPECT_FALSE(pm.cudnn_calls[1].causal);
  EXPECT_EQ(pm.cudnn_calls[1].kv_row0, 64);
}

TEST(MlaPrefillPlan, RefusesBadLayoutsAndOptions) {
  Step st;
  st.add(0, 100);
  EXPECT_THROW(mla_prefill_plan(st.positions, std::vector<int64_t>{0, 99}), Error);
  EXPECT_THROW(mla_prefill_plan(st.positions, std::vector<int64_t>{1, 100}), Error);
  EXPECT_THROW(mla_prefill_plan(st.positions, std::vector<int64_t>{0, 60, 50, 100}), Error);
  EXPECT_THROW(mla_prefill_plan(st.positions, std::vector<int64_t>{}), Error);
  EXPECT_THROW(mla_prefill_plan(st.positions, st.seq_begin, {0, 1024}), Error);
  EXPECT_THROW(mla_prefill_plan(st.positions, st.seq_begin, {64, 63}), Error);
  // Negative positions never take the path.
  st.positions[5] = -1;
  EXPECT_TRUE(mla_prefill_plan(st.positions, st.seq_begin).empty());
}

}  // namespace
}  // namespace bg::ops
