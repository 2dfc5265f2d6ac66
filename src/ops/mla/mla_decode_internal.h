// MLA decode: the argument block and launch function of the attention kernel, shared by the launcher
// (mla_decode_cuda.cu) and the kernel's translation unit (mla_decode_attention.cu). Not a public API.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/mla/mla_cuda.h"
#include "ops/mla/mla_decode_cuda.h"

namespace bg::ops::mla_decode {

struct AttentionArgs {
  const __nv_bfloat16* q_full;  // [n_tokens, n_heads, 576]
  __nv_bfloat16* o_lat;         // [n_tokens, n_heads, 512] (unsplit tokens)
  float* part_o;                // [max_slots, n_groups, 512, group_heads] (split tokens)
  float* part_ml;               // [max_slots, n_groups, 2, group_heads]
  const int32_t* meta;          // schedule (MlaDecodeMeta)
  MlaPagedCache cache;
  int n_tokens, n_heads, n_groups, block_size;
  float scale_log2;  // softmax_scale * log2(e): scores live in log2 units (exp2)
};

// The attention kernel's arguments for a launch of mla_decode_cuda with this workspace (its q_full and schedule are
// the ones that launch's absorb GEMM and prep kernel wrote).
AttentionArgs attention_args(const MlaDecodePlan& plan, const MlaPagedCache& cache, void* workspace);

// Grid n_partitions * n_groups, 256 threads, Smem<group_heads / 8>::kDynamicBytes of shared memory.
void launch_attention(const MlaDecodePlan& plan, const AttentionArgs& args, cudaStream_t stream);
size_t attention_smem_bytes(const MlaDecodePlan& plan);
MlaDecodeKernelInfo attention_kernel_info(const MlaDecodePlan& plan);

// The heads-as-M kernel (MlaDecodeMma::kWgmmaHeadsM, mla_decode_heads_m.cu): the same arguments, grid and outputs;
// the three functions above call these for that policy.
void launch_attention_heads_m(const MlaDecodePlan& plan, const AttentionArgs& args, cudaStream_t stream);
size_t attention_smem_bytes_heads_m(const MlaDecodePlan& plan);
MlaDecodeKernelInfo attention_kernel_info_heads_m(const MlaDecodePlan& plan);

}  // namespace bg::ops::mla_decode
