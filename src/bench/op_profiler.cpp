// The wall-clock StepProfiler and the reductions over op records.
#include "bench/op_profiler.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>

#include "core/error.h"

namespace bg::bench {
namespace {

using Clock = std::chrono::steady_clock;

class WallProfiler final : public StepProfiler {
 public:
  explicit WallProfiler(bool per_op) : per_op_(per_op) {}
  void op_begin(const char* name, void*) noexcept override {
    try {
      if (records_.empty() && open_.empty()) origin_ = Clock::now();
      open_.push_back({records_.size(), Clock::now()});
      records_.push_back({name, static_cast<int>(open_.size()) - 1, ms(open_.back().start), 0.0, false});
    } catch (...) {
      failed_ = true;  // out of memory: reported by take()
    }
  }
  void op_end(const char* name, void*) noexcept override {
    if (open_.empty() || records_[open_.back().index].name != name) {
      failed_ = true;
      return;
    }
    records_[open_.back().index].end_ms = ms(Clock::now());
    open_.pop_back();
  }
  bool per_op() const override { return per_op_; }
  std::vector<OpRecord> take() override {
    BG_CHECK(!failed_ && open_.empty(), "op profiler: unbalanced or failed op records");
    std::vector<OpRecord> out;
    out.swap(records_);
    return out;
  }

 private:
  struct Open {
    size_t index;
    Clock::time_point start;
  };
  double ms(Clock::time_point t) const { return std::chrono::duration<double, std::milli>(t - origin_).count(); }

  bool per_op_;
  bool failed_ = false;
  Clock::time_point origin_;
  std::vector<OpRecord> records_;
  std::vector<Open> open_;
};

// Ops outside the model step's device span: the metadata upload, the logits download, and the step sampling (timed
// on its own: the sampling kernel cases and the host figures).
bool host_side(const std::string& name) {
  return name == "upload_step" || name == "download_f32" || name == "sample_rows";
}

}  // namespace

std::unique_ptr<StepProfiler> make_wall_profiler(bool per_op) { return std::make_unique<WallProfiler>(per_op); }

double step_span_ms(const std::vector<OpRecord>& records) {
  double begin = 0, end = 0;
  bool any = false;
  for (const OpRecord& r : records) {
    if (r.depth != 0 || host_side(r.name)) continue;
    begin = any ? std::min(begin, r.begin_ms) : r.begin_ms;
    end = any ? std::max(end, r.end_ms) : r.end_ms;
    any = true;
  }
  return any ? end - begin : 0.0;
}

bool small_op(const std::string& name) {
  static const char* const kNotSmall[] = {"linear",       "moe_routed_local", "moe_experts", "mla_attention", "kda",
                                          "upload_step",  "download_f32",     "sample_rows", "graph"};
  for (const char* n : kNotSmall) {
    if (name == n) return false;
  }
  return true;
}

SmallOps small_ops(const std::vector<OpTime>& ops, double step_ms) {
  SmallOps s;
  double step_spans = 0;
  int64_t step_calls = 0;
  for (const OpTime& o : ops) {
    if (host_side(o.name)) continue;
    step_spans += o.ms;
    step_calls += o.calls;
    if (!small_op(o.name)) continue;
    s.raw_ms += o.ms;
    s.calls += o.calls;
  }
  if (step_calls > 0 && step_ms > 0) {
    s.overhead_us = 1000.0 * std::max(0.0, step_spans - step_ms) / static_cast<double>(step_calls);
  }
  s.net_ms = std::max(0.0, s.raw_ms - static_cast<double>(s.calls) * s.overhead_us / 1000.0);
  return s;
}

std::vector<OpTime> aggregate_ops(const std::vector<OpRecord>& records) {
  std::map<std::string, OpTime> by_name;
  double total = 0;
  for (const OpRecord& r : records) {
    if (r.depth != 0) continue;
    OpTime& t = by_name[r.name];
    t.name = r.name;
    ++t.calls;
    t.ms += r.end_ms - r.begin_ms;
    total += r.end_ms - r.begin_ms;
  }
  std::vector<OpTime> out;
  for (auto& [name, t] : by_name) {
    t.share = total > 0 ? t.ms / total : 0.0;
    out.push_back(t);
  }
  std::sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.ms > b.ms; });
  return out;
}

}  // namespace bg::bench
