// run_bench: resolves the sizes of each part, measures the ceilings, then runs the requested parts in order (kernels
// first, while the device holds nothing else; then per model: steps, prefill, and the host side for the first).
#include "bench/bench.h"
#include "bench/exchange_bench.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <map>
#include <string_view>

#include "bench/device_bench.h"
#include "bench/model_bench.h"
#include "bench/roofline.h"
#include "bg_build_info.h"
#include "core/error.h"
#include "core/log.h"
#include "model/random_checkpoint.h"
#include "engine/worker.h"

namespace bg::bench {
namespace {

namespace fs = std::filesystem;

// A directory under the system temp dir, removed with everything in it when this goes away.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "batchgen-bench-XXXXXX").string();
    BG_CHECK(::mkdtemp(pattern.data()) != nullptr, "bench: cannot create a temporary directory from {}", pattern);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// The sizes of one run: the flags where given, else the device's defaults (docs/PERF.md).
struct Plan {
  bool kernels = false, steps = false, prefill = false, host = false;
  std::vector<int64_t> batches, contexts, prefill_tokens;
  int64_t chunk = 0;
  int64_t decode_tokens = 0;
  int replays = 0;
};

Plan make_plan(const BenchOptions& o) {
  BG_CHECK(o.what == "kernels" || o.what == "step" || o.what == "prefill" || o.what == "all" ||
               o.what == "exchange",
           "bench: unknown part '{}' (kernels, step, prefill, all, exchange)", o.what);
  BG_CHECK(o.what != "exchange" || o.device == "cuda", "bench exchange: the ll exchange runs on CUDA (--device cuda); "
           "the CPU rank sets' shared-memory exchange is tested, not benchmarked");
  BG_CHECK(o.device == "cuda" || o.device == "cpu", "bench: --device must be cuda or cpu, got '{}'", o.device);
  Plan p;
  p.kernels = o.what == "kernels" || o.what == "all";
  p.steps = o.what == "step" || o.what == "all";
  p.prefill = o.what == "prefill" || o.what == "all";
  p.host = p.steps;
  const bool cpu = o.device == "cpu";
  auto pick = [](const std::vector<int64_t>& given, std::vector<int64_t> fallback) {
    return given.empty() ? fallback : given;
  };
  if (cpu) {  // the tiny presets: DeepSeek-V3 tiny has 512 positions
    p.batches = pick(o.batches, {1, 4});
    p.contexts = pick(o.contexts, {64, 200});
    p.prefill_tokens = pick(o.prefill_tokens, {96, 160});
  } else if (o.quick) {
    p.batches = pick(o.batches, {1, 16, 64});
    p.contexts = pick(o.contexts, {4096});
    p.prefill_tokens = pick(o.prefill_tokens, {4096});
  } else {
    p.batches = pick(o.batches, {1, 16, 64, 256});
    p.contexts = pick(o.contexts, {4096, 32768});
    p.prefill_tokens = pick(o.prefill_tokens, {4096, 8192, 16384, 65536});
  }
  // The step size `serve` prefills a lone prompt with by default (a step without decodes: --idle-prefill-size), so
  // the figures are what a server does.
  const int64_t serve_chunk = engine::WorkerOptions{}.chunked_prefill_size;
  p.chunk = o.prefill_chunk > 0 ? o.prefill_chunk : (cpu ? 64 : engine::idle_prefill_default("cuda", serve_chunk));
  p.replays = o.replays > 0 ? o.replays : (o.quick || cpu ? 3 : 10);
  for (int64_t b : p.batches) BG_CHECK(b >= 1 && b <= 4096, "bench: --batches value {} must be in [1, 4096]", b);
  for (int64_t c : p.contexts) BG_CHECK(c >= 1, "bench: --contexts value {} must be >= 1", c);
  for (int64_t t : p.prefill_tokens) BG_CHECK(t >= 1, "bench: --prefill-tokens value {} must be >= 1", t);
  BG_CHECK(o.prefill_chunk >= 0, "bench: --prefill-chunk {} must be >= 1", o.prefill_chunk);
  BG_CHECK(o.decode_tokens >= 0 && o.decode_tokens <= 4096, "bench: --decode-tokens {} must be in [0, 4096]",
           o.decode_tokens);
  p.decode_tokens = o.decode_tokens;
  BG_CHECK((o.weight_store.empty() && o.distributed_weight_config.empty()) || o.models.size() == 1,
           "bench: --weight-store and --distributed-weight-config name the weights of one --model (got {})",
           o.models.size());
  return p;
}

int64_t max_of(const std::vector<int64_t>& v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }

// Load options: graphs up to the largest batch.
LoadOptions load_options(const BenchOptions& o, const Plan& p) {
  LoadOptions lo;
  lo.device = o.device;
  lo.weight_store = o.weight_store;
  lo.distributed_weight_config = o.distributed_weight_config;
  lo.resident_experts = o.resident_experts;
  lo.expert_trace = o.expert_trace;
  lo.deterministic = o.deterministic;
  lo.cuda_graphs = true;
  lo.max_graph_batch = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(std::max<int64_t>(max_of(p.batches), 1))));
  return lo;
}

