// Backend helpers shared by every implementation, and backend selection.
#include "backend/backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

#ifdef BG_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace bg {

Tensor Backend::zeros(Shape shape, DType dtype) {
  Tensor t = alloc(std::move(shape), dtype);
  fill_zero(t);
  return t;
}

PreparedLinears Backend::prepare_linears(const LinearBatch& batch) {
  PreparedLinears out;
  out.weights.reserve(batch.weights.size());
  for (const QuantWeight* w : batch.weights) out.weights.push_back(prepare_linear(*w));
  out.runs.resize(batch.runs.size());
  return out;
}

void Backend::lay_out_expert(const ExpertSlots& slots, const LinearHandle& gate, const LinearHandle& up,
                             const LinearHandle& down, Tensor& dst) {
  (void)slots, (void)gate, (void)up, (void)down, (void)dst;
  fail("{} backend: no expert layout of its own to lay an expert out in", name());
}

void Backend::mla_write_normed(const MlaCacheRef& cache, Tensor& latent, const Tensor& norm, float eps) {
  rmsnorm(latent, norm, eps, latent);
  mla_write(cache, latent);
}

void Backend::linear_add(const LinearHandle& w, const Tensor& x, Tensor& y) {
  Tensor product = act(x.rows(), w.n_out());
  linear(w, x, product);
  add(y, product);
}

Tensor Backend::packed(const Tensor& t) {
  BG_CHECK(t.packed(), "{}: a strided view [{}] where packed rows were expected", name(), shape_str(t.shape));
  return t;
}

std::vector<Tensor> Backend::linear_group(const LinearGroup& g, const Tensor& x) {
  std::vector<Tensor> ys;
  ys.reserve(g.parts.size());
  for (const LinearHandle* part : g.parts) {
    ys.push_back(act(x.rows(), part->n_out()));
    linear(*part, x, ys.back());
  }
  return ys;
}

void Backend::kda_prep(const KdaPrepArgs& a, Tensor& q, Tensor& k, Tensor& v, Tensor& g, Tensor& beta) {
  Tensor* out[3] = {&q, &k, &v};
  for (size_t i = 0; i < 3; ++i) short_conv(a.raw[i], a.conv[i], a.conv_state[i], *out[i]);
  kda_l2norm(a.head_dim, a.q_scale, q);
  kda_l2norm(a.head_dim, 1.0f, k);
  kda_gate(a.g_raw, a.a_log, a.dt_bias, a.n_heads, a.gate_lower_bound, g);
  kda_beta(a.b, beta);
}

void Backend::attn_res_add_mix_rmsnorm(const Tensor& addend, bool replace, const Tensor& bank, int64_t n_candidates,
                                       const Tensor& norm, const Tensor& proj, float eps, Tensor& h,
                                       const Tensor& rms_weight, float rms_eps, Tensor& x) {
  BG_CHECK(bank.shape.size() == 3 && n_candidates >= 1 && n_candidates <= bank.shape[0],
           "attn_res_add_mix_rmsnorm: {} candidates of a bank of {}", n_candidates, shape_str(bank.shape));
  Tensor partial = bank.rows_view(n_candidates - 1, 1).reshaped({bank.shape[1], bank.shape[2]});
  attn_res_update(addend, replace, partial);
  attn_res_mix_rmsnorm(bank, n_candidates, norm, proj, eps, h, rms_weight, rms_eps, x);
}

void Backend::attn_res_update(const Tensor& addend, bool replace, Tensor& partial) {
  if (replace) {
    copy(addend, partial);
  } else {
    add(partial, addend);
  }
}

RopeHandle Backend::prepare_rope(const ops::RopeTable& table) {
  RopeHandle h;
  h.table = table;
  if (!table.inv_freq.empty()) {
    h.inv_freq = upload_f32(table.inv_freq, {static_cast<int64_t>(table.inv_freq.size())}, DType::kF32);
  }
  return h;
}

// Host tier defaults for backends whose device memory is host memory (the CPU): plain memory, copies at once.
std::shared_ptr<std::byte> Backend::alloc_host(size_t bytes) {
  void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) / 64 * 64);
  BG_CHECK(p != nullptr, "host tier: out of host memory allocating {} bytes", bytes);
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), std::free);
}

WritableLinear writable_linear_storage(Backend& be, const QuantWeight& like) {
  WritableLinear w;
  w.format = like.format;
  w.n_out = like.n_out;
  w.n_in = like.n_in;
  w.data = be.alloc({static_cast<int64_t>(like.data.nbytes)}, DType::kU8);
  if (like.scale.nbytes > 0) w.scale = be.alloc({static_cast<int64_t>(like.scale.nbytes)}, DType::kU8);
  return w;
}

WritableLinear Backend::alloc_linear(const QuantWeight& like) {
  fail("the {} backend cannot stream experts (--resident-experts below 1; docs/WEIGHTS.md, \"Streamed experts\"); "
       "weight {}", name(), like.name);
}

CopyFence Backend::copy_to_host(std::span<const HostCopy> copies) {
  for (const HostCopy& c : copies) {
    BG_CHECK(c.device_offset + c.bytes <= c.device.nbytes(), "copy_to_host: bytes [{}, {}) outside a tensor of {}",
             c.device_offset, c.device_offset + c.bytes, c.device.nbytes());
    std::memcpy(c.host, static_cast<const std::byte*>(c.device.data) + c.device_offset, c.bytes);
  }
  return ++copies_issued_;
}

CopyFence Backend::copy_from_host(std::span<const HostCopy> copies) {
  for (const HostCopy& c : copies) {
    BG_CHECK(c.device_offset + c.bytes <= c.device.nbytes(), "copy_from_host: bytes [{}, {}) outside a tensor of {}",
             c.device_offset, c.device_offset + c.bytes, c.device.nbytes());
    std::memcpy(static_cast<std::byte*>(c.device.data) + c.device_offset, c.host, c.bytes);
  }
  return ++copies_issued_;
}

MoeRouting Backend::moe_routing(const ops::MoeRoutingShape& shape) {
  MoeRouting r;
  r.shape = shape;
  r.buffer = alloc({static_cast<int64_t>(ops::moe_routing_bytes(shape))}, DType::kU8);
  return r;
}

void Backend::moe_routed_local(const ExpertSlots& experts, const GluSpec& glu, const MoeRouting& r, const Tensor& x,
                               Tensor& out, bool accumulate) {
  Tensor rows = act(r.shape.n_pairs(), x.cols()), y = act(r.shape.n_pairs(), x.cols());  // [n_pairs, hidden]
  moe_gather(r, x, rows);
  moe_experts(experts, glu, r, rows, y);
  if (!accumulate) fill_zero(out);
  moe_combine(r, y, out);
}

std::unique_ptr<Backend> make_backend(std::string_view device, const BackendOptions& options) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cpu-bf16") return make_cpu_backend(true);
  if (device == "cuda") {
#ifdef BG_HAVE_CUDA
    return make_cuda_backend({.deterministic = options.deterministic, .background_plans = options.background_plans});
#else
    (void)options;  // only the CUDA backend has options
    fail("--device cuda: this batchgen was built without the CUDA backend (configure where nvcc is installed, with "
         "-DBG_CUDA=ON)");
#endif
  }
  fail("unknown device '{}' (cpu, cuda, cpu-bf16)", device);
}

}  // namespace bg
