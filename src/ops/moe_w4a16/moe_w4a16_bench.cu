// The W4A16 expert kernel's micro-benchmark: random MXFP4 experts written straight into the layout on the device,
// `copies` launches on rotating expert sets captured in one CUDA graph (weights 281 MB per launch at K3 shapes, far
// past the 60 MB L2), median of the replays; the read ceiling is a uint4 grid-stride read over the same allocation.
#include "ops/moe_w4a16/moe_w4a16_bench.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_buffer.h"
#include "core/dtype.h"
#include "core/error.h"
#include "ops/moe_w4a16/moe_w4a16_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_layout.h"

namespace bg::ops {
namespace {

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return static_cast<uint32_t>(x ^ (x >> 33));
}

// Random codes; scale bytes s' in 240..248 (s = s' - 126 = 114..122: weights of 2^-13 .. 2^-2.4, realistic).
__global__ void fill_layout_kernel(uint8_t* base, int64_t bytes, int64_t block_base) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes; i += stride) {
    const uint32_t h = hash32(static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull + 1);
    const bool scale = (i - block_base) % w4::kStageBytes >= w4::kCodeBytes;
    base[i] = scale ? static_cast<uint8_t>(240 + h % 9) : static_cast<uint8_t>(h);
  }
}

__global__ void read_kernel(const uint4* p, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads
}

