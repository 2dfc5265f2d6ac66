// The W4A16 kernel's work list: the plan every CTA derives from the device-side touched-expert count (split-K factor,
// parallel or in-order splits, row chunk size), the table of its items each CTA builds in shared memory at its start
// (the dispatch's global arrays are read there, all items at once, so a pass boundary costs no dependent global
// loads), and the cursor a CTA's producer and consumer walk through its stages (item -> row chunk -> split ->
// k-stage). Plain integer code shared by the kernel and the host test that walks every CTA's schedule
// (moe_w4a16_test.cpp).
//
// Four ways to cut the work (ScheduleParams, Plan): stream-K (the default for the narrow shape, up to 16 tokens: every
// CTA takes an equal run of (pass-tile, k-stage) units, so both CTAs of an SM finish together whatever the number of
// touched experts), whole items round robin (the default above 32 tokens; the overlapped down launch deals them to
// tickets, the early ones one more: overlap_head), parallel splits (up to 32 tokens
// elsewhere, fixed or chosen per touched-expert count: item = tile x split), and in-order fixed splits (more tokens:
// one CTA runs a tile's splits in order). Fixed splits give a row the same bits whatever else is in the batch. Where
// stream-K runs was measured (MoeW4a16Params::stream_k).
#pragma once

#include <cstdint>

#include "ops/moe_w4a16/moe_w4a16_layout.h"

namespace bg::ops::w4 {

struct ScheduleParams {
  int n_items = 0;       // 512-row items per expert of this projection
  int n_kstages = 0;     // 64-input stages per item
  int nb_cap = 1;        // n8 token blocks per pass: a row chunk has at most 8 nb_cap rows
  int fixed_splits = 0;  // 0: choose on the device
  bool parallel_splits = false;       // n_tokens <= 32: splits run on different CTAs
  bool stream = false;                // stream-K (the workspace geometry's choice: MoeW4a16WorkspaceGeometry::stream)
  const int32_t* active = nullptr;    // the dispatch: touched experts, ascending
  const int32_t* offsets = nullptr;   // [n_experts + 1] first permuted row of each expert
  const void* const* blocks = nullptr;  // [n_experts] each slot's expert block (null in host tests of the schedule)
};

// One projection's schedule inputs for a launch of n_tokens rows per expert set: what the kernel, the workspace
// geometry and the schedule test all derive from the projection's shape (items, k-stages) and the launch.
BG_W4_HD ScheduleParams schedule_params(int n_items, int n_kstages, int nb_cap, int fixed_splits, int64_t n_tokens,
                                        bool stream, const int32_t* active = nullptr,
                                        const int32_t* offsets = nullptr, const void* const* blocks = nullptr) {
  ScheduleParams sp;
  sp.stream = stream && fixed_splits == 0;
  sp.n_items = n_items;
  sp.n_kstages = n_kstages;
  sp.nb_cap = nb_cap;
  sp.fixed_splits = fixed_splits;
  sp.parallel_splits = n_tokens <= kChunkRows;
  sp.active = active;
  sp.offsets = offsets;
  sp.blocks = blocks;
  return sp;
}

// The work decomposition for n_active touched experts on `grid` CTAs.
struct Plan {
  int splits = 1;
  bool parallel = false;  // splits on different CTAs (else one CTA runs a tile's splits in order)
  int64_t n_items = 0;    // work items: tiles (touched expert x item), times splits when parallel
  int chunk_rows = 8;
  bool stream = false;    // stream-K: the CTA's table holds pieces of pass-tiles (set_stream_units fills the rest)
  int units = 0;          // stream-K: pass-tiles x k-stages
  int ctas = 0;           // stream-K: the CTAs that take units (0 .. ctas - 1)
  int head = 0;           // overlapped down (overlap_head): CTAs 0 .. head - 1 take one item more, first; 0: none
};

BG_W4_HD Plan make_plan(const ScheduleParams& sp, int n_active, int grid) {
  Plan pl;
  const int64_t base = static_cast<int64_t>(n_active) * sp.n_items;
  pl.chunk_rows = 8 * sp.nb_cap;
  if (sp.stream) {
    pl.stream = true;  // units and ctas follow from the pass-tiles (set_stream_units)
    pl.n_items = 0;
  } else if (sp.parallel_splits) {
    pl.splits = choose_splits(base, sp.n_kstages, grid, sp.fixed_splits, sp.nb_cap);
    pl.parallel = true;
    pl.n_items = base * pl.splits;
  } else {
    pl.splits = sp.fixed_splits > 0 ? choose_splits(base, sp.n_kstages, 1, sp.fixed_splits, sp.nb_cap) : 1;
    pl.n_items = base;
  }
  return pl;
}

// A CTA takes items b, b + grid, b + 2 grid, ...: how many. With a head (overlapped down, below) CTA b < head takes
// item b first, then every CTA b takes head + b, head + b + grid, ...
BG_W4_HD int items_of_cta(const Plan& pl, int cta, int grid) {
  if (pl.head <= 0) return pl.n_items > cta ? static_cast<int>((pl.n_items - cta + grid - 1) / grid) : 0;
  const int64_t rest = pl.n_items - pl.head - cta;
  return (cta < pl.head && cta < pl.n_items ? 1 : 0) + (rest > 0 ? static_cast<int>((rest + grid - 1) / grid) : 0);
}
// The plan's item index of entry k of CTA b's table.
BG_W4_HD int item_of_cta(const Plan& pl, int cta, int k, int grid) {
  if (pl.head <= 0) return cta + k * grid;
  if (cta < pl.head) return k == 0 ? cta : pl.head + cta + (k - 1) * grid;
  return pl.head + cta + k * grid;
}

// Overlapped down (MoeW4a16Params::overlap): down's CTAs start on SMs as gate/up's CTAs leave them and take their items
// by the order they start in (a ticket), not by blockIdx. gate/up's gate_up_items whole items round robin leave
// r = gate_up_items % grid of its CTAs one item longer than the others (all of them when gate_up_items < grid but for
// the idle ones): the grid - r tickets that start first take one item more, first (Kimi-K3 at 64 tokens: 672 gate/up
// items on 132 SMs, 120 early tickets; 392 down items, 3 or 4 on an early ticket, 2 or 3 on a late one).
BG_W4_HD int overlap_head(int64_t gate_up_items, int grid) {
  const int64_t r = gate_up_items < grid ? gate_up_items : gate_up_items % grid;
  return r == 0 ? grid : grid - static_cast<int>(r);
}

// One item of a CTA's table (32 bytes): the expert's block, its rows, its slot and item, the tile and split; under
// stream-K a piece: one row chunk of one item over the k-stages [kb, ke).
struct ItemEntry {
  const uint8_t* block = nullptr;  // the slot's expert block (ScheduleParams::blocks)
  int32_t row0 = 0, rows = 0;  // the expert's permuted rows [row0, row0 + rows) (stream-K: the chunk's)
  int32_t e_m = 0;             // expert slot | item << 16 (slots <= 1024, items < 2^15: moe_w4a16_check_params)
  int32_t tile_s = 0;          // tile (touched-expert index x n_items + item) | split << 24 (parallel splits);
                               // stream-K: the pass-tile
  int32_t k_range = 0;         // stream-K: kb | ke << 16 (k-stages < 2^14)
};

// Item `item` of the plan, read from the dispatch (active, offsets). 32-bit arithmetic: items < 2^27 (tiles < 2^24,
// splits <= 8).
BG_W4_HD ItemEntry make_entry(const ScheduleParams& sp, const Plan& pl, int item) {
  const int tile = pl.parallel ? item / pl.splits : item;
  const int s = pl.parallel ? item - tile * pl.splits : 0;
  const int j = tile / sp.n_items;
  const int e = sp.active[j];
  ItemEntry en;
  if (sp.blocks != nullptr) en.block = static_cast<const uint8_t*>(sp.blocks[e]);
  en.row0 = sp.offsets[e];
  en.rows = sp.offsets[e + 1] - en.row0;
  en.e_m = e | (tile - j * sp.n_items) << 16;
  en.tile_s = tile | s << 24;
  return en;
}

// ---- Stream-K ----------------------------------------------------------------------------------------------------
// Pass-tiles: (touched expert j, item m, row chunk c), numbered expert by expert, item-major with the chunks of an
// item next to each other (a second chunk re-reads the item's weights right after the first, mostly from L2): expert
// j's first pass-tile is tile_first[j] = n_items x (chunks of the experts before it), chunks = ceil(rows / chunk
// rows). Units: (pass-tile, k-stage), P x n_kstages in all; CTA b < ctas takes units [begin(b), begin(b + 1)),
// begin(b) = units x b / ctas, so only its first and last piece can be part of a pass-tile. A pass-tile cut between
// CTAs is finished by whichever of its pieces arrives last, which adds the pieces' partial sums in k order (the
// same bits whoever it is). 32-bit arithmetic: the workspace geometry allows stream-K only where units x (grid + 1)
// < 2^31.
inline constexpr int kStreamMinStages = 24;  // the least units a CTA takes (fewer CTAs for small launches)

BG_W4_HD int stream_chunks(int rows, int chunk_rows) { return rows > 0 ? (rows + chunk_rows - 1) / chunk_rows : 0; }
BG_W4_HD int stream_ctas(int units, int grid) {
  const int g = units / kStreamMinStages;
  return g < 1 ? 1 : (g > grid ? grid : g);
}
BG_W4_HD void set_stream_units(Plan& pl, int pass_tiles, int n_kstages, int grid) {
  pl.units = pass_tiles * n_kstages;
  pl.ctas = stream_ctas(pl.units, grid);
}
BG_W4_HD int stream_begin(const Plan& pl, int b) {
  return b >= pl.ctas ? pl.units : static_cast<int>(static_cast<uint32_t>(pl.units) * static_cast<uint32_t>(b) /
                                                    static_cast<uint32_t>(pl.ctas));
}
// The CTA whose units hold unit u (the largest b with begin(b) <= u; every CTA below ctas has units).
BG_W4_HD int stream_owner(const Plan& pl, int u) {
  return static_cast<int>((static_cast<uint32_t>(u + 1) * static_cast<uint32_t>(pl.ctas) - 1u) /
                          static_cast<uint32_t>(pl.units));
}
// Pieces (table entries) of CTA b: the pass-tiles its units touch.
BG_W4_HD int stream_count(const Plan& pl, int n_kstages, int b) {
  const int u0 = stream_begin(pl, b), u1 = stream_begin(pl, b + 1);
  return u1 > u0 ? (u1 - 1) / n_kstages - u0 / n_kstages + 1 : 0;
}
// CTA b's piece of pass-tile p keeps its partial sums in slot 2b when it starts inside p (b's first piece, the tail
// of p) and 2b + 1 when it starts at p's first k-stage (b's last piece, the head of p).
BG_W4_HD int stream_slot(const Plan& pl, int n_kstages, int b, int p) {
  return stream_begin(pl, b) > p * n_kstages ? 2 * b : 2 * b + 1;
}
// The CTAs holding pieces of pass-tile p: [first, last], in k order.
BG_W4_HD int stream_first_cta(const Plan& pl, int n_kstages, int p) { return stream_owner(pl, p * n_kstages); }
BG_W4_HD int stream_last_cta(const Plan& pl, int n_kstages, int p) {
  return stream_owner(pl, p * n_kstages + n_kstages - 1);
}

// Entry k of CTA b's table (its pieces in k order). tile_first: [n_active + 1] (the pass-tile prefix above).
BG_W4_HD ItemEntry make_stream_entry(const ScheduleParams& sp, const Plan& pl, const int32_t* tile_first,
                                     int n_active, int b, int k) {
  const int u0 = stream_begin(pl, b), u1 = stream_begin(pl, b + 1);
  const int p = u0 / sp.n_kstages + k;
  const int kb = u0 > p * sp.n_kstages ? u0 - p * sp.n_kstages : 0;
  const int ke = u1 < (p + 1) * sp.n_kstages ? u1 - p * sp.n_kstages : sp.n_kstages;
  int lo = 0, hi = n_active;  // the touched expert j with tile_first[j] <= p < tile_first[j + 1]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (tile_first[mid] <= p) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int j = lo;
  const int chunks = (tile_first[j + 1] - tile_first[j]) / sp.n_items;
  const int local = p - tile_first[j];
  const int m = local / chunks, c = local - m * chunks;
  const int e = sp.active[j];
  const int row0 = sp.offsets[e], rows = sp.offsets[e + 1] - row0;
  ItemEntry en;
  if (sp.blocks != nullptr) en.block = static_cast<const uint8_t*>(sp.blocks[e]);
  en.row0 = row0 + c * pl.chunk_rows;
  en.rows = rows - c * pl.chunk_rows < pl.chunk_rows ? rows - c * pl.chunk_rows : pl.chunk_rows;
  en.e_m = e | m << 16;
  en.tile_s = p;
  en.k_range = kb | ke << 16;
  return en;
}

// Position in a CTA's stream of stages: entry k of its item table.
struct Cursor {
  int k = 0, count = 0;            // table entry; entries of this CTA
  bool valid = false;
  bool bad = false;                // contract violation (see load_item): the kernel flags kMoeErrorDuplicateExpert
  int tile = 0, m = 0, e = 0;      // tile = j * n_items + m (j: touched-expert index); e: the expert slot
  const uint8_t* block = nullptr;  // the slot's expert block
  int row0 = 0, rows = 0;          // the expert's permuted rows
  int s = 0, s_begin = 0, s_end = 1;
  int chunk = 0, n_chunks = 0;
  int chunk_row0 = 0, chunk_rows = 0, nb = 0;
  int kb = 0, ke = 0, ks = 0;      // the split's k-stages [kb, ke) and the current one
};

// The pass's k-stages: split s of the plan's, or a stream-K entry's own (read from the table, not kept in registers).
BG_W4_HD void set_split(Cursor& c, const ScheduleParams& sp, const Plan& pl, const ItemEntry* table) {
  const int k_range = pl.stream ? table[c.k].k_range : 0;
  c.kb = pl.stream ? k_range & 0xffff : split_begin(sp.n_kstages, pl.splits, c.s);
  c.ke = pl.stream ? k_range >> 16 : split_begin(sp.n_kstages, pl.splits, c.s + 1);
  c.ks = c.kb;
}

BG_W4_HD void set_chunk(Cursor& c, const Plan& pl) {
  c.chunk_row0 = c.row0 + c.chunk * pl.chunk_rows;
  const int left = c.rows - c.chunk * pl.chunk_rows;
  c.chunk_rows = left < pl.chunk_rows ? left : pl.chunk_rows;
  c.nb = (c.chunk_rows + 7) / 8;
}

// Loads the cursor's table entry, or the next one with rows; valid = false past the CTA's last item.
BG_W4_HD void load_item(Cursor& c, const ScheduleParams& sp, const Plan& pl, const ItemEntry* table) {
  for (; c.k < c.count; ++c.k) {
    const ItemEntry en = table[c.k];
    if (en.rows <= 0) continue;
    c.row0 = en.row0;
    c.rows = en.rows;
    c.e = en.e_m & 0xffff;
    c.block = en.block;
    c.m = en.e_m >> 16;
    c.tile = en.tile_s & 0xffffff;
    c.n_chunks = (c.rows + pl.chunk_rows - 1) / pl.chunk_rows;  // stream-K: 1 (an entry is one chunk)
    // Parallel splits own one partial slot per (tile, split): one pass of rows only. rows <= n_tokens <= 8 nb_cap
    // holds unless a token sent two rows to one expert (a token's expert ids must be distinct).
    c.bad = pl.parallel && pl.splits > 1 && c.n_chunks > 1;
    c.s_begin = en.tile_s >> 24;
    c.s_end = pl.parallel ? c.s_begin + 1 : pl.splits;
    c.s = c.s_begin;
    c.chunk = 0;
    set_chunk(c, pl);
    set_split(c, sp, pl, table);
    c.valid = true;
    return;
  }
  c.valid = false;
}

// Next stage: k-stage, then split (in-order splits), then row chunk, then the CTA's next item.
BG_W4_HD void advance(Cursor& c, const ScheduleParams& sp, const Plan& pl, const ItemEntry* table) {
  if (++c.ks < c.ke) return;
  if (++c.s < c.s_end) {
    set_split(c, sp, pl, table);
    return;
  }
  c.s = c.s_begin;
  set_split(c, sp, pl, table);
  if (++c.chunk < c.n_chunks) {
    set_chunk(c, pl);
    return;
  }
  ++c.k;
  load_item(c, sp, pl, table);
}

// Whether a pass ends with partial sums (split-K or a stream-K piece of part of a pass-tile).
BG_W4_HD bool pass_is_partial(const Cursor& c, const ScheduleParams& sp, const Plan& pl) {
  return pl.stream ? c.kb > 0 || c.ke < sp.n_kstages : pl.splits > 1;
}

// Split-K partial slot of a pass: (tile, split) for parallel splits, the CTA's running-sum slot for in-order splits;
// stream-K: the CTA's piece that starts inside its pass-tile (2 cta) or at its first k-stage (2 cta + 1).
BG_W4_HD int64_t partial_slot(const Cursor& c, const Plan& pl, int64_t seq_slot_base, int cta) {
  if (pl.stream) return 2 * static_cast<int64_t>(cta) + (c.kb > 0 ? 0 : 1);  // stream_slot's rule
  return pl.parallel ? static_cast<int64_t>(c.tile) * pl.splits + c.s : seq_slot_base + cta;
}

// The wide shape's pipeline depth (Shape<false>::kStages in moe_w4a16_pipeline.cuh).
inline constexpr int kWideStages = 6;

}  // namespace bg::ops::w4
