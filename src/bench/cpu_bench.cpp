// The CPU half of `batchgen bench`: host "ceilings" (a multi-threaded read and memcpy, a blocked fp32 GEMM), a few
// reference-op kernel cases timed by wall clock, and the wall-clock op profiler. The CPU backend is the fp32
// reference, so these figures exist to keep the harness honest in CI, not to tune anything.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>

#include "bench/bench.h"
#include "bench/device_bench.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "ops/linear/linear.h"
#include "ops/rmsnorm/rmsnorm.h"

namespace bg::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_of(const std::function<void()>& fn) {
  const auto t0 = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Best of `reps` runs, in seconds.
double best_of(int reps, const std::function<void()>& fn) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) best = std::min(best, seconds_of(fn));
  return best;
}

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "cpu";
}

// Sum of a buffer on every thread: the read rate.
double read_gbps(size_t bytes, int reps) {
  std::vector<uint64_t> buf(bytes / 8, 1);
  std::atomic<uint64_t> total{0};  // the sum is checked, so the loop cannot be optimised away
  const double s = best_of(reps, [&] {
    parallel_for(static_cast<int64_t>(buf.size()), 1 << 16, [&](int64_t b, int64_t e) {
      uint64_t acc = 0;
      for (int64_t i = b; i < e; ++i) acc += buf[static_cast<size_t>(i)];
      total.fetch_add(acc, std::memory_order_relaxed);
    });
  });
  BG_CHECK(total.load() % buf.size() == 0, "cpu read ceiling: wrong sum {}", total.load());
  return static_cast<double>(bytes) / s / 1e9;
}

// memcpy in parallel chunks: bytes read + written per second.
double copy_gbps(size_t bytes, int reps) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  const double s = best_of(reps, [&] {
    parallel_for(static_cast<int64_t>(bytes), 1 << 20, [&](int64_t b, int64_t e) {
      std::memcpy(dst.data() + b, src.data() + b, static_cast<size_t>(e - b));
    });
  });
  return 2.0 * static_cast<double>(bytes) / s / 1e9;
}

// C[n, n] = A[n, n] B[n, n] in fp32, rows in parallel, k-blocked so B rows stream from cache: the rate a plain
// compiled GEMM reaches (the reference ops are of this kind).
double gemm_f32_tflops(int64_t n, int reps) {
  std::vector<float> a(static_cast<size_t>(n * n), 0.5f), b(a.size(), 0.25f), c(a.size());
  const double s = best_of(reps, [&] {
    parallel_for(n, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* cr = c.data() + r * n;
        std::fill(cr, cr + n, 0.0f);
        for (int64_t k = 0; k < n; ++k) {
          const float av = a[static_cast<size_t>(r * n + k)];
          const float* br = b.data() + k * n;
          for (int64_t j = 0; j < n; ++j) cr[j] += av * br[j];
        }
      }
    });
  });
  BG_CHECK(c[0] == 0.125f * static_cast<float>(n), "cpu gemm ceiling: wrong result {}", c[0]);
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / s / 1e12;
}

// One CPU kernel case: run() once per timing; bytes / flops per run.
struct CpuCase {
  std::string name, shape;
  double bytes = 0, flops = 0;
  std::function<void()> run;
};

