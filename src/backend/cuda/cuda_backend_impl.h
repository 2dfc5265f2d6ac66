// The CUDA backend's class (internal: included by the cuda_backend*.cpp files only). It maps the backend op API onto
// the CUDA launchers. A step's metadata (ids, positions, block tables, state slots) is packed into pinned host memory
// and uploaded once per step into a persistent device buffer, so the ops of a step never synchronise and decode steps
// can be captured and replayed as CUDA graphs. Ops run on one stream in order; host-tier copies (kv::StateManager)
// run on a copy stream ordered against it by events.
#pragma once

#include "backend/cuda/cuda_backend.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <type_traits>
#include <utility>

#include "backend/cuda/cuda_allocator.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_linears.h"
#include "backend/cuda/cuda_moe.h"
#include "backend/cuda/device_buffer.h"
#include "backend/cuda/step_sampler.h"
#include "backend/cuda/weight_uploader.h"
#include "backend/fault_injection.h"
#include "core/env.h"
#include "core/log.h"
#include "ops/attn_res/attn_res_cuda.h"
#include "ops/elementwise/elementwise_cuda.h"
#include "ops/embedding/embedding_cuda.h"
#include "ops/gated_rmsnorm/gated_rmsnorm_cuda.h"
#include "ops/kda/kda_cuda.h"
#include "ops/kda/kda_varlen_plan.h"
#include "ops/kda_gate/kda_gate_cuda.h"
#include "ops/linear/linear_cuda.h"
#include "ops/mla/mla_cuda.h"
#include "ops/mla/mla_decode_cuda.h"
#include "ops/mla/mla_prefill_cuda.h"
#include "ops/moe/moe_cuda.h"
#include "ops/rmsnorm/rmsnorm_cuda.h"
#include "ops/rope/rope_cuda.h"
#include "ops/router/router_cuda.h"
#include "ops/kda_gate/kda_prep_cuda.h"
#include "ops/short_conv/short_conv_cuda.h"
#include "ops/situ/situ_cuda.h"
#include "ops/swiglu/swiglu_cuda.h"

