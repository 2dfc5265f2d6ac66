// MLA CUDA kernels: the paged bf16 latent-cache write and absorbed attention over it (decode and prefill alike).
//
// Attention design (simple, correct first): one CTA per (token, group of 8 heads), 256 threads.
//   1. q_full[g] = [W_UK[h]^T q_nope[h] | q_pe[h]] * scale * log2(e)   [8, 576] fp32 in shared memory
//   2. stream the token's context 0..pos in tiles of 32 cache entries (bf16 -> shared memory): warp g scores head g
//      against the 32 entries (one lane per entry), online softmax in fp32 (exp2 with the log2(e) folded into q);
//      every thread accumulates 2 latent channels x 8 heads of sum_j p_j c_j in fp32 registers
//   3. o_lat / l in shared memory, then out[h][v] = W_UV[h][v] . o_lat[h] (one warp per output row)
// The 8 heads of a CTA share each cache tile (the latent is one MQA head), so the cache is read once per 8 heads.
// Memory is O(tile), never O(context^2). Split-context (flash-decoding) and tensor cores are later work.
//
// Shapes: the shared-memory layout is built for the production entry (kv_lora 512 | rope 64). The kernel is a template
// on kExact: kExact = true is the production path (kv_lora 512, rope 64, 16-byte aligned cache, 4-byte aligned
// weights; 16-byte tile loads and bf16x2 weight loads). kExact = false takes any kv_lora_rank in [1, 512] and
// qk_rope_dim in [0, 64] at run time: cache entries are read element by element into the same zero-padded 576-column
// tile (latent channels at 0..kv_lora-1, rope at 512..512+rope-1), q_full is zero in the padding, so scores and the
// latent sum are exact, and W_UK / W_UV are read only over the real kv_lora channels.

#include <cmath>
#include <limits>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/mla/mla_cuda.h"