struct Timer {
  cudaEvent_t a = nullptr, b = nullptr;
  Timer() {
    BG_CUDA_CHECK(cudaEventCreate(&a));
    BG_CUDA_CHECK(cudaEventCreate(&b));
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
};

template <typename Fn>
double median_ms(int reps, cudaStream_t stream, Fn&& fn) {
  Timer t;
  std::vector<float> ms;
  fn();  // warm-up
  for (int r = 0; r < reps; ++r) {
    BG_CUDA_CHECK(cudaEventRecord(t.a, stream));
    fn();
    BG_CUDA_CHECK(cudaEventRecord(t.b, stream));
    BG_CUDA_CHECK(cudaEventSynchronize(t.b));
    float v = 0.0f;
    BG_CUDA_CHECK(cudaEventElapsedTime(&v, t.a, t.b));
    ms.push_back(v);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double read_ceiling_gbps(const void* data, int64_t bytes, cudaStream_t stream) {
  cuda::DeviceBuffer sink(sizeof(uint32_t));
  int sms = 0, dev = 0;
  BG_CUDA_CHECK(cudaGetDevice(&dev));
  BG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t n = bytes / 16;
  double best = 0.0;
  for (int per_sm : {4, 8, 16}) {  // best of three grid sizes
    const double ms = median_ms(5, stream, [&] {
      read_kernel<<<sms * per_sm, 512, 0, stream>>>(static_cast<const uint4*>(data), n, sink.as<uint32_t>());
      BG_CUDA_CHECK_LAUNCH();
    });
    best = std::max(best, static_cast<double>(n * 16) / (ms * 1e6));
  }
  return best;
}

// One row count: dispatches for `copies` rotated expert sets, then the timed graph of `copies` launches.
MoeW4a16BenchRow bench_rows(const MoeW4a16BenchConfig& cfg, const MoeW4a16Weights& w, int rows, bool pdl,
                            bool wgmma, bool narrow, double ceiling, cudaStream_t stream) {
  MoeCudaParams mp;
  mp.shape = {rows, cfg.touched, cfg.n_slots, cfg.n_slots, true};
  mp.hidden = cfg.hidden;
  mp.inter = cfg.inter;
  mp.expert_format = WeightFormat::kMxfp4;
  mp.act = {MoeGlu::kSitu, 4.0f, 25.0f};
  MoeW4a16Params p = moe_w4a16_params(mp);
  p.pdl = pdl;
  p.wgmma = wgmma;
  p.narrow = narrow;
  std::vector<uint16_t> x_bits(static_cast<size_t>(rows * cfg.hidden));
  for (size_t i = 0; i < x_bits.size(); ++i) {
    x_bits[i] = f32_to_bf16(static_cast<float>((i * 37) % 101) / 101.0f - 0.5f);
  }
  const cuda::DeviceBuffer x = cuda::upload(x_bits);
  cuda::DeviceBuffer out(static_cast<size_t>(rows * cfg.hidden) * 2);
  cuda::DeviceBuffer ws_buf(moe_w4a16_workspace_bytes(p));
  const MoeW4a16Workspace ws = moe_w4a16_workspace_layout(p, ws_buf.data());
  moe_w4a16_workspace_init(ws, stream);
  std::vector<cuda::DeviceBuffer> keep;
  std::vector<std::unique_ptr<MoeDispatchBuffers>> dbufs;
  std::vector<MoeWorkspace> dws;
  int64_t touched_sum = 0;
  for (int c = 0; c < cfg.copies; ++c) {
    std::vector<int32_t> ids;
    std::vector<float> wts;
    std::vector<int32_t> perm(static_cast<size_t>(cfg.n_slots));
    std::vector<bool> used(static_cast<size_t>(cfg.n_slots), false);
    std::mt19937 rng(static_cast<uint32_t>(c + 1));
    for (int t = 0; t < rows; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      if (cfg.random_routing) std::shuffle(perm.begin(), perm.end(), rng);
      for (int64_t j = 0; j < cfg.touched; ++j) {
        const int32_t e = cfg.random_routing ? perm[static_cast<size_t>(j)]
                                             : static_cast<int32_t>((c * cfg.touched + j) % cfg.n_slots);
        ids.push_back(e);
        wts.push_back(1.0f / static_cast<float>(cfg.touched));
        used[static_cast<size_t>(e)] = true;
      }
    }
    touched_sum += std::count(used.begin(), used.end(), true);
    keep.push_back(cuda::upload(ids));
    keep.push_back(cuda::upload(wts));
    dbufs.push_back(std::make_unique<MoeDispatchBuffers>(mp));
    dws.push_back(dbufs.back()->ws);
    moe_dispatch_cuda(mp, keep[keep.size() - 2].as<int32_t>(), keep[keep.size() - 1].as<float>(), dws.back(), stream);
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BG_CUDA_CHECK(cudaStreamSynchronize(stream));
  moe_w4a16_cuda(p, w, dws[0], {x.as<__nv_bfloat16>(), out.data()}, ws, stream);  // sets kernel attributes
  BG_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int c = 0; c < cfg.copies; ++c) {
    moe_w4a16_cuda(p, w, dws[static_cast<size_t>(c)], {x.as<__nv_bfloat16>(), out.data()}, ws, stream);
  }
  BG_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  BG_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double ms = median_ms(cfg.replays, stream, [&] { BG_CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  MoeW4a16BenchRow row;
  row.rows_per_expert = rows;
  row.experts = static_cast<double>(touched_sum) / cfg.copies;
  row.pdl = pdl;
  row.wgmma = wgmma;
  row.narrow = narrow;
  int sms = 0, dev = 0;
  BG_CUDA_CHECK(cudaGetDevice(&dev));
  BG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (narrow) sms *= 2;  // the narrow shape's grid
  const int nb_cap = std::clamp((rows + 7) / 8, 1, w4::kMaxNb);
  const auto experts = static_cast<int64_t>(row.experts + 0.5);
  row.splits_gate_up = rows <= w4::kChunkRows ? w4::choose_splits(experts * w.info.gate_up.n_items,
                                                                  w.info.gate_up.n_kstages, sms, 0, nb_cap) : 1;
  row.splits_down = rows <= w4::kChunkRows ? w4::choose_splits(experts * w.info.down.n_items,
                                                               w.info.down.n_kstages, sms, 0, nb_cap) : 1;
  row.us = ms * 1e3 / cfg.copies;
  const double bytes = row.experts * static_cast<double>(w.info.gate_up.slot_bytes + w.info.down.slot_bytes);
  row.gbps = bytes / (row.us * 1e3);
  row.fraction = row.gbps / ceiling;
  return row;
}

}  // namespace

MoeW4a16BenchResult moe_w4a16_bench_k3(const MoeW4a16BenchConfig& cfg) {
  BG_CHECK(cfg.touched > 0 && cfg.touched <= cfg.n_slots && cfg.copies > 0 && cfg.replays > 0,
           "moe_w4a16_bench: touched {} of {} slots, {} copies, {} replays", cfg.touched, cfg.n_slots, cfg.copies,
           cfg.replays);
  MoeW4a16BenchResult r;
  cudaDeviceProp prop{};
  int dev = 0;
  BG_CUDA_CHECK(cudaGetDevice(&dev));
  BG_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  r.device = prop.name;
  cudaStream_t stream = nullptr;
  BG_CUDA_CHECK(cudaStreamCreate(&stream));
  MoeW4a16Weights w;
  w.info = moe_w4a16_layout_info(cfg.n_slots, cfg.hidden, cfg.inter);
  cuda::DeviceBuffer storage(static_cast<size_t>(w.info.total_bytes));
  const cuda::DeviceBuffer table = moe_w4a16_block_table(storage.data(), w.info);
  w.blocks = table.as<const void*>();
  for (int64_t e = 0; e < cfg.n_slots; ++e) {
    for (const MoeW4a16MatrixInfo* m : {&w.info.gate_up, &w.info.down}) {
      fill_layout_kernel<<<256, 256, 0, stream>>>(storage.as<uint8_t>() + e * w.info.block_bytes + m->offset_bytes,
                                                  m->slot_bytes, 0);
      BG_CUDA_CHECK_LAUNCH();
    }
  }
  r.read_ceiling_gbps = read_ceiling_gbps(storage.data(), w.info.total_bytes / 16 * 16, stream);
  r.bytes_per_expert = static_cast<double>(w.info.gate_up.slot_bytes + w.info.down.slot_bytes);
  for (int rows : cfg.rows_per_expert) {
    for (const int shape : {0, 1, 2}) {  // mma.sync, mma.sync narrow (moe_w4a16_runs_narrow), wgmma
      if (shape == 1 && rows > kMoeW4a16NarrowMaxTokens) continue;  // it would run the wide shape
      for (bool pdl : {false, true}) {
        if (cfg.random_routing && (!pdl || shape == 2)) continue;  // the default's launches, narrow and wide
        r.rows.push_back(bench_rows(cfg, w, rows, pdl, shape == 2, shape == 1, r.read_ceiling_gbps, stream));
      }
    }
  }
  BG_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
  return r;
}

std::string moe_w4a16_bench_table(const MoeW4a16BenchResult& r) {
  std::string s = fmt::format("moe_decode_w4a16 on {}: read ceiling {:.0f} GB/s, {:.2f} MB packed weights per expert\n",
                              r.device, r.read_ceiling_gbps, r.bytes_per_expert / 1e6);
  s += "rows/expert  experts  mma              pdl  splits(gu,dn)      us     GB/s  fraction\n";
  for (const MoeW4a16BenchRow& row : r.rows) {
    s += fmt::format("{:>11}  {:>7.1f}  {:<15}  {:>3}  {:>6},{:<6}  {:>8.1f}  {:>7.0f}  {:>8.3f}\n",
                     row.rows_per_expert, row.experts,
                     row.wgmma ? "wgmma" : row.narrow ? "mma.sync narrow" : "mma.sync", row.pdl ? "on" : "off",
                     row.splits_gate_up, row.splits_down, row.us, row.gbps, row.fraction);
  }
  return s;
}

}  // namespace bg::ops
