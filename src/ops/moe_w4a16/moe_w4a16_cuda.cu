// Grouped W4A16 MXFP4 expert FFN for decode: a persistent, cp.async-pipelined mma.sync kernel over a device-side work
// list, run twice per layer (gate/up with the GLU fused, then down with the weighted combine fused).
//
// Design
// - Operands: weights are the M dimension of mma.sync.m16n8k16 (bf16 in, fp32 accumulate), tokens (an expert's rows)
//   the N dimension, 8 per n-block, 1..4 n-blocks per pass (1..32 rows). Weights stay MXFP4 (4.25 bits) all the way
//   into registers: the load-time layout (moe_w4a16_layout.h) stores each warp's A fragments so one 16-byte shared
//   load holds a thread's registers for 4 k-steps; E2M1 -> bf16 is 9 integer ops per 8 weights (bit placement chosen
//   at load time), the E8M0 scale one bf16x2 multiply per register (exact: a power of two), its 2^126 bias folded
//   into the stored exponent. Activations are gathered per token straight from x by the dispatch's row_token
//   (cp.async, no separate gather), 16-byte runs that land in B registers under a k permutation applied to both sides.
// - Work list: item = (touched expert j, 512-row item m, k-split s); CTA b takes items b, b + grid, ... (grid = SM
//   count, 1 CTA of 8 warps per SM), read from the dispatch once at its start into a shared-memory item table. The
//   touched-expert count is read on the device, so a CUDA graph captured once serves every routing. Split-K S (1..8)
//   is chosen on the device from n_active so that e.g. 16 touched Kimi-K3 experts (192 gate/up items) become 384 and
//   fill 132 SMs in 3 even waves; fixed_splits pins S (batch invariance). Narrow launches (at most 16 tokens) take
//   stream-K instead: every CTA an equal run of (pass-tile, k-stage) units, cut pass-tiles finished in k order by
//   their last piece (moe_w4a16_schedule.h, reduce_splits).
// - Pipeline: 6 stages of (17408 B weights + 4608 B activations) = 129 KiB of shared memory; the producer (every
//   thread, cp.async 16 B, plain L2 caching: see cp_async16) runs 5 stages ahead of the consumer across item
//   boundaries, so the stream of weights never stops for an epilogue. One __syncthreads per 17 KiB stage. The
//   producer keeps its source addresses and steps them by one stage; they are recomputed only at a pass's start.
// - The consumer runs one pass (chunk x split) at a time in a function templated on the pass's n8 blocks, so its
//   accumulators are sized by the pass: a 1..8-row pass keeps 16 of them, not 64 (a single accumulator array for up
//   to 4 blocks cost ~8 register moves per code word, measured with Nsight Compute on the H200).
// - Split-K reduction, deterministic: each split writes its fp32 accumulators in fragment order (coalesced float4) to
//   its own slot; the CTA whose arrival (an integer atomic) completes the tile adds slots 0..S-1 in that fixed order.
//   Who arrives last never changes the sum. With > 32 tokens (several row passes per expert) a fixed S is run
//   sequentially by one CTA with the same additions in the same order, so the bits do not depend on the batch size.
// - Epilogues: gate/up: 2^shift, GLU (SwiGLU / SiTU) in registers (a warp holds gate and up tiles of the same
//   columns), h in bf16. Down: y (fp32) per permuted row; then per (token, 512 output columns) an integer counter of
//   finished slots; the CTA that finishes the token's last slot computes out[t] = (accumulate ? out : 0) +
//   sum_k w_k y_k in fp32 in slot order (a fixed order whoever finishes last), so the combine is fused and
//   deterministic; counters are reset by their last user, so graph replays start from zero. Without accumulate the
//   rows of tokens with no pair (padding) are zeroed by down's CTAs, so `out` needs no fill before the launch. Above
//   32 tokens (moe_w4a16_separate_combine) down only writes y and a third kernel does the same sums, spread evenly.
// - Overlap (above 32 tokens with PDL, moe_w4a16_overlaps): gate/up releases a ready counter per expert after each
//   pass's h and lets down launch at once; down's CTAs start as gate/up's leave their SMs, take items by the order they
//   started in (the early ones one more: gate/up's last wave runs beside them) and wait per expert (await_expert).
//
// Performance model (H200: 132 SMs, read ceiling ~4.6 TB/s; Kimi-K3 expert = 17.5 MB packed, 16 touched = 281 MB)
// - Bytes in flight per SM: 5 stages x 17 KiB = 85 KiB of weights. Little's law at 0.85 x 4.6 TB/s / 132 SMs =
//   29.6 GB/s per SM and ~1 us loaded latency needs ~30 KiB: 2.9x margin.
// - Issue per 4-byte code word (8 weights, one thread): 9 decode + 4 mul.bf16x2 + 0.5 scale + NB mma + ~0.9 shared
//   loads/cp.async + ~1 address/loop = ~15.5 + NB instructions. At 29.6 GB/s per SM (~17 B/clk at 1.75 GHz) the SM
//   has 128 thread-instructions per clock: ~7.5 per byte available, 4.1 (NB = 1) to 4.9 (NB = 4) used.
// - Tensor pipe: NB mma per 128 bytes: 0.13 (1-8 rows) to 0.53 (25-32 rows) mma.m16n8k16 per clock per SM against
//   ~0.7 sustained by mma.sync on Hopper; 32 rows per expert is the tight case (wgmma would lift it).
// - Fixed costs per kernel: pipeline fill (~1.5 us), the last wave's tail and the final reductions (~1-2 us).
// - Predicted: >= 0.85 of read at 1-16 rows per expert, ~0.75-0.8 at 32. Measured (H100, random top-16 of 56,
//   2026-12-06): 0.70 / 0.84 at 1 / 16 tokens (narrow), 0.69 / 0.63 at 48 / 64 (wide): the decode's integer chains
//   after each stage barrier, with 2 warps per scheduler, bound it (docs/MOE_W4A16.md, "Where the time goes").
// Resources (nvcc 13.0 -Xptxas -v, sm_90a, 2026-12-06): 244 / 214 registers (down / gate-up), no spills; down's
// 120-byte stack frame is await_expert's call (out of line: inlined, ptxas spilled in the main loop); 129 KiB of
// dynamic shared memory + the item table, 1 CTA of 256 threads per SM. Full report and measurements:
// docs/MOE_W4A16.md.
#include <algorithm>
#include <mutex>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"
#include "ops/moe_w4a16/moe_w4a16_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_device.cuh"
#include "ops/moe_w4a16/moe_w4a16_epilogue.cuh"
#include "ops/moe_w4a16/moe_w4a16_pipeline.cuh"
#include "ops/moe_w4a16/moe_w4a16_schedule.h"