namespace bg::ops {
namespace {

constexpr int kLora = static_cast<int>(kMlaCudaMaxKvLoraRank);  // kv_lora_rank (the exact path; the padded maximum)
constexpr int kRope = static_cast<int>(kMlaCudaMaxRopeDim);     // qk_rope_dim (likewise)
constexpr int kEntry = kLora + kRope;       // 576 bf16 per (padded) cache entry
constexpr int kEntryWords = kEntry / 2;     // 288 bf16x2 words
constexpr int kRowWords = kEntryWords + 1;  // padded shared-memory row: lanes reading different rows hit all banks
constexpr int kTile = 32;                   // cache entries per tile (one per lane)
constexpr int kHeads = static_cast<int>(kMlaCudaHeadsPerCta);  // heads per CTA (one warp each in the score phase)
constexpr int kThreads = 256;                                  // 8 warps; thread i owns latent channels 2i, 2i+1
constexpr int kChunksPerEntry = kEntry / 8;                    // 16-byte chunks per entry
constexpr float kLog2e = 1.4426950408889634f;

static_assert(kThreads == 32 * kHeads, "one warp per head in the score phase");
static_assert(2 * kThreads == kLora, "each thread owns two latent channels");

// Shared memory of the attention kernel, in floats / words.
constexpr int kSmemQFull = kHeads * kEntry;   // [8, 576] fp32
constexpr int kSmemTile = kTile * kRowWords;  // [32, 289] bf16x2 words; reused for q_in and o_lat
constexpr int kSmemP = kHeads * kTile;        // [8, 32] fp32 softmax numerators of the tile
constexpr int kSmemBytes = (kSmemQFull + kSmemTile + kSmemP + kHeads) * 4;
static_assert(kHeads * kLora <= kSmemTile, "o_lat must fit in the tile buffer");

__device__ __forceinline__ float2 bf2_to_f2(uint32_t bits) {
  __nv_bfloat162 v;
  memcpy(&v, &bits, 4);
  return __bfloat1622float2(v);
}

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Element offset of cache position `pos` through a sequence's block table (entries of `entry` elements).
__device__ __forceinline__ int64_t cache_offset(const MlaPagedCache& c, const int32_t* table, int64_t pos,
                                                int block_size, int entry) {
  const int32_t block = table[pos / block_size];
  return block * c.block_stride + (pos % block_size) * entry;
}

// Null (and kMlaErrorBadPosition raised) when a token's position runs past its block table: a caller bug that would
// otherwise read or write another sequence's blocks. The caller's block then writes nothing; the backend reports the
// flag at the step's sync (a trap would poison the CUDA context).
// `report`: whether this thread raises the flag (one thread per token).
__device__ __forceinline__ const int32_t* token_table(const MlaPagedCache& c, int64_t t, int block_size,
                                                      int64_t* pos_out, bool report) {
  const int64_t pos = c.positions[t];
  if (pos < 0 || pos / block_size >= c.max_blocks_per_seq) {
    if (c.error_flags != nullptr && report) atomicOr(c.error_flags, kMlaErrorBadPosition);
    return nullptr;
  }
  *pos_out = pos;
  return c.block_tables + static_cast<int64_t>(c.seq_idx[t]) * c.max_blocks_per_seq;
}

// grid: n_tokens, block: 128. Copies one [entry_dim] latent per CTA (rows latent_ld elements apart): in 16-byte
// chunks when kVec (entry_dim and latent_ld multiples of 8, latent, cache base and block stride 16-byte aligned), else
// element by element.
template <bool kVec>
__global__ void mla_cache_write_kernel(const __nv_bfloat16* __restrict__ latent, int64_t latent_ld,
                                       MlaPagedCache cache, int entry_dim, int block_size) {
  const int64_t t = blockIdx.x;
  if (cache.live_tokens != nullptr && t >= *cache.live_tokens) return;  // a padding row: whole block
  int64_t pos = 0;
  const int32_t* table = token_table(cache, t, block_size, &pos, threadIdx.x == 0);
  if (table == nullptr) return;  // whole block
  const int32_t block = table[pos / block_size];
  const __nv_bfloat16* src = latent + t * latent_ld;
  __nv_bfloat16* dst = cache.base + block * cache.block_stride + (pos % block_size) * entry_dim;
  if constexpr (kVec) {
    const uint4* src4 = reinterpret_cast<const uint4*>(src);
    uint4* dst4 = reinterpret_cast<uint4*>(dst);
    for (int i = threadIdx.x; i < entry_dim / 8; i += blockDim.x) dst4[i] = src4[i];
  } else {
    for (int i = threadIdx.x; i < entry_dim; i += blockDim.x) dst[i] = src[i];
  }
}

constexpr int kNormedTokensPerCta = 8;  // one warp per token
constexpr int kNormedMaxPer = kMlaCudaMaxKvLoraRank / 32;

// grid: ceil(n_tokens / 8), block: 256, one warp per token. RMSNorm of the token's first kv_lora values, then the
// whole entry [normed c_kv | k_pe] into its cache slot. Lane l holds values l, l + 32, ...: the sum of squares in
// the order of rmsnorm_cuda's warp-per-row kernel (cuda_utils.cuh: row_norm_kernel) and the same epilogue,
// w * (x * inv), so the cache gets the bits rmsnorm_cuda then mla_cache_write_cuda would write.
__global__ void __launch_bounds__(32 * kNormedTokensPerCta)
    mla_cache_write_normed_kernel(const __nv_bfloat16* __restrict__ latent, int64_t latent_ld,
                                  const float* __restrict__ weight, float inv_lora, float eps, MlaPagedCache cache,
                                  int64_t n_tokens, int lora, int entry_dim, int block_size) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kNormedTokensPerCta + (threadIdx.x >> 5);
  if (t >= n_tokens) return;
  if (cache.live_tokens != nullptr && t >= *cache.live_tokens) return;  // a padding row: the whole warp
  int64_t pos = 0;
  const int32_t* table = token_table(cache, t, block_size, &pos, lane == 0);
  if (table == nullptr) return;  // the whole warp
  const __nv_bfloat16* src = latent + t * latent_ld;
  float v[kNormedMaxPer], w[kNormedMaxPer];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kNormedMaxPer; ++i) {
    const int d = lane + 32 * i;
    v[i] = d < lora ? __bfloat162float(src[d]) : 0.0f;
    w[i] = d < lora ? weight[d] : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < kNormedMaxPer; ++i) ss += v[i] * v[i];  // zeros past lora change nothing
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(ss * inv_lora + eps);
  __nv_bfloat16* dst = cache.base + cache_offset(cache, table, pos, block_size, entry_dim);
#pragma unroll
  for (int i = 0; i < kNormedMaxPer; ++i) {
    const int d = lane + 32 * i;
    if (d < lora) dst[d] = __float2bfloat16_rn(w[i] * (v[i] * inv));
  }
  for (int d = lora + lane; d < entry_dim; d += 32) dst[d] = src[d];
}