// State (KV blocks, KDA slots) sized for the largest step (every sequence fabricated to the longest context, plus the
// decode tokens the bench adds) and the longest prompt.
struct StateSize {
  int64_t max_sequences = 1;
  int64_t max_tokens = 64;
};

StateSize state_size(const Plan& p) {
  const int64_t max_batch = std::max<int64_t>(max_of(p.batches), 1);
  const int64_t step_tokens = p.steps ? max_batch * (max_of(p.contexts) + 192) : 0;
  const int64_t prefill_tokens = p.prefill ? max_of(p.prefill_tokens) + p.decode_tokens + 128 : 0;
  return {max_batch, std::max({step_tokens, prefill_tokens, int64_t{64}})};
}

void check_fits(const Model& model, const Plan& p, const std::string& name) {
  const int64_t limit = model.info().max_position_embeddings;
  if (p.steps) {
    BG_CHECK(max_of(p.contexts) + 64 <= limit, "bench: context {} (+64 decode tokens) exceeds {}'s "
             "max_position_embeddings {}; choose --contexts", max_of(p.contexts), name, limit);
  }
  if (p.prefill) {
    BG_CHECK(max_of(p.prefill_tokens) + p.decode_tokens <= limit, "bench: prompt of {} tokens (+{} decode tokens) "
             "exceeds {}'s max_position_embeddings {}; choose --prefill-tokens", max_of(p.prefill_tokens),
             p.decode_tokens, name, limit);
  }
}

// Runs one part; a failure is recorded in the report (and logged) so that the parts measured before and after it are
// not lost — a GPU run is expensive. A broken CUDA context makes the later parts fail too, each with its message.
void attempt(BenchReport& r, const std::string& part, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    log::error("bench {} failed: {}", part, e.what());
    r.errors.push_back(part + ": " + e.what());
  }
}

void bench_model(const fs::path& dir, bool first, const BenchOptions& o, const Plan& p, DeviceBench& device,
                 BenchReport& r) {
  const std::string name = dir.filename().string();
  const LoadOptions lo = load_options(o, p);
  const StateSize size = state_size(p);
  log::info("bench: loading {} ({} sequences, {} KV tokens)", dir.string(), size.max_sequences, size.max_tokens);
  std::unique_ptr<Model> model = load_model(dir, lo);
  check_fits(*model, p, name);
  {
    std::unique_ptr<kv::StateManager> state = make_state(*model, size.max_sequences, size.max_tokens);
    // One eager multi-token step first: the CUDA backend prepares per-layer MoE data on first use, which a graph
    // capture (the first decode step) must not be the one to do.
    {
      const std::vector<int32_t> tokens = {1, 2};
      std::unique_ptr<Sequence> seq = state->new_sequence(static_cast<int64_t>(tokens.size()));
      const BatchEntry entry{seq.get(), tokens};
      std::vector<float> logits(static_cast<size_t>(model->info().vocab_size));
      model->forward_batch(std::span<const BatchEntry>(&entry, 1), logits.data());
    }
    const StepCostModel cost = StepCostModel::load(dir, device.act_bytes());
    if (p.steps) {
      attempt(r, "steps " + name, [&] {
        const int64_t graphs = o.device == "cuda" ? lo.max_graph_batch : 0;
        auto steps =
            bench_steps(*model, *state, {name, p.batches, p.contexts, p.replays, graphs}, device, cost, r.ceilings);
        r.steps.insert(r.steps.end(), steps.begin(), steps.end());
      });
    }
    if (p.prefill) {
      attempt(r, "prefill " + name, [&] {
        const auto counts = [&device] { return device.path_counts(); };
        auto prefill = bench_prefill(*model, *state, {name, p.prefill_tokens, p.chunk, p.decode_tokens, counts}, cost,
                                     r.ceilings);
        r.prefill.insert(r.prefill.end(), prefill.begin(), prefill.end());
      });
    }
  }  // the state goes before the model moves to the engine
  if (p.host && first) {
    attempt(r, "host " + name, [&] {
      HostBenchSpec spec;
      spec.model_name = name;
      spec.device = o.device;
      spec.batches = p.batches;
      spec.context = max_of(p.contexts);
      spec.engine_steps = o.quick || o.device == "cpu" ? 3 : 10;
      r.host = bench_host(std::move(model), spec);
    });
  }
}

}  // namespace

