// The CUDA StepProfiler: a pair of events recorded on the backend's stream around each op, read back after the step.
// Events come from a pool reused across steps. With per_op it also records inside graph captures (in_graph): the
// backend captures the profiled step as a graph of its own, each record becomes an event node, and the ops are timed
// as a graph replay runs them, without the host's launch gaps of an eager step (which can exceed a small kernel's
// own time).
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "bench/cuda/cuda_bench_parts.h"

namespace bg::bench::cuda {
namespace {

class CudaEventProfiler final : public StepProfiler {
 public:
  explicit CudaEventProfiler(bool per_op) : per_op_(per_op) {}
  ~CudaEventProfiler() override {
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
  }

  void op_begin(const char* name, void* stream) noexcept override {
    if (stream == nullptr) return fail("an op without a stream");
    cudaEvent_t e = next_event();
    if (e == nullptr) return;
    bool captured = false;
    if (!record(e, stream, &captured)) return;
    try {
      open_.push_back(records_.size());
      records_.push_back({name, static_cast<int>(open_.size()) - 1, e, nullptr, captured});
    } catch (...) {
      fail("out of memory");
    }
  }
  void op_end(const char* name, void* stream) noexcept override {
    if (open_.empty() || records_[open_.back()].name != name) return fail("unbalanced op records");
    cudaEvent_t e = next_event();
    if (e == nullptr) return;
    bool captured = false;
    if (!record(e, stream, &captured)) return;
    records_[open_.back()].end = e;
    open_.pop_back();
  }
  bool per_op() const override { return per_op_; }
  bool in_graph() const override { return per_op_; }

  std::vector<OpRecord> take() override {
    std::vector<Raw> raw;
    raw.swap(records_);
    used_ = 0;  // every event is free again once this returns
    BG_CHECK(error_.empty() && open_.empty(), "cuda op profiler: {}", error_.empty() ? "an op never ended" : error_);
    std::vector<OpRecord> out;
    if (raw.empty()) return out;
    BG_CUDA_CHECK(cudaEventSynchronize(raw.back().end));
    for (const Raw& r : raw) {
      float begin_ms = 0, end_ms = 0;
      BG_CUDA_CHECK(cudaEventElapsedTime(&begin_ms, raw.front().begin, r.begin));
      BG_CUDA_CHECK(cudaEventElapsedTime(&end_ms, raw.front().begin, r.end));
      out.push_back({r.name, r.depth, begin_ms, end_ms, r.in_graph});
    }
    return out;
  }

 private:
  struct Raw {
    std::string name;
    int depth = 0;
    cudaEvent_t begin = nullptr, end = nullptr;
    bool in_graph = false;
  };
  // Records e on the stream; while the stream is being captured, as an event node of the graph (external record).
  bool record(cudaEvent_t e, void* stream, bool* captured) noexcept {
    const auto s = static_cast<cudaStream_t>(stream);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &status) != cudaSuccess) {
      fail("cudaStreamIsCapturing");
      return false;
    }
    *captured = status == cudaStreamCaptureStatusActive;
    const unsigned flags = *captured ? cudaEventRecordExternal : cudaEventRecordDefault;
    if (cudaEventRecordWithFlags(e, s, flags) != cudaSuccess) {
      fail("cudaEventRecord");
      return false;
    }
    return true;
  }
  cudaEvent_t next_event() noexcept {
    if (used_ == pool_.size()) {
      cudaEvent_t e = nullptr;
      if (cudaEventCreate(&e) != cudaSuccess) {
        fail("cudaEventCreate");
        return nullptr;
      }
      try {
        pool_.push_back(e);
      } catch (...) {
        cudaEventDestroy(e);
        fail("out of memory");
        return nullptr;
      }
    }
    return pool_[used_++];
  }
  void fail(const char* what) noexcept {
    cudaGetLastError();  // clear a non-sticky error so the step itself is not blamed for it
    if (error_.empty()) error_ = what;
  }

  bool per_op_;
  std::vector<cudaEvent_t> pool_;
  size_t used_ = 0;
  std::vector<Raw> records_;
  std::vector<size_t> open_;
  std::string error_;
};

}  // namespace

std::unique_ptr<StepProfiler> make_event_profiler(bool per_op) { return std::make_unique<CudaEventProfiler>(per_op); }

}  // namespace bg::bench::cuda