struct AttnArgs {
  const __nv_bfloat16* q;     // [n, H, nope + rope]
  const __nv_bfloat16* w_uk;  // [H, nope, lora]
  const __nv_bfloat16* w_uv;  // [H, v, lora]
  __nv_bfloat16* out;         // [n, H, v]
  MlaPagedCache cache;
  int n_heads, nope, v_head, block_size, n_groups;
  int lora, rope;    // the real kv_lora_rank / qk_rope_dim (kLora / kRope on the exact path)
  float scale_log2;  // softmax_scale * log2(e)
};

// Phase 1: q_full[g] = [W_UK^T q_nope | q_pe] * scale_log2 for the CTA's heads (zero for heads past n_heads, and in
// the padding columns lora..511 and 512+rope..575).
template <bool kExact>
__device__ void absorb_query(const AttnArgs& a, int64_t t, int h0, int n_valid, float* q_full, float* q_in) {
  const int lora = kExact ? kLora : a.lora, rope = kExact ? kRope : a.rope;
  const int qk = a.nope + rope;
  for (int idx = threadIdx.x; idx < kHeads * qk; idx += kThreads) {
    const int g = idx / qk;
    q_in[idx] = g < n_valid ? __bfloat162float(a.q[(t * a.n_heads + h0 + g) * qk + idx % qk]) : 0.0f;
  }
  __syncthreads();
  for (int g = 0; g < kHeads; ++g) {
    float acc0 = 0.0f, acc1 = 0.0f;
    if (g < n_valid) {
      const float* qg = q_in + g * qk;
      if constexpr (kExact) {
        // Thread i reads channels 2i, 2i+1 of every W_UK row: one coalesced 1 KiB row per step.
        const uint32_t* w = reinterpret_cast<const uint32_t*>(a.w_uk + static_cast<int64_t>(h0 + g) * a.nope * kLora);
        for (int i = 0; i < a.nope; ++i) {
          const float2 wf = bf2_to_f2(__ldg(w + i * (kLora / 2) + threadIdx.x));
          acc0 = fmaf(qg[i], wf.x, acc0);
          acc1 = fmaf(qg[i], wf.y, acc1);
        }
      } else {
        // Rows of lora elements: no alignment beyond bf16's; channels past lora stay zero.
        const int c0 = 2 * static_cast<int>(threadIdx.x), c1 = c0 + 1;
        const __nv_bfloat16* w = a.w_uk + static_cast<int64_t>(h0 + g) * a.nope * lora;
        if (c0 < lora) {
          for (int i = 0; i < a.nope; ++i) {
            const __nv_bfloat16* wr = w + static_cast<int64_t>(i) * lora;
            acc0 = fmaf(qg[i], __bfloat162float(__ldg(wr + c0)), acc0);
            if (c1 < lora) acc1 = fmaf(qg[i], __bfloat162float(__ldg(wr + c1)), acc1);
          }
        }
      }
    }
    q_full[g * kEntry + 2 * threadIdx.x] = acc0 * a.scale_log2;
    q_full[g * kEntry + 2 * threadIdx.x + 1] = acc1 * a.scale_log2;
  }
  for (int idx = threadIdx.x; idx < kHeads * kRope; idx += kThreads) {
    const int g = idx / kRope, r = idx % kRope;
    q_full[g * kEntry + kLora + r] = (kExact || r < rope) ? q_in[g * qk + a.nope + r] * a.scale_log2 : 0.0f;
  }
  __syncthreads();
}

// Element `c` of the padded 576-column row of a real [lora + rope] entry `e` (zero in the padding), as bf16 bits.
__device__ __forceinline__ uint32_t padded_entry_bits(const uint16_t* e, int c, int lora, int rope) {
  if (c < kLora) return c < lora ? e[c] : 0u;
  const int r = c - kLora;
  return r < rope ? e[lora + r] : 0u;
}

