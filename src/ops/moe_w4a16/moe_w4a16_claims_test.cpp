// Claims (the overlapped down launch with MoeW4a16Params::claims), emulated on the host with the kernel's own
// schedule code: CTAs run their pipeline stage by stage in random interleavings (some slow, some starting late),
// each with a producer kStages - 1 stages ahead of its consumer, thread 0's claim_fill / claim_step between stages and
// one shared counter. Every item's every stage must be consumed exactly once, in the producer's order, and no ring
// entry may be overwritten while the consumer still needs it.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ops/moe_w4a16/moe_w4a16.h"
#include "ops/moe_w4a16/moe_w4a16_schedule.h"

namespace bg::ops {
namespace {

using w4::ClaimState;
using w4::Cursor;
using w4::ItemEntry;

constexpr int kStages = w4::kWideStages;  // the wide shape's pipeline

struct Routing {
  std::vector<int32_t> active, offsets;
};

// n_active touched experts of n_experts, each with 1..max_rows rows (0 rows for the untouched ones).
Routing make_routing(int n_experts, int n_active, int max_rows, std::mt19937& rng) {
  Routing r;
  r.offsets.assign(static_cast<size_t>(n_experts) + 1, 0);
  std::vector<int> rows(static_cast<size_t>(n_experts), 0);
  std::vector<int> ids(static_cast<size_t>(n_experts));
  for (int e = 0; e < n_experts; ++e) ids[static_cast<size_t>(e)] = e;
  std::shuffle(ids.begin(), ids.end(), rng);
  for (int j = 0; j < n_active; ++j) {
    rows[static_cast<size_t>(ids[static_cast<size_t>(j)])] = 1 + static_cast<int>(rng() % max_rows);
  }
  for (int e = 0; e < n_experts; ++e) {
    r.offsets[static_cast<size_t>(e) + 1] = r.offsets[static_cast<size_t>(e)] + rows[static_cast<size_t>(e)];
    if (rows[static_cast<size_t>(e)] > 0) r.active.push_back(e);
  }
  return r;
}

using Stage = std::tuple<int, int, int, int>;  // tile, row chunk, split, k-stage

Stage stage_of(const Cursor& c) { return {c.tile, c.chunk, c.s, c.ks}; }

struct Cta {
  std::array<ItemEntry, w4::kClaimRing> table{};
  ClaimState st;
  int pending = -1, iter = 0;
  Cursor prod, cons;
  bool started = false, finished = false;
  std::vector<Stage> issued, consumed;
};

void run_case(int n_experts, int n_active, int max_rows, int n_items, int n_kstages, int fixed_splits, int grid,
              uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const Routing r = make_routing(n_experts, n_active, max_rows, rng);
  const w4::ScheduleParams sp =
      w4::schedule_params(n_items, n_kstages, w4::kMaxNb, fixed_splits, 64, false, r.active.data(), r.offsets.data());
  w4::Plan pl = w4::make_plan(sp, static_cast<int>(r.active.size()), grid);
  pl.ring = true;
  const std::string what = testing::PrintToString(std::array<int, 7>{n_experts, n_active, max_rows, n_items,
                                                                     n_kstages, fixed_splits, grid});
  int counter = 0;  // the device's claim counter
  auto claim = [&] { return counter++; };
  auto make = [&](int idx) { return w4::make_entry(sp, pl, idx); };

  std::vector<Cta> ctas(static_cast<size_t>(grid));
  // The kernel's start: claims for the prologue, the cursors on the published entries, the prologue's stages.
  auto start = [&](Cta& c) {
    w4::claim_fill(c.st, kStages - 1, sp, pl, c.table.data(), claim, make);
    c.prod.count = c.cons.count = c.st.published[0];
    w4::load_item(c.prod, sp, pl, c.table.data());
    w4::load_item(c.cons, sp, pl, c.table.data());
    int issued = 0;
    for (int i = 0; i < kStages - 1 && c.prod.valid; ++i, ++issued) {
      c.issued.push_back(stage_of(c.prod));
      w4::advance(c.prod, sp, pl, c.table.data());
    }
    c.st.rem -= issued;
    c.started = true;
  };
  // One stage of the main loop: the published count, the producer's stage, the consumer's, thread 0's claim step.
  auto stage = [&](Cta& c) {
    c.prod.count = c.cons.count = c.st.published[c.iter & 1];
    int issued = 0;
    if (c.prod.valid) {
      c.issued.push_back(stage_of(c.prod));
      w4::advance(c.prod, sp, pl, c.table.data());
      issued = 1;
    }
    ASSERT_TRUE(c.cons.valid) << what;
    c.consumed.push_back(stage_of(c.cons));
    const ItemEntry& en = c.table[static_cast<size_t>(w4::table_slot(pl, c.cons.k))];
    ASSERT_EQ(en.tile_s & 0xffffff, c.cons.tile) << what << ": the consumer's ring entry was overwritten";
    w4::advance(c.cons, sp, pl, c.table.data());
    const int before = c.st.next;
    w4::claim_step(c.st, c.pending, issued, c.iter, sp, pl, c.table.data(), claim, make);
    if (c.st.next > before) {  // the entry just inserted must not have taken a slot the consumer still reads
      ASSERT_LT(c.st.next - 1 - c.cons.k, w4::kClaimRing) << what;
      if (c.cons.valid) {
        EXPECT_EQ(c.table[static_cast<size_t>(w4::table_slot(pl, c.cons.k))].tile_s & 0xffffff, c.cons.tile) << what;
      }
    }
    ++c.iter;
    if (!c.cons.valid) c.finished = true;
  };

  // Random interleaving: a third of the CTAs run at a quarter of the speed, and CTAs start over the first steps.
  std::vector<int> speed(static_cast<size_t>(grid));
  for (int& s : speed) s = rng() % 3 == 0 ? 1 : 4;
  for (int guard = 0; guard < 50'000'000; ++guard) {
    bool all = true;
    for (const Cta& c : ctas) all = all && c.finished;
    if (all) break;
    Cta& c = ctas[rng() % ctas.size()];
    const size_t b = static_cast<size_t>(&c - ctas.data());
    if (c.finished || rng() % 4 >= static_cast<unsigned>(speed[b])) continue;
    if (!c.started) {
      start(c);
      if (!c.cons.valid) c.finished = true;  // nothing to do: the plan was claimed out before it started
      continue;
    }
    stage(c);
    if (::testing::Test::HasFatalFailure()) return;
  }

  // Every stage of every item exactly once; each CTA consumed what its producer issued, in that order.
  std::map<Stage, int> seen;
  for (const Cta& c : ctas) {
    ASSERT_TRUE(c.finished) << what;
    ASSERT_EQ(c.issued, c.consumed) << what;
    EXPECT_TRUE(c.st.done) << what << ": a CTA stopped with the plan not claimed out";
    for (const Stage& s : c.consumed) ++seen[s];
  }
  size_t want = 0;
  for (int j = 0; j < static_cast<int>(r.active.size()); ++j) {
    const int e = r.active[static_cast<size_t>(j)];
    const int rows = r.offsets[static_cast<size_t>(e) + 1] - r.offsets[static_cast<size_t>(e)];
    const int chunks = (rows + pl.chunk_rows - 1) / pl.chunk_rows;
    for (int m = 0; m < n_items; ++m) {
      const int tile = j * n_items + m;
      for (int ch = 0; ch < chunks; ++ch) {
        for (int s = 0; s < pl.splits; ++s) {
          for (int ks = w4::split_begin(n_kstages, pl.splits, s); ks < w4::split_begin(n_kstages, pl.splits, s + 1);
               ++ks) {
            ASSERT_EQ(seen[Stage(tile, ch, s, ks)], 1) << what << " tile " << tile << " chunk " << ch << " ks " << ks;
            ++want;
          }
        }
      }
    }
  }
  EXPECT_EQ(seen.size(), want) << what;
}

TEST(MoeW4a16Schedule, ClaimsTakeEveryStageOnceAndStayAheadOfTheProducer) {
  // Kimi-K3's down at 64 tokens (56 experts, 14 items of 48 k-stages) on 132 CTAs; then short items (1-3 k-stages:
  // the claims must run ahead of a producer that crosses an entry per stage), multi-chunk experts (> 32 rows),
  // in-order fixed splits, more CTAs than items, one CTA.
  run_case(56, 56, 30, 14, 48, 0, 132, 1);
  run_case(56, 40, 70, 3, 1, 0, 16, 2);
  run_case(10, 10, 100, 2, 2, 0, 7, 3);
  run_case(20, 17, 40, 4, 3, 2, 9, 4);
  run_case(8, 3, 5, 1, 5, 0, 64, 5);
  run_case(30, 30, 64, 2, 1, 0, 1, 6);
}

// The workspace of a launch that claims: the ring's table entries and the claim counter after the ticket and exit.
TEST(MoeW4a16Schedule, ClaimsWorkspace) {
  MoeW4a16Params p;
  p.n_tokens = 64;
  p.top_k = 16;
  p.n_experts = 56;
  p.hidden = 7168;
  p.inter = 3072;
  const MoeW4a16WorkspaceGeometry tickets = moe_w4a16_workspace_geometry(p, 132);
  p.claims = true;
  const MoeW4a16WorkspaceGeometry claims = moe_w4a16_workspace_geometry(p, 132);
  EXPECT_EQ(tickets.overlap_counters, 56 + 3);
  EXPECT_EQ(claims.overlap_counters, 56 + 3);
  EXPECT_LT(tickets.table_entries, w4::kClaimRing);  // 6 for Kimi-K3 on 132 SMs
  EXPECT_EQ(claims.table_entries, w4::kClaimRing);
  p.n_tokens = 32;  // no overlap, so no claims
  EXPECT_EQ(moe_w4a16_workspace_geometry(p, 132).overlap_counters, 0);
  EXPECT_LT(moe_w4a16_workspace_geometry(p, 132).table_entries, w4::kClaimRing);
}

}  // namespace
}  // namespace bg::ops
