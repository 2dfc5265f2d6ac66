// KDA CUDA kernels: the batch-shaped recurrent decode step and the CUDA-core chunked (UT transform) prefill of one
// sequence (kda_chunked_simt_cuda: the path for head dims other than 128; kda_chunked_tc.cu has the tensor-core one).
// Math, state layout [H, K, V] (K-first) and chunk formulas are those of kda_cpu.cpp; fp32 everywhere inside.
//
// Recurrent: one CTA (512 threads) per (token, head), or, when kda_recurrent_splits asks (steps of few tokens), four
// of 128 threads per (token, head) each taking 32 of the state's columns; thread (r, v) holds rows 32r..32r+31 of state
// column v in registers, so the state is read once and written once; the two K-reductions (S^T k, S^T q) go through
// shared memory across the 4 row groups.
//
// Chunked: one CTA (512 threads) per head keeps the head's state S [128, 128] in shared memory and runs the chunks
// of 64 tokens in order. Per chunk (n <= 64 tokens, G_i = cumulative log decay inside the chunk):
//   1. load k, q (bf16), v (-> U, fp32), beta; G by a running sum per channel
//   2. A_kk[i][j] = beta_i k_i . (exp(G_i - G_j) k_j) (j < i), A_qk[i][j] = q_i . (exp(G_i - G_j) k_j) (j <= i)
//   3. U_i = beta_i (v_i - S^T (exp(G_i) k_i)); o_i = S^T (exp(G_i) q_i) kept in registers
//   4. U_i -= sum_{j<i} A_kk[i][j] U_j (forward substitution, one column per 4 lanes)
//   5. o_i += sum_{j<=i} A_qk[i][j] U_j -> out
//   6. S = exp(G_last) S + sum_j exp(G_last - G_j) k_j U_j^T
// Every exponent is G_i - G_j with i >= j (or G_i): subtracted before exp, never exp(G_i) * exp(-G_j).
//
// Head dims: both kernels are laid out for K = V = 128 and are templates on kFull. kFull = true (K == V == 128) is the
// production path, unchanged; kFull = false takes any K, V in [1, 128] at run time and zero-pads to 128 on load: q, k,
// S rows past K, v, U, S columns past V are zero and G is zero past K, so the padding contributes exact zeros and
// stays zero; only the real [K, V] state and [V] outputs are written back.

#include <cstdlib>
#include <limits>

#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"
#include "ops/kda/kda_cuda.h"

