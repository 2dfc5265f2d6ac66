// What `batchgen bench` measured: the run's identity (commit, date, device, driver, clocks), the ceilings measured in
// the same run, and the kernel, step, prefill and host figures, each beside the ceiling it is a fraction of. One
// struct per JSON object (docs/PERF.md describes every field); to_json and the stdout table are the only readers.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace bg::bench {

struct DeviceInfo {
  std::string device;  // "cuda" | "cpu"
  std::string name;    // GPU name, or the CPU model
  std::optional<std::string> driver;  // NVIDIA driver version (NVML)
  std::optional<int64_t> sm_clock_mhz, mem_clock_mhz, sm_clock_max_mhz, mem_clock_max_mhz;  // NVML, at the start
  int64_t n_sms = 0;          // CUDA: SMs; CPU: threads of the pool
  int64_t l2_bytes = 0;       // CUDA
  int64_t memory_bytes = 0;   // CUDA: device memory; CPU: 0
};

// A bf16 grouped GEMM over the 56 K3 experts (gate|up [6144 x 3584], then down [3584 x 3072]) with `rows_per_expert`
// rows each: what bf16 weights could do at that row count.
struct GroupedGemmPoint {
  int64_t rows_per_expert = 0;
  double ms = 0;
  double tflops = 0;
  double gbps = 0;      // weight + activation bytes over the time
  std::string api;      // which cuBLAS call was faster: "grouped" (cublasGemmGroupedBatchedEx) or "strided_batched"
};

struct Ceilings {
  std::optional<double> read_gbps;         // CUDA: uint4 grid-stride read, best grid; CPU: multi-threaded sum
  std::optional<double> copy_gbps;         // bytes read + written; CUDA: an SM copy kernel; CPU: memcpy
  std::optional<double> gemm_bf16_tflops;  // CUDA: cuBLAS bf16 8192^3
  std::optional<double> gemm_fp8_tflops;   // CUDA: cuBLASLt E4M3 8192^3
  std::optional<double> gemm_f32_tflops;   // CPU: a blocked fp32 GEMM on all threads
  std::vector<GroupedGemmPoint> grouped_gemm_bf16;
  std::optional<double> h2d_gbps, d2h_gbps;  // pinned
  std::optional<double> graph_node_us;       // one empty kernel node in a replayed graph
  // The references every fraction below uses: memory = read_gbps; compute = gemm_bf16 (CUDA) or gemm_f32 (CPU).
  double memory_gbps() const { return read_gbps.value_or(0.0); }
  double compute_tflops() const { return gemm_bf16_tflops ? *gemm_bf16_tflops : gemm_f32_tflops.value_or(0.0); }
};

// What one kernel node of a case is (from the captured graph).
struct LaunchInfo {
  std::string kernel;  // function name as the driver reports it (mangled), or "?"
  int64_t grid = 0, block = 0, dynamic_smem = 0;
  std::optional<int64_t> registers, static_smem, max_threads, blocks_per_sm;
};

struct KernelResult {
  std::string name;   // "<op>_<phase>[_variant]"
  std::string shape;  // e.g. "B=16 ctx=4096"
  double ms = 0;      // per launch (median replay / copies)
  double bytes = 0, flops = 0;  // the case's model, per launch
  double gbps = 0, tflops = 0;
  double fraction = 0;  // floor / ms, floor = max(bytes / read, flops / compute reference)
  std::string bound;    // "memory" | "compute"
  std::string compute_ref;  // "gemm_bf16" | "grouped_gemm_bf16" | "gemm_f32"
  int64_t copies = 0, sets = 0;  // launches per graph, distinct input sets rotated through
  std::optional<std::string> error;  // the case could not run (an unsupported shape, say); its figures are 0
  // The launch with the most threads (grid x block) of the case; every launch is in `launches`.
  std::optional<int64_t> registers, smem, occupancy;  // occupancy: resident CTAs per SM
  std::vector<LaunchInfo> launches;
};

struct OpTime {
  std::string name;
  int64_t calls = 0;
  double ms = 0;
  double share = 0;  // of the sum of the step's op times
};

struct StepResult {
  std::string model;      // checkpoint directory name
  int64_t batch = 0, context = 0;
  bool graph = false;     // replayed as a CUDA graph
  double ms = 0;          // device time of one step (median of replays; CPU: wall time of the step body)
  double wall_ms = 0;     // forward_batch_sample wall time, host included (upload, step sampling, its download)
  double roofline_ms = 0;  // sum over ops of max(bytes / read, flops / compute)
  double roofline_bytes = 0, roofline_flops = 0;
  double ratio = 0;        // ms / roofline_ms
  double touched_experts = 0;  // routed experts with rows, per MoE layer (mean over layers)
  // Streamed experts (--resident-experts < 1): host -> device bytes one step copied (mean over the timed replays),
  // and those bytes at the pinned H2D ceiling (the step's floor on the copy engine; 0 when nothing streams).
  double streamed_bytes = 0;
  double copy_floor_ms = 0;
  // Of those, experts copied ahead while the layer before ran, and prefetched experts used (per step).
  double prefetched_experts = 0, prefetch_hits = 0;
  int64_t replays = 0;
  int64_t n_ops = 0;        // backend ops of one step (each one or more kernel launches)
  std::vector<OpTime> ops;  // one event-instrumented step: inside a graph of its own when the step is a graph
  bool ops_in_graph = false;  // ops were timed inside a captured graph (false: launched eagerly)
  // Of ops: the small ops (op_profiler.h small_ops) — their spans in all, the instrumentation's estimated cost per op,
  // and their time net of it per decoder layer (issue 9: <= 30 us)
  double small_ops_ms = 0, op_overhead_us = 0, small_ops_us_per_layer = 0;
};

