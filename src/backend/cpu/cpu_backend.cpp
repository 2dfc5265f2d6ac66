// CpuBackend: host memory and the fp32 reference ops.
#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend/fault_injection.h"
#include "core/error.h"
#include "ops/attn_res/attn_res.h"
#include "ops/gated_rmsnorm/gated_rmsnorm.h"
#include "ops/kda_gate/kda_gate.h"
#include "ops/linear/linear.h"
#include "ops/moe/moe.h"
#include "ops/rmsnorm/rmsnorm.h"
#include "ops/short_conv/short_conv.h"
#include "ops/situ/situ.h"
#include "ops/swiglu/swiglu.h"

namespace bg {
namespace {

// The deleter of allocations that hold bf16 values in bf16 emulation (fp32 storage, every value bf16-representable):
// a tensor is "bf16" when its owner carries this deleter (views share it).
struct Bf16Storage {
  void operator()(void* p) const { std::free(p); }
};

bool holds_bf16(const Tensor& t) { return t.owner && std::get_deleter<Bf16Storage>(t.owner) != nullptr; }

void round_to_bf16(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
}

class CpuLinear final : public LinearHandle {
 public:
  explicit CpuLinear(QuantWeight w) : w_(std::move(w)) {}
  // bf16 emulation of a dense F32/F16 weight: a bf16 copy (the CUDA backend uploads such weights as bf16).
  CpuLinear(QuantWeight w, std::vector<uint16_t> bf16) : w_(std::move(w)), bf16_(std::move(bf16)) {
    w_.data.dtype = DType::kBF16;
    w_.data.data = reinterpret_cast<const std::byte*>(bf16_.data());
    w_.data.nbytes = bf16_.size() * sizeof(uint16_t);
  }
  int64_t n_out() const override { return w_.n_out; }
  int64_t n_in() const override { return w_.n_in; }
  const QuantWeight& weight() const { return w_; }

 private:
  QuantWeight w_;
  std::vector<uint16_t> bf16_;
};

const QuantWeight& quant(const LinearHandle& h) { return static_cast<const CpuLinear&>(h).weight(); }

// Expert weights by slot: the slots' QuantWeights (owned by their CpuLinear handles, which outlive the model's step).
class CpuExpertSlots final : public ExpertSlots {
 public:
  explicit CpuExpertSlots(std::vector<ops::MoeExpertCpu> slots) : slots_(std::move(slots)) {}
  int64_t n_slots() const override { return static_cast<int64_t>(slots_.size()); }
  std::span<const ops::MoeExpertCpu> slots() const { return slots_; }
  void set(int64_t slot, const LinearHandle& gate, const LinearHandle& up, const LinearHandle& down) {
    BG_CHECK(slot >= 0 && slot < n_slots(), "set_expert_slot: slot {} of {}", slot, n_slots());
    slots_[static_cast<size_t>(slot)] = {&quant(gate), &quant(up), &quant(down)};
  }

