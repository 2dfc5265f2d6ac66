// The model-level parts of `batchgen bench`, device-neutral: decode steps of the real Model::forward_batch on
// fabricated contexts, single-prompt prefill, and the host side of a step (metadata upload, logits download,
// sampling, a whole Engine::step).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_report.h"
#include "bench/device_bench.h"
#include "bench/roofline.h"
#include "kv/state_manager.h"
#include "model/model.h"

namespace bg::bench {

struct StepBenchSpec {
  std::string model_name;
  std::vector<int64_t> batches, contexts;
  int replays = 10;
  int64_t max_graph_batch = 0;  // decode batches up to this run as CUDA graphs (0: no graphs, e.g. the CPU)
};

// For each context and batch: `batch` sequences fabricated to `context` tokens, one decode token each; warm-up
// (captures the graph), one eager step under a route hook that counts the experts each MoE layer touches, `replays`
// timed steps (device time from the profiler, wall time around forward_batch), then one eager step with a per-op
// profiler for the breakdown.
// `state`: the model's state (make_state), with room for the largest batch at the longest context.
std::vector<StepResult> bench_steps(Model& model, kv::StateManager& state, const StepBenchSpec& spec, DeviceBench& device,
                                    const StepCostModel& cost, const Ceilings& ceilings);

// The prompt bench_prefill runs for a length: n pseudo-random ids in [0, vocab), seeded by n (the same on every
// device and run).
std::vector<int32_t> bench_prompt(int64_t n, int64_t vocab);

struct PrefillBenchSpec {
  std::string model_name;
  std::vector<int64_t> prompt_tokens;
  int64_t chunk_tokens = 0;  // tokens per forward_batch, as the scheduler's chunked prefill would cut the prompt
  int64_t decode_tokens = 0;  // greedy tokens generated after each prompt (0: none)
  // DeviceBench::path_counts of the device (null: none recorded).
  std::function<std::map<std::string, uint64_t>()> path_counts;
};

// One sequence per prompt length, its prompt run in chunks; tokens/s beside the FLOP roofline of the same chunks,
// the memory the prompt took, then `decode_tokens` greedy tokens (ids and margins recorded, so two devices' runs of
// the same prompt can be compared: the prompt is the same pseudo-random ids on every device, seeded by its length).
std::vector<PrefillResult> bench_prefill(Model& model, kv::StateManager& state, const PrefillBenchSpec& spec,
                                         const StepCostModel& cost, const Ceilings& ceilings);

struct HostBenchSpec {
  std::string model_name;
  std::string device;
  std::vector<int64_t> batches;
  int64_t context = 4096;     // block-table width of the uploaded decode layout
  int64_t max_sample_rows = 8;  // top_p rows timed per batch (29 ms each on a fast CPU today); greedy: 8x more
  int engine_steps = 10;        // decode steps timed per batch in the Engine
};

// The host side. Takes the model: after the upload / download / sampling figures, it becomes the Engine's for the
// Engine::step timing (greedy, then temperature 1 / top_p 0.95 requests with 16-token prompts, prefilled, then
// `engine_steps` decode steps timed).
HostResult bench_host(std::unique_ptr<Model> model, const HostBenchSpec& spec);

}  // namespace bg::bench
