// Reading back the backend's per-op hook (backend.h OpProfiler): a StepProfiler keeps one record per op (CPU: host
// wall times; CUDA: events recorded on the backend's stream, bench/cuda/cuda_profiler.cpp) and hands them out after
// the step; the helpers reduce them to a step's device time and a per-op breakdown.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "bench/bench_report.h"

namespace bg::bench {

struct OpRecord {
  std::string name;
  int depth = 0;        // 0: a top-level op; nested ops (an op inside another) have depth > 0
  double begin_ms = 0;  // relative to the first op since the last take()
  double end_ms = 0;
  bool in_graph = false;  // recorded as an event node of a captured graph (CUDA StepProfiler::in_graph)
};

class StepProfiler : public OpProfiler {
 public:
  // The records since the last call, in begin order (CUDA: waits for the recorded events). Throws bg::Error when a
  // hook failed since the last call.
  virtual std::vector<OpRecord> take() = 0;
};

// Host wall-clock times around each op (the CPU backend's ops are synchronous).
std::unique_ptr<StepProfiler> make_wall_profiler(bool per_op);

// The device time of a step: from the first top-level op that is not the metadata upload to the end of the last one
// that is not the logits download (a graph replay is one op, "graph"). 0 without such ops.
double step_span_ms(const std::vector<OpRecord>& records);

// Top-level ops grouped by name, largest total first; share = fraction of the sum over the groups.
std::vector<OpTime> aggregate_ops(const std::vector<OpRecord>& records);

// The "small ops" of issue 9: every op of the step that is neither a GEMM (dense linears, the routed experts) nor
// attention (MLA, KDA), nor outside the step body (metadata upload, logits download, sampling).
bool small_op(const std::string& name);

// The small ops of a step's per-op breakdown. Each op's time is the span between the events around it, and those
// events cost device time of their own (inside a graph, event nodes break the kernel chain): the spans of the step's
// ops add up to more than the same step without them (step_ms). That excess, spread evenly over the step's ops, is
// overhead_us per op; net_ms is the small ops' spans less their share of it.
struct SmallOps {
  double raw_ms = 0, net_ms = 0, overhead_us = 0;
  int64_t calls = 0;
};
SmallOps small_ops(const std::vector<OpTime>& ops, double step_ms);

}  // namespace bg::bench