namespace bg::ops {
namespace {

using namespace w4;
using ptx::atomic_add_acq_rel;

// Fragment-order float4 index of (tile mt, n-block nb) for this thread inside a partial slot.
__device__ __forceinline__ int64_t partial_index(const KernelArgs& a, int mt, int nb) {
  return (static_cast<int64_t>(mt * a.sched.nb_cap + nb) * kThreads + threadIdx.x) * 4;
}

// Split-K bookkeeping at the end of a pass. Returns true when acc holds the full sum (this CTA finishes the tile).
template <int NB>
__device__ bool reduce_splits(Acc<NB>& acc, const Cursor& c, const KernelArgs& a, const Plan& pl, int* s_flag) {
  if (!pass_is_partial(c, a.sched, pl)) return true;
  const int64_t slot = partial_slot(c, pl, a.ws.seq_slot_base, static_cast<int>(blockIdx.x));
  float* own = a.ws.partials + slot * a.ws.partial_slot_floats;
  if (!pl.parallel && !pl.stream) {
    // Running sum ((p0 + p1) + p2) ... in this CTA's slot: the parallel path's additions, in its order.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        float4* p = reinterpret_cast<float4*>(own + partial_index(a, mt, nb));
        float4 v = make_float4(acc[mt][nb][0], acc[mt][nb][1], acc[mt][nb][2], acc[mt][nb][3]);
        if (c.s > 0) {
          const float4 run = *p;
          v = make_float4(run.x + v.x, run.y + v.y, run.z + v.z, run.w + v.w);
        }
        if (c.s + 1 < pl.splits) {
          *p = v;
        } else {
          acc[mt][nb][0] = v.x, acc[mt][nb][1] = v.y, acc[mt][nb][2] = v.z, acc[mt][nb][3] = v.w;
        }
      }
    return c.s + 1 == pl.splits;
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      __stcg(reinterpret_cast<float4*>(own + partial_index(a, mt, nb)),
             make_float4(acc[mt][nb][0], acc[mt][nb][1], acc[mt][nb][2], acc[mt][nb][3]));
    }
  // Stream-K: the pass-tile's pieces are held by CTAs [b0, b1] (in k order).
  const int kst = a.sched.n_kstages;
  const int b0 = pl.stream ? stream_first_cta(pl, kst, c.tile) : 0;
  const int b1 = pl.stream ? stream_last_cta(pl, kst, c.tile) : 0;
  const int pieces = pl.stream ? b1 - b0 + 1 : pl.splits;
  // Release (every thread's partial, then the arrival) and acquire (the arrival, then the other partials): the
  // barrier / fence / atomic / fence / barrier pattern of a grid-wide barrier. Thread 0's fences are cumulative over
  // the writes the CTA barrier ordered before them, so the other threads need no fence of their own (one each cost
  // ~1% at 1-4 rows, measured on the H200).
  __syncthreads();
  if (threadIdx.x == 0) *s_flag = atomic_add_acq_rel(&a.ws.tile_counters[c.tile], 1) == pieces - 1;
  __syncthreads();
  if (!*s_flag) return false;
  if (pl.stream) {
    // ((p_b0 + p_b0+1) + ...): the pieces' partial sums in k order, whichever piece arrived last.
#pragma unroll 1
    for (int b = b0; b <= b1; ++b) {
      const float* src = a.ws.partials + static_cast<int64_t>(stream_slot(pl, kst, b, c.tile)) *
                                             a.ws.partial_slot_floats;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          const float4 p = __ldcg(reinterpret_cast<const float4*>(src + partial_index(a, mt, nb)));
          if (b == b0) {
            acc[mt][nb][0] = p.x, acc[mt][nb][1] = p.y, acc[mt][nb][2] = p.z, acc[mt][nb][3] = p.w;
          } else {
            acc[mt][nb][0] += p.x, acc[mt][nb][1] += p.y, acc[mt][nb][2] += p.z, acc[mt][nb][3] += p.w;
          }
        }
    }
    if (threadIdx.x == 0) a.ws.tile_counters[c.tile] = 0;  // for the next launch (stream-ordered)
    return true;
  }
  const float* first = a.ws.partials + static_cast<int64_t>(c.tile) * pl.splits * a.ws.partial_slot_floats;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      float4 v = __ldcg(reinterpret_cast<const float4*>(first + partial_index(a, mt, nb)));
      for (int s = 1; s < pl.splits; ++s) {
        const float4 p = __ldcg(reinterpret_cast<const float4*>(first + s * a.ws.partial_slot_floats +
                                                                  partial_index(a, mt, nb)));
        v = make_float4(v.x + p.x, v.y + p.y, v.z + p.z, v.w + p.w);
      }
      acc[mt][nb][0] = v.x, acc[mt][nb][1] = v.y, acc[mt][nb][2] = v.z, acc[mt][nb][3] = v.w;
    }
  if (threadIdx.x == 0) a.ws.tile_counters[c.tile] = 0;  // for the next launch (stream-ordered)
  return true;
}

