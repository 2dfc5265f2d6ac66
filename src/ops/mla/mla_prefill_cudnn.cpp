// MLA prefill attention through cuDNN's fused attention (mla_prefill_cudnn.h). The operation graph is the one cuDNN's
// fused flash-attention engines recognise (facts from NVIDIA's cuDNN documentation and frontend): S = Q·Kᵀ (fp32),
// S·scale, a padding mask from the per-sequence lengths, the causal mask aligned at the bottom right
// (row + len_kv - len_q >= column), softmax (max, subtract, exp, sum, divide; P in bf16), O = P·V. Q, K, V and O are
// ragged: each sequence starts at its own element offset, so the rows of a step need no copy. An exact plan (one
// sequence filling its buckets, Shape::exact) has neither the padding mask nor the ragged offsets.
#include "ops/mla/mla_prefill_cudnn.h"

#include <array>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <deque>
#include <limits>
#include <map>
#include <span>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "core/log.h"

#if BG_HAVE_CUDNN
#include <cudnn.h>
#endif

namespace bg::ops {

int64_t mla_cudnn_bucket(int64_t n) {
  int64_t b = 64;
  while (b < n) b *= 2;
  return b;
}

int64_t mla_cudnn_max_plans(const char* env_value) {
  return env_int("BG_MLA_CUDNN_MAX_PLANS", env_value, MlaCudnnPrefill::kMinPlans, int64_t{1} << 20)
      .value_or(MlaCudnnPrefill::kDefaultMaxPlans);
}

bool mla_cudnn_exact_plans(const char* env_value) {
  return env_switch("BG_MLA_CUDNN_EXACT", env_value, true);
}

// set_max_plans' argument, in the builds with and without cuDNN alike.
static void check_max_plans(int64_t n) {
  BG_CHECK(n >= MlaCudnnPrefill::kMinPlans, "mla_prefill_cudnn: at most {} plans asked; the bound is at least {}", n,
           MlaCudnnPrefill::kMinPlans);
}

#if BG_HAVE_CUDNN
namespace {

constexpr int64_t kQk = 192, kV = 128;

void check(cudnnStatus_t st, const char* what) {
  if (st == CUDNN_STATUS_SUCCESS) return;
  std::array<char, 1024> detail{};
  cudnnGetLastErrorString(detail.data(), detail.size());
  throw Error(fmt::format("cuDNN {}: {} ({})", what, cudnnGetErrorString(st), detail.data()));
}

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) { check(cudnnBackendCreateDescriptor(type, &d_), "create"); }
  ~Desc() {
    if (d_ != nullptr) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;

  cudnnBackendDescriptor_t get() const { return d_; }
  template <class T>
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, std::span<const T> values) {
    check(cudnnBackendSetAttribute(d_, name, type, static_cast<int64_t>(values.size()), values.data()), "set");
    return *this;
  }
  template <class T>
  Desc& set1(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T& value) {
    return set(name, type, std::span<const T>(&value, 1));
  }
  Desc& set_desc(cudnnBackendAttributeName_t name, const Desc& other) {
    return set1(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, other.get());
  }
  void finalize(const char* what) { check(cudnnBackendFinalize(d_), what); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<int64_t, 4>;

// The operation graph under construction: every descriptor stays alive as long as the plan made from it.
struct Builder {
  std::vector<std::unique_ptr<Desc>> keep;
  std::vector<cudnnBackendDescriptor_t> ops;
  std::vector<int64_t> bound;  // the non-virtual tensors' uids: what a launch binds
  int64_t next_virtual_uid = 1000;

  Desc& make(cudnnBackendDescriptorType_t type) { return *keep.emplace_back(std::make_unique<Desc>(type)); }

  Desc& tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides, bool is_virtual,
               bool by_value = false, const Desc* ragged = nullptr) {
    Desc& t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    t.set1(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, uid);
    t.set1(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, type);
    t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, std::span<const int64_t>(dims));
    t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, std::span<const int64_t>(strides));
    t.set1(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, alignment);
    t.set1(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, is_virtual);
    if (by_value) t.set1(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, true);
    if (ragged != nullptr) t.set_desc(CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, *ragged);
    t.finalize("tensor");
    if (!is_virtual) bound.push_back(uid);
    return t;
  }
  Desc& virtual_tensor(cudnnDataType_t type, const Dims& dims, const Dims& strides) {
    return tensor(next_virtual_uid++, type, dims, strides, true);
  }

  void add_op(Desc& op, const char* what) {
    op.finalize(what);
    ops.push_back(op.get());
  }

  // y = mode(x[, b][, t]) computed in `prec`; axis for GEN_INDEX and the index arithmetic.
  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t prec, const Desc& x, const Desc* b, const Desc* t,
                 const Desc& y, int64_t axis = -1) {
    Desc& pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw.set1(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, mode);
    pw.set1(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, prec);
    if (axis >= 0) pw.set1(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, axis);
    pw.finalize("pointwise");
    Desc& op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b != nullptr) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    if (t != nullptr) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    add_op(op, "pointwise op");
  }

  void reduction(cudnnReduceTensorOp_t mode, const Desc& x, const Desc& y) {
    Desc& red = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    red.set1(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, mode);
    red.set1(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT);
    red.finalize("reduction");
    Desc& op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, red);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    add_op(op, "reduction op");
  }

  // c = a · b with the GEMM's M / N / K overridden per batch entry by device lengths (null: not overridden).
  void matmul(const Desc& a, const Desc& b, const Desc& c, const Desc* m, const Desc* n, const Desc* k,
              bool padded) {
    Desc& mm = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    mm.set1(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT);
    if (padded) mm.set1(CUDNN_ATTR_MATMUL_PADDING_VALUE, CUDNN_TYPE_DOUBLE, 0.0);
    mm.finalize("matmul");
    Desc& op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm);
    if (m != nullptr) op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, *m);
    if (n != nullptr) op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, *n);
    if (k != nullptr) op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, *k);
    add_op(op, "matmul op");
  }
};