 private:
  std::vector<ops::MoeExpertCpu> slots_;
};

ops::MoeRoutingArrays routing_arrays(const MoeRouting& r) {
  return ops::moe_routing_layout(r.shape, r.buffer.data);
}

ops::MoeGluParams moe_glu(const GluSpec& g) {
  return {g.kind == GluKind::kSwiGlu ? ops::MoeGlu::kSwiGlu : ops::MoeGlu::kSitu, g.situ_beta, g.situ_linear_beta};
}

void expect_f32(const Tensor& t, const char* what) {
  BG_CHECK(t.dtype == DType::kF32, "cpu backend: {} must be F32, got {}", what, dtype_name(t.dtype));
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(bool emulate_bf16) : emulate_(emulate_bf16) {}
  std::string_view name() const override { return emulate_ ? "cpu-bf16" : "cpu"; }
  DeviceKind device() const override { return DeviceKind::kCpu; }
  // bf16 emulation asks the model for "BF16" activations and hands out fp32 tensors tagged as bf16 (see alloc).
  DType act_dtype() const override { return emulate_ ? DType::kBF16 : DType::kF32; }

  Tensor alloc(Shape shape, DType dtype) override {
    const bool bf16 = emulate_ && dtype == DType::kBF16;
    Tensor t;
    t.dtype = bf16 ? DType::kF32 : dtype;
    t.shape = std::move(shape);
    size_t bytes = std::max<size_t>(t.nbytes(), 1);
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    BG_CHECK(p != nullptr, "cpu backend: out of host memory allocating {} bytes", bytes);
    t.owner = bf16 ? std::shared_ptr<void>(p, Bf16Storage{}) : std::shared_ptr<void>(p, std::free);
    t.data = p;
    return t;
  }
  void fill_zero(Tensor& t) override {
    BG_PROFILE_OP("fill_zero", nullptr);
    std::memset(t.data, 0, t.nbytes());
  }
  Tensor upload_f32(std::span<const float> values, Shape shape, DType dtype) override {
    Tensor t = alloc(std::move(shape), dtype);
    BG_CHECK(static_cast<int64_t>(values.size()) == t.numel(), "upload_f32: {} values for shape {}", values.size(),
             shape_str(t.shape));
    if (t.dtype == DType::kF32) {
      std::memcpy(t.data, values.data(), t.nbytes());
      round(t);
    } else {
      BG_CHECK(dtype == DType::kBF16, "upload_f32: unsupported target dtype {}", dtype_name(dtype));
      for (size_t i = 0; i < values.size(); ++i) t.as<uint16_t>()[i] = f32_to_bf16(values[i]);
    }
    return t;
  }
  Tensor upload_view(const TensorView& view) override {
    Tensor t;
    t.data = const_cast<std::byte*>(view.data);  // borrowed, read-only by contract
    t.dtype = view.dtype;
    t.shape = view.shape;
    return t;
  }
  void download_f32(const Tensor& t, float* host) override {
    BG_PROFILE_OP("download_f32", nullptr);
    for (int64_t i = 0; i < t.numel(); ++i) host[i] = load_as_f32(static_cast<const std::byte*>(t.data), t.dtype, i);
  }
  void sample_rows(const Tensor& logits, std::span<const ops::RowSampling> rows,
                   std::span<ops::RowSample> out) override {
    BG_PROFILE_OP("sample_rows", nullptr);
    BG_CHECK(logits.dtype == DType::kF32 && logits.shape.size() == 2, "sample_rows: logits must be F32 [rows, vocab]");
    ops::sample_rows_cpu(rows, logits.as<float>(), logits.rows(), logits.cols(), out);
  }
  void copy(const Tensor& src, Tensor& dst) override {
    BG_PROFILE_OP("copy", nullptr);
    BG_CHECK(src.nbytes() == dst.nbytes(), "copy of {} bytes into {}", src.nbytes(), dst.nbytes());
    std::memmove(dst.data, src.data, src.nbytes());
  }
  void write_bytes(Tensor& dst, std::span<const std::byte> src) override {
    BG_CHECK(src.size() == dst.nbytes(), "write_bytes: {} bytes into a tensor of {}", src.size(), dst.nbytes());
    std::memcpy(dst.data, src.data(), src.size());
  }
  void synchronize() override {}

  std::unique_ptr<LinearHandle> prepare_linear(const QuantWeight& w) override {
    if (emulate_ && w.format == WeightFormat::kDense && w.data.dtype != DType::kBF16) {
      std::vector<uint16_t> bits(static_cast<size_t>(w.n_out * w.n_in));
      for (size_t i = 0; i < bits.size(); ++i) bits[i] = f32_to_bf16(w.data.get_f32(static_cast<int64_t>(i)));
      return std::make_unique<CpuLinear>(w, std::move(bits));
    }
    return std::make_unique<CpuLinear>(w);
  }
  WritableLinear alloc_linear(const QuantWeight& like) override {
    // Under bf16 emulation prepare_linear rounds dense F32/F16 weights once; a streamed copy of the stored bytes
    // would compute something else than the resident expert, so such weights are never streamed.
    BG_CHECK(!(emulate_ && like.format == WeightFormat::kDense && like.data.dtype != DType::kBF16),
             "cpu-bf16: dense {} expert {} cannot be streamed (bf16 emulation rounds it when resident); use "
             "--resident-experts 1", dtype_name(like.data.dtype), like.name);
    WritableLinear w = writable_linear_storage(*this, like);
    QuantWeight q = like;
    q.data.data = static_cast<const std::byte*>(w.data.data);
    if (!w.scale.empty()) q.scale.data = static_cast<const std::byte*>(w.scale.data);
    w.handle = std::make_unique<CpuLinear>(std::move(q));
    return w;
  }

  void embedding(const Tensor& table, Tensor& out) override {
    BG_PROFILE_OP("embedding", nullptr);
    TensorView view{table.dtype, table.shape, static_cast<const std::byte*>(table.data), table.nbytes(), "embedding"};
    ops::embedding_cpu(view, step_.token_ids.data(), step_.n_tokens(), out.as<float>());
    round(out);
  }
  void gather_last_rows(const Tensor& x, Tensor& out) override {
    BG_PROFILE_OP("gather_last_rows", nullptr);
    const int64_t d = x.cols();
    for (int64_t s = 0; s < step_.n_seqs(); ++s) {
      std::memcpy(out.as<float>() + s * d, x.as<float>() + step_.last_rows[static_cast<size_t>(s)] * d,
                  static_cast<size_t>(d) * sizeof(float));
    }
  }
  void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& y) override {
    BG_PROFILE_OP("rmsnorm", nullptr);
    const int64_t dim = w.numel(), stride = x.cols();
    if (dim == stride) {
      ops::rmsnorm_cpu({x.rows(), dim, eps}, x.as<float>(), w.as<float>(), y.as<float>());
    } else {
      for (int64_t r = 0; r < x.rows(); ++r) {
        ops::rmsnorm_cpu({1, dim, eps}, x.as<float>() + r * stride, w.as<float>(), y.as<float>() + r * stride);
      }
    }
    round(y);
  }
  void linear(const LinearHandle& w, const Tensor& x, Tensor& y) override {
    BG_PROFILE_OP("linear", nullptr);
    expect_f32(x, "linear input");
    expect_f32(y, "linear output");
    ops::linear_cpu(quant(w), x.as<float>(), x.rows(), y.as<float>());
    round(y);
  }
  void add(Tensor& y, const Tensor& x) override {
    BG_PROFILE_OP("add", nullptr);
    float* a = y.as<float>();
    const float* b = x.as<float>();
    for (int64_t i = 0; i < y.numel(); ++i) a[i] += b[i];
    round(y);
  }
  void glu(const GluSpec& p, const Tensor& gate, const Tensor& up, Tensor& out) override {
    BG_PROFILE_OP("glu", nullptr);
    if (p.kind == GluKind::kSwiGlu) {
      ops::swiglu_cpu(gate.as<float>(), up.as<float>(), gate.numel(), out.as<float>());
    } else {
      ops::situ_cpu({gate.rows(), gate.cols(), p.situ_beta, p.situ_linear_beta}, gate.as<float>(), up.as<float>(),
                    out.as<float>());
    }
    round(out);
  }
  void sigmoid_mul(Tensor& x, const Tensor& gate) override {
    BG_PROFILE_OP("sigmoid_mul", nullptr);
    float* a = x.as<float>();
    const float* g = gate.as<float>();
    for (int64_t i = 0; i < x.numel(); ++i) a[i] *= 1.0f / (1.0f + std::exp(-g[i]));
    round(x);
  }
  void rope(const ops::RopeParams& p, const RopeHandle& table, Tensor& x) override {
    BG_PROFILE_OP("rope", nullptr);
    ops::apply_rope_cpu(p, table.table, step_.positions.data(), x.as<float>());
    round(x);
  }
  void mla_write(const MlaCacheRef& c, const Tensor& latent) override {
    BG_PROFILE_OP("mla_write", nullptr);
    for (int64_t t = 0; t < step_.n_tokens(); ++t) {
      const auto i = static_cast<size_t>(t);
      std::memcpy(entry(c, block_table(step_.token_seq[i]), step_.positions[i]), latent.as<float>() + t * c.entry_dim,
                  static_cast<size_t>(c.entry_dim) * sizeof(float));
    }
  }
  // Per sequence: its tokens' rows of q / out against its blocks.
  void mla_attention(const ops::MlaParams& p, const Tensor& q, const Tensor& w_uk, const Tensor& w_uv,
                     const MlaCacheRef& c, Tensor& out) override {
    BG_PROFILE_OP("mla_attention", nullptr);
    const int64_t q_cols = q.cols(), out_cols = out.cols();
    for (int64_t s = 0; s < step_.n_seqs(); ++s) {
      const int64_t b = step_.seq_begin[static_cast<size_t>(s)], e = step_.seq_begin[static_cast<size_t>(s) + 1];
      std::vector<const float*> blocks;
      for (int32_t blk : block_table(static_cast<int32_t>(s))) blocks.push_back(block_base(c, blk));
      ops::MlaParams ps = p;
      ps.n_tokens = e - b;
      ops::mla_attention_cpu(ps, q.as<float>() + b * q_cols, w_uk.as<float>(), w_uv.as<float>(), blocks.data(),
                             step_.positions.data() + b, out.as<float>() + b * out_cols);
    }
    round(out);
  }
  void route(const ops::RouterParams& p, const Tensor& logits, const Tensor& bias, Tensor& ids,
             Tensor& weights) override {
    BG_PROFILE_OP("route", nullptr);
    ops::route_topk_cpu(p, logits.as<float>(), bias.empty() ? nullptr : bias.as<float>(), ids.as<int32_t>(),
                        weights.as<float>());
  }
  std::unique_ptr<ExpertSlots> prepare_experts(const ExpertWeights& by_slot) override {
    std::vector<ops::MoeExpertCpu> slots;
    for (int64_t s = 0; s < by_slot.size(); ++s) {
      auto i = static_cast<size_t>(s);
      slots.push_back({&quant(*by_slot.gate[i]), &quant(*by_slot.up[i]), &quant(*by_slot.down[i])});
    }
    return std::make_unique<CpuExpertSlots>(std::move(slots));
  }
  void set_expert_slot(ExpertSlots& slots, int64_t slot, const LinearHandle& gate, const LinearHandle& up,
                       const LinearHandle& down, const Tensor* laid_out) override {
    (void)laid_out;  // the CPU reads the checkpoint's format: no layout of its own
    static_cast<CpuExpertSlots&>(slots).set(slot, gate, up, down);
  }
  void moe_dispatch(const Tensor& slot_map, const Tensor& ids, const Tensor& weights, MoeRouting& r,
                    int64_t step_row0) override {
    BG_PROFILE_OP("moe_dispatch", nullptr);
    BG_CHECK(slot_map.numel() == r.shape.n_experts && ids.numel() == r.shape.n_pairs() &&
                 weights.numel() == r.shape.n_pairs(), "moe_dispatch: slot map of {} for {} experts, {} ids and {} "
             "weights for {} pairs", slot_map.numel(), r.shape.n_experts, ids.numel(), weights.numel(),
             r.shape.n_pairs());
    const int64_t live = step_row0 < 0 ? -1 : std::max<int64_t>(0, step_.live_tokens() - step_row0);
    ops::moe_dispatch_cpu(r.shape, slot_map.as<int32_t>(), ids.as<int32_t>(), weights.as<float>(), routing_arrays(r),
                          live);
  }
  void moe_gather(const MoeRouting& r, const Tensor& x, Tensor& rows) override {
    BG_PROFILE_OP("moe_gather", nullptr);
    expect_f32(x, "moe_gather input");
    ops::moe_gather_cpu(r.shape, routing_arrays(r), x.as<float>(), x.cols(), rows.as<float>());
  }
  void moe_experts(const ExpertSlots& experts, const GluSpec& glu, const MoeRouting& r, const Tensor& rows,
                   Tensor& y_rows) override {
    BG_PROFILE_OP("moe_experts", nullptr);
    expect_f32(rows, "moe_experts input");
    ops::moe_experts_cpu(r.shape, routing_arrays(r), static_cast<const CpuExpertSlots&>(experts).slots(), moe_glu(glu),
                         rows.as<float>(), y_rows.as<float>(), emulate_);
    round(y_rows);
  }
  void moe_combine(const MoeRouting& r, const Tensor& y_rows, Tensor& out) override {
    BG_PROFILE_OP("moe_combine", nullptr);
    expect_f32(out, "moe_combine output");
    ops::moe_combine_cpu(r.shape, routing_arrays(r), y_rows.as<float>(), out.cols(), out.as<float>());
    round(out);
  }
  void short_conv(const Tensor& x, const Tensor& weight, const StateRef& state, Tensor& out) override {
    BG_PROFILE_OP("short_conv", nullptr);
    const int64_t c = x.cols();
    for (int64_t s = 0; s < step_.n_seqs(); ++s) {
      const int64_t b = step_.seq_begin[static_cast<size_t>(s)], e = step_.seq_begin[static_cast<size_t>(s) + 1];
      ops::short_conv_cpu({e - b, c, weight.cols()}, x.as<float>() + b * c, weight.as<float>(), slot_state(state, s),
                          out.as<float>() + b * c);
    }
    round(out);
  }
  void kda_l2norm(int64_t head_dim, float scale, Tensor& x) override {
    BG_PROFILE_OP("kda_l2norm", nullptr);
    ops::kda_l2norm_cpu({x.numel() / head_dim, head_dim, scale, 1e-6f}, x.as<float>(), x.as<float>());
    round(x);
  }
  void kda_gate(const Tensor& g_raw, const Tensor& a_log, const Tensor& dt_bias, int64_t n_heads, float lower_bound,
                Tensor& g) override {
    BG_PROFILE_OP("kda_gate", nullptr);
    ops::kda_gate_cpu({g_raw.rows(), n_heads, g_raw.cols() / n_heads, lower_bound}, g_raw.as<float>(),
                      a_log.as<float>(), dt_bias.as<float>(), g.as<float>());
  }
  void kda_beta(const Tensor& b, Tensor& beta) override {
    BG_PROFILE_OP("kda_beta", nullptr);
    ops::kda_beta_cpu(b.numel(), b.as<float>(), beta.as<float>());
  }
  void kda(const ops::KdaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
           const Tensor& beta, const StateRef& state, Tensor& out) override {
    BG_PROFILE_OP("kda", nullptr);
    const int64_t qk = p.n_heads * p.head_dim_k, vd = p.n_heads * p.head_dim_v;
    for (int64_t s = 0; s < step_.n_seqs(); ++s) {
      const int64_t b = step_.seq_begin[static_cast<size_t>(s)], e = step_.seq_begin[static_cast<size_t>(s) + 1];
      ops::KdaParams ps = p;
      ps.n_tokens = e - b;
      const float *qs = q.as<float>() + b * qk, *ks = k.as<float>() + b * qk, *vs = v.as<float>() + b * vd;
      const float *gs = g.as<float>() + b * qk, *betas = beta.as<float>() + b * p.n_heads;
      if (ps.n_tokens == 1) {
        ops::kda_recurrent_cpu(ps, qs, ks, vs, gs, betas, slot_state(state, s), out.as<float>() + b * vd);
      } else {
        ops::kda_chunked_cpu(ps, qs, ks, vs, gs, betas, slot_state(state, s), out.as<float>() + b * vd);
      }
    }
    round(out);
  }
  void gated_rmsnorm(int64_t n_heads, float eps, const Tensor& x, const Tensor& gate, const Tensor& weight,
                     Tensor& y) override {
    BG_PROFILE_OP("gated_rmsnorm", nullptr);
    ops::gated_rmsnorm_cpu({x.rows(), n_heads, weight.numel(), eps}, x.as<float>(), gate.as<float>(),
                           weight.as<float>(), y.as<float>());
    round(y);
  }
  void attn_res_mix(const Tensor& bank, int64_t n_candidates, const Tensor& norm, const Tensor& proj, float eps,
                    Tensor& out) override {
    BG_PROFILE_OP("attn_res_mix", nullptr);
    const int64_t n = bank.shape.at(1), d = bank.shape.at(2);
    std::vector<const float*> values;
    for (int64_t i = 0; i < n_candidates; ++i) values.push_back(bank.as<float>() + i * n * d);
    ops::attn_res_mix_cpu({n_candidates, n, d, eps}, values.data(), norm.as<float>(), proj.as<float>(),
                          out.as<float>());
    round(out);
  }