bool kernel_case_matches(std::string_view name, std::string_view filter) {
  if (filter.empty()) return true;
  for (size_t at = 0; at <= filter.size();) {
    const size_t comma = std::min(filter.find(',', at), filter.size());
    std::string_view entry = filter.substr(at, comma - at);
    at = comma + 1;
    if (entry.empty()) continue;
    if (entry.back() == '$') {
      if (name == entry.substr(0, entry.size() - 1)) return true;
    } else if (name.find(entry) != std::string_view::npos) {
      return true;
    }
  }
  return false;
}

namespace {

// The BG_* variables of this process's environment, by name.
std::map<std::string, std::string> bg_environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view kv(*e);
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos || !kv.starts_with("BG_")) continue;
    env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return env;
}

}  // namespace

BenchReport run_bench(const BenchOptions& o) {
  // The exchange bench runs its ranks as threads of this process: their streams share the context's hardware queues
  // (8 by default), where a rank's flag wait could hold back a peer's kernels queued behind it. 32 queues (the most)
  // give each rank's stream its own; read once, when CUDA starts (below). A value the user set is kept.
  if (o.what == "exchange") setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  const Plan p = make_plan(o);
  std::unique_ptr<DeviceBench> device = make_device_bench(o.device);
  BenchReport r;
  r.commit = BG_GIT_DESCRIBE;
  r.date = utc_now();
  r.command = o.command;
  r.env = bg_environment();
  r.quick = o.quick;
  r.device = device->info();
  log::info("bench: {} ({}), commit {}", r.device.name, r.device.device, r.commit);
  const auto t0 = std::chrono::steady_clock::now();
  if (o.what == "exchange") {
#ifdef BG_HAVE_CUDA
    ExchangeBenchOptions eo;
    if (!o.exchange_ranks.empty()) eo.ranks = o.exchange_ranks;
    if (!o.exchange_tokens.empty()) eo.tokens = o.exchange_tokens;
    if (o.quick) eo.calls = 5;
    attempt(r, "exchange", [&] { r.exchange = run_exchange_bench(eo); });
#endif
    return r;
  }
  r.ceilings = device->ceilings(o.quick);
  if (p.kernels) attempt(r, "kernels", [&] { r.kernels = device->kernels(r.ceilings, o.quick, o.kernel_filter); });
  if (p.steps || p.prefill) {
    std::vector<fs::path> models = o.models;
    std::unique_ptr<TempDir> tmp;
    if (models.empty()) {
      BG_CHECK(o.device == "cpu", "bench step / prefill on {} needs --model DIR (e.g. the K3 slice: batchgen "
               "make-random --arch kimi_k3 --preset ep16-rank --out DIR)", o.device);
      tmp = std::make_unique<TempDir>();
      for (const char* arch : {"kimi_k3", "deepseek_v3"}) {
        RandomCheckpointSpec spec;
        spec.arch = arch;
        spec.preset = "tiny";
        spec.seed = 1;
        spec.out_dir = tmp->path() / (std::string(arch) + "-tiny");
        write_random_checkpoint(spec);
        models.push_back(spec.out_dir);
      }
    }
    for (size_t i = 0; i < models.size(); ++i) {
      attempt(r, "model " + models[i].string(), [&] { bench_model(models[i], i == 0, o, p, *device, r); });
    }
  }
  log::info("bench: done in {:.1f} s",
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return r;
}

}  // namespace bg::bench