// Unique ids of the tensors bound at run time.
enum Uid : int64_t {
  kUidQ = 1, kUidK, kUidV, kUidO, kUidLenQ, kUidLenKv, kUidOffQ, kUidOffK, kUidOffV, kUidOffO, kUidScale,
  kUidNegInfPad, kUidNegInfCausal, kUidStats,
};

// A cuDNN handle owned by a plan built on the helper thread (destroyed after the plan's descriptors).
class OwnedHandle {
 public:
  OwnedHandle() = default;
  explicit OwnedHandle(cudnnHandle_t h) : h_(h) {}
  ~OwnedHandle() {
    if (h_ != nullptr) cudnnDestroy(h_);
  }
  OwnedHandle(OwnedHandle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  OwnedHandle& operator=(OwnedHandle&& o) noexcept {
    std::swap(h_, o.h_);
    return *this;
  }
  OwnedHandle(const OwnedHandle&) = delete;
  OwnedHandle& operator=(const OwnedHandle&) = delete;
  cudnnHandle_t get() const { return h_; }

 private:
  cudnnHandle_t h_ = nullptr;
};

// What a plan is built for: the bucket, and whether the graph may assume it is exact.
struct Shape {
  int64_t b = 0, h = 0, sq = 0, skv = 0;  // batch, heads, query and key buckets
  bool causal = true;
  // One sequence (b == 1) of exactly sq queries and skv keys: no padding mask, no GEMM length overrides and no
  // ragged offsets (the launch passes K / V pointers already at the sequence's rows); a causal mask with sq == skv is
  // the plain row >= column one. cuDNN's fused kernel evaluates the masks per score element, so an exact plan does
  // less work per element (measured in bench/RESULTS.md). Ragged offsets need the padding mask (a ragged batch of
  // two exact sequences without it faulted on the H200 with cuDNN 9.19), so a batch is never exact.
  bool exact = false;
  bool ragged() const { return !exact; }
};

struct Plan {
  OwnedHandle owned;              // first member: destroyed last
  cudnnHandle_t exec = nullptr;   // the handle the plan was built with and runs with
  Shape shape;
  Builder graph;
  std::unique_ptr<Desc> op_graph;
  std::unique_ptr<Desc> heuristics;
  std::vector<std::unique_ptr<Desc>> configs;
  std::unique_ptr<Desc> plan;
  int64_t workspace_bytes = 0;
  int64_t engine_config = 0;  // index of the heuristics' config the plan runs
  int64_t engine_configs = 0;  // how many the heuristics offered
};

// The first heuristics config tried (BG_MLA_CUDNN_ENGINE_CONFIG, default 0: cuDNN's first choice). For measuring the
// engines cuDNN offers against each other; a config that does not build falls through to the next as usual.
int64_t first_engine_config() {
  return env_int("BG_MLA_CUDNN_ENGINE_CONFIG", 0, 64).value_or(0);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
// Builds the graph and an execution plan for one bucket; throws bg::Error when cuDNN refuses it.
// Static shapes: the engine compiles its kernel for the plan (~0.8 s on the H200). cuDNN's dynamic shapes with a
// kernel cache (one compile per topology) were measured giving wrong outputs on ragged multi-sequence and multi-pass
// steps with cuDNN 9.19 (docs/MLA_PREFILL.md), so they are not used.
std::unique_ptr<Plan> build_plan(cudnnHandle_t handle, const Shape& shape) {
  auto plan = std::make_unique<Plan>();
  plan->exec = handle;
  plan->shape = shape;
  Builder& g = plan->graph;
  const auto [b, h, sq, skv, causal, exact] = shape;
  const bool ragged = shape.ragged();
  const Dims one{1, 1, 1, 1};
  const Desc* off_q = nullptr;
  const Desc* off_k = nullptr;
  const Desc* off_v = nullptr;
  const Desc* off_o = nullptr;
  if (ragged) {
    off_q = &g.tensor(kUidOffQ, CUDNN_DATA_INT32, {b + 1, 1, 1, 1}, one, false);
    off_k = &g.tensor(kUidOffK, CUDNN_DATA_INT32, {b + 1, 1, 1, 1}, one, false);
    off_v = &g.tensor(kUidOffV, CUDNN_DATA_INT32, {b + 1, 1, 1, 1}, one, false);
    off_o = &g.tensor(kUidOffO, CUDNN_DATA_INT32, {b + 1, 1, 1, 1}, one, false);
  }
  // Rows of all heads side by side ([token, head, dim]); the batch stride is replaced by the ragged offsets.
  Desc& q = g.tensor(kUidQ, CUDNN_DATA_BFLOAT16, {b, h, sq, kQk}, {sq * h * kQk, kQk, h * kQk, 1}, false, false,
                     off_q);
  Desc& kt = g.tensor(kUidK, CUDNN_DATA_BFLOAT16, {b, h, kQk, skv}, {skv * h * kQk, kQk, 1, h * kQk}, false, false,
                      off_k);
  Desc& v = g.tensor(kUidV, CUDNN_DATA_BFLOAT16, {b, h, skv, kV}, {skv * h * kV, kV, h * kV, 1}, false, false,
                     off_v);
  Desc& o = g.tensor(kUidO, CUDNN_DATA_BFLOAT16, {b, h, sq, kV}, {sq * h * kV, kV, h * kV, 1}, false, false, off_o);
  Desc& scale = g.tensor(kUidScale, CUDNN_DATA_FLOAT, one, one, false, true);

  const Dims s_dims{b, h, sq, skv}, s_strides{h * sq * skv, sq * skv, skv, 1};
  const Dims row_dims{b, h, sq, 1}, row_strides{h * sq, sq, 1, 1};
  auto scores = [&](cudnnDataType_t type) -> Desc& { return g.virtual_tensor(type, s_dims, s_strides); };
  // The per-sequence lengths, made on first use (an exact plan needs them only for a causal mask with sq != skv).
  const Desc* len_q = nullptr;
  const Desc* len_kv = nullptr;
  auto lengths = [&] {
    if (len_q != nullptr) return;
    len_q = &g.tensor(kUidLenQ, CUDNN_DATA_INT32, {b, 1, 1, 1}, one, false);
    len_kv = &g.tensor(kUidLenKv, CUDNN_DATA_INT32, {b, 1, 1, 1}, one, false);
  };
  if (!exact) lengths();

  Desc& s0 = scores(CUDNN_DATA_FLOAT);
  g.matmul(q, kt, s0, len_q, len_kv, nullptr, !exact);
  Desc& s1 = scores(CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s0, &scale, nullptr, s1);

  // Padding: rows past len_q and columns past len_kv of each sequence.
  Desc* s2 = &s1;
  if (!exact) {
    Desc& neg_inf_pad = g.tensor(kUidNegInfPad, CUDNN_DATA_FLOAT, one, one, false, true);
    Desc& row = scores(CUDNN_DATA_INT32);
    g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s1, nullptr, nullptr, row, 2);
    Desc& col = scores(CUDNN_DATA_INT32);
    g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s1, nullptr, nullptr, col, 3);
    Desc& row_in = scores(CUDNN_DATA_BOOLEAN);
    g.pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, row, len_q, nullptr, row_in);
    Desc& col_in = scores(CUDNN_DATA_BOOLEAN);
    g.pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, col, len_kv, nullptr, col_in);
    Desc& inside = scores(CUDNN_DATA_BOOLEAN);
    g.pointwise(CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, row_in, &col_in, nullptr, inside);
    s2 = &scores(CUDNN_DATA_FLOAT);
    g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s1, &neg_inf_pad, &inside, *s2);
  }

  // Causal, bottom right: keep column c of row r when r + len_kv - len_q >= c (r >= c when the lengths are equal).
  auto bottom_right = [&]() -> Desc& {
    Desc& row2 = scores(CUDNN_DATA_INT32);
    g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, *s2, nullptr, nullptr, row2, 2);
    Desc& col2 = scores(CUDNN_DATA_INT32);
    g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, *s2, nullptr, nullptr, col2, 3);
    Desc* diagonal = &row2;
    if (!exact || sq != skv) {
      lengths();
      Desc& shifted = scores(CUDNN_DATA_INT32);
      g.pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_INT32, row2, len_kv, nullptr, shifted, 3);
      diagonal = &scores(CUDNN_DATA_INT32);
      g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_INT32, shifted, len_q, nullptr, *diagonal, 3);
    }
    Desc& visible = scores(CUDNN_DATA_BOOLEAN);
    g.pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, *diagonal, &col2, nullptr, visible);
    Desc& neg_inf_causal = g.tensor(kUidNegInfCausal, CUDNN_DATA_FLOAT, one, one, false, true);
    Desc& s3 = scores(CUDNN_DATA_FLOAT);
    g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, *s2, &neg_inf_causal, &visible, s3);
    return s3;
  };
  Desc* masked = causal ? &bottom_right() : s2;

  // Softmax over the keys.
  Desc& max = g.virtual_tensor(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, *masked, max);
  Desc& centred = scores(CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, *masked, &max, nullptr, centred);
  Desc& e = scores(CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, centred, nullptr, nullptr, e);
  Desc& sum = g.virtual_tensor(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  // The log-sum-exp of each row (max + log sum), fp32 [B, H, bucket q]. Measured on the H200 with cuDNN 9.19: without
  // this output the engine chosen still writes per-row statistics, through a pointer it was never given (an illegal
  // address); with it, every check passes.
  Desc& log_sum = g.virtual_tensor(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.pointwise(CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, sum, nullptr, nullptr, log_sum);
  Desc& stats = g.tensor(kUidStats, CUDNN_DATA_FLOAT, row_dims, row_strides, false);
  g.pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, max, &log_sum, nullptr, stats);
  Desc& p = scores(CUDNN_DATA_BFLOAT16);
  g.pointwise(CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, e, &sum, nullptr, p);

  g.matmul(p, v, o, exact ? nullptr : len_q, nullptr, exact ? nullptr : len_kv, false);

  plan->op_graph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  plan->op_graph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                      std::span<const cudnnBackendDescriptor_t>(g.ops));
  plan->op_graph->set1(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, handle);
  plan->op_graph->finalize("operation graph");

  plan->heuristics = std::make_unique<Desc>(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  plan->heuristics->set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *plan->op_graph);
  plan->heuristics->set1(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, CUDNN_HEUR_MODE_A);
  plan->heuristics->finalize("heuristics");
  int64_t count = 0;
  check(cudnnBackendGetAttribute(plan->heuristics->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
        "heuristics count");
  BG_CHECK(count > 0, "cuDNN: no engine for the attention graph");
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    raw.push_back(plan->configs.emplace_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))->get());
  }
  int64_t got = 0;
  check(cudnnBackendGetAttribute(plan->heuristics->get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data()),
        "heuristics results");
  std::string reasons;
  for (int64_t i = std::min(first_engine_config(), got); i < got; ++i) {
    try {
      auto exec = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      exec->set1(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle);
      exec->set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *plan->configs[static_cast<size_t>(i)]);
      exec->finalize("execution plan");
      int64_t ws = 0, n_ws = 0;
      check(cudnnBackendGetAttribute(exec->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                     &n_ws, &ws),
            "workspace size");
      plan->plan = std::move(exec);
      plan->workspace_bytes = ws;
      plan->engine_config = i;
      plan->engine_configs = got;
      return plan;
    } catch (const Error& err) {
      reasons += fmt::format("[engine config {}: {}] ", i, err.what());
    }
  }
  throw Error(fmt::format("cuDNN: none of {} engine configs built: {}", got, reasons));
}
#pragma GCC diagnostic pop