namespace bg::ops {
namespace {

constexpr int kDim = static_cast<int>(kKdaCudaMaxHeadDim);  // K = V = 128 (padded to when smaller)
static_assert(kKdaCudaHeadDim == kKdaCudaMaxHeadDim, "the production path is the unpadded layout");
constexpr int kThreads = 512;
constexpr int kRowGroups = kThreads / kDim;                     // 4 (recurrent: row groups of the state)
constexpr int kRowsPerGroup = kDim / kRowGroups;                // 32
constexpr int kChunk = static_cast<int>(kKdaDefaultChunkSize);  // 64

// Chunked kernel shared-memory rows, padded so that the access patterns below are free of bank conflicts.
constexpr int kSStride = kDim + 4;    // S [128, 132] fp32: thread (d, vg) rows differ by 4 banks
constexpr int kGStride = kDim + 1;    // G [64, 129] fp32: lanes reading different tokens hit different banks
constexpr int kUStride = kDim + 8;    // U [64, 136] fp32: 4 tokens x 8 columns per warp hit 32 banks
constexpr int kAStride = kChunk + 1;  // A_kk, A_qk [64, 65] fp32
constexpr int kKqStride = kDim + 2;   // k, q [64, 130] bf16 (65 words per row)
constexpr int kSmemFloats = kDim * kSStride + kChunk * kGStride + kChunk * kUStride + 2 * kChunk * kAStride + kChunk +
                            kChunk * kKqStride;  // the last term: k and q, two bf16 per float
constexpr int kSmemBytes = kSmemFloats * 4;
static_assert(kSmemBytes <= 227 * 1024, "chunked KDA shared memory exceeds the H200 per-block limit");

__device__ __forceinline__ float ld_bf16(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// ---- recurrent step ----

struct RecurrentArgs {
  KdaCudaInputs in;
  KdaStateSlots states;
  __nv_bfloat16* out;
  int n_heads;
  int dim_k, dim_v;  // the real K, V (kDim on the kFull path)
};

// grid: n_tokens * n_heads * (128 / kCols) (token-major, then head, then column block), block: kCols * 4 threads.
// Columns of the state are independent (u[v] and o[v] read column v only), so a head's 128 columns can be split over
// 128 / kCols CTAs without changing any arithmetic: every column runs the same four 32-row partial sums, added in the
// same order, whatever kCols is (bit-identical results; the split is meant to fill the SMs when a step has few tokens).
// The production (full-dims) kernels keep 1024 threads per SM, i.e. 64 registers a thread: unbounded, ptxas took 72-76
// once the column split and the padding check were added, one 512-thread CTA fit per SM instead of two, and Kimi-K3's
// step at batch 64 spent 286 instead of 208 us per layer in it on the H200.
template <bool kFull, int kCols>
__global__ void __launch_bounds__(kCols * kRowGroups, kFull ? 1024 / (kCols * kRowGroups) : 1)
    kda_recurrent_kernel(RecurrentArgs a) {
  static_assert(kDim % kCols == 0 && (kFull || kCols == kDim), "column blocks of a full-dims head only");
  constexpr int kBlocks = kDim / kCols;
  __shared__ float q_s[kDim], k_s[kDim], decay_s[kDim], v_s[kCols];
  __shared__ float red[2][kRowGroups][kCols];
  const int dk = kFull ? kDim : a.dim_k, dv = kFull ? kDim : a.dim_v;
  // 32-bit indices (tokens x heads < 2^31: the grid's size), to keep the state's 32 registers and the rest in 64.
  const int th = static_cast<int>(blockIdx.x) / kBlocks;  // t * n_heads + h
  const int c0 = static_cast<int>(blockIdx.x % kBlocks) * kCols;
  const int t = th / a.n_heads;
  const int h = th - t * a.n_heads;
  const int lc = threadIdx.x % kCols, col = c0 + lc, grp = threadIdx.x / kCols, row0 = grp * kRowsPerGroup;
  const int64_t k_off = static_cast<int64_t>(th) * dk;  // q, k, g
  const int64_t v_off = static_cast<int64_t>(th) * dv;  // v, out
  const int32_t slot = cuda_util::live_slot(a.states.slot_idx, a.states.live_tokens, t);
  if (slot < 0) {  // a padding row (uniform over the CTA)
    if (grp == 0 && (kFull || col < dv)) a.out[v_off + col] = __float2bfloat16(0.0f);
    return;
  }
  float* state = a.states.base + slot * a.states.slot_stride + static_cast<int64_t>(h) * dk * dv;
  // Padding (rows past K, columns past V) holds zeros and is never written back.
  const bool col_ok = kFull || col < dv;

  // The small inputs first: issued after the state's 32 loads they kept registers live across them (spills at 64).
  for (int d = static_cast<int>(threadIdx.x); d < kDim; d += kCols * kRowGroups) {
    const bool k_ok = kFull || d < dk;
    q_s[d] = k_ok ? ld_bf16(a.in.q + k_off + d) : 0.0f;
    k_s[d] = k_ok ? ld_bf16(a.in.k + k_off + d) : 0.0f;
    decay_s[d] = k_ok ? expf(a.in.g[k_off + d]) : 0.0f;
  }
  if (static_cast<int>(threadIdx.x) < kCols) v_s[lc] = col_ok ? ld_bf16(a.in.v + v_off + col) : 0.0f;
  float s[kRowsPerGroup];  // S[row0 + i][col]
#pragma unroll
  for (int i = 0; i < kRowsPerGroup; ++i)
    s[i] = (kFull || (col_ok && row0 + i < dk)) ? state[(row0 + i) * dv + col] : 0.0f;
  const float beta = a.in.beta[th];
  __syncthreads();

  // S <- diag(exp(g)) S, and this group's part of S^T k.
  float part = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerGroup; ++i) {
    s[i] *= decay_s[row0 + i];
    part = fmaf(k_s[row0 + i], s[i], part);
  }
  red[0][grp][lc] = part;
  __syncthreads();
  float sk = 0.0f;
#pragma unroll
  for (int r = 0; r < kRowGroups; ++r) sk += red[0][r][lc];
  const float u = v_s[lc] - sk;

  // S += beta k u^T, and this group's part of S^T q.
  part = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerGroup; ++i) {
    s[i] = fmaf(beta * k_s[row0 + i], u, s[i]);
    part = fmaf(q_s[row0 + i], s[i], part);
    if (kFull || (col_ok && row0 + i < dk)) state[(row0 + i) * dv + col] = s[i];
  }
  red[1][grp][lc] = part;
  __syncthreads();
  if (grp == 0 && col_ok) {
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < kRowGroups; ++r) o += red[1][r][lc];
    a.out[v_off + col] = __float2bfloat16(o);
  }
}