// The consumer's state across passes: the buffer read next, dependents released.
struct Consumer {
  Cursor c;
  int buf = 0;
  bool triggered = false;
};

// One pass (a chunk of NB n8 token blocks x a split's k-stages) of the consumer, with the producer kStages - 1 stages
// ahead (across pass and item boundaries), then its epilogue. The accumulators live in this function, sized by NB.
template <bool kGateUp, bool kWgmma, int kStages, int NB>
__device__ __forceinline__ void consume_pass(Consumer& k, Producer& prod, const KernelArgs& a, const Plan& pl,
                                             const ItemEntry* table, uint8_t* bufs, int* s_flag, CombineSmem& cs) {
  using B = Buf<kWgmma>;
  constexpr bool kOverlap = kStages != Shape<true>::kStages;  // the narrow shape never overlaps (moe_w4a16_overlaps)
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  Acc<NB> acc;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nb][i] = 0.0f;
  // A token sent two rows to one expert (its expert ids were not distinct): flagged for the backend to report at the
  // step's sync; the pass computes garbage for that chunk but stays in bounds (a trap would poison the context).
  if (k.c.bad && threadIdx.x == 0) atomicOr(a.d.error_flags, kMoeErrorDuplicateExpert);
#pragma unroll 1
  for (int ks = k.c.ks; ks < k.c.ke; ++ks) {
    cp_async_wait<kStages - 2>();  // this thread's copies of stage `buf` landed
    if constexpr (kWgmma) fence_proxy_async();  // ... and are visible to wgmma's reads
    __syncthreads();  // everyone's did, and everyone finished the stage before (its buffer is refilled now)
    const int pbuf = k.buf == 0 ? kStages - 1 : k.buf - 1;
    if (prod.c.valid) {
      issue_weights(prod, bufs + pbuf * B::kBytes + B::kWeights);
      if (kOverlap && !kGateUp && a.overlap && prod.c.e != prod.ready_e) await_expert(prod, a, pl.chunk_rows);
      issue_acts<kWgmma>(prod, a, bufs + pbuf * B::kBytes);
      producer_next<kGateUp>(prod, a, pl, table);
    } else if (!k.triggered) {
      // Nothing left to request: let the dependent grid (down, with a.pdl) start on SMs as they free up.
      launch_dependents();
      k.triggered = true;
    }
    cp_async_commit();
    const uint8_t* wbuf = bufs + k.buf * B::kBytes;
    if constexpr (kWgmma) {
      wgmma_stage<NB>(acc, wbuf + B::kWeights, smem_addr(wbuf + B::kActs), warp, lane);
    } else {
      mma_stage<NB>(acc, wbuf, wbuf + B::kActs, warp, lane);  // Buf<false>: weights at 0, activations after
    }
    k.buf = k.buf + 1 == kStages ? 0 : k.buf + 1;
  }
  k.c.ks = k.c.ke - 1;  // the pass's last stage: advance() moves to the next pass
  if (reduce_splits<NB>(acc, k.c, a, pl, s_flag)) {
    if constexpr (kGateUp) {
      store_h<NB>(acc, k.c, a);
      if (kOverlap && a.overlap) {  // this pass's h rows are down's to read (await_expert)
        __syncthreads();
        if (threadIdx.x == 0) ptx::red_add_release(a.ws.expert_ready + k.c.e, 1);
      }
    } else if (a.rows_out) {
      store_rows<NB>(acc, k.c, a);
    } else if (!a.combine_fused) {
      store_y<NB>(acc, k.c, a);
    } else {
      store_y_and_combine<NB, kStages == Shape<true>::kStages ? 4 : 8>(acc, k.c, a, cs);  // narrow : wide
    }
  }
  advance(k.c, a.sched, pl, table);
}