// (batch, heads, bucket q, bucket kv, causal, exact)
using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool>;

Shape shape_of(const Key& k) {
  return {std::get<0>(k), std::get<1>(k), std::get<2>(k), std::get<3>(k), std::get<4>(k), std::get<5>(k)};
}

std::string describe(const Key& k) {
  return fmt::format("B {} H {} q {} kv {} {}{}", std::get<0>(k), std::get<1>(k), std::get<2>(k), std::get<3>(k),
                     std::get<4>(k) ? "causal" : "full", std::get<5>(k) ? " exact" : "");
}

}  // namespace

struct MlaCudnnPrefill::Impl {
  // A bucket's entry: done with a plan, done without one (refused), or queued / being built (not done).
  struct Entry {
    bool done = false;
    std::unique_ptr<Plan> plan;
    int64_t last_use = 0;  // use_clock at the bucket's last lookup
  };

  cudnnHandle_t handle = nullptr;  // the calling thread's: builds on the step's path, and first of the process
  bool background = false;
  int device = 0;  // the caller's CUDA device, made current on the helper thread

  mutable std::mutex mu;  // guards everything below it but the buffers
  std::map<Key, Entry> plans;
  int64_t use_clock = 0;
  int64_t max_plans = mla_cudnn_max_plans(std::getenv("BG_MLA_CUDNN_MAX_PLANS"));
  const bool exact_plans = mla_cudnn_exact_plans(std::getenv("BG_MLA_CUDNN_EXACT"));
  int64_t plans_dropped = 0;
  std::deque<Key> queue;
  bool building = false;
  bool stop = false;
  int64_t plans_built = 0;
  double plan_build_ms = 0.0;
  std::string last_refusal;
  std::condition_variable wake;  // the helper: a key was queued, or stop
  std::condition_variable idle;  // wait_for_builds: the queue drained
  std::mutex build_mu;           // held across each helper build, and by hold_builds()
  std::thread helper;