struct PrefillResult {
  std::string model;
  int64_t prompt_tokens = 0, chunk_tokens = 0;
  double seconds = 0;
  double tokens_per_s = 0;
  double roofline_tokens_per_s = 0;  // prompt / sum over chunks of max(flops / compute, bytes / read)
  double flops = 0;
  double ratio = 0;  // roofline_tokens_per_s / tokens_per_s
  // Memory of the prompt (bytes): the device's use at the backend allocator's peak during the prefill, what the
  // allocator held at most (in use + cached) and had in use at most, the device's size (all 0 on a host backend),
  // and this process's peak resident set.
  double peak_device_bytes = 0, peak_pool_bytes = 0, peak_in_use_bytes = 0, device_total_bytes = 0,
         peak_rss_bytes = 0;
  // --decode-tokens: the greedy continuation after the prompt (the first id is the prompt's own argmax), each
  // step's top-1 minus top-2 logit (a small margin means another device's rounding may pick another id), and the
  // wall time of one decode step at the prompt's length.
  // Calls by path while the prompt ran (DeviceBench::path_counts differences, the paths that ran at least once): which
  // MoE prefill kernel the figure measured.
  std::map<std::string, uint64_t> paths;
  // Wall ms of each chunk's forward_batch (it returns the logits to the host, so each is a finished step): where a
  // prompt's time goes, e.g. a one-off stall in one chunk against a uniformly slower path.
  std::vector<double> chunk_ms;
  std::vector<int32_t> decoded_ids;
  std::vector<float> decode_margins;
  double decode_ms_per_token = 0;
};

struct HostBatch {
  int64_t batch = 0;
  int64_t context = 0;
  double upload_ms = 0;          // begin_step of the decode layout (pack + H2D), synchronised
  double logits_d2h_ms = 0;      // download_f32 of [batch, vocab] fp32 into pageable memory (not on the CUDA path)
  double sample_greedy_ms = 0;   // the CPU sampler (engine::sample_next) over every row of a step, serially
  double sample_top_p_ms = 0;    // the same at temperature 1, top_p 0.95 (K3's recommended setting)
  int64_t sampled_rows = 0;      // rows timed; per-step figures scale to `batch` when fewer
  // Backend::sample_rows over the step's [batch, vocab] logits in backend memory, host-timed (CUDA: rows up, the
  // kernel, one download of the results into pinned memory, the synchronisation): what Engine::step spends sampling.
  double step_sample_greedy_ms = 0;
  double step_sample_top_p_ms = 0;
  std::optional<double> engine_step_ms;        // a whole Engine::step (decode, greedy)
  std::optional<double> engine_step_top_p_ms;  // a whole Engine::step (decode, temperature 1, top_p 0.95)
};

struct HostResult {
  std::string model;
  int64_t vocab = 0;
  std::vector<HostBatch> batches;
};

// One point of `bench exchange`: `ranks` ranks (threads of this process, each with its own backend and stream, all
// on this GPU: a regression guard, not a multi-GPU figure), each sending `tokens_per_rank` tokens, top_k pairs each.
struct ExchangeResult {
  std::string exchange;  // "ll"
  int64_t ranks = 0, tokens_per_rank = 0, top_k = 0, hidden = 0, experts = 0;
  double dispatch_us = 0, combine_us = 0;          // median over the timed calls, rank 0's stream
  double dispatch_gb_s = 0, combine_gb_s = 0;      // rank 0's payload bytes (rows + headers) / time
  bool shared_gpu = true;
};

struct BenchReport {
  std::string commit, date, command;
  // The BG_* environment variables set when it ran (kernel choices such as BG_MOE_PREFILL or BG_MLA_DECODE change what
  // a figure measures; docs/GPU.md lists them), by name.
  std::map<std::string, std::string> env;
  bool quick = false;
  DeviceInfo device;
  Ceilings ceilings;
  std::vector<KernelResult> kernels;
  std::vector<StepResult> steps;
  std::vector<PrefillResult> prefill;
  std::optional<HostResult> host;  // of the first model
  std::vector<ExchangeResult> exchange;
  // Parts that failed ("steps kimi_k3-tiny: <message>"): the rest of the run still went on and is reported.
  std::vector<std::string> errors;
};

nlohmann::json to_json(const BenchReport& r);
// The short table printed on stdout.
std::string format_table(const BenchReport& r);

}  // namespace bg::bench