// Stream-K: tile_first[j] = n_items x (row chunks of touched experts 0 .. j - 1), j = 0 .. n_active (shared memory),
// from the dispatch's offsets: a block scan, each thread over up to 4 experts (n_active <= 1024). Ends with a barrier.
__device__ void stream_tile_prefix(const ScheduleParams& sp, int chunk_rows, int n_active, int32_t* tile_first) {
  __shared__ int s_warp[kWarps];
  const int per = (n_active + kThreads - 1) / kThreads;
  const int j0 = static_cast<int>(threadIdx.x) * per;
  int tiles[4] = {0, 0, 0, 0};
  int local = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (i < per && j0 + i < n_active) {
      const int e = sp.active[j0 + i];
      tiles[i] = stream_chunks(sp.offsets[e + 1] - sp.offsets[e], chunk_rows) * sp.n_items;
      local += tiles[i];
    }
  }
  int total = 0;
  int run = cuda_util::block_exclusive_scan<kThreads>(local, s_warp, &total);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (i < per && j0 + i < n_active) {
      tile_first[j0 + i] = run;
      run += tiles[i];
    }
  }
  if (threadIdx.x == 0) tile_first[n_active] = total;
  __syncthreads();
}

template <bool kGateUp, bool kWgmma, bool kNarrow>
__global__ void __launch_bounds__(kThreads, Shape<kNarrow>::kCtasPerSm)
    moe_w4a16_kernel(const __grid_constant__ KernelArgs a) {
  static_assert(!(kNarrow && kWgmma), "the narrow shape runs mma.sync");
  using B = Buf<kWgmma>;
  constexpr int kStages = Shape<kNarrow>::kStages;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* const bufs = buffers<kWgmma>(smem);
  __shared__ int s_flag;
  __shared__ CombineSmem s_combine;
  const int grid = static_cast<int>(gridDim.x);
  // Overlap: gate/up lets down's grid launch at once (its CTAs take SMs as gate/up's leave them); a down CTA's place
  // in the schedule is its ticket, the order it started in (overlap_head).
  constexpr bool kOverlap = !kNarrow;  // the narrow shape never overlaps (moe_w4a16_overlaps): compiled out there
  if (kOverlap && kGateUp && a.overlap) launch_dependents();
  int cta = static_cast<int>(blockIdx.x);
  if (kOverlap && !kGateUp && a.overlap) {
    if (threadIdx.x == 0) s_flag = atomicAdd(a.ws.overlap_sched, 1);
    __syncthreads();
    cta = s_flag;
    __syncthreads();  // s_flag is reused
  }
  const int n_active = *a.d.n_active;
  Plan pl = make_plan(a.sched, n_active, grid);
  if (kOverlap && !kGateUp && a.overlap) {
    pl.head = overlap_head(static_cast<int64_t>(n_active) * a.n_items_gate_up, grid);
  }

  // This CTA's items, read from the dispatch all at once (one round of dependent global loads, not one per pass).
  auto* table = reinterpret_cast<ItemEntry*>(smem + Shape<kNarrow>::kSmemBytes);
  auto* tile_first = reinterpret_cast<int32_t*>(table + a.table_cap);  // stream-K: [n_active + 1]
  int count = 0;
  if (pl.stream) {
    if (n_active > a.n_experts) {  // a broken dispatch (the prefix has n_experts + 1 entries)
      if (threadIdx.x == 0) atomicOr(a.d.error_flags, kMoeErrorBadDescriptor);
      return;
    }
    stream_tile_prefix(a.sched, pl.chunk_rows, n_active, tile_first);
    set_stream_units(pl, tile_first[n_active], a.sched.n_kstages, grid);
    count = stream_count(pl, a.sched.n_kstages, cta);
  } else {
    count = items_of_cta(pl, cta, grid);
  }
  if (count > a.table_cap) {  // the host sized the table for every touched-expert count: a broken dispatch
    if (threadIdx.x == 0) atomicOr(a.d.error_flags, kMoeErrorBadDescriptor);
    count = 0;  // nothing to run, but an overlapped down CTA still takes part in the counters' reset below
  }
  for (int k = static_cast<int>(threadIdx.x); k < count; k += kThreads) {
    table[k] = checked_entry(a, pl.stream ? make_stream_entry(a.sched, pl, tile_first, n_active, cta, k)
                                          : make_entry(a.sched, pl, item_of_cta(pl, cta, k, grid)));
  }
  __syncthreads();

  Producer prod;
  Consumer cons;
  prod.c.count = cons.c.count = count;
  load_item(prod.c, a.sched, pl, table);
  load_item(cons.c, a.sched, pl, table);
  if (prod.c.valid) producer_start_pass<kGateUp>(prod, a);
  // Prologue: the first stages' weights do not depend on the previous kernel, so they are requested before
  // griddepcontrol.wait (a no-op unless this grid was launched as a programmatic dependent, see a.pdl); the
  // activations (h, for down) only after it. Stage 0's group holds all those weights: waits stay in order.
  {
    Producer w = prod;
#pragma unroll 1
    for (int i = 0; i < kStages - 1 && w.c.valid; ++i) {
      issue_weights(w, bufs + i * B::kBytes + B::kWeights);
      producer_next<kGateUp>(w, a, pl, table);
    }
  }
  if (!kOverlap || kGateUp || !a.overlap) grid_dependency_wait();
  if (!kGateUp && a.combine_fused && !a.accumulate && !a.rows_out) zero_tokens_without_pairs(a, cta, grid);
#pragma unroll 1
  for (int i = 0; i < kStages - 1; ++i) {
    if (prod.c.valid) {
      if (kOverlap && !kGateUp && a.overlap && prod.c.e != prod.ready_e) await_expert(prod, a, pl.chunk_rows);
      issue_acts<kWgmma>(prod, a, bufs + i * B::kBytes);
      producer_next<kGateUp>(prod, a, pl, table);
    }
    cp_async_commit();
  }

#pragma unroll 1
  while (cons.c.valid) {
    // Uniform across the CTA. A narrow launch (at most 16 tokens) has passes of at most 2 n8 blocks (its workspace's
    // nb_cap), and only those are compiled into its kernel: 3- and 4-block passes would set its registers. (Written
    // out here: the same dispatch in a forceinline function changed the narrow kernel's spills, 2026-12-07.)
    if constexpr (kNarrow) {
      if (cons.c.nb == 1) {
        consume_pass<kGateUp, kWgmma, kStages, 1>(cons, prod, a, pl, table, bufs, &s_flag, s_combine);
      } else {
        consume_pass<kGateUp, kWgmma, kStages, 2>(cons, prod, a, pl, table, bufs, &s_flag, s_combine);
      }
    } else {
      switch (cons.c.nb) {
        case 1: consume_pass<kGateUp, kWgmma, kStages, 1>(cons, prod, a, pl, table, bufs, &s_flag, s_combine); break;
        case 2: consume_pass<kGateUp, kWgmma, kStages, 2>(cons, prod, a, pl, table, bufs, &s_flag, s_combine); break;
        case 3: consume_pass<kGateUp, kWgmma, kStages, 3>(cons, prod, a, pl, table, bufs, &s_flag, s_combine); break;
        default: consume_pass<kGateUp, kWgmma, kStages, 4>(cons, prod, a, pl, table, bufs, &s_flag, s_combine); break;
      }
    }
  }
  cp_async_wait<0>();
  if (kOverlap && !kGateUp && a.overlap) {
    // gate/up has finished (so a kernel after this one that relies on stream order sees it done too); the last CTA
    // to leave zeroes the ready counters, the ticket and this count for the next launch.
    grid_dependency_wait();
    __syncthreads();
    if (threadIdx.x == 0) s_flag = atomic_add_acq_rel(a.ws.overlap_sched + 1, 1) == grid - 1;
    __syncthreads();
    if (s_flag) {
      for (int e = static_cast<int>(threadIdx.x); e < a.n_experts; e += kThreads) a.ws.expert_ready[e] = 0;
      if (threadIdx.x == 0) a.ws.overlap_sched[0] = a.ws.overlap_sched[1] = 0;
    }
  }
}