  // The step thread's buffers.
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  float* stats = nullptr;  // [B, H, bucket q] of the largest plan run so far
  int64_t stats_floats = 0;

  ~Impl() {
    {
      std::lock_guard lock(mu);
      stop = true;
    }
    wake.notify_all();
    if (helper.joinable()) helper.join();
    plans.clear();  // before the handle the step thread's plans were built with
    if (workspace != nullptr) cudaFree(workspace);
    if (stats != nullptr) cudaFree(stats);
    if (handle != nullptr) cudnnDestroy(handle);
  }

  // Takes out of the map, under mu, the least recently used built plans past `keep` (never one still queued or
  // being built, whose entry has no plan yet); the caller destroys them after the device is idle.
  std::vector<std::unique_ptr<Plan>> take_over(int64_t keep) {
    std::vector<std::unique_ptr<Plan>> out;
    for (;;) {
      int64_t held = 0;
      auto oldest = plans.end();
      for (auto it = plans.begin(); it != plans.end(); ++it) {
        if (it->second.plan == nullptr) continue;
        ++held;
        if (oldest == plans.end() || it->second.last_use < oldest->second.last_use) oldest = it;
      }
      if (held <= keep || oldest == plans.end()) return out;
      log::debug("mla_prefill_cudnn: plan for {} dropped (least recently used of {}; bound {})",
                 describe(oldest->first), held, max_plans);
      out.push_back(std::move(oldest->second.plan));
      plans.erase(oldest);
      ++plans_dropped;
    }
  }