// ---- chunked prefill ----

struct ChunkedArgs {
  KdaCudaInputs in;
  float* state;  // [H, K, V]
  __nv_bfloat16* out;
  int64_t n_tokens;
  int n_heads;
  int dim_k, dim_v;  // the real K, V (kDim on the kFull path)
};

// Pointers into the chunked kernel's dynamic shared memory.
struct ChunkSmem {
  float* s;          // [128, kSStride]   the head's state
  float* g;          // [64, kGStride]    cumulative log decay G
  float* u;          // [64, kUStride]    v, then the new values u
  float* a_kk;       // [64, kAStride]
  float* a_qk;       // [64, kAStride]
  float* beta;       // [64]
  __nv_bfloat16* k;  // [64, kKqStride]
  __nv_bfloat16* q;  // [64, kKqStride]
};

__device__ ChunkSmem carve_smem(float* base) {
  ChunkSmem m;
  m.s = base;
  m.g = m.s + kDim * kSStride;
  m.u = m.g + kChunk * kGStride;
  m.a_kk = m.u + kChunk * kUStride;
  m.a_qk = m.a_kk + kChunk * kAStride;
  m.beta = m.a_qk + kChunk * kAStride;
  m.k = reinterpret_cast<__nv_bfloat16*>(m.beta + kChunk);
  m.q = m.k + kChunk * kKqStride;
  return m;
}

// Step 1: the chunk's inputs into shared memory, G_i = g_0 + ... + g_i (the CPU's summation order). Channels past K
// get k = q = 0 and G = 0, columns past V get v = 0.
template <bool kFull>
__device__ void load_chunk(const ChunkedArgs& a, int h, int64_t t0, int n, const ChunkSmem& m) {
  const int dk = kFull ? kDim : a.dim_k, dv = kFull ? kDim : a.dim_v;
  for (int idx = threadIdx.x; idx < n * kDim; idx += kThreads) {
    const int i = idx / kDim, d = idx % kDim;
    const int64_t tok = (t0 + i) * a.n_heads + h;
    const bool k_ok = kFull || d < dk, v_ok = kFull || d < dv;
    m.k[i * kKqStride + d] = k_ok ? a.in.k[tok * dk + d] : __float2bfloat16(0.0f);
    m.q[i * kKqStride + d] = k_ok ? a.in.q[tok * dk + d] : __float2bfloat16(0.0f);
    m.u[i * kUStride + d] = v_ok ? ld_bf16(a.in.v + tok * dv + d) : 0.0f;
  }
  if (static_cast<int>(threadIdx.x) < n) m.beta[threadIdx.x] = a.in.beta[(t0 + threadIdx.x) * a.n_heads + h];
  if (threadIdx.x < kDim) {
    const int d = threadIdx.x;
    float run = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float gi = (kFull || d < dk) ? a.in.g[((t0 + i) * a.n_heads + h) * dk + d] : 0.0f;
      run = i == 0 ? gi : run + gi;
      m.g[i * kGStride + d] = run;
    }
  }
}