// Loads cache entries tile0 .. tile0+31 (rows past n_ctx are zero, so 0 * garbage never makes a NaN).
template <bool kExact>
__device__ void load_tile(const AttnArgs& a, const int32_t* table, int64_t tile0, int64_t n_ctx, uint32_t* tile) {
  if constexpr (kExact) {
    for (int idx = threadIdx.x; idx < kTile * kChunksPerEntry; idx += kThreads) {
      const int row = idx / kChunksPerEntry, chunk = idx % kChunksPerEntry;
      const int64_t pos = tile0 + row;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (pos < n_ctx) {
        const uint4* src =
            reinterpret_cast<const uint4*>(a.cache.base + cache_offset(a.cache, table, pos, a.block_size, kEntry));
        v = src[chunk];
      }
      uint32_t* dst = tile + row * kRowWords + chunk * 4;
      dst[0] = v.x;
      dst[1] = v.y;
      dst[2] = v.z;
      dst[3] = v.w;
    }
  } else {
    // Entries of lora + rope elements, read one bf16 at a time into the zero-padded layout of the exact path.
    const int entry = a.lora + a.rope;
    for (int idx = threadIdx.x; idx < kTile * kEntryWords; idx += kThreads) {
      const int row = idx / kEntryWords, word = idx % kEntryWords;
      const int64_t pos = tile0 + row;
      uint32_t v = 0u;
      if (pos < n_ctx) {
        const uint16_t* e =
            reinterpret_cast<const uint16_t*>(a.cache.base + cache_offset(a.cache, table, pos, a.block_size, entry));
        v = padded_entry_bits(e, 2 * word, a.lora, a.rope) | (padded_entry_bits(e, 2 * word + 1, a.lora, a.rope) << 16);
      }
      tile[row * kRowWords + word] = v;
    }
  }
}

// Running softmax state of one head, held by every lane of its warp.
struct SoftmaxState {
  float max = -INFINITY;  // in log2 units
  float sum = 0.0f;
};

// Phase 2, score half: warp g scores its head against the 32 tile rows; writes p (numerators) and the rescale
// factor of the previous accumulators.
__device__ void score_tile(const float* q_full, const uint32_t* tile, int n_rows, SoftmaxState& st, float* p_s,
                           float* alpha_s) {
  const int g = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float2* qf = reinterpret_cast<const float2*>(q_full + g * kEntry);
  const uint32_t* row = tile + lane * kRowWords;
  float s0 = 0.0f, s1 = 0.0f;
#pragma unroll 8
  for (int w = 0; w < kEntryWords; ++w) {
    const float2 e = bf2_to_f2(row[w]);
    const float2 qv = qf[w];
    s0 = fmaf(qv.x, e.x, s0);
    s1 = fmaf(qv.y, e.y, s1);
  }
  const bool valid = lane < n_rows;
  const float s = valid ? s0 + s1 : -INFINITY;
  const float m_new = fmaxf(st.max, warp_max(s));  // finite: row 0 of every tile is valid
  const float p = valid ? exp2f(s - m_new) : 0.0f;
  const float alpha = exp2f(st.max - m_new);  // 0 on the first tile (max = -inf)
  st.sum = st.sum * alpha + warp_sum(p);
  st.max = m_new;
  p_s[g * kTile + lane] = p;
  if (lane == 0) alpha_s[g] = alpha;
}

