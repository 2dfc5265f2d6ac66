// The backend-neutral op API the model code is written against. The CPU backend runs the fp32 reference ops; the
// CUDA backend runs bf16-activation kernels. Model code never knows which one it drives.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backend/tensor.h"
#include "formats/quant.h"
#include "formats/weight_source.h"
#include "ops/kda/kda.h"
#include "ops/mla/mla.h"
#include "ops/moe/moe.h"
#include "ops/rope/rope.h"
#include "ops/router/router.h"
#include "ops/sampling/sampling.h"

namespace bg {

// A linear weight prepared for one backend (CPU: the stored QuantWeight; CUDA: uploaded device copies).
class LinearHandle {
 public:
  virtual ~LinearHandle() = default;
  virtual int64_t n_out() const = 0;
  virtual int64_t n_in() const = 0;
};

// A linear whose bytes live in backend memory the caller rewrites with copy_from_host (a streamed expert's buffer,
// moe/expert_stream.h): `data` and `scale` (U8, empty when the format has no scales) hold exactly the bytes of a
// QuantWeight of this format and shape, and `handle` reads them.
struct WritableLinear {
  std::unique_ptr<LinearHandle> handle;
  Tensor data, scale;
  WeightFormat format = WeightFormat::kDense;
  int64_t n_out = 0, n_in = 0;
};
class Backend;
// `like`'s format, shape and byte tensors on `be`, without the handle (each backend's alloc_linear adds its own).
WritableLinear writable_linear_storage(Backend& be, const QuantWeight& like);

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

// One forward step over several sequences, each a contiguous range of the step's tokens. The model lays it out on
// the host and hands it to Backend::begin_step before the step's ops; the ops that need token ids, positions, block
// tables or state slots read them from the current step (on CUDA from device copies uploaded once per step).
struct StepLayout {
  std::vector<int32_t> token_ids;     // [n_tokens]
  std::vector<int64_t> positions;     // [n_tokens] position of each token in its sequence
  std::vector<int32_t> token_seq;     // [n_tokens] index of the token's sequence in this step
  std::vector<int64_t> seq_begin;     // [n_seqs + 1] token ranges
  std::vector<int32_t> block_tables;  // [n_seqs, max_blocks] physical MLA cache blocks (unused entries: any valid block)
  int64_t max_blocks = 0;
  std::vector<int32_t> state_slots;   // [n_seqs] KDA state slots (empty without KDA layers)
  std::vector<int32_t> last_rows;     // [n_seqs] row of each sequence's last token
  // The last n_padding sequences are padding (pad_decode_step: one token each, the pools' padding block and slot).
  // Their rows exist only to fill a captured graph's bucket: backends may skip them (no experts routed, no KDA state
  // read or written) and leave their outputs zero or unchanged; nothing reads them.
  int64_t n_padding = 0;

  int64_t n_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  int64_t n_seqs() const { return static_cast<int64_t>(seq_begin.size()) - 1; }
  bool all_single_token() const { return n_tokens() == n_seqs(); }
  // Rows before the padding (the padding sequences' tokens are the last rows).
  int64_t live_tokens() const { return n_tokens() - n_padding; }
};

// One layer's per-sequence state in a pool (KDA recurrent or conv state): the state of slot s starts at 4-byte word
// offset + s * slot_stride of `storage` (fp32 words). A recurrent state is fp32; a conv state holds elements of the
// backend's conv_state_dtype() (bf16 on CUDA) from there (kv/kda_state_pool.h).
struct StateRef {
  Tensor storage;
  int64_t offset = 0;
  int64_t slot_stride = 0;
};

// The inputs of Backend::kda_prep for one KDA layer and step (n rows, P = n_heads * head_dim).
struct KdaPrepArgs {
  std::array<Tensor, 3> raw;            // q, k, v projections [n, P] (bf16)
  std::array<Tensor, 3> conv;           // their depthwise conv weights [P, W] (fp32)
  std::array<StateRef, 3> conv_state;   // their conv states (slot step().state_slots[s])
  Tensor g_raw, a_log, dt_bias, b;      // gate input [n, P] (bf16), A_log [>= n_heads], dt_bias [P], b [n, n_heads]
  int64_t n_heads = 0, head_dim = 0;
  float q_scale = 1.0f;                 // head_dim^-0.5
  float gate_lower_bound = -5.0f;
};

// ---- host tier (kv::StateManager): pinned host memory and copies on a copy stream ----------------------------------
// One device <-> host copy: `bytes` at byte `device_offset` of `device` and at `host`.
struct HostCopy {
  Tensor device;
  size_t device_offset = 0;
  std::byte* host = nullptr;
  size_t bytes = 0;
};
// Completion of a batch of copies: increasing numbers, 0 = nothing to wait for. Copies complete in issue order.
using CopyFence = uint64_t;

enum class GluKind : uint8_t { kSwiGlu, kSitu };

struct GluSpec {
  GluKind kind = GluKind::kSwiGlu;
  float situ_beta = 4.0f;
  float situ_linear_beta = 25.0f;
};

// Linear weights prepared together (CUDA: one device allocation for the batch, copied from pinned memory or through a
// pinned staging buffer, no per-weight cudaMalloc). n_experts > 0: the batch is one layer's routed experts, expert e's
// weights at [e * k, (e + 1) * k) in table order (k = size / n_experts), each expert laid out as one block
// (formats/expert_block.h), as the weight store lays it out in host memory.
struct LinearRun {
  size_t first = 0, count = 0;  // weights [first, first + count) of a batch
};
struct LinearBatch {
  std::vector<const QuantWeight*> weights;
  int64_t n_experts = 0;
  // Runs of consecutive weights that read the same input (n_experts == 0 only): the backend may also prepare each run
  // as one linear over the parts' output rows side by side, [sum of n_out, n_in] (PreparedLinears::runs).
  std::vector<LinearRun> runs;
};
struct PreparedLinears {
  std::vector<std::unique_ptr<LinearHandle>> weights;  // one per weight, in batch order
  std::vector<std::unique_ptr<LinearHandle>> runs;     // one per run: its concatenated linear, or null (kept apart)
};

// Linears that read the same input (model/backend_weights.h: BackendLinears::group). `fused`, when the backend made
// one, computes every part's output side by side in one product; the parts' own handles stay usable alone.
struct LinearGroup {
  std::vector<const LinearHandle*> parts;
  const LinearHandle* fused = nullptr;
  // The caller hands the parts only to ops that read strided views (Tensor::cols_view), so a fused product's parts
  // may be its output's columns in place (CUDA: no split launch) instead of packed copies.
  bool strided_parts = false;
};

// Expert weights of one MoE layer: expert e's FFN is down(glu(gate(x), up(x))). Indexed by global expert id when it
// comes from the checkpoint, by local slot when handed to Backend::prepare_experts.
struct ExpertWeights {
  std::vector<const LinearHandle*> gate, up, down;
  // Slots are repointed while serving (streamed experts, moe/expert_stream.h): streamed_slots[s] marks the slots whose
  // handles are the pool's placeholder until their expert is staged, and streamed_host holds those experts' host
  // weights (gate, up, down of each), which a backend with its own layout reads for what every expert of the layer
  // must share (CUDA: the W4A16 layout's scale shifts).
  bool streamed = false;
  std::vector<bool> streamed_slots;
  std::vector<const QuantWeight*> streamed_host;
  int64_t size() const { return static_cast<int64_t>(gate.size()); }
};

// One layer's expert weights prepared for the backend, indexed by local slot (CUDA: a device array of descriptors,
// uploaded when prepared and rewritten in place by set_expert_slot, so captured graphs stay valid).
class ExpertSlots {
 public:
  virtual ~ExpertSlots() = default;
  virtual int64_t n_slots() const = 0;
};

// One MoE layer's routing on this rank in backend memory (the ops/moe routing layout): which local slot each (token,
// k) pair goes to, each slot's rows, and the way back. Sized by the step's shape, so no op waits for the host.
struct MoeRouting {
  ops::MoeRoutingShape shape;
  Tensor buffer;  // U8 [moe_routing_bytes(shape)]
};

// Per-op timing (`batchgen bench`): an attached profiler sees every backend op bracketed by op_begin / op_end, with
// the backend's stream (CUDA: its cudaStream_t; CPU: null) so that it can record device events around the op. Every
// op method of a backend starts with BG_PROFILE_OP (one pointer check when no profiler is attached). The hooks must
// not throw (they run in destructors): a profiler keeps its own errors and reports them when read.
class OpProfiler {
 public:
  virtual ~OpProfiler() = default;
  virtual void op_begin(const char* name, void* stream) noexcept = 0;
  virtual void op_end(const char* name, void* stream) noexcept = 0;
  // True: the profiler wants every op. False: a graph replay is seen as one op named "graph".
  virtual bool per_op() const = 0;
  // With per_op: true, a step that would replay a CUDA graph captures a graph of its own with the hooks live (the
  // profiler records its events as graph nodes) and launches it once, so the ops are timed as a replay runs them;
  // false, such steps run eagerly (every op launched from the host).
  virtual bool in_graph() const { return false; }
};

// Brackets one op for the attached profiler, if any.
class OpScope {
 public:
  OpScope(OpProfiler* profiler, const char* name, void* stream) : profiler_(profiler), name_(name), stream_(stream) {
    if (profiler_ != nullptr) profiler_->op_begin(name_, stream_);
  }
  ~OpScope() {
    if (profiler_ != nullptr) profiler_->op_end(name_, stream_);
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  OpProfiler* profiler_;
  const char* name_;
  void* stream_;
};

// First line of every backend op method: `BG_PROFILE_OP("rmsnorm", stream)`.
#define BG_PROFILE_OP(name, stream) const ::bg::OpScope bg_op_scope_(profiler_, name, stream)

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  virtual DeviceKind device() const = 0;
  // Activation dtype between ops: F32 on the CPU reference, BF16 on CUDA.
  virtual DType act_dtype() const = 0;
  // How the KDA short-conv states are stored (KdaStatePool): past conv inputs, so the activations' storage dtype (BF16
  // on CUDA; F32 on the CPU, whose bf16 emulation stores bf16 values in fp32).
  virtual DType conv_state_dtype() const { return DType::kF32; }

  // ---- memory -------------------------------------------------------------------------------------------------
  virtual Tensor alloc(Shape shape, DType dtype) = 0;
  Tensor act(int64_t rows, int64_t cols) { return alloc({rows, cols}, act_dtype()); }
  Tensor zeros(Shape shape, DType dtype);
  virtual void fill_zero(Tensor& t) = 0;
  // t itself when its rows are packed, else a packed copy (a strided view: Tensor::cols_view). The CPU backend never
  // makes strided views, so its default refuses one.
  virtual Tensor packed(const Tensor& t);
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
  // Waits for the plans queued for background builds (BackendOptions::background_plans); a no-op without them.
  virtual void wait_for_plans() {}

  // ---- sampling (one step's "sample this step": the engine's only interface to it) ---------------------------------
  // out[i] for rows[i] over logits F32 [n_rows, vocab] in backend memory, by ops/sampling's rules (sample_rows_cpu
  // defines them): the id, the row's finite flag, and the logprobs a row asks for. CPU: sample_rows_cpu in place.
  // CUDA: the logits stay on the device; one upload of the rows and one download of the results (with the step's
  // kernel error flags) through pinned buffers the backend owns. Synchronises (the step's host wait); reports a
  // kernel error flag of the step like download_f32 does.
  virtual void sample_rows(const Tensor& logits, std::span<const ops::RowSampling> rows,
                           std::span<ops::RowSample> out) = 0;

  // ---- host tier --------------------------------------------------------------------------------------------
  // Host memory for offloaded state: page-locked on CUDA (so copies are asynchronous DMA), plain on the CPU.
  virtual std::shared_ptr<std::byte> alloc_host(size_t bytes);
  // Device -> host / host -> device copies, issued after every op issued so far and run on a copy stream in issue
  // order (CPU: done at once). Ops issued after copy_from_host wait for it on the device, without a host wait. The
  // host memory must stay valid until the fence is done; device memory a device -> host copy reads must not be
  // rewritten by ops issued before compute_wait(fence).
  virtual CopyFence copy_to_host(std::span<const HostCopy> copies);
  virtual CopyFence copy_from_host(std::span<const HostCopy> copies);
  // copy_from_host for bytes no op needs yet (a prefetch): ops issued after it do not wait for it; call
  // compute_wait(fence) before issuing one that reads them. CPU: done at once, as copy_from_host.
  virtual CopyFence prefetch_from_host(std::span<const HostCopy> copies) { return copy_from_host(copies); }
  virtual bool fence_done(CopyFence fence) { return fence <= copies_issued_; }
  virtual void wait_fence(CopyFence fence) { (void)fence; }
  // Ops issued from now on run after the fence's copies (device side; the host does not wait).
  virtual void compute_wait(CopyFence fence) { (void)fence; }

  // ---- steps --------------------------------------------------------------------------------------------------
  // Makes `step` the current step (CUDA: one stream-ordered upload of its metadata, no host synchronisation).
  void begin_step(StepLayout step) {
    step_ = std::move(step);
    upload_step();
  }
  const StepLayout& step() const { return step_; }
  // Runs `body` (the ops of one step, returning its output tensor). CUDA with graphs on: the first call for `key`
  // captures body's ops into a CUDA graph (nothing runs during capture), then every call replays it; `body` must
  // issue the same ops for the same key, read per-step values only through step(), and never synchronise. The
  // returned tensor is owned by the graph and overwritten by its next replay. CPU (or graphs off): body().
  virtual Tensor run_graph(int64_t key, const std::function<Tensor()>& body) {
    (void)key;
    return body();
  }
  // Graph keys captured so far (for tests and logs).
  virtual int64_t n_graphs() const { return 0; }

  // ---- profiling (see OpProfiler) -----------------------------------------------------------------------------
  // Not owned; null detaches. Ops issued while a CUDA graph is being captured are not reported.
  void set_profiler(OpProfiler* profiler) { profiler_ = profiler; }
  OpProfiler* profiler() const { return profiler_; }

  // ---- weights ------------------------------------------------------------------------------------------------
  virtual std::unique_ptr<LinearHandle> prepare_linear(const QuantWeight& w) = 0;
  // One handle per weight, in batch order, and per run. Default: prepare_linear one by one; no run is fused.
  virtual PreparedLinears prepare_linears(const LinearBatch& batch);
  // Pins host memory weights are read from (CUDA: cudaHostRegister, read-only), so uploads (and later streamed
  // experts) copy at the pinned rate; unpinned when the handle is destroyed. Default: nothing to do (null).
  virtual std::shared_ptr<void> pin_host_memory(std::span<const HostRegion> regions) {
    (void)regions;
    return nullptr;
  }
  // Device memory. held / peak_held: what the backend's caching allocator holds (in use + cached) now and at most
  // since reset_memory_peak(); in_use / peak_in_use: what it has handed out now and at most over that span (the
  // cache is given back before the device runs out, so this is what the work needed); device_used / device_total:
  // the device's own figures (every allocation of every process, weights and the context included);
  // peak_device_used: device_used - held + peak_held, the device's use at the allocator's peak (weights are
  // allocated outside the allocator and do not change during a step). Host backends: zeros.
  struct MemoryUse {
    size_t held = 0, in_use = 0, peak_held = 0, peak_in_use = 0, device_used = 0, device_total = 0,
           peak_device_used = 0;
  };
  virtual MemoryUse memory_use() const { return {}; }
  virtual void reset_memory_peak() {}
  RopeHandle prepare_rope(const ops::RopeTable& table);
  // A writable linear of `like`'s format and shape (its contents undefined until written). Default: throws (the
  // backend cannot stream experts).
  virtual WritableLinear alloc_linear(const QuantWeight& like);

  // ---- ops (shapes [rows, cols]; `out` tensors are allocated by the caller) -----------------------------------
  // out[t] = table[step().token_ids[t]].
  virtual void embedding(const Tensor& table, Tensor& out) = 0;
  // out[s] = x[step().last_rows[s]] (x [n_tokens, d] act dtype -> out [n_seqs, d]).
  virtual void gather_last_rows(const Tensor& x, Tensor& out) = 0;
  // RMSNorm of the first w.numel() values of each row of x into y (same shape). x and y may be strided views (a fused
  // group's strided_parts; CUDA), in place only at equal row strides.
  virtual void rmsnorm(const Tensor& x, const Tensor& w, float eps, Tensor& y) = 0;
  // y[n, out] = x[n, in] W^T; y may be act dtype or F32.
  virtual void linear(const LinearHandle& w, const Tensor& x, Tensor& y) = 0;
  // ys[i] = x W_i^T for each part of g ([n, n_out_i], act dtype). Where linear_group_fuses(g, n), one product for all
  // (CUDA: one GEMM, plus one split launch above one row, or with g.strided_parts the GEMM output's columns as strided
  // views); otherwise linear() part by part (the default).
  virtual std::vector<Tensor> linear_group(const LinearGroup& g, const Tensor& x);
  virtual bool linear_group_fuses(const LinearGroup& g, int64_t rows) const {
    (void)g;
    (void)rows;
    return false;
  }
  virtual void add(Tensor& y, const Tensor& x) = 0;                            // y += x
  // y[n, out] += x[n, in] W^T (y act dtype). Default: the product into a new tensor, then add() (two roundings, the
  // bits of linear() then add()); CUDA: one cuBLAS GEMM with beta = 1 where the weight is dense and the backend not
  // deterministic (one rounding of the fp32 sum), else the default.
  virtual void linear_add(const LinearHandle& w, const Tensor& x, Tensor& y);
  virtual void glu(const GluSpec& p, const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  virtual void sigmoid_mul(Tensor& x, const Tensor& gate) = 0;  // x *= sigmoid(gate); gate may be strided (CUDA)
  // RoPE at the step's positions.
  virtual void rope(const ops::RopeParams& p, const RopeHandle& table, Tensor& x) = 0;
  // Latent entries [n_tokens, entry_dim] -> the cache at the step's positions through each token's block table.
  virtual void mla_write(const MlaCacheRef& cache, const Tensor& latent) = 0;
  // rmsnorm of each latent row's first norm.numel() values (c_kv), then mla_write of [normed c_kv | k_pe]: for models
  // whose k_pe is not rotated (Kimi-K3). The latent may be a strided view (CUDA) and is left normed or untouched.
  // Default: rmsnorm in place, then mla_write; CUDA: one launch that leaves the latent as it was.
  virtual void mla_write_normed(const MlaCacheRef& cache, Tensor& latent, const Tensor& norm, float eps);
  // Each token attends to its own sequence's cache up to its position.
  virtual void mla_attention(const ops::MlaParams& p, const Tensor& q, const Tensor& w_uk, const Tensor& w_uv,
                             const MlaCacheRef& cache, Tensor& out) = 0;
  // Router: F32 logits [n, E] -> ids I32 [n, k] and weights F32 [n, k] (backend memory). NaN scores never become
  // an out-of-range id.
  virtual void route(const ops::RouterParams& p, const Tensor& logits, const Tensor& bias, Tensor& ids,
                     Tensor& weights) = 0;

  // ---- MoE stages (the MoE layer, src/moe/, composes them with an exchange) ------------------------------------
  // Prepares experts by local slot (slot s = by_slot.gate[s], ...; all slots the same format and shape).
  virtual std::unique_ptr<ExpertSlots> prepare_experts(const ExpertWeights& by_slot) = 0;
  // Points `slot` at other weights (same format and shape), ordered with the ops already issued. `laid_out`: the same
  // expert in the backend's own layout (lay_out_expert), required where the layer keeps one (expert_layout_bytes > 0).
  virtual void set_expert_slot(ExpertSlots& slots, int64_t slot, const LinearHandle& gate, const LinearHandle& up,
                               const LinearHandle& down, const Tensor* laid_out = nullptr) = 0;
  // Bytes of one expert in the backend's own layout for `slots`' layer (CUDA: one W4A16 block where the layer's MXFP4
  // experts live in that layout); 0 where the layer reads streamed experts in the checkpoint's format (every CPU layer).
  virtual size_t expert_layout_bytes(const ExpertSlots& slots) const {
    (void)slots;
    return 0;
  }
  // Whether a weight store's W4A16 block of an expert (QuantWeight::w4a16) is that layout byte for byte, so a
  // streamed expert's block is copied into its buffer's laid-out part as it is, with no lay_out_expert (CUDA: the
  // layer's W4A16 layout has scale shifts 0). False on the CPU.
  virtual bool expert_layout_takes_blocks(const ExpertSlots& slots) const {
    (void)slots;
    return false;
  }
  // Whether prepare_linears takes routed experts bound deferred (QuantWeight::deferred: a weight store's W4A16 block,
  // no checkpoint bytes) and resolves what it needs itself (CUDA); otherwise BackendLinears hands it resolved copies.
  virtual bool takes_deferred_experts() const { return false; }
  // Lays the expert in gate / up / down (a streamed-expert buffer whose copies the device has been told to wait for)
  // out into `dst` (U8, expert_layout_bytes) for `slots`' layer, ordered with the ops already issued.
  virtual void lay_out_expert(const ExpertSlots& slots, const LinearHandle& gate, const LinearHandle& up,
                              const LinearHandle& down, Tensor& dst);
  // The same for a prefetched expert: ordered after the copies issued so far (prefetch_from_host) and not before
  // compute_wait of the returned fence, so it overlaps the compute as the copies do (CUDA: on the copy stream).
  virtual CopyFence lay_out_expert_ahead(const ExpertSlots& slots, const LinearHandle& gate, const LinearHandle& up,
                                         const LinearHandle& down, Tensor& dst) {
    lay_out_expert(slots, gate, up, down, dst);
    return copies_issued_;
  }
  // A routing buffer for `shape` (backend memory; contents written by moe_dispatch).
  MoeRouting moe_routing(const ops::MoeRoutingShape& shape);
  // Groups the pairs whose expert is on this rank by slot: slot_map I32 [n_experts] (local slot or -1), ids I32
  // [n_tokens, k], weights F32 [n_tokens, k]. step_row0 >= 0: the ids are the current step's rows [step_row0,
  // step_row0 + n_tokens), and the pairs of its padding rows (StepLayout::n_padding) are dropped like another rank's
  // (no expert reads them; a combine leaves their rows as they were). -1: every pair counts (rows an exchange
  // delivered).
  virtual void moe_dispatch(const Tensor& slot_map, const Tensor& ids, const Tensor& weights, MoeRouting& r,
                            int64_t step_row0) = 0;
  // rows[row] = x[token of row] for this rank's rows; x [n_tokens, d], rows [n_pairs, d] (act dtype).
  virtual void moe_gather(const MoeRouting& r, const Tensor& x, Tensor& rows) = 0;
  // y_rows = down(glu(gate(rows), up(rows))) with each slot's weights; rows, y_rows [n_pairs, hidden] (act dtype).
  virtual void moe_experts(const ExpertSlots& experts, const GluSpec& glu, const MoeRouting& r, const Tensor& rows,
                           Tensor& y_rows) = 0;
  // out[t] += sum_k w(t,k) y_rows[row of (t,k)] in k order (fp32), over this rank's pairs; out [n_tokens, hidden].
  virtual void moe_combine(const MoeRouting& r, const Tensor& y_rows, Tensor& out) = 0;
  // gather -> experts -> combine of a routing whose pairs are all on this rank (one rank): out[t] += sum_k w E(x[t]),
  // or with `accumulate` false out[t] = sum_k w E(x[t]), every row written (a padding row's is zero), so `out` needs
  // no zeroing first. Backends may fuse it (CUDA: the W4A16 decode kernel gathers in its loads and combines in its
  // epilogue).
  virtual void moe_routed_local(const ExpertSlots& experts, const GluSpec& glu, const MoeRouting& r, const Tensor& x,
                                Tensor& out, bool accumulate);
  // ---- Kimi-K3 ------------------------------------------------------------------------------------------------
  // Causal short conv + SiLU of each sequence's tokens continuing its conv state (slot step().state_slots[s]).
  virtual void short_conv(const Tensor& x, const Tensor& weight, const StateRef& state, Tensor& out) = 0;
  virtual void kda_l2norm(int64_t head_dim, float scale, Tensor& x) = 0;
  virtual void kda_gate(const Tensor& g_raw, const Tensor& a_log, const Tensor& dt_bias, int64_t n_heads,
                        float lower_bound, Tensor& g) = 0;
  virtual void kda_beta(const Tensor& b, Tensor& beta) = 0;
  // KDA's per-token preparation after its projections (KdaPrepArgs): q, k, v = short_conv of each projection (SiLU,
  // conv states updated); q, k L2-normalised per head (q scaled by q_scale); g = kda_gate(g_raw); beta =
  // kda_beta(b). This default runs those ops one by one; a backend may fuse them (CUDA does for decode steps).
  virtual void kda_prep(const KdaPrepArgs& a, Tensor& q, Tensor& k, Tensor& v, Tensor& g, Tensor& beta);
  // Gated delta rule of each sequence over its state (slot step().state_slots[s]): chunked for a sequence with
  // several tokens, recurrent for one (all single-token sequences of a step in one batched launch). p.n_tokens is
  // the step's token count.
  virtual void kda(const ops::KdaParams& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                   const Tensor& beta, const StateRef& state, Tensor& out) = 0;
  virtual void gated_rmsnorm(int64_t n_heads, float eps, const Tensor& x, const Tensor& gate, const Tensor& weight,
                             Tensor& y) = 0;
  // out = softmax-weighted mix of candidates[0..n_candidates) of a packed [max_candidates, n, D] bank.
  virtual void attn_res_mix(const Tensor& bank, int64_t n_candidates, const Tensor& norm, const Tensor& proj,
                            float eps, Tensor& out) = 0;
  // The mix, then the RMSNorm the model applies to it: h = attn_res_mix(...), x = rmsnorm(h, rms_weight, rms_eps).
  // This default runs the two ops; a backend may fuse them (CUDA does).
  virtual void attn_res_mix_rmsnorm(const Tensor& bank, int64_t n_candidates, const Tensor& norm, const Tensor& proj,
                                    float eps, Tensor& h, const Tensor& rms_weight, float rms_eps, Tensor& x) {
    attn_res_mix(bank, n_candidates, norm, proj, eps, h);
    rmsnorm(h, rms_weight, rms_eps, x);
  }
  // The residual update that precedes a mix, folded into it: the last candidate (the running partial sum) first
  // becomes `addend` (replace) or partial + addend (as add()), written back into the bank, then
  // attn_res_mix_rmsnorm over n_candidates. This default runs copy / add, then the mix; CUDA does it in one kernel.
  virtual void attn_res_add_mix_rmsnorm(const Tensor& addend, bool replace, const Tensor& bank, int64_t n_candidates,
                                        const Tensor& norm, const Tensor& proj, float eps, Tensor& h,
                                        const Tensor& rms_weight, float rms_eps, Tensor& x);
  // That residual update alone: partial = addend (replace) or partial += addend (add()). The model runs it as its own
  // op when taps must see the partial sum.
  void attn_res_update(const Tensor& addend, bool replace, Tensor& partial);

 protected:
  // Called by begin_step after step_ changed (CUDA uploads the metadata).
  virtual void upload_step() {}
  StepLayout step_;
  OpProfiler* profiler_ = nullptr;
  CopyFence copies_issued_ = 0;
};

// Choices that hold for every op of a backend.
struct BackendOptions {
  // Batch invariance (--deterministic): every op computes a row the same way whatever else is in the batch (fixed
  // reduction orders and kernel choices independent of the batch size); CUDA pays for it at small batches
  // (docs/DETERMINISM.md). The CPU backend is batch invariant anyway.
  bool deterministic = false;
  // Library execution plans (CUDA: cuDNN's MLA prefill attention) are built on a helper thread; until a plan is
  // ready its steps run batchgen's own kernel instead of waiting for the build (a serving process). Off: the first
  // step of a shape waits for its plan (tests and benchmarks, which want the same kernel every time).
  bool background_plans = false;
};

// "cpu" or "cuda" (CUDA only when built with it and a GPU is present); throws naming what is missing.
std::unique_ptr<Backend> make_backend(std::string_view device, const BackendOptions& options = {});

}  // namespace bg