// The combine in a kernel of its own (moe_w4a16_separate_combine): CTA (t, m) computes out[t] over the down item m's
// 512 columns, 4 per thread, with the fused combine's arithmetic (combine_token: the same bits). Launched after down
// (as its programmatic dependent with pdl: it waits for down's y before reading it). A token without pairs (padding:
// its first slot is -1) is left alone, or zeroed without accumulate, as the fused combine does.
constexpr int kCombineThreads = kCombineCols / 4;
__global__ void __launch_bounds__(kCombineThreads) moe_w4a16_combine_kernel(const __grid_constant__ KernelArgs a) {
  __shared__ int s_prow[kMaxTopK];
  __shared__ float s_weight[kMaxTopK];
  grid_dependency_wait();
  const int token = static_cast<int>(blockIdx.x);
  const int k = static_cast<int>(threadIdx.x);
  if (k < a.top_k) {
    const int prow = a.d.slot_row[static_cast<int64_t>(token) * a.top_k + k];
    s_prow[k] = prow;
    s_weight[k] = prow >= 0 ? a.d.row_weight[prow] : 0.0f;
  }
  __syncthreads();
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kCombineCols + 4 * k;
  if (col >= a.n_out) return;  // n_out % 32 == 0: all 4 columns valid
  if (s_prow[0] >= 0) {
    combine_token<8>(a, token, s_prow, s_weight, col);
  } else if (!a.accumulate) {
    zero_columns(a, token, col);
  }
}