// Step 2: thread (token row group, column j); lanes of a warp take 32 consecutive j of one i. Channels past dk are
// zero and skipped.
template <bool kFull>
__device__ void chunk_interactions(int n, int dim_k, const ChunkSmem& m) {
  const int dk = kFull ? kDim : dim_k;
  const int j = threadIdx.x % kChunk;
  for (int i = threadIdx.x / kChunk; i < n; i += kThreads / kChunk) {
    if (j > i) continue;
    float kk = 0.0f, qk = 0.0f;
    for (int d = 0; d < dk; ++d) {
      const float kj = expf(m.g[i * kGStride + d] - m.g[j * kGStride + d]) * __bfloat162float(m.k[j * kKqStride + d]);
      kk = fmaf(__bfloat162float(m.k[i * kKqStride + d]), kj, kk);
      qk = fmaf(__bfloat162float(m.q[i * kKqStride + d]), kj, qk);
    }
    m.a_qk[i * kAStride + j] = qk;
    if (j < i) m.a_kk[i * kAStride + j] = m.beta[i] * kk;
  }
}

// Step 4: U_i -= sum_{j<i} A_kk[i][j] U_j, rows in order. Four lanes per column split the j sum.
__device__ void chunk_solve(int n, const ChunkSmem& m) {
  const int col = threadIdx.x / 4, part = threadIdx.x % 4;
  for (int i = 1; i < n; ++i) {
    float acc = 0.0f;
    for (int j = part; j < i; j += 4) acc = fmaf(m.a_kk[i * kAStride + j], m.u[j * kUStride + col], acc);
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    if (part == 0) m.u[i * kUStride + col] -= acc;
    __syncwarp();  // row i is read by the other lanes of this column from the next row on
  }
}

// Step 6: S = exp(G_last) S + sum_j exp(G_last - G_j) k_j U_j^T; thread (row d, columns vg + 4m).
__device__ void chunk_state_update(int n, const ChunkSmem& m) {
  constexpr int kCols = kDim / 4;
  const int d = threadIdx.x / 4, vg = threadIdx.x % 4;
  const float g_last = m.g[(n - 1) * kGStride + d];
  const float decay = expf(g_last);
  float s[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) s[c] = m.s[d * kSStride + vg + 4 * c] * decay;
  for (int j = 0; j < n; ++j) {
    const float kj = expf(g_last - m.g[j * kGStride + d]) * __bfloat162float(m.k[j * kKqStride + d]);
    const float* uj = m.u + j * kUStride + vg;
#pragma unroll
    for (int c = 0; c < kCols; ++c) s[c] = fmaf(kj, uj[4 * c], s[c]);
  }
#pragma unroll
  for (int c = 0; c < kCols; ++c) m.s[d * kSStride + vg + 4 * c] = s[c];
}