std::vector<CpuCase> cpu_cases(bool quick) {
  std::vector<CpuCase> cases;
  const int64_t n_out = quick ? 1024 : 4096, n_in = quick ? 1024 : 7168;
  auto weight = std::make_shared<HostTensor>(DType::kF32, Shape{n_out, n_in});
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  auto* w = reinterpret_cast<float*>(weight->data());
  for (int64_t i = 0; i < n_out * n_in; ++i) w[i] = normal(rng);
  QuantWeight q{WeightFormat::kDense, n_out, n_in, weight->view("bench.linear"), {}, "bench.linear", {}};
  for (int64_t batch : {int64_t{1}, int64_t{16}}) {
    auto x = std::make_shared<std::vector<float>>(static_cast<size_t>(batch * n_in), 1.0f);
    auto y = std::make_shared<std::vector<float>>(static_cast<size_t>(batch * n_out));
    cases.push_back({"linear_f32_decode", "B=" + std::to_string(batch) + " " + std::to_string(n_out) + "x" +
                                              std::to_string(n_in),
                     static_cast<double>(weight->nbytes()) + 4.0 * static_cast<double>(batch * (n_in + n_out)),
                     2.0 * static_cast<double>(batch * n_in * n_out),
                     [q, weight, x, y, batch] { ops::linear_cpu(q, x->data(), batch, y->data()); }});
  }
  const int64_t rows = quick ? 64 : 256, dim = 7168;
  auto x = std::make_shared<std::vector<float>>(static_cast<size_t>(rows * dim), 0.5f);
  auto g = std::make_shared<std::vector<float>>(static_cast<size_t>(dim), 1.0f);
  auto y = std::make_shared<std::vector<float>>(x->size());
  cases.push_back({"rmsnorm", "rows=" + std::to_string(rows) + " dim=7168", 8.0 * static_cast<double>(rows * dim),
                   4.0 * static_cast<double>(rows * dim),
                   [x, g, y, rows] { ops::rmsnorm_cpu({rows, 7168, 1e-5f}, x->data(), g->data(), y->data()); }});
  return cases;
}

class CpuBench final : public DeviceBench {
 public:
  DeviceInfo info() override {
    DeviceInfo d;
    d.device = "cpu";
    d.name = cpu_model_name();
    d.n_sms = default_pool().n_threads();
    return d;
  }
  Ceilings ceilings(bool quick) override {
    Ceilings c;
    const int reps = quick ? 2 : 5;
    c.read_gbps = read_gbps(quick ? (size_t{64} << 20) : (size_t{1} << 30), reps);
    c.copy_gbps = copy_gbps(quick ? (size_t{32} << 20) : (size_t{512} << 20), reps);
    c.gemm_f32_tflops = gemm_f32_tflops(quick ? 192 : 768, reps);
    return c;
  }
  std::vector<KernelResult> kernels(const Ceilings& c, bool quick, const std::string& filter) override {
    std::vector<KernelResult> out;
    for (const CpuCase& k : cpu_cases(quick)) {
      if (!kernel_case_matches(k.name, filter)) continue;
      k.run();  // warm-up
      std::vector<double> ms;
      for (int i = 0; i < (quick ? 3 : 7); ++i) ms.push_back(1e3 * seconds_of(k.run));
      KernelResult r;
      r.name = k.name;
      r.shape = k.shape;
      r.ms = median(ms);
      r.bytes = k.bytes;
      r.flops = k.flops;
      r.gbps = k.bytes / (r.ms * 1e6);
      r.tflops = k.flops / (r.ms * 1e9);
      const double read_ms = k.bytes / (c.memory_gbps() * 1e6), compute_ms = k.flops / (c.compute_tflops() * 1e9);
      r.bound = read_ms >= compute_ms ? "memory" : "compute";
      r.compute_ref = "gemm_f32";
      r.fraction = std::max(read_ms, compute_ms) / r.ms;
      r.copies = 1;
      r.sets = 1;
      out.push_back(std::move(r));
    }
    return out;
  }
  std::unique_ptr<StepProfiler> profiler(bool per_op) override { return make_wall_profiler(per_op); }
  int64_t act_bytes() const override { return 4; }
};

}  // namespace

std::unique_ptr<DeviceBench> make_cpu_bench() { return std::make_unique<CpuBench>(); }

std::unique_ptr<DeviceBench> make_device_bench(const std::string& device) {
  if (device == "cpu") return make_cpu_bench();
  if (device == "cuda") {
#ifdef BG_HAVE_CUDA
    return make_cuda_bench();
#else
    fail("bench --device cuda: this batchgen was built without the CUDA backend (configure where nvcc is installed)");
#endif
  }
  fail("bench: unknown device '{}' (cpu, cuda)", device);
}

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

}  // namespace bg::bench
