// MLA prefill attention through cuDNN's fused attention (cuDNN 9 graph API, no frontend library): causal attention
// aligned at the bottom right, or full attention, q/k head dim 192 and v 128, bf16 in and out, fp32 softmax, over a
// ragged batch of query / key runs (the causal or the full pieces of a pass, mla_prefill_plan.h), with each row's
// log-sum-exp for the merge across passes. mla_prefill_cuda uses it in place of its own attention kernel;
// docs/MLA_PREFILL.md ("cuDNN's fused attention") has the measurements that made it the default.
//
// Shapes vary every step, so execution plans are built for buckets (the batch as the caller rounds it,
// mla_prefill_cudnn_batch; the longest query and key runs rounded up to a power of two, at least 64) and the real
// lengths and ragged offsets are device arrays read at run time. A build takes 0.05-1.5 s of host time (measured on
// the H200; 0.5 s for a batch of 64 in a serving process). By default the first step of a bucket waits for its
// build; with background builds (a serving process) a helper thread builds it and the steps before it is ready run
// batchgen's own kernel (takes() returns false), so no step waits. Not graph-capturable by contract (the backend
// runs prefill eagerly); one stream at a time. Plans are kept up to a bound (each one built on the helper thread holds
// a cuDNN handle of its own, ~8 MiB of device memory): past it the least recently used is dropped when a new bucket
// comes, and rebuilt if that bucket comes back.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace bg::ops {

// One launch over B sequences of a pass. Element offsets (int32, B + 1 each, device) are relative to the pointers.
struct MlaCudnnLaunch {
  int64_t batch = 0;   // B
  int64_t heads = 0;
  int64_t max_q = 0;   // longest query run (tokens of one sequence)
  int64_t max_kv = 0;  // longest key run
  float scale = 0.0f;  // softmax scale
  bool causal = true;  // bottom-right causal (row i sees keys 0 .. len_kv - len_q + i), else every key
  const __nv_bfloat16* q = nullptr;  // [.., heads, 192] rows at q_off
  const __nv_bfloat16* k = nullptr;  // [.., heads, 192] rows at k_off
  const __nv_bfloat16* v = nullptr;  // [.., heads, 128] rows at v_off
  __nv_bfloat16* out = nullptr;      // [.., heads, 128] rows at o_off
  const int32_t* seq_len_q = nullptr;   // [B]
  const int32_t* seq_len_kv = nullptr;  // [B], each >= its seq_len_q (bottom-right causal)
  const int32_t* q_off = nullptr;
  const int32_t* k_off = nullptr;
  const int32_t* v_off = nullptr;
  const int32_t* o_off = nullptr;
  // Every one of the `batch` sequences has exactly max_q queries and max_kv keys (no empty padding entries). A batch
  // of one with both lengths at their buckets runs an exact plan (no padding mask, not ragged;
  // MlaCudnnPrefill::exact_launches).
  bool uniform = false;
  // The first sequence's first key row (k_off[0] / (heads · 192), which must equal v_off[0] / (heads · 128)): an exact
  // plan reads K and V from there.
  int64_t kv_row0 = 0;
};

class MlaCudnnPrefill {
 public:
  MlaCudnnPrefill();
  ~MlaCudnnPrefill();
  MlaCudnnPrefill(const MlaCudnnPrefill&) = delete;
  MlaCudnnPrefill& operator=(const MlaCudnnPrefill&) = delete;

  // Whether this build links cuDNN.
  static bool built();
  // Off (the default): takes() builds a missing plan on the calling thread. On: takes() queues it for a helper
  // thread (with a cuDNN handle of its own per plan, as cuDNN's thread-safety rules ask) and returns false until it is
  // built. Set before the first takes().
  void set_background_builds(bool on);
  // Whether run() would launch for this shape now: looks up the plan of its bucket, building it first (off) or
  // queueing it (background builds). Host only.
  bool takes(const MlaCudnnLaunch& launch);
  // Blocks until no background build is queued or running.
  void wait_for_builds();
  // While the returned lock is held the helper thread starts no build (and any build under way has finished): a
  // caller that captures a CUDA graph holds it, since a build may touch the legacy stream, which would invalidate
  // the capture of a blocking stream.
  std::unique_lock<std::mutex> hold_builds();
  // Launches the attention on `stream` and returns true, or returns false with nothing launched when cuDNN has no
  // engine for this bucket (remembered: later calls of the bucket return false at once; the reason is logged once).
  // Throws bg::Error on a cuDNN failure after a plan was built (never silently wrong).
  bool run(const MlaCudnnLaunch& launch, cudaStream_t stream);

  // The last launch's log-sum-exp per row (natural log of the scaled scores): fp32 [B, heads, stats_rows()], on the
  // device; valid until the next launch on the stream.
  const float* stats() const;
  int64_t stats_rows() const { return stats_rows_; }

  int64_t launches() const { return launches_; }
  int64_t exact_launches() const { return exact_launches_; }  // of those, on an exact plan
  // The most plans kept (kDefaultMaxPlans, or BG_MLA_CUDNN_MAX_PLANS when set: an integer >= kMinPlans, else an
  // error naming the variable). A smaller bound drops the least recently used plans now. At least kMinPlans, so that
  // the distinct buckets of one step (a few: one per pass and kind) never evict each other.
  static constexpr int64_t kDefaultMaxPlans = 32;
  static constexpr int64_t kMinPlans = 4;
  void set_max_plans(int64_t n);
  int64_t max_plans() const;
  int64_t plans_held() const;    // plans kept now (built, not refused)
  int64_t plans_dropped() const;  // dropped for the bound, in all
  int64_t plans_built() const;
  double plan_build_ms() const;  // host time spent building plans, in all (either thread)
  std::string last_refusal() const;

 private:
  // The bucket's plan (an Impl-private type); null when refused or, with background builds, not built yet.
  void* plan_for(const MlaCudnnLaunch& launch);

  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t launches_ = 0;
  int64_t exact_launches_ = 0;
  int64_t stats_rows_ = 0;
};

// The bucket a length runs in: the next power of two, at least 64.
int64_t mla_cudnn_bucket(int64_t n);

// The plan bound from BG_MLA_CUDNN_MAX_PLANS's value: kDefaultMaxPlans when unset or empty, else an integer >=
// kMinPlans (anything else throws bg::Error naming the variable).
int64_t mla_cudnn_max_plans(const char* env_value);
// Whether exact plans are used (BG_MLA_CUDNN_EXACT: 1 or unset, the default; 0 for comparisons; anything else throws).
bool mla_cudnn_exact_plans(const char* env_value);

}  // namespace bg::ops