  // Destroys dropped plans once the device has finished what they launched (prefill is eager, never captured).
  static void destroy(std::vector<std::unique_ptr<Plan>> dropped) {
    if (dropped.empty()) return;
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    dropped.clear();
  }

  // Records a finished build (plan null: refused) under mu.
  void finish(const Key& key, std::unique_ptr<Plan> plan, double ms, const std::string& refusal, const char* where) {
    constexpr const char* op = "mla_prefill_cudnn";
    if (plan != nullptr) {
      ++plans_built;
      plan_build_ms += ms;
      log::debug("{}: plan for {} built {}in {:.1f} ms (engine config {} of {}), workspace {} bytes", op,
                 describe(key), where, ms, plan->engine_config, plan->engine_configs, plan->workspace_bytes);
    } else {
      last_refusal = refusal;
      log::warn("{}: cuDNN refused {}; such steps run on batchgen's own kernel: {}", op, describe(key), refusal);
    }
    Entry& e = plans[key];
    e.plan = std::move(plan);
    e.done = true;
  }

  // Builds one plan; null with the reason when cuDNN refuses it (or fails to make a handle on the helper thread).
  static std::unique_ptr<Plan> build(cudnnHandle_t shared, const Key& key, double& ms, std::string& refusal) {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<Plan> plan;
    try {
      OwnedHandle owned;
      cudnnHandle_t h = shared;
      if (h == nullptr) {
        cudnnHandle_t fresh = nullptr;
        check(cudnnCreate(&fresh), "create handle");
        owned = OwnedHandle(fresh);
        h = fresh;
      }
      plan = build_plan(h, shape_of(key));
      plan->owned = std::move(owned);
    } catch (const std::exception& e) {
      refusal = e.what();
      plan.reset();
    }
    ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return plan;
  }