int sm_count() {
  int dev = 0, n = 0;
  BG_CUDA_CHECK(cudaGetDevice(&dev));
  BG_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

bool runs_narrow(const MoeW4a16Params& p) { return moe_w4a16_runs_narrow(p); }

// Persistent CTAs of a launch: one or two per SM.
int grid_of(const MoeW4a16Params& p) {
  return sm_count() * (runs_narrow(p) ? Shape<true>::kCtasPerSm : Shape<false>::kCtasPerSm);
}

// Dynamic shared memory of a launch: the pipeline's buffers, then the item table.
int smem_bytes(const MoeW4a16Workspace& ws) {
  const int pipeline = runs_narrow(ws.params) ? Shape<true>::kSmemBytes : Shape<false>::kSmemBytes;
  return pipeline + ws.table_entries * static_cast<int>(sizeof(ItemEntry)) +
         ws.prefix_entries * static_cast<int>(sizeof(int32_t));
}

// The most dynamic shared memory a CTA may opt in to, less the kernel's static shared memory (kStaticSmemBytes); the
// narrow shape's two CTAs share an SM's shared memory (and each reserves 1 KiB of it).
int smem_limit(bool narrow) {
  int dev = 0, optin = 0, per_sm = 0;
  BG_CUDA_CHECK(cudaGetDevice(&dev));
  BG_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  BG_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  return (narrow ? std::min(optin, per_sm / Shape<true>::kCtasPerSm - 1024) : optin) - kStaticSmemBytes;
}

// The dynamic shared-memory opt-in is per device and kernel: raised to `bytes` when a launch needs more than set.
template <bool kGateUp, bool kWgmma, bool kNarrow>
void set_smem_attribute(int bytes) {
  static std::mutex mu;
  static int set[64] = {};  // per device
  int dev = 0;
  BG_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 64 && set[dev] >= bytes) return;
  BG_CUDA_CHECK(
      cudaFuncSetAttribute(moe_w4a16_kernel<kGateUp, kWgmma, kNarrow>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  if (dev < 64) set[dev] = bytes;
}

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Byte offsets of the workspace parts (counters first, so one memset clears them).
struct WsOffsets {
  size_t counters = 0, partials = 0, h = 0, y = 0, total = 0;
};
WsOffsets ws_offsets(const MoeW4a16Params& p, const MoeW4a16WorkspaceGeometry& s) {
  WsOffsets o;
  o.partials =
      align256(static_cast<size_t>(s.tile_counters + s.token_counters + s.overlap_counters) * sizeof(int32_t));
  o.h = o.partials + align256(static_cast<size_t>(s.partial_slots * s.slot_floats) * sizeof(float));
  o.y = o.h + align256(static_cast<size_t>(s.rows * p.inter) * sizeof(__nv_bfloat16));
  o.total = o.y + align256(static_cast<size_t>(p.rows_out ? 0 : s.rows * p.hidden) * sizeof(float));  // y: combine
  return o;
}

void check_workspace(const MoeW4a16Params& p, const MoeW4a16Workspace& ws) {
  const MoeW4a16Params& q = ws.params;
  BG_CHECK(q.n_tokens == p.n_tokens && q.top_k == p.top_k && q.n_experts == p.n_experts && q.hidden == p.hidden &&
               q.inter == p.inter && q.fixed_splits == p.fixed_splits && q.stream_k == p.stream_k,
           "moe_w4a16_cuda: workspace laid out for n_tokens {} top_k {} experts {} hidden {} inter {} splits {} "
           "stream-K {}, launched with {} {} {} {} {} {} {}", q.n_tokens, q.top_k, q.n_experts, q.hidden, q.inter,
           q.fixed_splits, q.stream_k, p.n_tokens, p.top_k, p.n_experts, p.hidden, p.inter, p.fixed_splits,
           p.stream_k);
  BG_CHECK(runs_narrow(q) == runs_narrow(p), "moe_w4a16_cuda: workspace laid out for the {} shape, launched with "
           "the {} shape (MoeW4a16Params::narrow / wgmma)", runs_narrow(q) ? "narrow" : "wide",
           runs_narrow(p) ? "narrow" : "wide");
  BG_CHECK(ws.grid == grid_of(p), "moe_w4a16_cuda: workspace laid out for {} CTAs, this device runs {}", ws.grid,
           grid_of(p));
  BG_CHECK(!moe_w4a16_overlaps(p) || ws.expert_ready != nullptr, "moe_w4a16_cuda: the launch overlaps gate/up and "
           "down (MoeW4a16Params::overlap, pdl), the workspace was laid out without their counters");
}

KernelArgs kernel_args(const MoeW4a16Params& p, const MoeW4a16Weights& w, const MoeWorkspace& d,
                       const MoeW4a16Args& args, const MoeW4a16Workspace& ws, MoeW4a16Proj proj) {
  KernelArgs k;
  const MoeW4a16MatrixInfo& m = proj == MoeW4a16Proj::kGateUp ? w.info.gate_up : w.info.down;
  k.proj_offset = m.offset_bytes;
  k.sched = schedule_params(m.n_items, m.n_kstages, ws.nb_cap, p.fixed_splits, p.n_tokens, ws.stream, d.active,
                            d.offsets, w.blocks);
  k.n_in = m.n_in;
  k.n_out = m.n_out;
  k.out_scale = std::ldexp(1.0f, m.scale_shift);
  k.act = proj == MoeW4a16Proj::kGateUp ? args.x : ws.h;
  k.act_ld = proj == MoeW4a16Proj::kGateUp && args.x_ld != 0 ? args.x_ld : m.n_in;
  k.d = d;
  k.n_tokens = static_cast<int>(p.n_tokens);
  k.top_k = static_cast<int>(p.top_k);
  k.n_items_down = w.info.down.n_items;
  k.n_items_gate_up = w.info.gate_up.n_items;
  k.overlap = moe_w4a16_overlaps(p);
  k.ws = ws;
  k.table_cap = ws.table_entries;
  k.n_experts = static_cast<int>(p.n_experts);
  k.out = args.out;
  k.out_f32 = p.out_f32;
  k.accumulate = p.accumulate;
  k.rows_out = p.rows_out;
  k.combine_fused = !moe_w4a16_separate_combine(p);
  k.act_kind = p.act;
  k.beta = p.beta;
  k.beta_lin = p.beta_lin;
  return k;
}


// Launches kernel(args) after the stream's previous kernel, as its programmatic dependent with pdl.
template <class Kernel>
void launch_after(Kernel kernel, dim3 grid, dim3 block, int smem, bool pdl, const KernelArgs& args,
                  cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  BG_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args));
}