// grid: n_heads, block: 512, dynamic shared memory kSmemBytes.
template <bool kFull>
__global__ void __launch_bounds__(kThreads) kda_chunked_kernel(ChunkedArgs a) {
  extern __shared__ float4 smem_f4[];
  const ChunkSmem m = carve_smem(reinterpret_cast<float*>(smem_f4));
  const int dk = kFull ? kDim : a.dim_k, dv = kFull ? kDim : a.dim_v;
  const int h = blockIdx.x;
  float* state = a.state + static_cast<int64_t>(h) * dk * dv;
  if constexpr (kFull) {
    for (int idx = threadIdx.x; idx < kDim * kDim; idx += kThreads)
      m.s[(idx / kDim) * kSStride + idx % kDim] = state[idx];
  } else {
    for (int idx = threadIdx.x; idx < kDim * kDim; idx += kThreads) {
      const int r = idx / kDim, c = idx % kDim;
      m.s[r * kSStride + c] = (r < dk && c < dv) ? state[r * dv + c] : 0.0f;
    }
  }

  // Steps 3 and 5: thread (token i, columns vg + 8c); a warp covers 4 tokens x 8 column offsets.
  constexpr int kCols = kDim / 8;
  const int row = threadIdx.x / 8, vg = threadIdx.x % 8;
  for (int64_t t0 = 0; t0 < a.n_tokens; t0 += kChunk) {
    const int n = static_cast<int>(a.n_tokens - t0 < kChunk ? a.n_tokens - t0 : kChunk);
    load_chunk<kFull>(a, h, t0, n, m);
    __syncthreads();
    chunk_interactions<kFull>(n, dk, m);

    // Step 3 (reads S and U; A is not needed): U_i = beta_i (v_i - S^T (e^G_i k_i)), o_i = S^T (e^G_i q_i).
    float o[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) o[c] = 0.0f;
    if (row < n) {
      float w[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) w[c] = 0.0f;
      for (int d = 0; d < dk; ++d) {
        const float e = expf(m.g[row * kGStride + d]);
        const float kd = e * __bfloat162float(m.k[row * kKqStride + d]);
        const float qd = e * __bfloat162float(m.q[row * kKqStride + d]);
        const float* srow = m.s + d * kSStride + vg;
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          w[c] = fmaf(kd, srow[8 * c], w[c]);
          o[c] = fmaf(qd, srow[8 * c], o[c]);
        }
      }
      float* urow = m.u + row * kUStride + vg;
#pragma unroll
      for (int c = 0; c < kCols; ++c) urow[8 * c] = m.beta[row] * (urow[8 * c] - w[c]);
    }
    __syncthreads();
    chunk_solve(n, m);
    __syncthreads();

    // Step 5: o_i += sum_{j<=i} A_qk[i][j] U_j.
    if (row < n) {
      for (int j = 0; j <= row; ++j) {
        const float aij = m.a_qk[row * kAStride + j];
        const float* uj = m.u + j * kUStride + vg;
#pragma unroll
        for (int c = 0; c < kCols; ++c) o[c] = fmaf(aij, uj[8 * c], o[c]);
      }
      __nv_bfloat16* out = a.out + ((t0 + row) * a.n_heads + h) * dv + vg;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        if (kFull || vg + 8 * c < dv) out[8 * c] = __float2bfloat16(o[c]);
      }
    }
    chunk_state_update(n, m);  // writes only S, which steps 4-5 do not read
    __syncthreads();           // the next chunk overwrites k, q, G, U and A
  }
  if constexpr (kFull) {
    for (int idx = threadIdx.x; idx < kDim * kDim; idx += kThreads)
      state[idx] = m.s[(idx / kDim) * kSStride + idx % kDim];
  } else {
    for (int idx = threadIdx.x; idx < dk * dv; idx += kThreads) state[idx] = m.s[(idx / dv) * kSStride + idx % dv];
  }
}

void check_kda_cuda(const char* op, const KdaParams& p, const KdaCudaInputs& in, const float* state,
                    const __nv_bfloat16* out) {
  BG_CHECK(p.n_tokens >= 0, "{}: n_tokens {} is negative", op, p.n_tokens);
  BG_CHECK(p.n_heads > 0 && p.n_heads <= 65535, "{}: n_heads {} out of range", op, p.n_heads);
  BG_CHECK(p.head_dim_k >= 1 && p.head_dim_k <= kDim && p.head_dim_v >= 1 && p.head_dim_v <= kDim,
           "{}: head dims k={} v={} unsupported (each must be in [1, {}])", op, p.head_dim_k, p.head_dim_v, kDim);
  BG_CHECK(state != nullptr, "{}: state is null", op);
  if (p.n_tokens == 0) return;
  BG_CHECK(in.q && in.k && in.v && in.g && in.beta && out, "{}: null input/output pointer with n_tokens {}", op,
           p.n_tokens);
}

// K == V == 128: the unpadded production path.
bool full_dims(const KdaParams& p) { return p.head_dim_k == kDim && p.head_dim_v == kDim; }

}  // namespace

namespace {
// BG_KDA_RECURRENT_SPLIT as a choice index: 0 one CTA, 1 four, -1 (unset or empty) or 2 by the step's size.
int split_policy(const char* env_value) {
  return env_choice("BG_KDA_RECURRENT_SPLIT", env_value, {"1", "4", "auto"});
}

int splits_for(int policy, int64_t token_heads) {
  if (policy == 1) return 4;
  if (policy == 2 || policy < 0) return token_heads <= kKdaRecurrentSplitBelow ? 4 : 1;
  return 1;  // "1"
}
}  // namespace