namespace bg::cuda_backend_detail {

using bf16 = __nv_bfloat16;

using cuda::CudaExpertSlots;

inline const ops::DeviceWeight& desc(const LinearHandle& h) { return cuda::cuda_linear(h).desc(); }

inline void expect(const Tensor& t, DType dtype, const char* what) {
  BG_CHECK(t.device == DeviceKind::kCuda, "cuda backend: {} is not in device memory", what);
  BG_CHECK(t.dtype == dtype, "cuda backend: {} must be {}, got {}", what, dtype_name(dtype), dtype_name(t.dtype));
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaBackendOptions& o) {
    int n = cuda::device_count();
    BG_CHECK(n > 0, "--device cuda: no CUDA device is visible (driver missing or no GPU)");
    int device = o.device;
    if (device < 0) BG_CUDA_CHECK(cudaGetDevice(&device));
    BG_CHECK(device >= 0 && device < n, "--device cuda: device {} does not exist ({} visible)", device, n);
    BG_CUDA_CHECK(cudaSetDevice(device));
    BG_CUDA_CHECK(cudaStreamCreate(&stream_));
    BG_CUBLAS_CHECK(cublasCreate(&cublas_));
    alloc_ = cuda::make_cuda_allocator(o.memory_budget_bytes);
    cublas_ws_ = alloc_->allocate(ops::kCublasWorkspaceBytes);
    if (ops::dense_decode_enabled()) {
      dense_decode_buf_ = alloc_->allocate(ops::dense_decode_workspace_bytes());
      dense_decode_ = ops::dense_decode_workspace(dense_decode_buf_.get());
      ops::dense_decode_workspace_init(dense_decode_, stream_);
    }
    errors_ = cuda::DeviceBuffer(sizeof(int32_t));
    BG_CUDA_CHECK(cudaMemset(errors_.data(), 0, sizeof(int32_t)));
    BG_CUDA_CHECK(cudaMallocHost(&errors_host_, sizeof(int32_t)));
    cudaDeviceProp prop{};
    BG_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    n_sms_ = prop.multiProcessorCount;
    deterministic_ = o.deterministic;
    mla_cudnn_.set_background_builds(o.background_plans);
    log::info("cuda backend: {} (sm_{}{}), {:.1f} GiB budget", prop.name, prop.major, prop.minor,
              static_cast<double>(alloc_->budget_bytes()) / (1 << 30));
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g.exec);
    graphs_.clear();
    decode_arena_.reset();
    if (profiled_graph_.exec != nullptr) cudaGraphExecDestroy(profiled_graph_.exec);
    if (step_host_ != nullptr) cudaFreeHost(step_host_);
    if (step_uploaded_ != nullptr) cudaEventDestroy(step_uploaded_);
    if (copy_stream_ != nullptr) cudaStreamSynchronize(copy_stream_);
    for (auto& [fence, ev] : copies_in_flight_) cudaEventDestroy(ev);
    for (cudaEvent_t ev : spare_copy_events_) cudaEventDestroy(ev);
    if (copy_after_ != nullptr) cudaEventDestroy(copy_after_);
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
    if (errors_host_ != nullptr) cudaFreeHost(errors_host_);
    cublas_ws_.reset();
    dense_decode_buf_.reset();
    moe_grouped_scratch_.reset();
    cublasDestroy(cublas_);
    cudaStreamDestroy(stream_);
  }

  std::string_view name() const override { return "cuda"; }
  DeviceKind device() const override { return DeviceKind::kCuda; }
  DType act_dtype() const override { return DType::kBF16; }
  DType conv_state_dtype() const override { return DType::kBF16; }

  Tensor alloc(Shape shape, DType dtype) override { return cuda::alloc_tensor(*alloc_, std::move(shape), dtype); }
  void fill_zero(Tensor& t) override {
    BG_PROFILE_OP("fill_zero", stream_);
    BG_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), stream_));
  }
  Tensor packed(const Tensor& t) override {
    if (t.packed()) return t;
    BG_PROFILE_OP("pack", stream_);
    return cuda::packed_copy(*alloc_, t, stream_);
  }
  Tensor upload_f32(std::span<const float> values, Shape shape, DType dtype) override {
    Tensor t = alloc(std::move(shape), dtype);
    BG_CHECK(static_cast<int64_t>(values.size()) == t.numel(), "upload_f32: {} values for shape {}", values.size(),
             shape_str(t.shape));
    if (dtype == DType::kF32) {
      copy_in(t.data, values.data(), t.nbytes());
    } else {
      BG_CHECK(dtype == DType::kBF16, "upload_f32: unsupported target dtype {}", dtype_name(dtype));
      std::vector<uint16_t> bits(values.size());
      for (size_t i = 0; i < values.size(); ++i) bits[i] = f32_to_bf16(values[i]);
      copy_in(t.data, bits.data(), t.nbytes());
    }
    return t;
  }
  Tensor upload_view(const TensorView& view) override {
    if (view.dtype == DType::kBF16 || view.dtype == DType::kF32) {
      Tensor t = alloc(view.shape, view.dtype);
      copy_in(t.data, view.data, view.nbytes);
      return t;
    }
    std::vector<float> values = view.to_f32();
    return upload_f32(values, view.shape, DType::kF32);
  }
  void download_f32(const Tensor& t, float* host) override {
    BG_PROFILE_OP("download_f32", stream_);
    const int64_t n = t.numel();
    if (t.dtype == DType::kF32) {
      copy_out(host, t.data, t.nbytes());
      return;
    }
    std::vector<std::byte> raw(t.nbytes());
    copy_out(raw.data(), t.data, raw.size());
    for (int64_t i = 0; i < n; ++i) host[i] = load_as_f32(raw.data(), t.dtype, i);
  }
  void copy(const Tensor& src, Tensor& dst) override {
    BG_PROFILE_OP("copy", stream_);
    BG_CHECK(src.nbytes() == dst.nbytes(), "copy of {} bytes into {}", src.nbytes(), dst.nbytes());
    BG_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice, stream_));
  }
  void write_bytes(Tensor& dst, std::span<const std::byte> src) override {
    BG_CHECK(src.size() == dst.nbytes(), "write_bytes: {} bytes into a tensor of {}", src.size(), dst.nbytes());
    copy_in(dst.data, src.data(), src.size());
  }
  void synchronize() override {
    BG_CUDA_CHECK(cudaStreamSynchronize(stream_));
    check_device_errors();
  }
  void wait_for_plans() override { mla_cudnn_.wait_for_builds(); }
  // The logits stay on the device: see cuda/step_sampler.h (its pinned buffers are this backend's).
  void sample_rows(const Tensor& logits, std::span<const ops::RowSampling> rows,
                   std::span<ops::RowSample> out) override {
    BG_PROFILE_OP("sample_rows", stream_);
    BG_CHECK(!capturing_, "cuda backend: sampling during graph capture");
    const int32_t flags = sampler_.run(logits, rows, out, errors_.as<int32_t>(), stream_);
    if (flags != 0) raise_device_errors(flags);
  }

  // Weights go up in batches through the uploader (one allocation per batch, pinned copies); see weight_uploader.h.
  std::unique_ptr<LinearHandle> prepare_linear(const QuantWeight& w) override {
    return std::move(prepare_linears({{&w}, 0, {}}).weights.front());
  }
  PreparedLinears prepare_linears(const LinearBatch& batch) override {
    return cuda::prepare_linears(uploader(), batch);
  }
  WritableLinear alloc_linear(const QuantWeight& like) override {
    // The device holds dense F32/F16 weights as bf16 (rounded at upload); a streamed copy is the stored bytes.
    BG_CHECK(like.format != WeightFormat::kDense || like.data.dtype == DType::kBF16,
             "cuda: dense {} expert {} cannot be streamed (the device holds it rounded to bf16); use "
             "--resident-experts 1", dtype_name(like.data.dtype), like.name);
    WritableLinear w = writable_linear_storage(*this, like);
    ops::DeviceWeightStorage s;  // the descriptor only: the tensors in `w` own the memory
    s.desc = {like.format, like.n_out, like.n_in, w.data.data, w.scale.empty() ? nullptr : w.scale.data};
    w.handle = std::make_unique<cuda::CudaLinear>(std::move(s), like);
    return w;
  }
  std::shared_ptr<void> pin_host_memory(std::span<const HostRegion> regions) override {
    return uploader().pin(regions);
  }
  MemoryUse memory_use() const override {
    MemoryUse m;
    m.in_use = alloc_->bytes_in_use();
    m.held = m.in_use + alloc_->bytes_cached();
    m.peak_held = alloc_->peak_bytes_held();
    m.peak_in_use = alloc_->peak_bytes_in_use();
    size_t free_bytes = 0;
    BG_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &m.device_total));
    m.device_used = m.device_total - free_bytes;
    m.peak_device_used = m.device_used - std::min(m.held, m.device_used) + m.peak_held;
    return m;
  }
  void reset_memory_peak() override { alloc_->reset_peak(); }

  void embedding(const Tensor& table, Tensor& out) override {
    BG_PROFILE_OP("embedding", stream_);
    expect(out, DType::kBF16, "embedding output");
    ops::EmbeddingParams p{step_.n_tokens(), table.shape.at(0), table.shape.at(1)};
    if (table.dtype == DType::kBF16) {
      ops::embedding_cuda(p, table.as<bf16>(), dev_.token_ids, out.as<bf16>(), nullptr, stream_);
    } else {
      ops::embedding_cuda(p, table.as<float>(), dev_.token_ids, out.as<bf16>(), nullptr, stream_);
    }
  }
  // The embedding kernel is a row gather: x is the table, the last rows the ids.
  void gather_last_rows(const Tensor& x, Tensor& out) override {
    BG_PROFILE_OP("gather_last_rows", stream_);
    expect(x, DType::kBF16, "gather_last_rows input");
    ops::EmbeddingParams p{step_.n_seqs(), x.rows(), x.cols()};
    ops::embedding_cuda(p, x.as<bf16>(), dev_.last_rows, out.as<bf16>(), nullptr, stream_);
  }
  void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& y) override {
    BG_PROFILE_OP("rmsnorm", stream_);
    expect(x, DType::kBF16, "rmsnorm input");
    ops::rmsnorm_cuda({x.rows(), w.numel(), eps}, {x.ld(), y.ld()}, x.strided_as<bf16>(), w.as<float>(),
                      y.strided_as<bf16>(), stream_);
  }
  void linear(const LinearHandle& w, const Tensor& x_in, Tensor& y) override {
    const ops::DeviceWeight& d = desc(w);
    // A strided x (a fused group's part) goes to cuBLAS as it is (its row stride as lda); other paths get it packed.
    const bool strided = !x_in.packed() && d.format == WeightFormat::kDense && !deterministic_;
    const Tensor x = strided ? x_in : packed(x_in);
    BG_PROFILE_OP("linear", stream_);
    expect(x, DType::kBF16, "linear input");
    ops::LinearCudaParams p{x.rows(), y.dtype == DType::kF32 ? ops::LinearOutType::kF32 : ops::LinearOutType::kBf16,
                            ops::LinearPath::kAuto, deterministic_};
    p.x_ld = strided ? x.ld() : 0;
    BG_CHECK(d.data != nullptr, "cuda linear '{}': no device copy (a routed expert, held in its MoE layer's own "
             "layout)", cuda::cuda_linear(w).host().name);
    size_t scratch_bytes = ops::linear_dequant_scratch_bytes(d, p);
    std::shared_ptr<void> scratch = scratch_bytes > 0 ? alloc_->allocate(scratch_bytes) : nullptr;
    ops::LinearCudaContext ctx{cublas_,      cublas_ws_.get(), ops::kCublasWorkspaceBytes,
                               scratch.get(), scratch_bytes,    dense_decode_ctx()};
    ops::linear_cuda(p, d, x.strided_as<bf16>(), y.data, ctx, stream_);
  }
  void linear_add(const LinearHandle& w, const Tensor& x, Tensor& y) override {
    const ops::DeviceWeight& d = desc(w);
    if (d.format != WeightFormat::kDense || deterministic_ || y.dtype != DType::kBF16) {
      Backend::linear_add(w, x, y);
      return;
    }
    BG_PROFILE_OP("linear", stream_);
    expect(x, DType::kBF16, "linear input");
    BG_CHECK(d.data != nullptr && y.rows() == x.rows() && y.cols() == d.n_out,
             "cuda linear_add: y [{}, {}] for {} rows of a [{}, {}] weight", y.rows(), y.cols(), x.rows(), d.n_out,
             d.n_in);
    ops::LinearCudaParams p{x.rows(), ops::LinearOutType::kBf16, ops::LinearPath::kAuto, false};
    p.accumulate = true;
    const ops::LinearCudaContext ctx{cublas_, cublas_ws_.get(), ops::kCublasWorkspaceBytes, nullptr, 0,
                                     dense_decode_ctx()};
    ops::linear_cuda(p, d, x.as<bf16>(), y.data, ctx, stream_);
  }
  std::vector<Tensor> linear_group(const LinearGroup& g, const Tensor& x) override;
  bool linear_group_fuses(const LinearGroup& g, int64_t rows) const override {
    return fuse_linear_groups_ && g.fused != nullptr && rows <= cuda::kLinearGroupMaxFusedRows &&
           g.parts.size() <= ops::kMaxColumnSlices;
  }
  void add(Tensor& y, const Tensor& x) override {
    BG_PROFILE_OP("add", stream_);
    ops::add_inplace_cuda(y.numel(), x.as<bf16>(), y.as<bf16>(), stream_);
  }
  // SiTU reads strided gate / up (a fused group's parts) in place; SwiGLU gets them packed.
  void glu(const GluSpec& p, const Tensor& gate, const Tensor& up, Tensor& out) override {
    if (p.kind == GluKind::kSwiGlu) {
      const Tensor g = packed(gate), u = packed(up);
      BG_PROFILE_OP("glu", stream_);
      ops::swiglu_cuda(g.numel(), g.as<bf16>(), u.as<bf16>(), out.as<bf16>(), stream_);
    } else {
      BG_PROFILE_OP("glu", stream_);
      BG_CHECK(gate.rows() == up.rows() && gate.cols() == up.cols(), "glu: gate [{}] and up [{}] differ",
               shape_str(gate.shape), shape_str(up.shape));
      BG_CHECK((gate.packed() && up.packed()) || (out.data != gate.data && out.data != up.data),
               "glu: the output may alias packed inputs only");
      ops::situ_cuda({gate.rows(), gate.cols(), p.situ_beta, p.situ_linear_beta}, gate.strided_as<bf16>(),
                     up.strided_as<bf16>(), out.as<bf16>(), stream_, gate.ld(), up.ld());
    }
  }
  void sigmoid_mul(Tensor& x, const Tensor& gate) override {
    BG_PROFILE_OP("sigmoid_mul", stream_);
    BG_CHECK(gate.rows() == x.rows() && gate.cols() == x.cols(), "sigmoid_mul: gate [{}] for x [{}]",
             shape_str(gate.shape), shape_str(x.shape));
    ops::sigmoid_gate_cuda(x.rows(), x.cols(), gate.strided_as<bf16>(), gate.ld(), x.as<bf16>(), stream_);
  }
  void rope(const ops::RopeParams& p, const RopeHandle& table, Tensor& x) override {
    BG_PROFILE_OP("rope", stream_);
    ops::apply_rope_cuda(p, dev_.positions, table.inv_freq.as<float>(), table.table.attention_factor, x.as<bf16>(),
                         stream_);
  }
  void mla_write(const MlaCacheRef& c, const Tensor& latent) override {
    BG_PROFILE_OP("mla_write", stream_);
    ops::mla_cache_write_cuda(write_params(c), latent.strided_as<bf16>(), write_cache(c), stream_, latent.ld());
  }
  void mla_write_normed(const MlaCacheRef& c, Tensor& latent, const Tensor& norm, float eps) override {
    BG_PROFILE_OP("mla_write", stream_);
    const ops::MlaParams p = write_params(c);
    BG_CHECK(norm.numel() == p.kv_lora_rank, "mla_write_normed: a norm of {} values for kv_lora_rank {}", norm.numel(),
             p.kv_lora_rank);
    ops::mla_cache_write_normed_cuda(p, latent.strided_as<bf16>(), norm.as<float>(), eps, write_cache(c), stream_,
                                     latent.ld());
  }
  // Decode steps (one token per sequence) at the production latent shape (kv_lora 512, rope 64) run the split-KV
  // tensor-core kernel (mla_decode_cuda.h); prefill and mixed steps, and the small latent shapes of test
  // checkpoints, the general kernel (mla_cuda.h). Under --deterministic every step takes the general kernel: which
  // kernel a decode token gets must not depend on whether another sequence prefills in the same step.
  void mla_attention(const ops::MlaParams& p, const Tensor& q, const Tensor& w_uk, const Tensor& w_uv,
                     const MlaCacheRef& c, Tensor& out) override {
    BG_PROFILE_OP("mla_attention", stream_);
    if (!deterministic_ && step_.all_single_token() && ops::mla_decode_takes(p)) {
      mla_decode(p, q, w_uk, w_uv, c, out);
      return;
    }
    if (!deterministic_ && !capturing_ && !step_.all_single_token() && ops::mla_prefill_takes(p)) {
      const ops::MlaPrefillPlan& plan = mla_prefill_plan();
      if (!plan.empty()) {
        mla_prefill(p, plan, q, w_uk, w_uv, c, out);
        return;
      }
    }
    ops::mla_attention_cuda(p, q.as<bf16>(), w_uk.as<bf16>(), w_uv.as<bf16>(), paged(c), out.as<bf16>(), stream_);
  }
  void route(const ops::RouterParams& p, const Tensor& logits, const Tensor& bias, Tensor& ids,
             Tensor& weights) override {
    BG_PROFILE_OP("route", stream_);
    ops::route_topk_cuda(p, logits.as<float>(), bias.empty() ? nullptr : bias.as<float>(), ids.as<int32_t>(),
                         weights.as<float>(), stream_);
  }
  std::unique_ptr<ExpertSlots> prepare_experts(const ExpertWeights& by_slot) override {
    return std::make_unique<CudaExpertSlots>(by_slot, uploader());
  }
  size_t expert_layout_bytes(const ExpertSlots& slots) const override {
    return static_cast<const CudaExpertSlots&>(slots).layout_bytes();
  }
  bool expert_layout_takes_blocks(const ExpertSlots& slots) const override {
    return static_cast<const CudaExpertSlots&>(slots).takes_blocks();
  }
  bool takes_deferred_experts() const override { return true; }
  void lay_out_expert(const ExpertSlots& slots, const LinearHandle& gate, const LinearHandle& up,
                      const LinearHandle& down, Tensor& dst) override {
    BG_PROFILE_OP("lay_out_expert", stream_);
    static_cast<const CudaExpertSlots&>(slots).lay_out(gate, up, down, dst, errors_.as<int32_t>(), stream_);
  }
  CopyFence lay_out_expert_ahead(const ExpertSlots& slots, const LinearHandle& gate, const LinearHandle& up,
                                 const LinearHandle& down, Tensor& dst) override;
  void set_expert_slot(ExpertSlots& slots, int64_t slot, const LinearHandle& gate, const LinearHandle& up,
                       const LinearHandle& down, const Tensor* laid_out) override {
    static_cast<CudaExpertSlots&>(slots).set(slot, gate, up, down, laid_out, stream_);
  }
  void moe_dispatch(const Tensor& slot_map, const Tensor& ids, const Tensor& weights, MoeRouting& r,
                    int64_t step_row0) override {
    BG_PROFILE_OP("moe_dispatch", stream_);
    cuda::moe_dispatch(moe_ctx(), slot_map, ids, weights, r, step_row0 >= 0 ? dev_.live_tokens : nullptr,
                       step_row0);
  }
  void moe_gather(const MoeRouting& r, const Tensor& x, Tensor& rows) override {
    BG_PROFILE_OP("moe_gather", stream_);
    cuda::moe_gather(moe_ctx(), r, x, rows);
  }
  void moe_experts(const ExpertSlots& experts, const GluSpec& glu, const MoeRouting& r, const Tensor& rows,
                   Tensor& y_rows) override {
    BG_PROFILE_OP("moe_experts", stream_);
    cuda::moe_experts(moe_ctx(), static_cast<const CudaExpertSlots&>(experts), glu, r, rows, y_rows);
  }
  void moe_combine(const MoeRouting& r, const Tensor& y_rows, Tensor& out) override {
    BG_PROFILE_OP("moe_combine", stream_);
    cuda::moe_combine(moe_ctx(), r, y_rows, out);
  }
  void moe_routed_local(const ExpertSlots& experts, const GluSpec& glu, const MoeRouting& r, const Tensor& x,
                        Tensor& out, bool accumulate) override {
    BG_PROFILE_OP("moe_routed_local", stream_);
    cuda::moe_routed_local(moe_ctx(), static_cast<const CudaExpertSlots&>(experts), glu, r, x, out, accumulate);
  }
  // Decode steps: one batched launch over the sequences' slots; otherwise one launch per sequence.
  void short_conv(const Tensor& x, const Tensor& weight, const StateRef& state, Tensor& out) override;
  void kda_l2norm(int64_t head_dim, float scale, Tensor& x) override {
    BG_PROFILE_OP("kda_l2norm", stream_);
    ops::kda_l2norm_cuda({x.numel() / head_dim, head_dim, scale, 1e-6f}, x.as<bf16>(), x.as<bf16>(), stream_);
  }
  void kda_gate(const Tensor& g_raw, const Tensor& a_log, const Tensor& dt_bias, int64_t n_heads, float lower_bound,
                Tensor& g) override {
    BG_PROFILE_OP("kda_gate", stream_);
    ops::kda_gate_cuda({g_raw.rows(), n_heads, g_raw.cols() / n_heads, lower_bound}, g_raw.as<bf16>(),
                       a_log.as<float>(), dt_bias.as<float>(), g.as<float>(), stream_);
  }
  void kda_beta(const Tensor& b, Tensor& beta) override {
    BG_PROFILE_OP("kda_beta", stream_);
    ops::kda_beta_cuda(b.numel(), b.as<bf16>(), beta.as<float>(), stream_);
  }
  // Decode steps: one fused launch (kda_prep_cuda.h; BG_KDA_PREP_FUSED=0 runs the separate ops). Otherwise, and for
  // head dims or conv widths past the fused kernel's, the separate ops.
  // Steps with prefill pieces: with BG_KDA_PREP_PREFILL_FUSED=1 the q and k convs take their L2 norm in the same
  // launch (short_conv_l2norm_cuda); else the separate ops. Off by default: its tests pass, but it measured ~1.3x
  // slower than the two passes on the H100 (bench/RESULTS.md, 2026-12-06).
  // The fused decode kernel reads strided inputs (a fused group's parts) in place; the other paths get them packed.
  void kda_prep(const KdaPrepArgs& a_in, Tensor& q, Tensor& k, Tensor& v, Tensor& g, Tensor& beta) override;
  // Decode steps: one recurrent launch over all sequences' slots. Otherwise a recurrent step for each 1-token sequence
  // and one varlen chunked launch pair for all the longer ones (kda_plan_, made in upload_step).
  void kda(const ops::KdaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
           const Tensor& beta, const StateRef& state, Tensor& out) override;
  void gated_rmsnorm(int64_t n_heads, float eps, const Tensor& x, const Tensor& gate, const Tensor& weight,
                     Tensor& y) override {
    BG_PROFILE_OP("gated_rmsnorm", stream_);
    ops::gated_rmsnorm_cuda({x.rows(), n_heads, weight.numel(), eps}, x.as<bf16>(), gate.strided_as<bf16>(),
                            weight.as<float>(), y.as<bf16>(), stream_, gate.ld());
  }
  void attn_res_mix(const Tensor& bank, int64_t n_candidates, const Tensor& norm, const Tensor& proj, float eps,
                    Tensor& out) override {
    BG_PROFILE_OP("attn_res_mix", stream_);
    ops::attn_res_mix_cuda({n_candidates, bank.shape.at(1), bank.shape.at(2), eps}, bank.as<bf16>(), norm.as<float>(),
                           proj.as<float>(), out.as<bf16>(), stream_);
  }
  void attn_res_mix_rmsnorm(const Tensor& bank, int64_t n_candidates, const Tensor& norm, const Tensor& proj, float eps,
                            Tensor& h, const Tensor& rms_weight, float rms_eps, Tensor& x) override {
    BG_PROFILE_OP("attn_res_mix_rmsnorm", stream_);
    BG_CHECK(h.rows() == bank.shape.at(1) && h.cols() == bank.shape.at(2) && x.rows() == h.rows() &&
                 x.cols() == h.cols() && rms_weight.numel() == h.cols(),
             "attn_res_mix_rmsnorm: h / x / weight do not match the bank's [{}, {}]", bank.shape.at(1),
             bank.shape.at(2));
    ops::attn_res_mix_rmsnorm_cuda({n_candidates, bank.shape.at(1), bank.shape.at(2), eps}, bank.as<bf16>(),
                                   norm.as<float>(), proj.as<float>(), rms_weight.as<float>(), rms_eps,
                                   h.as<bf16>(), x.as<bf16>(), stream_);
  }

  void attn_res_add_mix_rmsnorm(const Tensor& addend, bool replace, const Tensor& bank, int64_t n_candidates,
                                const Tensor& norm, const Tensor& proj, float eps, Tensor& h, const Tensor& rms_weight,
                                float rms_eps, Tensor& x) override {
    BG_PROFILE_OP("attn_res_add_mix_rmsnorm", stream_);
    BG_CHECK(h.rows() == bank.shape.at(1) && h.cols() == bank.shape.at(2) && x.rows() == h.rows() &&
                 x.cols() == h.cols() && rms_weight.numel() == h.cols() && addend.rows() == h.rows() &&
                 addend.cols() == h.cols() && n_candidates <= bank.shape.at(0),
             "attn_res_add_mix_rmsnorm: addend / h / x / weight do not match the bank's [{}, {}], or {} candidates "
             "of {}", bank.shape.at(1), bank.shape.at(2), n_candidates, bank.shape.at(0));
    ops::attn_res_add_mix_rmsnorm_cuda({n_candidates, bank.shape.at(1), bank.shape.at(2), eps}, addend.as<bf16>(),
                                       replace, bank.as<bf16>(), norm.as<float>(), proj.as<float>(),
                                       rms_weight.as<float>(), rms_eps, h.as<bf16>(), x.as<bf16>(), stream_);
  }

  Tensor run_graph(int64_t key, const std::function<Tensor()>& body) override;
  int64_t n_graphs() const override { return static_cast<int64_t>(graphs_.size()); }

  // Host tier: pinned memory; copies on a second stream, ordered after the compute stream by an event (see below).
  std::shared_ptr<std::byte> alloc_host(size_t bytes) override;
  CopyFence copy_to_host(std::span<const HostCopy> copies) override {
    return issue_copies(copies, cudaMemcpyDeviceToHost);
  }
  CopyFence copy_from_host(std::span<const HostCopy> copies) override {
    const CopyFence fence = issue_copies(copies, cudaMemcpyHostToDevice);
    compute_wait(fence);
    return fence;
  }
  CopyFence prefetch_from_host(std::span<const HostCopy> copies) override {
    return issue_copies(copies, cudaMemcpyHostToDevice);
  }
  bool fence_done(CopyFence fence) override;
  void wait_fence(CopyFence fence) override;
  void compute_wait(CopyFence fence) override;

  CudaStreamContext stream_context() { return {stream_, errors_.as<int32_t>()}; }

 private:
  // Device copies of the current step's metadata (one buffer, see upload_step).
  struct StepDevice {
    const int32_t* token_ids = nullptr;
    const int64_t* positions = nullptr;
    const int32_t* token_seq = nullptr;
    const int32_t* block_tables = nullptr;
    const int32_t* state_slots = nullptr;
    const int32_t* last_rows = nullptr;
    const int32_t* kda_plan = nullptr;  // kda_plan_.packed()
    const int32_t* live_tokens = nullptr;  // [1] StepLayout::live_tokens(): rows from there on are padding
  };
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    Tensor out;
    std::shared_ptr<CapturePool> memory;  // every block handed out while capturing (reused inside the capture)
  };
  // arena: capture into it (a decode graph, BG_GRAPH_ARENA) instead of a pool of the graph's own. `outlived` gets
  // the blocks reused from the arena that outlive the capture, other than the output's.
  Graph capture_graph(const std::function<Tensor()>& body, bool profile_ops,
                      const std::shared_ptr<CapturePool>& arena = nullptr, std::vector<void*>* outlived = nullptr);
  void drop_graphs();
  void drop_profiled_graph();

  void upload_step() override;
  CopyFence issue_copies(std::span<const HostCopy> copies, cudaMemcpyKind kind);
  CopyFence record_copy_fence(cudaStream_t stream);  // an event after `stream`'s work so far, as the next fence
  cudaEvent_t fence_event(CopyFence fence) const;
  void retire_copies();
  cuda::MoeContext moe_ctx() const {
    return {alloc_.get(), errors_.as<int32_t>(), stream_, deterministic_, &moe_grouped_scratch_,
            {cublas_, cublas_ws_.get(), ops::kCublasWorkspaceBytes}};
  }
  // Device error flags (MoE / MLA kernels raise bits instead of trapping): read after each synchronisation; a raised
  // flag is reset and reported as an error of this step (the context stays usable). Both go through stream_, never the
  // legacy default stream: a legacy-stream copy waits for every blocking stream of the context, so with ll ranks that
  // share a process (tests) it would wait for a peer's flag wait that waits for this rank's next call.
  void check_device_errors() {
    BG_CUDA_CHECK(cudaMemcpyAsync(errors_host_, errors_.data(), sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
    BG_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (*errors_host_ != 0) raise_device_errors(*errors_host_);
  }
  [[noreturn]] void raise_device_errors(int32_t flags) {
    BG_CUDA_CHECK(cudaMemsetAsync(errors_.data(), 0, sizeof(int32_t), stream_));
    BG_CUDA_CHECK(cudaStreamSynchronize(stream_));
    fail("cuda backend: a kernel of this step reported{}{}{}{}{}{}{}{} (flags {:#x}); the step's outputs are discarded",
         (flags & ops::kMoeErrorBadExpertId) ? " a routed expert id outside the layer's experts" : "",
         (flags & ops::kMoeErrorBadDescriptor) ? " an expert slot whose weights disagree with the layer" : "",
         (flags & ops::kMoeErrorNoSlot) ? " a routed expert without a slot on this rank" : "",
         (flags & ops::kMoeErrorDuplicateExpert) ? " a token routed twice to one expert" : "",
         (flags & ops::kMlaErrorBadPosition) ? " a cache position past its sequence's block table" : "",
         (flags & ops::kMlaErrorBadBlock) ? " a negative MLA block-table entry" : "",
         (flags & ops::kMoeErrorExchange) ? " expert rows the ll exchange could not place or read" : "",
         (flags & ops::kMoeErrorOverlapStall) ? " an expert kernel that waited 2 s for its inputs" : "", flags);
  }
  // kda_prep of a step with prefill pieces, per sequence: q and k through short_conv_l2norm_cuda (the conv and the
  // norm in one launch, bit for bit the two), v through short_conv_cuda; then the gate and beta as usual.
  void kda_prep_prefill(const KdaPrepArgs& a, Tensor& q, Tensor& k, Tensor& v, Tensor& g, Tensor& beta);
  // A conv state (bf16 elements from a word offset, StateRef) of every slot of a decode step; the live count on every
  // decode step: a graph captured without padding replays steps with some.
  ops::ConvStateSlots conv_slots(const StateRef& st) const {
    return {reinterpret_cast<bf16*>(st.storage.as<float>() + st.offset), dev_.state_slots, 2 * st.slot_stride,
            dev_.live_tokens};
  }
  // Sequence seq's conv state.
  bf16* conv_state(const StateRef& st, int64_t seq) const {
    return reinterpret_cast<bf16*>(st.storage.as<float>() + st.offset +
                                   step_.state_slots.at(static_cast<size_t>(seq)) * st.slot_stride);
  }
  void copy_in(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;
    BG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    BG_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the host source may go away after return
  }
  void copy_out(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;
    BG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    BG_CUDA_CHECK(cudaStreamSynchronize(stream_));
    check_device_errors();
  }
  // The decode workspace is shared by every MLA layer and every graph (they run one at a time on stream_). It only
  // grows; a replaced buffer is kept while the backend lives, since graphs captured earlier may point into it.
  void mla_decode(const ops::MlaParams& p, const Tensor& q, const Tensor& w_uk, const Tensor& w_uv,
                  const MlaCacheRef& c, Tensor& out) {
    mla_decode_launch(p, {q.as<bf16>(), w_uk.as<bf16>(), w_uv.as<bf16>(), out.as<bf16>()}, paged(c));
  }
  // p.n_tokens tokens, each the only one of its sequence, at t.q / t.out with the cache view's per-token arrays.
  void mla_decode_launch(const ops::MlaParams& p, const ops::MlaDecodeTensors& t, const ops::MlaPagedCache& cache) {
    // Never under --deterministic (mla_attention takes the general kernel then), so the balanced split-KV plan;
    // the per-token plan (MlaDecodeOptions::per_token) stays a kernel option with its own batch-invariance test.
    ops::MlaDecodeOptions options;
    static const ops::MlaDecodeMma mma = ops::mla_decode_mma_from_env();  // BG_MLA_DECODE, read once
    options.mma = mma;
    static const bool align = ops::mla_decode_align_from_env();  // BG_MLA_DECODE_ALIGN, read once
    options.align_tokens = align;
    const ops::MlaDecodePlan plan = ops::mla_decode_plan(p, n_sms_, options);
    if (plan.ws.total_bytes > mla_ws_bytes_) {
      if (mla_ws_) mla_ws_retired_.push_back(std::move(mla_ws_));
      mla_ws_bytes_ = std::max(plan.ws.total_bytes, 2 * mla_ws_bytes_);
      // During a capture the graph keeps it too (capture sink). With the graph arena it must not be another graph's
      // scratch (it outlives the capture that grows it): allocate_persistent then.
      mla_ws_ = graph_arena_ ? alloc_->allocate_persistent(mla_ws_bytes_) : alloc_->allocate(mla_ws_bytes_);
    }
    const ops::MlaDecodeContext ctx{cublas_, cublas_ws_.get(), ops::kCublasWorkspaceBytes, mla_ws_.get(),
                                    mla_ws_bytes_};
    ops::mla_decode_cuda(plan, t, cache, ctx, stream_);
  }
  // Prefill and mixed steps (mla_prefill_plan.h): the plan is made once per step, its metadata uploaded once per step
  // into the prefill workspace, and every MLA layer of the step reuses both. The single-token sequences of a mixed
  // step run the absorbed decode kernel over each of their token ranges (the general kernel at other latent shapes).
  const ops::MlaPrefillPlan& mla_prefill_plan() {
    if (prefill_plan_serial_ != step_serial_) {
      prefill_plan_ = ops::mla_prefill_plan(step_.positions, step_.seq_begin);
      prefill_plan_serial_ = step_serial_;
    }
    return prefill_plan_;
  }
  void mla_prefill(const ops::MlaParams& p, const ops::MlaPrefillPlan& plan, const Tensor& q, const Tensor& w_uk,
                   const Tensor& w_uv, const MlaCacheRef& c, Tensor& out) {
    const ops::MlaPrefillWorkspace ws = ops::mla_prefill_workspace(p, plan);
    if (ws.total_bytes > prefill_ws_bytes_) {
      BG_CUDA_CHECK(cudaStreamSynchronize(stream_));  // kernels of an earlier layer may still read the old buffer
      prefill_ws_.reset();
      prefill_ws_bytes_ = ws.total_bytes;
      prefill_ws_ = alloc_->allocate(prefill_ws_bytes_);
      prefill_meta_serial_ = -1;
    }
    if (prefill_meta_serial_ != step_serial_) {
      const std::vector<std::byte> meta = ops::mla_prefill_meta(plan, ws);
      copy_in(prefill_ws_.get(), meta.data(), meta.size());
      prefill_meta_serial_ = step_serial_;
    }
    const ops::MlaPrefillContext ctx{
        {cublas_, cublas_ws_.get(), ops::kCublasWorkspaceBytes, prefill_ws_.get(), prefill_ws_bytes_}, &mla_cudnn_};
    ops::mla_prefill_cuda(p, plan, ws, q.as<bf16>(), w_uk.as<bf16>(), w_uv.as<bf16>(), paged(c), out.as<bf16>(), ctx,
                          stream_, mla_prefill_mma_);
    const int64_t qk = p.qk_nope_dim + p.qk_rope_dim;
    for (const auto& [begin, end] : plan.absorbed_runs) {
      ops::MlaParams run = p;
      run.n_tokens = end - begin;
      ops::MlaPagedCache pc = paged(c);
      pc.seq_idx += begin;
      pc.positions += begin;
      const ops::MlaDecodeTensors t{q.as<bf16>() + begin * p.n_heads * qk, w_uk.as<bf16>(), w_uv.as<bf16>(),
                                    out.as<bf16>() + begin * p.n_heads * p.v_head_dim};
      if (plan.absorbed_single_tokens && ops::mla_decode_takes(run)) {
        mla_decode_launch(run, t, pc);
      } else {
        ops::mla_attention_cuda(run, t.q, t.w_uk, t.w_uv, pc, t.out, stream_);
      }
    }
  }
  // The cache writes' shape and cache view (at decode the padding rows write nothing).
  ops::MlaParams write_params(const MlaCacheRef& c) const {
    ops::MlaParams p{};
    p.n_tokens = step_.n_tokens();
    p.kv_lora_rank = c.kv_lora_rank;
    p.qk_rope_dim = c.entry_dim - c.kv_lora_rank;
    p.block_size = c.block_size;
    return p;
  }
  ops::MlaPagedCache write_cache(const MlaCacheRef& c) const {
    ops::MlaPagedCache cache = paged(c);
    if (step_.all_single_token()) cache.live_tokens = dev_.live_tokens;  // decode: padding rows write nothing
    return cache;
  }
  ops::MlaPagedCache paged(const MlaCacheRef& c) const {
    ops::MlaPagedCache pc;
    pc.base = c.storage.as<bf16>() + c.layer * c.block_size * c.entry_dim;
    pc.block_stride = c.n_layers * c.block_size * c.entry_dim;
    pc.block_tables = dev_.block_tables;
    pc.max_blocks_per_seq = step_.max_blocks;
    pc.seq_idx = dev_.token_seq;
    pc.positions = dev_.positions;
    pc.error_flags = errors_.as<int32_t>();
    return pc;
  }

  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  std::shared_ptr<cuda::CachingAllocator> alloc_;
  std::shared_ptr<void> cublas_ws_;
  // The dense decode GEMM's partial sums and tile counters (ops::DenseDecodeWorkspace), only with BG_LINEAR_DECODE=1
  // (off by default: cuBLAS measured faster; docs/PERF.md "Dense decode GEMM").
  std::shared_ptr<void> dense_decode_buf_;
  ops::DenseDecodeWorkspace dense_decode_;
  const ops::DenseDecodeWorkspace* dense_decode_ctx() const {
    return dense_decode_.partials != nullptr ? &dense_decode_ : nullptr;
  }
  // Step metadata: pinned host staging and its device copy (grown on demand; growing drops the captured graphs,
  // whose kernels point into the old buffer).
  std::byte* step_host_ = nullptr;
  std::shared_ptr<void> step_dev_;
  size_t step_capacity_ = 0;
  cudaEvent_t step_uploaded_ = nullptr;  // the last upload finished reading step_host_
  StepDevice dev_;
  std::map<int64_t, Graph> graphs_;
  // The decode graphs share one capture pool (CachingAllocator's arena; they never run at once), so together they
  // hold about the largest one's peak instead of the sum (the ep16-rank slice at batches 1/16/64: 214 MiB in 1 pool
  // against 319 MiB in 4, same step times; bench/RESULTS.md 2026-12-05). Turned off for the backend's life if a
  // capture keeps an arena block past its end (see run_graph). BG_GRAPH_ARENA=0: a pool per graph.
  bool graph_arena_ = env_switch("BG_GRAPH_ARENA", true);
  std::shared_ptr<CapturePool> decode_arena_;
  Graph profiled_graph_;  // the last step captured with a per-op profiler's event nodes (run_graph)
  bool capturing_ = false;
  // Host-tier copies: their stream, the event it waits on (the compute stream's position at issue), and one event per
  // batch in flight (completed in issue order; completed ones are reused).
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t copy_after_ = nullptr;
  std::deque<std::pair<CopyFence, cudaEvent_t>> copies_in_flight_;
  std::vector<cudaEvent_t> spare_copy_events_;
  CopyFence copies_done_ = 0;
  cuda::DeviceBuffer errors_;         // int32 kernel error flags (see check_device_errors)
  int32_t* errors_host_ = nullptr;    // pinned
  cuda::StepSampler sampler_;         // sample_rows: its pinned and device buffers
  int64_t n_sms_ = 1;
  bool deterministic_ = false;  // BackendOptions::deterministic
  bool fuse_linear_groups_ = cuda::linear_groups_from_env();  // BG_LINEAR_GROUPS (cuda_linears.h)
  bool group_views_ = cuda::switch_from_env("BG_LINEAR_GROUP_VIEWS");  // strided parts in place (linear_group)
  bool kda_prep_fused_ = cuda::switch_from_env("BG_KDA_PREP_FUSED");
  bool kda_prep_prefill_fused_ = env_switch("BG_KDA_PREP_PREFILL_FUSED", false);
  // BG_SKIP_PADDING_ROWS=0: the step's live count is uploaded as every row, so padding rows run like real ones (for
  // measuring what skipping them saves).
  bool skip_padding_rows_ = cuda::switch_from_env("BG_SKIP_PADDING_ROWS");
  mutable cuda::MoeGroupedScratch moe_grouped_scratch_;  // grouped prefill MoE: bf16 expert weights (cuda_moe.h)
  std::shared_ptr<void> mla_ws_;  // MLA decode workspace (see mla_decode)
  size_t mla_ws_bytes_ = 0;
  std::vector<std::shared_ptr<void>> mla_ws_retired_;
  int64_t step_serial_ = 0;  // bumped by every upload_step: what the per-step caches below are keyed by
  ops::MlaPrefillPlan prefill_plan_;  // MLA prefill (see mla_prefill_plan)
  int64_t prefill_plan_serial_ = -1;
  std::shared_ptr<void> prefill_ws_;
  size_t prefill_ws_bytes_ = 0;
  // MLA prefill attention: cuDNN's fused attention where built in, else the wgmma kernel (BG_MLA_PREFILL overrides).
  ops::MlaPrefillMma mla_prefill_mma_ = ops::mla_prefill_mma_from_env();
  ops::MlaCudnnPrefill mla_cudnn_;
  int64_t prefill_meta_serial_ = -1;  // the step whose metadata prefill_ws_ holds
  ops::KdaVarlenPlan kda_plan_;  // this step's chunked KDA sequences (upload_step)
  std::vector<int32_t> kda_plan_packed_;
  std::shared_ptr<void> kda_ws_;  // chunked KDA workspace (see kda)
  size_t kda_ws_bytes_ = 0;
  std::unique_ptr<cuda::WeightUploader> uploader_;
  cuda::WeightUploader& uploader() {
    if (!uploader_) uploader_ = std::make_unique<cuda::WeightUploader>(stream_);
    return *uploader_;
  }
};

}  // namespace bg::cuda_backend_detail