 private:
  void upload_step() override { inject_device_fault_if_armed(name()); }
  // bf16 emulation: rounds a tensor that holds bf16 values (its allocation is tagged) after an op wrote it.
  void round(Tensor& t) const {
    if (emulate_ && holds_bf16(t)) round_to_bf16(t.as<float>(), t.numel());
  }
  std::span<const int32_t> block_table(int32_t seq) const {
    return std::span<const int32_t>(step_.block_tables).subspan(static_cast<size_t>(seq * step_.max_blocks),
                                                                static_cast<size_t>(step_.max_blocks));
  }
  float* slot_state(const StateRef& st, int64_t seq) const {
    return st.storage.as<float>() + st.offset + step_.state_slots.at(static_cast<size_t>(seq)) * st.slot_stride;
  }
  static float* block_base(const MlaCacheRef& c, int32_t block) {
    return c.storage.as<float>() + ((block * c.n_layers + c.layer) * c.block_size) * c.entry_dim;
  }
  static float* entry(const MlaCacheRef& c, std::span<const int32_t> table, int64_t pos) {
    BG_CHECK(pos / c.block_size < static_cast<int64_t>(table.size()), "mla cache: position {} beyond the {} "
             "reserved blocks", pos, table.size());
    return block_base(c, table[static_cast<size_t>(pos / c.block_size)]) + (pos % c.block_size) * c.entry_dim;
  }

  bool emulate_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(bool emulate_bf16) { return std::make_unique<CpuBackend>(emulate_bf16); }

}  // namespace bg