// gate/up, then down (as a programmatic dependent with pdl: down's CTAs may start and stream their first weights
// while gate/up finishes; they read h only after griddepcontrol.wait, which waits for gate/up to complete and flush),
// then the separate combine where it runs (its CTAs wait the same way for y).
template <bool kWgmma, bool kNarrow>
void launch(const KernelArgs& gu, const KernelArgs& dn, int smem, int grid, int64_t n_tokens, bool pdl,
            cudaStream_t stream) {
  set_smem_attribute<true, kWgmma, kNarrow>(smem);
  set_smem_attribute<false, kWgmma, kNarrow>(smem);
  moe_w4a16_kernel<true, kWgmma, kNarrow><<<grid, kThreads, smem, stream>>>(gu);
  BG_CUDA_CHECK_LAUNCH();
  launch_after(moe_w4a16_kernel<false, kWgmma, kNarrow>, dim3(static_cast<unsigned>(grid)), dim3(kThreads), smem, pdl,
               dn, stream);
  if (dn.rows_out || dn.combine_fused) return;
  const dim3 combine_grid(static_cast<unsigned>(n_tokens), static_cast<unsigned>(ceil_div(dn.n_out, kCombineCols)));
  launch_after(moe_w4a16_combine_kernel, combine_grid, dim3(kCombineThreads), 0, pdl, dn, stream);
}

}  // namespace

size_t moe_w4a16_workspace_bytes(const MoeW4a16Params& p) {
  moe_w4a16_check_params(p);
  return ws_offsets(p, moe_w4a16_workspace_geometry(p, grid_of(p))).total;
}

