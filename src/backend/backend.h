// The backend-neutral op API the model code is written against. The CPU backend runs the fp32 reference ops; the
// CUDA backend runs bf16-activation kernels. Model code never knows which one it drives.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backend/tensor.h"
#include "formats/quant.h"
#include "ops/kda/kda.h"
#include "ops/mla/mla.h"
#include "ops/rope/rope.h"
#include "ops/router/router.h"

namespace bg {

// A linear weight prepared for one backend (CPU: the stored QuantWeight; CUDA: uploaded device copies).
class LinearHandle {
 public:
  virtual ~LinearHandle() = default;
  virtual int64_t n_out() const = 0;
  virtual int64_t n_in() const = 0;
};

// A RoPE table prepared for one backend.
struct RopeHandle {
  ops::RopeTable table;  // host copy (CPU backend uses it directly)
  Tensor inv_freq;       // fp32 [rope_dim / 2] in backend memory
};

// One MLA layer's view of a paged latent cache: storage [n_blocks, n_layers, block_size, entry_dim].
struct MlaCacheRef {
  Tensor storage;
  int64_t n_layers = 0;
  int64_t block_size = 0;
  int64_t entry_dim = 0;     // kv_lora_rank + rope_dim
  int64_t kv_lora_rank = 0;  // c_kv part of an entry; the rest is k_pe
  int64_t layer = 0;
};

enum class GluKind : uint8_t { kSwiGlu, kSitu };

struct GluSpec {
  GluKind kind = GluKind::kSwiGlu;
  float situ_beta = 4.0f;
  float situ_linear_beta = 25.0f;
};

// Routed experts of one MoE layer: expert e's FFN is down(glu(gate(x), up(x))).
struct ExpertWeights {
  std::vector<const LinearHandle*> gate, up, down;  // [n_experts]
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  virtual DeviceKind device() const = 0;
  // Activation dtype between ops: F32 on the CPU reference, BF16 on CUDA.
  virtual DType act_dtype() const = 0;

  // ---- memory -------------------------------------------------------------------------------------------------
  virtual Tensor alloc(Shape shape, DType dtype) = 0;
  Tensor act(int64_t rows, int64_t cols) { return alloc({rows, cols}, act_dtype()); }
  Tensor zeros(Shape shape, DType dtype);
  virtual void fill_zero(Tensor& t) = 0;
  // Host fp32 values -> a new backend tensor of `dtype` (F32 or BF16).
  virtual Tensor upload_f32(std::span<const float> values, Shape shape, DType dtype) = 0;
  // A checkpoint tensor (embedding table) as a backend tensor (CPU: may borrow the mapping).
  virtual Tensor upload_view(const TensorView& view) = 0;
  // Backend tensor (F32 or BF16) -> host fp32. Synchronises.
  virtual void download_f32(const Tensor& t, float* host) = 0;
  virtual void copy(const Tensor& src, Tensor& dst) = 0;
  // Host bytes -> an existing tensor of exactly that size (any dtype). Synchronises.
  virtual void write_bytes(Tensor& dst, std::span<const std::byte> src) = 0;
  virtual void synchronize() = 0;

  // ---- weights ------------------------------------------------------------------------------------------------
  virtual std::unique_ptr<LinearHandle> prepare_linear(const QuantWeight& w) = 0;
  RopeHandle prepare_rope(const ops::RopeTable& table);

  // ---- ops (shapes [rows, cols]; `out` tensors are allocated by the caller) -----------------------------------
  virtual void embedding(const Tensor& table, std::span<const int32_t> ids, Tensor& out) = 0;
  // RMSNorm of the first w.numel() values of each row of x (row stride x.cols()) into y (same layout).
  virtual void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& y) = 0;
  // y[n, out] = x[n, in] W^T; y may be act dtype or F32.
  virtual void linear(const LinearHandle& w, const Tensor& x, Tensor& y) = 0;
  virtual void add(Tensor& y, const Tensor& x) = 0;                            // y += x
  virtual void glu(const GluSpec& p, const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  virtual void sigmoid_mul(Tensor& x, const Tensor& gate) = 0;                 // x *= sigmoid(gate)
  virtual void rope(const ops::RopeParams& p, const RopeHandle& table, std::span<const int64_t> positions,
                    Tensor& x) = 0;
  // Latent entries [n, entry_dim] -> the cache at `positions` through the sequence's block table.
  virtual void mla_write(const MlaCacheRef& cache, std::span<const int32_t> block_table,
                         std::span<const int64_t> positions, const Tensor& latent) = 0;
  virtual void mla_attention(const ops::MlaParams& p, const Tensor& q, const Tensor& w_uk, const Tensor& w_uv,
                             const MlaCacheRef& cache, std::span<const int32_t> block_table,
                             std::span<const int64_t> positions, Tensor& out) = 0;
  // Router: F32 logits [n, E] -> ids I32 [n, k] and weights F32 [n, k] (backend memory).
  virtual void route(const ops::RouterParams& p, const Tensor& logits, const Tensor& bias, Tensor& ids,
                     Tensor& weights) = 0;
  // out[n, out_dim] += sum_k w[t,k] * Expert_{ids[t,k]}(x[t]) (dispatch, experts and combine).
  virtual void routed_experts(const ExpertWeights& experts, const GluSpec& glu, const Tensor& x, const Tensor& ids,
                              const Tensor& weights, Tensor& out) = 0;
  // ---- Kimi-K3 ------------------------------------------------------------------------------------------------
  virtual void short_conv(const Tensor& x, const Tensor& weight, Tensor& state, Tensor& out) = 0;
  virtual void kda_l2norm(int64_t head_dim, float scale, Tensor& x) = 0;
  virtual void kda_gate(const Tensor& g_raw, const Tensor& a_log, const Tensor& dt_bias, int64_t n_heads,
                        float lower_bound, Tensor& g) = 0;
  virtual void kda_beta(const Tensor& b, Tensor& beta) = 0;
  // Gated delta rule for one sequence: chunked when n > 1 tokens, recurrent for one.
  virtual void kda(const ops::KdaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                   const Tensor& beta, Tensor& state, Tensor& out) = 0;
  virtual void gated_rmsnorm(int64_t n_heads, float eps, const Tensor& x, const Tensor& gate, const Tensor& weight,
                             Tensor& y) = 0;
  // out = softmax-weighted mix of candidates[0..n_candidates) of a packed [max_candidates, n, D] bank.
  virtual void attn_res_mix(const Tensor& bank, int64_t n_candidates, const Tensor& norm, const Tensor& proj,
                            float eps, Tensor& out) = 0;
};

// "cpu" or "cuda" (CUDA only when built with it and a GPU is present); throws naming what is missing.
std::unique_ptr<Backend> make_backend(std::string_view device);

}  // namespace bg
