// The host side of a decode step, timed stage by stage: the step metadata upload (Backend::begin_step), the logits
// download into pageable memory (download_f32) and the CPU sampler over every row (engine::sample_next) -- the old
// CPU-sampling path, for comparison -- then the engine's path, Backend::sample_rows over the step's logits in backend
// memory, and a whole Engine::step of the real engine on greedy and on top_p requests.
#include <chrono>
#include <random>
#include <set>

#include "backend/backend.h"
#include "bench/model_bench.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "model/forward_common.h"

namespace bg::bench {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// A decode layout of `batch` sequences at `context` (64-token blocks, the width forward_batch would use).
StepLayout decode_layout(int64_t batch, int64_t context, int64_t max_positions) {
  StepLayout s;
  const int64_t blocks = (context + 1 + 63) / 64;
  s.max_blocks = step_table_width(blocks, 64, max_positions);
  for (int64_t i = 0; i < batch; ++i) {
    s.token_ids.push_back(static_cast<int32_t>(i));
    s.positions.push_back(context);
    s.token_seq.push_back(static_cast<int32_t>(i));
    s.seq_begin.push_back(i);
    s.state_slots.push_back(static_cast<int32_t>(i));
    s.last_rows.push_back(static_cast<int32_t>(i));
    for (int64_t b = 0; b < s.max_blocks; ++b) s.block_tables.push_back(static_cast<int32_t>(i * blocks + b % blocks));
  }
  s.seq_begin.push_back(batch);
  return s;
}

// Host-side stages on a backend of its own (the same code path as the model's backend).
void time_transfers(Backend& be, int64_t vocab, int64_t context, int64_t max_positions, HostBatch& h) {
  std::vector<double> upload;
  for (int i = 0; i < 20; ++i) {
    StepLayout s = decode_layout(h.batch, context, max_positions);  // built outside the timed region, like the model does
    const auto t0 = Clock::now();
    be.begin_step(std::move(s));
    be.synchronize();
    upload.push_back(ms_since(t0));
  }
  h.upload_ms = median(upload);
  Tensor logits = be.zeros({h.batch, vocab}, DType::kF32);
  std::vector<float> host(static_cast<size_t>(h.batch * vocab));
  std::vector<double> d2h;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    be.download_f32(logits, host.data());
    d2h.push_back(ms_since(t0));
  }
  h.logits_d2h_ms = median(d2h);
}

// Mean time per row of sample_next over `rows` random rows (logits ~ Normal(0, 3), the spread of a real model's),
// times the batch: what Engine::sample spends per step, serially.
double sampling_ms(const proto::SamplingParams& params, int64_t vocab, int64_t rows, int64_t batch) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(static_cast<size_t>(rows * vocab));
  for (float& v : logits) v = normal(rng);
  const auto t0 = Clock::now();
  for (int64_t r = 0; r < rows; ++r) {
    const engine::Sampled s = engine::sample_next(params, logits.data() + r * vocab, vocab, rng);
    BG_CHECK(s.token >= 0 && s.token < vocab, "bench sampling: token {} outside the vocabulary", s.token);
  }
  return ms_since(t0) / static_cast<double>(rows) * static_cast<double>(batch);
}

// Median host time of Backend::sample_rows over logits [batch, vocab] ~ Normal(0, 3) in backend memory, every row
// sampled with `params` (rows beyond `rows` are not timed on the CPU, where the figure scales to the batch).
double step_sampling_ms(Backend& be, const ops::SamplingParams& params, int64_t vocab, int64_t rows, int64_t batch) {
  std::mt19937_64 rng(13);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> host(static_cast<size_t>(rows * vocab));
  for (float& v : host) v = normal(rng);
  const Tensor logits = be.upload_f32(host, {rows, vocab}, DType::kF32);
  std::vector<ops::RowSampling> spec(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    spec[static_cast<size_t>(r)] = {params, ops::draw_uniform(rng), static_cast<int32_t>(r), -1};
  }
  std::vector<ops::RowSample> out(spec.size());
  std::vector<double> times;
  for (int i = 0; i < 7; ++i) {
    const auto t0 = Clock::now();
    be.sample_rows(logits, spec, out);
    times.push_back(ms_since(t0));
    for (const ops::RowSample& s : out) {
      BG_CHECK(s.token >= 0 && s.token < vocab, "bench step sampling: token {} outside the vocabulary", s.token);
    }
  }
  return median(times) / static_cast<double>(rows) * static_cast<double>(batch);
}