MoeW4a16Workspace moe_w4a16_workspace_layout(const MoeW4a16Params& p, void* base) {
  moe_w4a16_check_params(p);
  BG_CHECK(base != nullptr && cuda::aligned_to(base, 256),
           "moe_w4a16_workspace_layout: base {} must be non-null and 256-byte aligned", base);
  const int grid = grid_of(p);
  const MoeW4a16WorkspaceGeometry s = moe_w4a16_workspace_geometry(p, grid);
  const WsOffsets o = ws_offsets(p, s);
  auto* b = static_cast<uint8_t*>(base);
  MoeW4a16Workspace ws;
  ws.params = p;
  ws.grid = grid;
  ws.nb_cap = s.nb_cap;
  ws.table_entries = s.table_entries;
  ws.prefix_entries = s.prefix_entries;
  ws.stream = s.stream;
  BG_CHECK(smem_bytes(ws) <= smem_limit(runs_narrow(p)),
           "moe_w4a16: {} work items per CTA need {} bytes of shared memory, the device allows {}", s.table_entries,
           smem_bytes(ws), smem_limit(runs_narrow(p)));
  ws.counters = reinterpret_cast<int32_t*>(b + o.counters);
  ws.n_counters = s.tile_counters + s.token_counters + s.overlap_counters;
  ws.tile_counters = ws.counters;
  ws.token_counters = ws.counters + s.tile_counters;
  if (s.overlap_counters > 0) {
    ws.expert_ready = ws.token_counters + s.token_counters;
    ws.overlap_sched = ws.expert_ready + p.n_experts;
  }
  ws.partials = reinterpret_cast<float*>(b + o.partials);
  ws.n_partial_slots = s.partial_slots;
  ws.partial_slot_floats = s.slot_floats;
  ws.seq_slot_base = s.seq_slot_base;
  ws.h = reinterpret_cast<__nv_bfloat16*>(b + o.h);
  ws.y = reinterpret_cast<float*>(b + o.y);
  return ws;
}

void moe_w4a16_workspace_init(const MoeW4a16Workspace& ws, cudaStream_t stream) {
  BG_CHECK(ws.counters != nullptr, "moe_w4a16_workspace_init: workspace has no counters");
  BG_CUDA_CHECK(cudaMemsetAsync(ws.counters, 0, static_cast<size_t>(ws.n_counters) * sizeof(int32_t), stream));
}

void moe_w4a16_cuda(const MoeW4a16Params& p, const MoeW4a16Weights& w, const MoeWorkspace& d,
                    const MoeW4a16Args& args, const MoeW4a16Workspace& ws, cudaStream_t stream) {
  moe_w4a16_check_params(p);
  BG_CHECK(w.info.version == kMoeW4a16LayoutVersion, "moe_w4a16_cuda: weight layout version {} (this build runs {})",
           w.info.version, kMoeW4a16LayoutVersion);
  BG_CHECK(w.info.n_slots == p.n_experts && w.info.hidden == p.hidden && w.info.inter == p.inter,
           "moe_w4a16_cuda: weights hold {} experts {} -> {}, params say {} experts {} -> {}", w.info.n_slots,
           w.info.hidden, w.info.inter, p.n_experts, p.hidden, p.inter);
  check_workspace(p, ws);
  if (p.n_tokens == 0) return;
  BG_CHECK(w.blocks && args.x && cuda::aligned_to(args.x, 16) && args.out && cuda::aligned_to(args.out, 16),
           "moe_w4a16_cuda: block table {}, x {} and out {} must be non-null (x and out 16-byte aligned)",
           static_cast<const void*>(w.blocks), static_cast<const void*>(args.x), args.out);
  BG_CHECK(args.x_ld == 0 || (args.x_ld >= p.hidden && args.x_ld % 8 == 0 && !p.rows_out),
           "moe_w4a16_cuda: x rows {} elements apart (hidden {}; a multiple of 8, not with rows out)", args.x_ld,
           p.hidden);
  BG_CHECK(d.offsets && d.active && d.n_active && d.error_flags &&
               (p.rows_out || (d.row_token && d.row_weight && d.slot_row)),
           "moe_w4a16_cuda: the dispatch workspace is incomplete");
  const KernelArgs gu = kernel_args(p, w, d, args, ws, MoeW4a16Proj::kGateUp);
  const KernelArgs dn = kernel_args(p, w, d, args, ws, MoeW4a16Proj::kDown);
  if (p.wgmma) {
    launch<true, false>(gu, dn, smem_bytes(ws), ws.grid, p.n_tokens, p.pdl, stream);
  } else if (runs_narrow(p)) {
    BG_CHECK(ws.nb_cap <= 2, "moe_w4a16_cuda: a narrow launch has passes of at most 2 n8 blocks, the workspace {}",
             ws.nb_cap);
    launch<false, true>(gu, dn, smem_bytes(ws), ws.grid, p.n_tokens, p.pdl, stream);
  } else {
    launch<false, false>(gu, dn, smem_bytes(ws), ws.grid, p.n_tokens, p.pdl, stream);
  }
}

}  // namespace bg::ops