int kda_recurrent_splits(int64_t token_heads, const char* env_value) {
  return splits_for(split_policy(env_value), token_heads);
}

int kda_recurrent_splits(int64_t token_heads) {
  static const int policy = split_policy(std::getenv("BG_KDA_RECURRENT_SPLIT"));  // parsed once, not per launch
  return splits_for(policy, token_heads);
}

int kda_recurrent_ctas_per_sm(int splits) {
  BG_CHECK(splits == 1 || splits == 4, "kda_recurrent_ctas_per_sm: {} column splits (1 or 4)", splits);
  int n = 0;
  if (splits == 4) {
    constexpr int kCols = kDim / 4;
    BG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kda_recurrent_kernel<true, kCols>,
                                                                kCols * kRowGroups, 0));
  } else {
    BG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kda_recurrent_kernel<true, kDim>,
                                                                kDim * kRowGroups, 0));
  }
  return n;
}

void kda_recurrent_cuda(const KdaParams& p, const KdaCudaInputs& in, const KdaStateSlots& states, __nv_bfloat16* out,
                        cudaStream_t stream, int splits) {
  constexpr const char* op = "kda_recurrent_cuda";
  check_kda_cuda(op, p, in, states.base, out);
  if (p.n_tokens == 0) return;
  BG_CHECK(states.slot_idx != nullptr, "{}: slot_idx is null", op);
  const int64_t state_floats = p.n_heads * p.head_dim_k * p.head_dim_v;
  BG_CHECK(states.slot_stride >= state_floats, "{}: slot_stride {} < one state of {} floats", op, states.slot_stride,
           state_floats);
  BG_CHECK(p.n_tokens * p.n_heads <= std::numeric_limits<int32_t>::max(), "{}: {} tokens x {} heads too many", op,
           p.n_tokens, p.n_heads);
  const RecurrentArgs a{in, states, out, static_cast<int>(p.n_heads), static_cast<int>(p.head_dim_k),
                        static_cast<int>(p.head_dim_v)};
  BG_CHECK(splits == 0 || splits == 1 || splits == 4, "{}: {} column splits (0, 1 or 4)", op, splits);
  const auto pairs = static_cast<unsigned>(p.n_tokens * p.n_heads);
  if (splits == 0) splits = kda_recurrent_splits(p.n_tokens * p.n_heads);
  if (!full_dims(p)) {
    kda_recurrent_kernel<false, kDim><<<pairs, kDim * kRowGroups, 0, stream>>>(a);
  } else if (splits == 4) {
    constexpr int kCols = kDim / 4;
    kda_recurrent_kernel<true, kCols><<<pairs * 4, kCols * kRowGroups, 0, stream>>>(a);
  } else {
    kda_recurrent_kernel<true, kDim><<<pairs, kDim * kRowGroups, 0, stream>>>(a);
  }
  BG_CUDA_CHECK_LAUNCH();
}

void kda_chunked_simt_cuda(const KdaParams& p, const KdaCudaInputs& in, float* state, __nv_bfloat16* out,
                           cudaStream_t stream) {
  constexpr const char* op = "kda_chunked_simt_cuda";
  check_kda_cuda(op, p, in, state, out);
  if (p.n_tokens == 0) return;
  const ChunkedArgs a{in,
                      state,
                      out,
                      p.n_tokens,
                      static_cast<int>(p.n_heads),
                      static_cast<int>(p.head_dim_k),
                      static_cast<int>(p.head_dim_v)};
  const unsigned grid = static_cast<unsigned>(p.n_heads);
  // Above the 48 KiB default: opt in (a host-side attribute, allowed while a stream is being captured).
  if (full_dims(p)) {
    BG_CUDA_CHECK(
        cudaFuncSetAttribute(kda_chunked_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    kda_chunked_kernel<true><<<grid, kThreads, kSmemBytes, stream>>>(a);
  } else {
    BG_CUDA_CHECK(
        cudaFuncSetAttribute(kda_chunked_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    kda_chunked_kernel<false><<<grid, kThreads, kSmemBytes, stream>>>(a);
  }
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops
