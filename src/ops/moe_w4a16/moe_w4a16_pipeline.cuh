// The W4A16 decode kernel's pipeline (namespace w4 like moe_w4a16_device.cuh; included only by moe_w4a16_cuda.cu):
// its two launch shapes and buffer layouts, the producer (every thread's cp.async copies of a stage's weights and
// activation rows, stepped stage by stage) and the overlapped down's wait per expert.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "ops/moe/moe_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_device.cuh"
#include "ops/moe_w4a16/moe_w4a16_epilogue.cuh"
#include "ops/moe_w4a16/moe_w4a16_schedule.h"

namespace bg::ops::w4 {

constexpr int kBufBytes = kStageBytes + kActStageBytes;

// The two launch shapes of the kernel. Wide (any rows): one CTA of 8 warps per SM, 6 pipeline stages (129 KiB),
// passes of up to 4 n8 blocks, ~250 registers. Narrow (MoeW4a16Params::narrow, at most 16 tokens, mma.sync): two
// CTAs per SM (16 warps, 4 per scheduler, to hide the decode's dependent integer chains), 128 registers, 3 stages
// each, passes of up to 2 n8 blocks only (3- and 4-block passes spill in a 128-register kernel, in its main loop).
// Which launches run it: moe_w4a16_runs_narrow.
template <bool kNarrow>
struct Shape {
  static constexpr int kCtasPerSm = kNarrow ? 2 : 1;
  static constexpr int kStages = kNarrow ? 3 : kWideStages;  // kWideStages: moe_w4a16_schedule.h
  static constexpr int kSmemBytes = kStages * kBufBytes;  // wide: 132096
};

// A pipeline buffer: mma.sync reads the weights at 0 and the padded activation rows after them; wgmma reads the
// activations as a 128-byte-swizzle operand, which must start on 1024 bytes, so they come first (4096 B, then the
// weights; 21504 B = 21 KiB per buffer from a 1024-aligned base, within the same dynamic shared memory).
template <bool kWgmma>
struct Buf {
  static constexpr int kBytes = kWgmma ? kActSw128Bytes + kStageBytes : kBufBytes;
  static constexpr int kWeights = kWgmma ? kActSw128Bytes : 0;
  static constexpr int kActs = kWgmma ? 0 : kStageBytes;
  static constexpr int kAlign = kWgmma ? 1024 : 128;
};
static_assert(Shape<false>::kStages * Buf<true>::kBytes + Buf<true>::kAlign - 128 <= Shape<false>::kSmemBytes,
              "the wgmma buffers must fit");
static_assert(Buf<true>::kBytes % 1024 == 0 && kActSw128Bytes % 1024 == 0, "swizzle atoms stay 1024-byte aligned");

// The first buffer: the dynamic shared memory's base (128-byte aligned), rounded up to 1024 bytes for wgmma.
template <bool kWgmma>
__device__ __forceinline__ uint8_t* buffers(uint8_t* smem) {
  if constexpr (!kWgmma) return smem;
  const uint32_t a = smem_addr(smem);
  return smem + ((Buf<kWgmma>::kAlign - (a & (Buf<kWgmma>::kAlign - 1))) & (Buf<kWgmma>::kAlign - 1));
}

// The producer: its cursor and this thread's global source addresses for the stage it issues next. The addresses are
// set up at the first stage of a pass (k-stage kb of a chunk x split) and then advance by one stage, so the common
// stage costs a few adds, not the item's address arithmetic.
struct Producer {
  Cursor c;
  const uint8_t* w = nullptr;          // this thread's first 16 bytes of the stage's weight block
  const __nv_bfloat16* act = nullptr;  // this thread's 16-byte activation chunk; null: zero-fill (row past the chunk)
  int64_t k = 0;                       // its first input (checked against n_in: the last stage may be partial)
  int ready_e = -1;                    // overlapped down: the expert slot whose h rows await_expert last saw ready
};

// Overlapped down (a.overlap): before the producer's first h copy of expert slot e, thread 0 waits until gate/up has
// released every pass over e's rows (n_items_gate_up per row chunk: gate/up's red_add_release after its h stores, this
// acquire, then the CTA barrier, order those stores before the CTA's copies). Leaves the wait on a gate/up error (its
// CTAs may have stopped) or after kOverlapStallNs, flagging kMoeErrorOverlapStall: never a hang. CTA-uniform.
constexpr uint64_t kOverlapStallNs = 2'000'000'000;
__device__ __noinline__ void await_expert(Producer& p, const KernelArgs& a, int chunk_rows) {
  if (threadIdx.x == 0) {
    const int need = a.n_items_gate_up * ((p.c.rows + chunk_rows - 1) / chunk_rows);
    const int* ready = a.ws.expert_ready + p.c.e;
    if (ptx::ld_acquire(ready) < need) {
      const uint64_t t0 = ptx::globaltimer();
      while (ptx::ld_acquire(ready) < need) {
        if (*static_cast<volatile int32_t*>(a.d.error_flags) & kMoeErrorBadDescriptor) break;
        if (ptx::globaltimer() - t0 > kOverlapStallNs) {
          atomicOr(a.d.error_flags, kMoeErrorOverlapStall);
          break;
        }
        __nanosleep(128);
      }
    }
  }
  __syncthreads();
  p.ready_e = p.c.e;
}

// First stage of a pass: thread tid copies weight bytes tid * 16 + i * 4096 (scale bytes tid * 16: the first 64) and
// activation chunk (tid & 7) of row (tid >> 3): gate/up's rows from x through row_token (rows out: x), down's from h.
template <bool kGateUp>
__device__ __forceinline__ void producer_start_pass(Producer& p, const KernelArgs& a) {
  const int tid = static_cast<int>(threadIdx.x);
  const Cursor& c = p.c;
  p.w = c.block + a.proj_offset + (static_cast<int64_t>(c.m) * a.sched.n_kstages + c.ks) * kStageBytes + tid * 16;
  const int row = tid >> 3;
  p.k = static_cast<int64_t>(c.ks) * kKStage + (tid & 7) * 8;
  p.act = nullptr;
  if (row < c.chunk_rows) {
    const int prow = c.chunk_row0 + row;
    const int64_t act_row = kGateUp && !a.rows_out ? static_cast<int64_t>(a.d.row_token[prow]) : prow;
    p.act = a.act + act_row * a.act_ld + p.k;
  }
}

// The producer's stage: the weight block (one contiguous 17408-byte copy, 4.25 x 16 B per thread, cp.async.cg)...
__device__ __forceinline__ void issue_weights(const Producer& p, uint8_t* buf) {
  const int tid = static_cast<int>(threadIdx.x);
  const uint32_t dst = smem_addr(buf) + tid * 16;
#pragma unroll
  for (int i = 0; i < kCodeBytes / 16 / kThreads; ++i) cp_async16(dst + i * kThreads * 16, p.w + i * kThreads * 16);
  if (tid < kScaleBytes / 16) cp_async16(dst + kCodeBytes, p.w + kCodeBytes);
}

// ... and the activation rows the consumer reads in this pass (NB n8 blocks); rows past the chunk are zero-filled.
// mma.sync: one 16-byte copy per thread into the padded rows; wgmma: the same 16 bytes as four 4-byte copies into
// the swizzled tile (act_sw128_offset: each word lands where the k permutation puts it).
template <bool kWgmma>
__device__ __forceinline__ void issue_acts(const Producer& p, const KernelArgs& a, uint8_t* buf) {
  const int tid = static_cast<int>(threadIdx.x);
  const int row = tid >> 3;
  if (row >= p.c.nb * 8) return;
  const bool valid = p.act != nullptr && p.k < a.n_in;
  if constexpr (kWgmma) {
    const uint32_t base = smem_addr(buf + Buf<true>::kActs);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      cp_async4_zfill(base + act_sw128_offset(row, tid & 7, i), valid ? p.act + 2 * i : a.act, valid ? 4 : 0);
    }
  } else {
    cp_async16_zfill(smem_addr(buf + kStageBytes + act_offset(row, tid & 7)), valid ? p.act : a.act, valid ? 16 : 0);
  }
}

// Moves the producer to its next stage.
template <bool kGateUp>
__device__ __forceinline__ void producer_next(Producer& p, const KernelArgs& a, const Plan& pl,
                                              const ItemEntry* table) {
  const bool same_pass = p.c.ks + 1 < p.c.ke;
  advance(p.c, a.sched, pl, table);
  if (same_pass) {
    p.w += kStageBytes;
    p.k += kKStage;
    if (p.act != nullptr) p.act += kKStage;
  } else if (p.c.valid) {
    producer_start_pass<kGateUp>(p, a);
  }
}

// The kernel's static shared memory: the combine's state, the split flag and the stream-K scan's warp sums.
constexpr int kStaticSmemBytes = static_cast<int>(sizeof(CombineSmem)) + 64;

}  // namespace bg::ops::w4