  void helper_loop() {
    if (cudaSetDevice(device) != cudaSuccess) log::warn("mla_prefill_cudnn: helper thread could not select device");
    for (;;) {
      Key key;
      {
        std::unique_lock lock(mu);
        wake.wait(lock, [&] { return stop || !queue.empty(); });
        if (stop) return;
        key = queue.front();
        queue.pop_front();
        building = true;
      }
      double ms = 0.0;
      std::string refusal;
      std::unique_ptr<Plan> plan;
      {
        std::lock_guard hold(build_mu);
        plan = build(nullptr, key, ms, refusal);  // a handle of its own, used by the step thread once published
      }
      {
        std::lock_guard lock(mu);
        finish(key, std::move(plan), ms, refusal, "on the helper thread ");
        building = false;
      }
      idle.notify_all();
    }
  }
};

MlaCudnnPrefill::MlaCudnnPrefill() : impl_(std::make_unique<Impl>()) {}
MlaCudnnPrefill::~MlaCudnnPrefill() = default;
bool MlaCudnnPrefill::built() { return true; }
const float* MlaCudnnPrefill::stats() const { return impl_->stats; }

void MlaCudnnPrefill::set_background_builds(bool on) {
  std::lock_guard lock(impl_->mu);
  BG_CHECK(!impl_->helper.joinable() || on, "mla_prefill_cudnn: background builds cannot be turned off once started");
  impl_->background = on;
}

void MlaCudnnPrefill::wait_for_builds() {
  std::unique_lock lock(impl_->mu);
  impl_->idle.wait(lock, [&] { return impl_->queue.empty() && !impl_->building; });
}

std::unique_lock<std::mutex> MlaCudnnPrefill::hold_builds() { return std::unique_lock(impl_->build_mu); }

int64_t MlaCudnnPrefill::plans_built() const {
  std::lock_guard lock(impl_->mu);
  return impl_->plans_built;
}

double MlaCudnnPrefill::plan_build_ms() const {
  std::lock_guard lock(impl_->mu);
  return impl_->plan_build_ms;
}

std::string MlaCudnnPrefill::last_refusal() const {
  std::lock_guard lock(impl_->mu);
  return impl_->last_refusal;
}

bool MlaCudnnPrefill::takes(const MlaCudnnLaunch& l) { return plan_for(l) != nullptr; }