// grid: n_tokens * n_groups (token-major, so the head groups of a token run together and share its cache in L2).
template <bool kExact>
__global__ void __launch_bounds__(kThreads) mla_attention_kernel(AttnArgs a) {
  extern __shared__ float4 smem_f4[];
  float* q_full = reinterpret_cast<float*>(smem_f4);                  // [8, 576]
  uint32_t* tile = reinterpret_cast<uint32_t*>(q_full + kSmemQFull);  // [32, 289] words
  float* p_s = reinterpret_cast<float*>(tile + kSmemTile);            // [8, 32]
  float* alpha_s = p_s + kSmemP;                                      // [8]; at the end 1 / sum

  const int64_t t = blockIdx.x / a.n_groups;
  const int h0 = static_cast<int>(blockIdx.x % a.n_groups) * kHeads;
  const int n_valid = min(kHeads, a.n_heads - h0);
  int64_t pos = 0;
  const int32_t* table = token_table(a.cache, t, a.block_size, &pos, threadIdx.x == 0);
  if (table == nullptr) return;  // whole block, before any barrier
  const int64_t n_ctx = pos + 1;

  absorb_query<kExact>(a, t, h0, n_valid, q_full, reinterpret_cast<float*>(tile));

  float acc[kHeads][2];  // latent channels 2*tid, 2*tid+1 of sum_j p_j c_j, per head
#pragma unroll
  for (int g = 0; g < kHeads; ++g) acc[g][0] = acc[g][1] = 0.0f;
  SoftmaxState st;
  for (int64_t tile0 = 0; tile0 < n_ctx; tile0 += kTile) {
    const int n_rows = n_ctx - tile0 < kTile ? static_cast<int>(n_ctx - tile0) : kTile;
    load_tile<kExact>(a, table, tile0, n_ctx, tile);
    __syncthreads();
    score_tile(q_full, tile, n_rows, st, p_s, alpha_s);
    __syncthreads();
#pragma unroll
    for (int g = 0; g < kHeads; ++g) {
      acc[g][0] *= alpha_s[g];
      acc[g][1] *= alpha_s[g];
    }
    for (int j = 0; j < n_rows; ++j) {
      const float2 e = bf2_to_f2(tile[j * kRowWords + threadIdx.x]);
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        const float p = p_s[g * kTile + j];
        acc[g][0] = fmaf(p, e.x, acc[g][0]);
        acc[g][1] = fmaf(p, e.y, acc[g][1]);
      }
    }
    __syncthreads();  // the next tile overwrites tile, p_s and alpha_s
  }

  // Phase 3: o_lat = acc / sum into the (now free) tile buffer, then W_UV per output row (o_lat is zero in the
  // padding channels lora..511, which W_UV is not read over).
  if (threadIdx.x % 32 == 0) alpha_s[threadIdx.x / 32] = 1.0f / st.sum;
  __syncthreads();
  float* o_lat = reinterpret_cast<float*>(tile);  // [8, 512]
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    o_lat[g * kLora + 2 * threadIdx.x] = acc[g][0] * alpha_s[g];
    o_lat[g * kLora + 2 * threadIdx.x + 1] = acc[g][1] * alpha_s[g];
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < n_valid * a.v_head; r += kHeads) {
    const int g = r / a.v_head, v = r % a.v_head;
    float s = 0.0f;
    if constexpr (kExact) {
      const uint32_t* w =
          reinterpret_cast<const uint32_t*>(a.w_uv + (static_cast<int64_t>(h0 + g) * a.v_head + v) * kLora);
      const float2* o = reinterpret_cast<const float2*>(o_lat + g * kLora);
#pragma unroll
      for (int k = 0; k < kLora / 64; ++k) {
        const float2 wf = bf2_to_f2(__ldg(w + lane + 32 * k));
        const float2 ov = o[lane + 32 * k];
        s = fmaf(wf.x, ov.x, fmaf(wf.y, ov.y, s));
      }
    } else {
      const __nv_bfloat16* w = a.w_uv + (static_cast<int64_t>(h0 + g) * a.v_head + v) * a.lora;
      const float* o = o_lat + g * kLora;
      for (int c = lane; c < a.lora; c += 32) s = fmaf(__bfloat162float(__ldg(w + c)), o[c], s);
    }
    s = warp_sum(s);
    if (lane == 0) a.out[(t * a.n_heads + h0 + g) * a.v_head + v] = __float2bfloat16(s);
  }
}

// Whether 16-byte copies of whole entries are possible: every entry of every block starts 16-byte aligned.
bool cache_vectorizable(const MlaPagedCache& c, int64_t entry_dim) {
  return entry_dim % 8 == 0 && c.block_stride % 8 == 0 && cuda::aligned_to(c.base, 16);
}