// Median Engine::step of `batch` requests with `params` in decode (after their 16-token prompts were prefilled).
double engine_step_ms(engine::Engine& engine, const proto::SamplingParams& params, int64_t batch, int64_t vocab,
                      int steps) {
  std::vector<std::string> ids;
  const std::vector<int32_t> prompt = [&] {
    std::vector<int32_t> p(16);
    for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<int32_t>((i * 7919 + 13) % static_cast<size_t>(vocab));
    return p;
  }();
  for (int64_t i = 0; i < batch; ++i) {
    proto::GenerateRequest req;
    req.id = "bench-" + std::to_string(batch) + "-" + std::to_string(i);
    req.prompt = prompt;
    req.params = params;
    req.params.seed = static_cast<uint64_t>(i);
    req.params.max_tokens = steps + 8;
    req.params.ignore_eos = true;
    engine.submit(std::move(req));
    ids.push_back("bench-" + std::to_string(batch) + "-" + std::to_string(i));
  }
  // Until every request has its first token (its prompt is in), then every step is a decode of all of them.
  std::set<std::string> started;
  for (int guard = 0; static_cast<int64_t>(started.size()) < batch; ++guard) {
    BG_CHECK(guard < 1000 && engine.step(), "bench engine: {} of {} requests never started", started.size(), batch);
    for (const proto::TokenEvent& ev : engine.take_events()) {
      BG_CHECK(ev.finish_reason != "error", "bench engine: request {} failed: {}", ev.id, ev.error);
      if (!ev.tokens.empty()) started.insert(ev.id);
    }
  }
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = Clock::now();
    BG_CHECK(engine.step(), "bench engine: nothing scheduled at decode step {}", i);
    times.push_back(ms_since(t0));
    for (const proto::TokenEvent& ev : engine.take_events()) {
      BG_CHECK(ev.finish_reason != "error", "bench engine: request {} failed: {}", ev.id, ev.error);
    }
  }
  for (const std::string& id : ids) engine.cancel(id);
  engine.take_events();
  return median(times);
}

}  // namespace

HostResult bench_host(std::unique_ptr<Model> model, const HostBenchSpec& spec) {
  HostResult r;
  r.model = spec.model_name;
  r.vocab = model->info().vocab_size;
  {
    std::unique_ptr<Backend> be = make_backend(spec.device);
    for (int64_t batch : spec.batches) {
      HostBatch h;
      h.batch = batch;
      h.context = spec.context;
      time_transfers(*be, r.vocab, spec.context, model->info().max_position_embeddings, h);
      h.sampled_rows = std::min(batch, spec.max_sample_rows);
      proto::SamplingParams greedy;
      greedy.temperature = 0.0f;
      h.sample_greedy_ms = sampling_ms(greedy, r.vocab, std::min(batch, 8 * spec.max_sample_rows), batch);
      proto::SamplingParams top_p;
      top_p.temperature = 1.0f;
      top_p.top_p = 0.95f;
      h.sample_top_p_ms = sampling_ms(top_p, r.vocab, h.sampled_rows, batch);
      // The engine's path: every row on a device backend; on the CPU the same rows as the CPU sampler above.
      const int64_t step_rows = be->device() == DeviceKind::kCpu ? h.sampled_rows : batch;
      h.step_sample_greedy_ms = step_sampling_ms(*be, {0.0f, 0, 1.0f}, r.vocab, step_rows, batch);
      h.step_sample_top_p_ms = step_sampling_ms(*be, {1.0f, 0, 0.95f}, r.vocab, step_rows, batch);
      r.batches.push_back(h);
    }
  }
  int64_t max_batch = 1;
  for (int64_t b : spec.batches) max_batch = std::max(max_batch, b);
  sched::SchedulerConfig config;
  config.max_num_seqs = max_batch;
  config.max_model_len = std::min<int64_t>(model->info().max_position_embeddings, 16 + spec.engine_steps + 64);
  config.chunked_prefill_size = std::max<int64_t>(config.chunked_prefill_size, 16 * max_batch);
  const kv::StatePlan state = kv::StatePlan::simple(max_batch, max_batch * config.max_model_len + 64);
  engine::Engine engine(std::move(model), state, config);
  proto::SamplingParams greedy, top_p;
  greedy.temperature = 0.0f;
  top_p.temperature = 1.0f;
  top_p.top_p = 0.95f;
  for (HostBatch& h : r.batches) {
    h.engine_step_ms = engine_step_ms(engine, greedy, h.batch, r.vocab, spec.engine_steps);
    h.engine_step_top_p_ms = engine_step_ms(engine, top_p, h.batch, r.vocab, spec.engine_steps);
    log::info("bench host {} B={}: upload {:.3f} ms, logits D2H {:.3f} ms, CPU sampler greedy {:.3f} / top_p {:.3f} "
              "ms, step sampling greedy {:.3f} / top_p {:.3f} ms, Engine::step greedy {:.3f} / top_p {:.3f} ms",
              spec.model_name, h.batch, h.upload_ms, h.logits_d2h_ms, h.sample_greedy_ms, h.sample_top_p_ms,
              h.step_sample_greedy_ms, h.step_sample_top_p_ms, *h.engine_step_ms, *h.engine_step_top_p_ms);
  }
  return r;
}

}  // namespace bg::bench