void* MlaCudnnPrefill::plan_for(const MlaCudnnLaunch& l) {
  constexpr const char* op = "mla_prefill_cudnn";
  BG_CHECK(l.batch >= 1 && l.heads >= 1 && l.max_q >= 1 && l.max_kv >= 1 && (!l.causal || l.max_kv >= l.max_q),
           "{}: bad shape B {} H {} q {} kv {} ({})", op, l.batch, l.heads, l.max_q, l.max_kv,
           l.causal ? "causal" : "full");
  BG_CHECK(l.q && l.k && l.v && l.out && l.seq_len_q && l.seq_len_kv && l.q_off && l.k_off && l.v_off && l.o_off,
           "{}: null pointer", op);
  Impl& m = *impl_;
  // The process's first handle is made here, on the step thread, before any helper makes its own (cuDNN's advice).
  if (m.handle == nullptr) check(cudnnCreate(&m.handle), "create handle");
  const int64_t bq = mla_cudnn_bucket(l.max_q), bkv = mla_cudnn_bucket(l.max_kv);
  const bool exact = l.batch == 1 && l.uniform && bq == l.max_q && bkv == l.max_kv && m.exact_plans;
  const Key key{l.batch, l.heads, bq, bkv, l.causal, exact};
  std::unique_lock lock(m.mu);
  if (const auto it = m.plans.find(key); it != m.plans.end()) {
    it->second.last_use = ++m.use_clock;
    return it->second.done ? it->second.plan.get() : nullptr;
  }
  // A new bucket: make room for its plan first. The buckets of this step were all looked up just now, so they are
  // the most recently used and stay (the bound is at least kMinPlans).
  if (std::vector<std::unique_ptr<Plan>> dropped = m.take_over(m.max_plans - 1); !dropped.empty()) {
    lock.unlock();
    Impl::destroy(std::move(dropped));
    lock.lock();
  }
  if (m.background) {
    m.plans.emplace(key, Impl::Entry{false, nullptr, ++m.use_clock});
    m.queue.push_back(key);
    if (!m.helper.joinable()) {
      BG_CUDA_CHECK(cudaGetDevice(&m.device));
      m.helper = std::thread([&m] { m.helper_loop(); });
    }
    log::debug("{}: plan for {} queued; the bucket's steps run batchgen's own kernel until it is built", op,
               describe(key));
    lock.unlock();
    m.wake.notify_one();
    return nullptr;
  }
  lock.unlock();
  double ms = 0.0;
  std::string refusal;
  std::unique_ptr<Plan> plan = Impl::build(m.handle, key, ms, refusal);
  lock.lock();
  m.finish(key, std::move(plan), ms, refusal, "");
  Impl::Entry& entry = m.plans[key];
  entry.last_use = ++m.use_clock;
  return entry.plan.get();
}

void MlaCudnnPrefill::set_max_plans(int64_t n) {
  check_max_plans(n);
  std::vector<std::unique_ptr<Plan>> dropped;
  {
    std::lock_guard lock(impl_->mu);
    impl_->max_plans = n;
    dropped = impl_->take_over(n);
  }
  Impl::destroy(std::move(dropped));
}

int64_t MlaCudnnPrefill::max_plans() const {
  std::lock_guard lock(impl_->mu);
  return impl_->max_plans;
}

int64_t MlaCudnnPrefill::plans_held() const {
  std::lock_guard lock(impl_->mu);
  int64_t held = 0;
  for (const auto& [key, entry] : impl_->plans) held += entry.plan != nullptr ? 1 : 0;
  return held;
}

int64_t MlaCudnnPrefill::plans_dropped() const {
  std::lock_guard lock(impl_->mu);
  return impl_->plans_dropped;
}

bool MlaCudnnPrefill::run(const MlaCudnnLaunch& l, cudaStream_t stream) {
  auto* plan = static_cast<Plan*>(plan_for(l));
  if (plan == nullptr) return false;
  if (plan->workspace_bytes > impl_->workspace_bytes) {
    BG_CUDA_CHECK(cudaStreamSynchronize(stream));  // an earlier launch may still use the old buffer
    if (impl_->workspace != nullptr) BG_CUDA_CHECK(cudaFree(impl_->workspace));
    impl_->workspace = nullptr;
    BG_CUDA_CHECK(cudaMalloc(&impl_->workspace, static_cast<size_t>(plan->workspace_bytes)));
    impl_->workspace_bytes = plan->workspace_bytes;
  }
  const int64_t stats_floats = l.batch * l.heads * mla_cudnn_bucket(l.max_q);
  if (stats_floats > impl_->stats_floats) {
    BG_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (impl_->stats != nullptr) BG_CUDA_CHECK(cudaFree(impl_->stats));
    impl_->stats = nullptr;
    BG_CUDA_CHECK(cudaMalloc(&impl_->stats, static_cast<size_t>(stats_floats) * sizeof(float)));
    impl_->stats_floats = stats_floats;
  }
  check(cudnnSetStream(plan->exec, stream), "set stream");
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float scale = l.scale, neg_inf_pad = neg_inf, neg_inf_causal = neg_inf;
  // Bound by unique id: each plan's graph names the tensors it reads (a full plan has no causal mask; an exact one no
  // padding mask and no ragged offsets: its K / V pointers start at the sequence's rows).
  const int64_t k_row = plan->shape.ragged() ? 0 : l.kv_row0 * l.heads;
  auto pointer = [&](int64_t uid) -> void* {
    switch (uid) {
      case kUidQ: return const_cast<__nv_bfloat16*>(l.q);
      case kUidK: return const_cast<__nv_bfloat16*>(l.k + k_row * kQk);
      case kUidV: return const_cast<__nv_bfloat16*>(l.v + k_row * kV);
      case kUidO: return l.out;
      case kUidLenQ: return const_cast<int32_t*>(l.seq_len_q);
      case kUidLenKv: return const_cast<int32_t*>(l.seq_len_kv);
      case kUidOffQ: return const_cast<int32_t*>(l.q_off);
      case kUidOffK: return const_cast<int32_t*>(l.k_off);
      case kUidOffV: return const_cast<int32_t*>(l.v_off);
      case kUidOffO: return const_cast<int32_t*>(l.o_off);
      case kUidScale: return &scale;
      case kUidNegInfPad: return &neg_inf_pad;
      case kUidNegInfCausal: return &neg_inf_causal;
      case kUidStats: return impl_->stats;
      default: throw Error(fmt::format("mla_prefill_cudnn: graph tensor {} has no binding", uid));
    }
  };
  const std::vector<int64_t>& ids = plan->graph.bound;
  std::vector<void*> data;
  for (const int64_t uid : ids) data.push_back(pointer(uid));
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, std::span<const int64_t>(ids));
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, std::span<void* const>(data));
  void* ws = impl_->workspace;
  pack.set1(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, ws);
  pack.finalize("variant pack");
  check(cudnnBackendExecute(plan->exec, plan->plan->get(), pack.get()), "execute");
  stats_rows_ = mla_cudnn_bucket(l.max_q);
  ++launches_;
  if (plan->shape.exact) ++exact_launches_;
  return true;
}

#else  // no cuDNN in this build: every call declines.

struct MlaCudnnPrefill::Impl {
  std::mutex build_mu;
};
MlaCudnnPrefill::MlaCudnnPrefill() : impl_(std::make_unique<Impl>()) {}
MlaCudnnPrefill::~MlaCudnnPrefill() = default;
bool MlaCudnnPrefill::built() { return false; }
const float* MlaCudnnPrefill::stats() const { return nullptr; }
void MlaCudnnPrefill::set_background_builds(bool) {}
void MlaCudnnPrefill::wait_for_builds() {}
std::unique_lock<std::mutex> MlaCudnnPrefill::hold_builds() { return std::unique_lock(impl_->build_mu); }
void MlaCudnnPrefill::set_max_plans(int64_t n) {
  check_max_plans(n);
}
int64_t MlaCudnnPrefill::max_plans() const { return kDefaultMaxPlans; }
int64_t MlaCudnnPrefill::plans_held() const { return 0; }
int64_t MlaCudnnPrefill::plans_dropped() const { return 0; }
int64_t MlaCudnnPrefill::plans_built() const { return 0; }
double MlaCudnnPrefill::plan_build_ms() const { return 0.0; }
std::string MlaCudnnPrefill::last_refusal() const { return "this build has no cuDNN"; }
bool MlaCudnnPrefill::takes(const MlaCudnnLaunch& l) { return plan_for(l) != nullptr; }
void* MlaCudnnPrefill::plan_for(const MlaCudnnLaunch&) { return nullptr; }
bool MlaCudnnPrefill::run(const MlaCudnnLaunch& l, cudaStream_t) { return plan_for(l) != nullptr; }

#endif

}  // namespace bg::ops
