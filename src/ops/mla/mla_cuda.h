// MLA on the GPU, batch-shaped: the paged bf16 latent-cache write and absorbed attention for tokens of many
// sequences in one launch (decode: one token per sequence; prefill: many tokens of one sequence; or a mix).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/mla/mla.h"

namespace bg::ops {

// Where each token's cache position lives, all device pointers. Position p of sequence s is slot p % block_size of
// block block_tables[s * max_blocks_per_seq + p / block_size]; that block's entries start at
// base + block * block_stride (elements), each entry [kv_lora + rope] = [c_kv | k_pe] bf16.
struct MlaPagedCache {
  __nv_bfloat16* base = nullptr;          // this MLA layer's block 0
  int64_t block_stride = 0;               // elements from one block of this layer to the next (>= block_size * entry)
  const int32_t* block_tables = nullptr;  // [n_seqs, max_blocks_per_seq] physical block ids
  int64_t max_blocks_per_seq = 0;
  const int32_t* seq_idx = nullptr;    // [n_tokens] row of block_tables each token belongs to
  const int64_t* positions = nullptr;  // [n_tokens] each token's position in its sequence
  int32_t* error_flags = nullptr;      // optional device int32: kMlaErrorBadPosition is raised there
  // mla_cache_write_cuda only: when set, tokens t >= *live_tokens (device, read by the kernel: each graph replay
  // sees its step's count) are a decode graph's padding rows and write nothing.
  const int32_t* live_tokens = nullptr;
};

// A token whose position lies past its block table writes nothing and raises this bit (error_flags above).
inline constexpr int32_t kMlaErrorBadPosition = 4;
// The decode kernel (mla_decode_cuda.h) met a negative block-table entry where it reads the cache: the rows read as
// zero and this bit is raised.
inline constexpr int32_t kMlaErrorBadBlock = 32;

// Heads handled by one CTA of the attention kernel (they share the streamed cache tile).
inline constexpr int64_t kMlaCudaHeadsPerCta = 8;

// Largest latent shape the kernels take: kv_lora_rank in [1, 512], qk_rope_dim in [0, 64] (DeepSeek-V3 / Kimi use
// exactly 512 / 64, the fast path; smaller shapes, e.g. of test checkpoints, run a zero-padded variant). Larger shapes
// are rejected with bg::Error.
inline constexpr int64_t kMlaCudaMaxKvLoraRank = 512;
inline constexpr int64_t kMlaCudaMaxRopeDim = 64;

// Writes latent [n_tokens, kv_lora + rope] bf16 to each token's (block, slot). Uses p.n_tokens, p.kv_lora_rank,
// p.qk_rope_dim, p.block_size. latent_ld: elements from one latent row to the next (0: the entry size; more for a
// strided view, e.g. kv_a's columns of a fused projection's output). 16-byte copies when the entry size and latent_ld
// are multiples of 8 elements and latent, cache base and block stride are 16-byte aligned, element copies otherwise
// (any entry size, bf16-aligned pointers).
void mla_cache_write_cuda(const MlaParams& p, const __nv_bfloat16* latent, const MlaPagedCache& cache,
                          cudaStream_t stream, int64_t latent_ld = 0);

// rmsnorm_cuda of each latent row's first kv_lora values (norm_weight [kv_lora] fp32, eps) then
// mla_cache_write_cuda of [normed c_kv | k_pe], in one launch: the cache gets the same bits as those two calls (for
// a model whose k_pe is not rotated, Kimi-K3). The latent itself is left as it was.
void mla_cache_write_normed_cuda(const MlaParams& p, const __nv_bfloat16* latent, const float* norm_weight,
                                 float eps, const MlaPagedCache& cache, cudaStream_t stream, int64_t latent_ld = 0);

// Absorbed attention (same contract as mla_attention_cpu, bf16 in/out, fp32 inside):
//   q    [n_tokens, n_heads, qk_nope + qk_rope] bf16
//   w_uk [n_heads, qk_nope, kv_lora] bf16,  w_uv [n_heads, v_head, kv_lora] bf16
//   out  [n_tokens, n_heads, v_head] bf16
// Token t attends to positions 0..positions[t] of sequence seq_idx[t], which must be written already.
// kv_lora_rank in [1, 512], qk_rope_dim in [0, 64], qk_nope_dim >= 1 with qk_nope + qk_rope <= 1156, v_head in
// [1, 4096]; cache entries are kv_lora + rope elements. kv_lora 512 / rope 64 with a 16-byte aligned cache (base and
// block stride) and 4-byte aligned weights take the production path; any other shape or alignment the padded one.
void mla_attention_cuda(const MlaParams& p, const __nv_bfloat16* q, const __nv_bfloat16* w_uk,
                        const __nv_bfloat16* w_uv, const MlaPagedCache& cache, __nv_bfloat16* out, cudaStream_t stream);

}  // namespace bg::ops