void check_cache(const char* op, const MlaParams& p, const MlaPagedCache& c, int64_t entry_dim) {
  BG_CHECK(p.block_size > 0 && p.block_size <= (1 << 20), "{}: block_size {} outside [1, 2^20]", op, p.block_size);
  BG_CHECK(c.base && c.block_tables && c.seq_idx && c.positions, "{}: null cache pointer", op);
  BG_CHECK(cuda::aligned_to(c.base, 2), "{}: cache base is not bf16-aligned", op);
  BG_CHECK(c.block_stride >= p.block_size * entry_dim, "{}: block_stride {} must be >= block_size {} * entry {}", op,
           c.block_stride, p.block_size, entry_dim);
  BG_CHECK(c.max_blocks_per_seq > 0, "{}: max_blocks_per_seq {} must be positive", op, c.max_blocks_per_seq);
}

// The checks both cache writes make; latent_ld resolved (0: the entry size).
int64_t check_write(const char* op, const MlaParams& p, const __nv_bfloat16* latent, const MlaPagedCache& cache,
                    int64_t* latent_ld) {
  BG_CHECK(p.n_tokens >= 0 && p.n_tokens <= std::numeric_limits<int32_t>::max(), "{}: n_tokens {} out of range", op,
           p.n_tokens);
  BG_CHECK(p.kv_lora_rank >= 1 && p.kv_lora_rank <= kMlaCudaMaxKvLoraRank && p.qk_rope_dim >= 0 &&
               p.qk_rope_dim <= kMlaCudaMaxRopeDim,
           "{}: kv_lora_rank {} / qk_rope_dim {} unsupported (kv_lora_rank in [1, {}], qk_rope_dim in [0, {}])", op,
           p.kv_lora_rank, p.qk_rope_dim, kMlaCudaMaxKvLoraRank, kMlaCudaMaxRopeDim);
  const int64_t entry_dim = p.kv_lora_rank + p.qk_rope_dim;
  if (*latent_ld == 0) *latent_ld = entry_dim;
  BG_CHECK(*latent_ld >= entry_dim, "{}: latent rows {} elements apart hold no {}-element entry", op, *latent_ld,
           entry_dim);
  if (p.n_tokens == 0) return entry_dim;
  BG_CHECK(latent != nullptr && cuda::aligned_to(latent, 2), "{}: latent null or not bf16-aligned", op);
  check_cache(op, p, cache, entry_dim);
  return entry_dim;
}

}  // namespace

void mla_cache_write_cuda(const MlaParams& p, const __nv_bfloat16* latent, const MlaPagedCache& cache,
                          cudaStream_t stream, int64_t latent_ld) {
  const int64_t entry_dim = check_write("mla_cache_write_cuda", p, latent, cache, &latent_ld);
  if (p.n_tokens == 0) return;
  const unsigned grid = static_cast<unsigned>(p.n_tokens);
  if (cache_vectorizable(cache, entry_dim) && latent_ld % 8 == 0 && cuda::aligned_to(latent, 16)) {
    mla_cache_write_kernel<true><<<grid, 128, 0, stream>>>(latent, latent_ld, cache, static_cast<int>(entry_dim),
                                                           static_cast<int>(p.block_size));
  } else {
    mla_cache_write_kernel<false><<<grid, 128, 0, stream>>>(latent, latent_ld, cache, static_cast<int>(entry_dim),
                                                            static_cast<int>(p.block_size));
  }
  BG_CUDA_CHECK_LAUNCH();
}

void mla_cache_write_normed_cuda(const MlaParams& p, const __nv_bfloat16* latent, const float* norm_weight,
                                 float eps, const MlaPagedCache& cache, cudaStream_t stream, int64_t latent_ld) {
  const int64_t entry_dim = check_write("mla_cache_write_normed_cuda", p, latent, cache, &latent_ld);
  if (p.n_tokens == 0) return;
  BG_CHECK(norm_weight != nullptr, "mla_cache_write_normed_cuda: null norm weight");
  const auto grid = static_cast<unsigned>((p.n_tokens + kNormedTokensPerCta - 1) / kNormedTokensPerCta);
  mla_cache_write_normed_kernel<<<grid, 32 * kNormedTokensPerCta, 0, stream>>>(
      latent, latent_ld, norm_weight, 1.0f / static_cast<float>(p.kv_lora_rank), eps, cache, p.n_tokens,
      static_cast<int>(p.kv_lora_rank), static_cast<int>(entry_dim), static_cast<int>(p.block_size));
  BG_CUDA_CHECK_LAUNCH();
}

void mla_attention_cuda(const MlaParams& p, const __nv_bfloat16* q, const __nv_bfloat16* w_uk,
                        const __nv_bfloat16* w_uv, const MlaPagedCache& cache, __nv_bfloat16* out,
                        cudaStream_t stream) {
  constexpr const char* op = "mla_attention_cuda";
  BG_CHECK(p.n_tokens >= 0, "{}: n_tokens {} is negative", op, p.n_tokens);
  if (p.n_tokens == 0) return;
  BG_CHECK(p.kv_lora_rank >= 1 && p.kv_lora_rank <= kLora && p.qk_rope_dim >= 0 && p.qk_rope_dim <= kRope,
           "{}: kv_lora_rank {} / qk_rope_dim {} unsupported (kv_lora_rank in [1, {}], qk_rope_dim in [0, {}])", op,
           p.kv_lora_rank, p.qk_rope_dim, kLora, kRope);
  BG_CHECK(p.n_heads > 0 && p.n_heads <= 4096, "{}: n_heads {} out of range", op, p.n_heads);
  BG_CHECK(p.qk_nope_dim > 0 && p.qk_nope_dim + p.qk_rope_dim <= kSmemTile / kHeads,
           "{}: qk_nope_dim {} out of range (qk_nope + qk_rope <= {})", op, p.qk_nope_dim, kSmemTile / kHeads);
  BG_CHECK(p.v_head_dim > 0 && p.v_head_dim <= 4096, "{}: v_head_dim {} out of range", op, p.v_head_dim);
  BG_CHECK(std::isfinite(p.softmax_scale) && p.softmax_scale > 0.0f, "{}: softmax_scale {} must be positive", op,
           p.softmax_scale);
  BG_CHECK(q && w_uk && w_uv && out, "{}: null q / w_uk / w_uv / out", op);
  BG_CHECK(cuda::aligned_to(q, 2) && cuda::aligned_to(w_uk, 2) && cuda::aligned_to(w_uv, 2) && cuda::aligned_to(out, 2),
           "{}: q / w_uk / w_uv / out must be bf16-aligned", op);
  const int64_t entry_dim = p.kv_lora_rank + p.qk_rope_dim;
  check_cache(op, p, cache, entry_dim);
  // The production shape on aligned memory takes the exact path; everything else the zero-padded one.
  const bool exact = p.kv_lora_rank == kLora && p.qk_rope_dim == kRope && cache_vectorizable(cache, entry_dim) &&
                     cuda::aligned_to(w_uk, 4) && cuda::aligned_to(w_uv, 4);
  const int64_t n_groups = (p.n_heads + kHeads - 1) / kHeads;
  BG_CHECK(p.n_tokens * n_groups <= std::numeric_limits<int32_t>::max(), "{}: {} tokens x {} head groups too many", op,
           p.n_tokens, n_groups);

  AttnArgs a{q,
             w_uk,
             w_uv,
             out,
             cache,
             static_cast<int>(p.n_heads),
             static_cast<int>(p.qk_nope_dim),
             static_cast<int>(p.v_head_dim),
             static_cast<int>(p.block_size),
             static_cast<int>(n_groups),
             static_cast<int>(p.kv_lora_rank),
             static_cast<int>(p.qk_rope_dim),
             p.softmax_scale * kLog2e};
  const unsigned grid = static_cast<unsigned>(p.n_tokens * n_groups);
  // Above the 48 KiB default: opt in (a host-side attribute, allowed while a stream is being captured).
  if (exact) {
    BG_CUDA_CHECK(
        cudaFuncSetAttribute(mla_attention_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    mla_attention_kernel<true><<<grid, kThreads, kSmemBytes, stream>>>(a);
  } else {
    BG_CUDA_CHECK(
        cudaFuncSetAttribute(mla_attention_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    mla_attention_kernel<false><<<grid, kThreads, kSmemBytes, stream>>>(a);
  }
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops
