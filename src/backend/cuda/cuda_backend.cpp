// CudaBackend (cuda_backend_impl.h): the step upload, CUDA graphs, fused linear groups, and the factory.
#include "backend/cuda/cuda_backend_impl.h"

#include <array>
#include <set>

namespace bg {
namespace cuda_backend_detail {

// Packs the step's arrays (8-byte aligned) into pinned memory and copies them to the device buffer in one transfer.
void CudaBackend::upload_step() {
  BG_PROFILE_OP("upload_step", stream_);
  inject_device_fault_if_armed(name());
  const StepLayout& s = step_;
  ++step_serial_;
  kda_plan_ = s.state_slots.empty() || s.all_single_token() ? ops::KdaVarlenPlan{}
                                                            : ops::kda_varlen_plan(s.seq_begin, s.state_slots);
  kda_plan_packed_ = kda_plan_.packed();
  const std::array<int32_t, 1> live{static_cast<int32_t>(skip_padding_rows_ ? s.live_tokens() : s.n_tokens())};
  auto bytes_of = [](const auto& v) { return (v.size() * sizeof(v[0]) + 7) / 8 * 8; };
  const size_t total = bytes_of(live) + bytes_of(s.token_ids) + bytes_of(s.positions) + bytes_of(s.token_seq) +
                       bytes_of(s.block_tables) + bytes_of(s.state_slots) + bytes_of(s.last_rows) +
                       bytes_of(kda_plan_packed_);
  if (step_uploaded_ == nullptr) BG_CUDA_CHECK(cudaEventCreateWithFlags(&step_uploaded_, cudaEventDisableTiming));
  BG_CUDA_CHECK(cudaEventSynchronize(step_uploaded_));  // the previous upload has read the staging memory
  if (total > step_capacity_) {
    BG_CHECK(!capturing_, "cuda backend: step metadata grew during graph capture");
    drop_graphs();
    if (step_host_ != nullptr) BG_CUDA_CHECK(cudaFreeHost(step_host_));
    step_capacity_ = std::max<size_t>(total * 2, 4096);
    void* host = nullptr;
    BG_CUDA_CHECK(cudaMallocHost(&host, step_capacity_));
    step_host_ = static_cast<std::byte*>(host);
    step_dev_ = alloc_->allocate(step_capacity_);
  }
  size_t offset = 0;
  auto place = [&](const auto& v, auto*& dev_ptr) {
    std::memcpy(step_host_ + offset, v.data(), v.size() * sizeof(v[0]));
    dev_ptr = reinterpret_cast<std::remove_reference_t<decltype(dev_ptr)>>(static_cast<std::byte*>(step_dev_.get()) +
                                                                           offset);
    offset += bytes_of(v);
  };
  place(live, dev_.live_tokens);  // first: the same offset in every step
  place(s.token_ids, dev_.token_ids);
  place(s.positions, dev_.positions);
  place(s.token_seq, dev_.token_seq);
  place(s.block_tables, dev_.block_tables);
  place(s.state_slots, dev_.state_slots);
  place(s.last_rows, dev_.last_rows);
  place(kda_plan_packed_, dev_.kda_plan);
  if (offset > 0) {
    BG_CUDA_CHECK(cudaMemcpyAsync(step_dev_.get(), step_host_, offset, cudaMemcpyHostToDevice, stream_));
  }
  BG_CUDA_CHECK(cudaEventRecord(step_uploaded_, stream_));
}

// Captures body on the stream into an executable graph. With profile_ops the attached profiler stays live, so its
// event records become nodes of the graph; otherwise it is detached while capturing (events must not land in a graph
// that is replayed without it).
CudaBackend::Graph CudaBackend::capture_graph(const std::function<Tensor()>& body, bool profile_ops,
                                              const std::shared_ptr<CapturePool>& arena, std::vector<void*>* outlived) {
  Graph g;
  cudaGraph_t graph = nullptr;
  const std::unique_lock no_builds = mla_cudnn_.hold_builds();  // a plan build must not touch the legacy stream now
  g.memory = alloc_->begin_capture(arena);  // from here until end_capture nothing is returned to the driver
  if (const cudaError_t began = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed); began != cudaSuccess) {
    alloc_->end_capture();
    BG_CUDA_CHECK(began);
  }
  OpProfiler* profiler = profile_ops ? profiler_ : std::exchange(profiler_, nullptr);
  capturing_ = true;
  try {
    g.out = body();
  } catch (...) {
    cudaStreamEndCapture(stream_, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    profiler_ = profiler;
    capturing_ = false;
    alloc_->end_capture();
    throw;
  }
  profiler_ = profiler;
  const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
  capturing_ = false;
  std::vector<void*> kept = alloc_->end_capture();
  if (outlived != nullptr) {
    std::erase(kept, g.out.owner.get());  // the output: rewritten at every replay, read before the next step's
    *outlived = std::move(kept);
  }
  BG_CUDA_CHECK(ended);
  const cudaError_t err = cudaGraphInstantiate(&g.exec, graph, 0);
  cudaGraphDestroy(graph);
  BG_CUDA_CHECK(err);
  return g;
}

// Capture once per key (the caller guarantees the same ops and shapes for a key; per-step values come from the
// step buffer, whose address stays fixed while graphs exist), then launch. A per-op profiler that records inside
// graphs gets a graph of its own, launched once and kept (its output and memory) until the next such step.
Tensor CudaBackend::run_graph(int64_t key, const std::function<Tensor()>& body) {
  if (profiler_ != nullptr && profiler_->per_op() && profiler_->in_graph()) {
    drop_profiled_graph();
    profiled_graph_ = capture_graph(body, true);
    BG_CUDA_CHECK(cudaGraphLaunch(profiled_graph_.exec, stream_));
    return profiled_graph_.out;
  }
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    Graph g;
    if (graph_arena_) {
      std::vector<void*> outlived;
      g = capture_graph(body, false, decode_arena_, &outlived);
      decode_arena_ = g.memory;
      if (!outlived.empty()) {
        // A buffer made during the capture kept an arena block that other graphs use as scratch at their replays:
        // nothing has run since it was handed out, so dropping every arena graph now leaves it to its owner alone.
        // From here on each graph has a pool of its own.
        log::warn("cuda backend: a CUDA graph capture kept {} block(s) of the shared graph arena past its end (a "
                  "persistent buffer not made with allocate_persistent); the decode graphs are recaptured with a "
                  "pool each", outlived.size());
        cudaGraphExecDestroy(g.exec);
        g = Graph{};
        drop_graphs();
        graph_arena_ = false;
      }
    }
    if (g.exec == nullptr) g = capture_graph(body, false);
    it = graphs_.emplace(key, std::move(g)).first;
    // Each graph keeps its capture's memory while it lives (its own pool, or the arena), and nothing bounds their
    // number yet (one per batch bucket and block-table width): say what they hold, so a run's log shows how much.
    std::set<const CapturePool*> pools;
    size_t held = 0;
    for (const auto& entry : graphs_) {
      const CapturePool* pool = entry.second.memory.get();
      if (pool != nullptr && pools.insert(pool).second) held += pool->bytes();
    }
    log::info("cuda backend: captured graph {:#x}{}: {} graphs hold {:.1f} MiB in {} pool(s)", key,
              decode_arena_ ? " in the shared arena" : "", graphs_.size(), static_cast<double>(held) / (1 << 20),
              pools.size());
  }
  BG_PROFILE_OP("graph", stream_);
  BG_CUDA_CHECK(cudaGraphLaunch(it->second.exec, stream_));
  return it->second.out;
}

// Every decode graph (and the arena they share) goes, after the stream has finished with them.
void CudaBackend::drop_graphs() {
  BG_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g.exec);
  graphs_.clear();
  decode_arena_.reset();
}

void CudaBackend::drop_profiled_graph() {
  if (profiled_graph_.exec == nullptr) return;
  BG_CUDA_CHECK(cudaStreamSynchronize(stream_));  // its memory goes back to the allocator
  cudaGraphExecDestroy(profiled_graph_.exec);
  profiled_graph_ = Graph{};
}

// A fused group (cuda_linears.h) up to kLinearGroupMaxFusedRows rows: on the dense decode GEMM, one launch that writes
// each part's columns into its own output; on cuBLAS, one GEMM into [n, sum of n_out], then each part's columns:
// views at one row (contiguous there) or where the caller reads strided views (g.strided_parts, BG_LINEAR_GROUP_VIEWS
// unset or 1), one split launch otherwise. More rows, or no fused weight: part by part.
std::vector<Tensor> CudaBackend::linear_group(const LinearGroup& g, const Tensor& x) {
  const int64_t n = x.rows();
  if (!linear_group_fuses(g, n)) return Backend::linear_group(g, x);
  const ops::LinearCudaParams p{n, ops::LinearOutType::kBf16, ops::LinearPath::kAuto, deterministic_};
  const ops::LinearCudaContext ctx{cublas_, cublas_ws_.get(), ops::kCublasWorkspaceBytes, nullptr, 0,
                                   dense_decode_ctx()};
  if (ops::dense_decode_applies(p, desc(*g.fused), x.as<bf16>(), ctx)) {
    // The decode GEMM writes each part's columns into its own output as it stores them: no split pass.
    BG_PROFILE_OP("linear", stream_);
    std::vector<Tensor> ys;
    std::vector<ops::ColumnSlice> parts;
    int64_t col = 0;
    for (const LinearHandle* part : g.parts) {
      ys.push_back(act(n, part->n_out()));
      parts.push_back({col, part->n_out(), ys.back().data});
      col += part->n_out();
    }
    ops::dense_decode_parts_cuda(p, desc(*g.fused), x.as<bf16>(), parts, *ctx.dense_decode, stream_);
    return ys;
  }
  Tensor all = act(n, g.fused->n_out());
  linear(*g.fused, x, all);
  std::vector<Tensor> ys;
  std::vector<ops::ColumnSlice> slices;
  int64_t col = 0;
  const bool views = n == 1 || (g.strided_parts && group_views_);
  for (const LinearHandle* part : g.parts) {
    const int64_t cols = part->n_out();
    if (views) {
      ys.push_back(all.cols_view(col, cols));
    } else {
      ys.push_back(act(n, cols));
      slices.push_back({col, cols, ys.back().data});
    }
    col += cols;
  }
  BG_CHECK(col == all.cols(), "linear_group: parts of {} columns in all, fused weight {}", col, all.cols());
  if (!slices.empty()) {
    BG_PROFILE_OP("split_columns", stream_);
    ops::split_columns_cuda(n, all.as<bf16>(), all.cols(), slices, stream_);
  }
  return ys;
}

}  // namespace cuda_backend_detail

using cuda_backend_detail::CudaBackend;

std::unique_ptr<Backend> make_cuda_backend(const CudaBackendOptions& options) {
  return std::make_unique<CudaBackend>(options);
}

CudaStreamContext cuda_stream_context(Backend& be) {
  auto* cuda = dynamic_cast<CudaBackend*>(&be);
  BG_CHECK(cuda != nullptr, "{} is not the CUDA backend", be.name());
  return cuda->stream_context();
}

}  // namespace bg
