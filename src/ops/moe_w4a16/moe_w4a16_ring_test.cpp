// The W4A16 kernel's stage ring (MoeW4a16Params::mbarriers), emulated on the host with the kernel's own ring
// positions (w4::RingPos, kMbarLead): warps read a stage once its full barrier's phase completes, arrive on its empty
// barrier, then refill the buffer kMbarLead stages ahead once its empty barrier's previous phase completes; each
// warp's share of a stage lands at a random later time and then arrives on the full barrier (cp.async's arrival);
// CTA barriers sit in the producer's path (await_expert) and after passes (the epilogues). Random interleavings must
// finish (no deadlock), every stage must be read by every warp after all of it landed, no share may land in a buffer
// whose previous stage a warp has not read yet, and no wait may be on a barrier that has moved two phases on (parity
// then names the wrong phase).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "ops/moe_w4a16/moe_w4a16_schedule.h"

namespace bg::ops {
namespace {

using w4::kMbarLead;
using w4::kWideStages;
using w4::RingPos;

// An mbarrier: `count` arrivals complete a phase. test_wait(parity) is PTX's: true when the phase of that parity is
// the one before the current (incomplete) phase.
struct MBar {
  int count = 0, pending = 0, completed = 0;
  void arrive() {
    if (--pending == 0) {
      ++completed;
      pending = count;
    }
  }
  bool test_wait(uint32_t parity) const { return parity != (static_cast<uint32_t>(completed) & 1u); }
};

enum class Pc { kRead, kProduce, kBarrier, kDone };

template <class Pos>
struct Warp {
  Pos read, fill;
  int next_read = 0, next_fill = 0, barriers = 0;
  Pc pc = Pc::kRead;
};

struct Landing {
  int warp, stage, buf;
};

// The ring of one CTA over `total` stages with `n_warps` warps (a full barrier's phase needs one arrival per warp
// here, standing for its threads' cp.async arrivals; an empty one, as in the kernel, lane 0's after its warp read the
// stage). Returns "" or what went wrong.
template <class Pos>
std::string run_ring(int n_warps, int total, int lead, uint64_t seed) {
  std::mt19937_64 rng(seed);
  MBar full[kWideStages], empty[kWideStages];
  for (int b = 0; b < kWideStages; ++b) full[b] = empty[b] = MBar{n_warps, n_warps, 0};
  std::vector<std::vector<int>> tag(kWideStages, std::vector<int>(static_cast<size_t>(n_warps), -1));
  std::vector<int> reads(static_cast<size_t>(total), 0), barrier_arrivals;
  std::vector<Warp<Pos>> warps(static_cast<size_t>(n_warps));
  std::vector<Landing> landings;
  // The CTA barriers every warp meets at the same points: a new expert at every 7th produced stage, a pass end after
  // every 5th read one.
  auto barrier_after = [&](int read_stage, int produced) {
    return (read_stage % 5 == 4) || (produced >= 0 && produced % 7 == 3);
  };
  // A wait on phase `want` (0, 1, ...) of a barrier: the barrier must not have completed more than want + 1 phases.
  auto lapped = [](const MBar& m, int want) { return m.completed > want + 1; };
  auto issue = [&](Warp<Pos>& w, int wi) {
    landings.push_back({wi, w.next_fill, w.fill.buf});
    w.fill.next();
    ++w.next_fill;
  };
  for (int wi = 0; wi < n_warps; ++wi) {  // the prologue: fresh buffers, no empty wait
    for (int i = 0; i < lead && i < total; ++i) issue(warps[static_cast<size_t>(wi)], wi);
  }
  for (int64_t step = 0;; ++step) {
    if (step > 10'000'000) return "no end";
    // Candidates: the warps that can move, and the landings.
    std::vector<int> movable;
    bool all_done = true;
    for (int wi = 0; wi < n_warps; ++wi) {
      Warp<Pos>& w = warps[static_cast<size_t>(wi)];
      if (w.pc == Pc::kDone) continue;
      all_done = false;
      bool can = false;
      if (w.pc == Pc::kRead) {
        can = w.next_read == total || full[w.read.buf].test_wait(w.read.full_parity());
      } else if (w.pc == Pc::kProduce) {
        can = w.next_fill >= total || empty[w.fill.buf].test_wait(w.fill.empty_parity());
      } else {
        can = barrier_arrivals[static_cast<size_t>(w.barriers)] == n_warps;
      }
      if (can) movable.push_back(wi);
    }
    if (all_done) break;
    const size_t n = movable.size() + landings.size();
    if (n == 0) return "deadlock at step " + std::to_string(step);
    const size_t pick = std::uniform_int_distribution<size_t>(0, n - 1)(rng);
    if (pick >= movable.size()) {  // a warp's share of a stage lands, then its arrival on the full barrier
      const Landing l = landings[pick - movable.size()];
      landings.erase(landings.begin() + static_cast<int64_t>(pick - movable.size()));
      const int prev = l.stage - kWideStages;
      if (prev >= 0 && reads[static_cast<size_t>(prev)] != n_warps) {
        return "stage " + std::to_string(l.stage) + " landed over stage " + std::to_string(prev) + " before every "
               "warp read it";
      }
      tag[static_cast<size_t>(l.buf)][static_cast<size_t>(l.warp)] = l.stage;
      if (lapped(full[l.buf], l.stage / kWideStages)) return "full barrier lapped";
      full[l.buf].arrive();
      continue;
    }
    const int wi = movable[pick];
    Warp<Pos>& w = warps[static_cast<size_t>(wi)];
    if (w.pc == Pc::kRead) {
      if (w.next_read == total) {
        w.pc = Pc::kDone;
        continue;
      }
      const int s = w.next_read;
      if (w.read.buf != s % kWideStages) return "read position off";
      if (lapped(full[w.read.buf], s / kWideStages)) return "full barrier lapped at a read";
      for (int share = 0; share < n_warps; ++share) {
        if (tag[static_cast<size_t>(w.read.buf)][static_cast<size_t>(share)] != s) {
          return "stage " + std::to_string(s) + " read before all of it landed";
        }
      }
      ++reads[static_cast<size_t>(s)];
      empty[w.read.buf].arrive();
      w.read.next();
      ++w.next_read;
      w.pc = Pc::kProduce;
    } else if (w.pc == Pc::kProduce) {
      int produced = -1;
      if (w.next_fill < total) {
        if (lapped(empty[w.fill.buf], w.next_fill / kWideStages - 1)) return "empty barrier lapped";
        produced = w.next_fill;
        issue(w, wi);
      }
      if (barrier_after(w.next_read - 1, produced)) {
        if (barrier_arrivals.size() <= static_cast<size_t>(w.barriers)) barrier_arrivals.push_back(0);
        ++barrier_arrivals[static_cast<size_t>(w.barriers)];
        w.pc = Pc::kBarrier;
      } else {
        w.pc = Pc::kRead;
      }
    } else {
      ++w.barriers;
      w.pc = Pc::kRead;
    }
  }
  for (int s = 0; s < total; ++s) {
    if (reads[static_cast<size_t>(s)] != n_warps) return "stage " + std::to_string(s) + " not read by every warp";
  }
  return "";
}

// A filler that waits on the empty barrier's current phase instead of the previous one.
struct WrongParity : RingPos {
  uint32_t empty_parity() const { return phase; }
};

TEST(MoeW4a16Ring, EveryStageReadOnceLandedAndNeverOverwrittenEarly) {
  // The kernel's 8 warps, few and many stages (fewer than the lead, one ring, many rings), and other warp counts.
  for (const int total : {1, 3, 4, 6, 7, 13, 64, 300}) {
    for (uint64_t seed = 1; seed <= 20; ++seed) {
      EXPECT_EQ(run_ring<RingPos>(8, total, kMbarLead, seed), "") << total << " stages, seed " << seed;
    }
  }
  EXPECT_EQ(run_ring<RingPos>(1, 100, kMbarLead, 7), "");
  EXPECT_EQ(run_ring<RingPos>(3, 100, kMbarLead, 8), "");
}

TEST(MoeW4a16Ring, TheEmulationCatchesABrokenRing) {
  // A filler on the wrong parity never waits on the first refill (so a share lands over an unread stage) or waits
  // forever; a lead past the ring refills a buffer the warps have not all read.
  bool caught = false;
  for (uint64_t seed = 1; seed <= 20 && !caught; ++seed) {
    caught = !run_ring<WrongParity>(8, 64, kMbarLead, seed).empty();
  }
  EXPECT_TRUE(caught) << "a wrong parity";
  caught = false;
  for (uint64_t seed = 1; seed <= 20 && !caught; ++seed) {
    caught = !run_ring<RingPos>(8, 64, kWideStages + 1, seed).empty();
  }
  EXPECT_TRUE(caught) << "a lead past the ring";
}

}  // namespace
}  // namespace bg::ops
