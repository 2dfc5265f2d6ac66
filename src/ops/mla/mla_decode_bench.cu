// MLA decode micro-benchmark (see mla_decode_bench.h): device-filled inputs, one CUDA graph of many launches over
// rotated copies, median of replays, figures against a read ceiling measured in the same run.
#include "ops/mla/mla_decode_bench.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_buffer.h"
#include "ops/mla/mla_decode_cuda.h"
#include "ops/mla/mla_decode_internal.h"

namespace bg::ops {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;

// Values in [-scale, scale) from a hash of the index (no host data for gigabytes of cache).
__global__ void fill_bf16_kernel(bf16* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32) * 40503u;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = __float2bfloat16(scale * (static_cast<float>(x & 0xffffu) / 32768.0f - 1.0f));
  }
}

void fill(DeviceBuffer& b, uint32_t seed, float scale) {
  fill_bf16_kernel<<<1024, 256>>>(b.as<bf16>(), static_cast<int64_t>(b.bytes() / 2), seed, scale);
  BG_CUDA_CHECK_LAUNCH();
}

__global__ void read_kernel(const uint4* p, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // practically never: keeps the loads alive
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One copy of every input of a launch (its own cache, weights and workspace), filled on the device.
struct Copy {
  DeviceBuffer pool, q, w_uk, w_uv, out, tables, seq_idx, positions, ws;

  Copy(const MlaDecodePlan& plan, int64_t context, uint32_t seed) {
    const MlaParams& p = plan.params;
    const int64_t b = p.n_tokens, h = p.n_heads, nb = (context + p.block_size - 1) / p.block_size;
    pool = DeviceBuffer(static_cast<size_t>(b * nb * p.block_size * kMlaDecodeEntry) * 2);
    q = DeviceBuffer(static_cast<size_t>(b * h * (p.qk_nope_dim + kMlaDecodeRope)) * 2);
    w_uk = DeviceBuffer(static_cast<size_t>(h * p.qk_nope_dim * kMlaDecodeLora) * 2);
    w_uv = DeviceBuffer(static_cast<size_t>(h * p.v_head_dim * kMlaDecodeLora) * 2);
    out = DeviceBuffer(static_cast<size_t>(b * h * p.v_head_dim) * 2);
    ws = DeviceBuffer(plan.ws.total_bytes);
    fill(pool, seed, 1.0f);
    fill(q, seed + 1, 1.0f);
    fill(w_uk, seed + 2, 0.05f);
    fill(w_uv, seed + 3, 0.05f);
    std::vector<int32_t> table(static_cast<size_t>(b * nb)), seq(static_cast<size_t>(b));
    std::iota(table.begin(), table.end(), 0);
    std::iota(seq.begin(), seq.end(), 0);
    tables = cuda::upload(table);
    seq_idx = cuda::upload(seq);
    positions = cuda::upload(std::vector<int64_t>(static_cast<size_t>(b), context - 1));
  }
  int64_t input_bytes() const {
    return static_cast<int64_t>(pool.bytes() + q.bytes() + w_uk.bytes() + w_uv.bytes());
  }
  MlaPagedCache cache(const MlaDecodePlan& plan, int64_t blocks_per_seq) const {
    MlaPagedCache c;
    c.base = pool.as<bf16>();
    c.block_stride = plan.params.block_size * kMlaDecodeEntry;
    c.block_tables = tables.as<int32_t>();
    c.max_blocks_per_seq = blocks_per_seq;
    c.seq_idx = seq_idx.as<int32_t>();
    c.positions = positions.as<int64_t>();
    return c;
  }
  // The whole op (attention_only = false) or only the attention kernel over the q_full and schedule an earlier
  // whole-op launch on this copy left in its workspace.
  void launch(const MlaDecodePlan& plan, const MlaDecodeContext& ctx, int64_t blocks_per_seq, bool attention_only,
              cudaStream_t s) const {
    if (attention_only) {
      mla_decode::launch_attention(plan, mla_decode::attention_args(plan, cache(plan, blocks_per_seq), ws.data()), s);
      return;
    }
    MlaDecodeContext x = ctx;
    x.workspace = ws.data();
    x.workspace_bytes = ws.bytes();
    mla_decode_cuda(plan, {q.as<bf16>(), w_uk.as<bf16>(), w_uv.as<bf16>(), out.as<bf16>()},
                    cache(plan, blocks_per_seq), x, s);
  }
};

// Median time of one launch: a graph of n launches over the copies, replayed.
double time_launch_us(const MlaDecodePlan& plan, const std::vector<Copy>& copies, int64_t blocks_per_seq,
                      bool attention_only, int replays) {
  cublasHandle_t cublas = nullptr;
  BG_CUBLAS_CHECK(cublasCreate(&cublas));
  DeviceBuffer cublas_ws(size_t{32} << 20);
  const MlaDecodeContext ctx{cublas, cublas_ws.data(), cublas_ws.bytes(), nullptr, 0};
  cudaStream_t stream = nullptr;
  BG_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t n_launch = std::max<int64_t>(10, static_cast<int64_t>(copies.size()));
  for (const Copy& c : copies) c.launch(plan, ctx, blocks_per_seq, false, stream);  // eager: errors surface here
  BG_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BG_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  for (int64_t i = 0; i < n_launch; ++i) {
    copies[static_cast<size_t>(i) % copies.size()].launch(plan, ctx, blocks_per_seq, attention_only, stream);
  }
  BG_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  BG_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a = nullptr, b = nullptr;
  BG_CUDA_CHECK(cudaEventCreate(&a));
  BG_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> us;
  for (int rep = 0; rep <= replays; ++rep) {
    BG_CUDA_CHECK(cudaEventRecord(a, stream));
    BG_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    BG_CUDA_CHECK(cudaEventRecord(b, stream));
    BG_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    BG_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (rep > 0) us.push_back(ms * 1e3 / static_cast<double>(n_launch));  // replay 0 warms up
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cublasDestroy(cublas);
  return median(us);
}

}  // namespace

double mla_decode_bench_read_ceiling_tbps() {
  const int64_t bytes = int64_t{2} << 30;
  DeviceBuffer buf(static_cast<size_t>(bytes)), sink(4);
  BG_CUDA_CHECK(cudaMemset(buf.data(), 1, buf.bytes()));
  int sms = 0;
  BG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t a = nullptr, b = nullptr;
  BG_CUDA_CHECK(cudaEventCreate(&a));
  BG_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> tbps;
  for (int rep = 0; rep < 6; ++rep) {
    BG_CUDA_CHECK(cudaEventRecord(a));
    read_kernel<<<sms * 8, 512>>>(buf.as<uint4>(), bytes / 16, sink.as<uint32_t>());
    BG_CUDA_CHECK_LAUNCH();
    BG_CUDA_CHECK(cudaEventRecord(b));
    BG_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    BG_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (rep > 0) tbps.push_back(static_cast<double>(bytes) / (ms * 1e-3) / 1e12);  // rep 0 warms up
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(tbps);
}

std::vector<MlaDecodeBenchResult> mla_decode_bench(const MlaDecodeBenchOptions& o) {
  int sms = 0;
  BG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double ceiling = mla_decode_bench_read_ceiling_tbps();
  std::printf("mla_decode: heads %lld, block %lld, read ceiling %.2f TB/s (uint4 read, 2 GiB), %d SMs\n",
              static_cast<long long>(o.n_heads), static_cast<long long>(o.block_size), ceiling, sms);
  std::printf("%-9s %5s %7s | %9s %8s %8s %8s %8s | %9s %8s | %4s %7s %5s\n", "mma", "batch", "context", "op us",
              "KV TB/s", "TFLOP/s", "fraction", "all B", "attn us", "fraction", "regs", "smem", "spill");
  std::vector<MlaDecodeBenchResult> results;
  for (const MlaDecodeBenchCase& c : o.cases) {
    for (MlaDecodeMma mma : o.mmas) {
      const MlaParams p{c.batch, o.n_heads, kMlaDecodeLora, o.qk_nope, kMlaDecodeRope, o.v_head, o.block_size,
                        1.0f / std::sqrt(static_cast<float>(o.qk_nope + kMlaDecodeRope))};
      const MlaDecodePlan plan = mla_decode_plan(p, sms, {mma});
      const int64_t blocks_per_seq = (c.context + o.block_size - 1) / o.block_size;
      std::vector<Copy> copies;
      int64_t bytes = 0;
      do {
        copies.emplace_back(plan, c.context, static_cast<uint32_t>(17 * copies.size() + 1));
        bytes += copies.back().input_bytes();
      } while (bytes < o.rotate_bytes);
      MlaDecodeBenchResult r;
      r.c = c;
      r.mma = mma;
      r.us = time_launch_us(plan, copies, blocks_per_seq, false, o.replays);
      r.attention_us = time_launch_us(plan, copies, blocks_per_seq, true, o.replays);
      const double kv_bytes = static_cast<double>(c.batch * c.context) * kMlaDecodeEntry * 2;
      const double flops = 2.0 * static_cast<double>(o.n_heads * c.batch) *
                           (static_cast<double>(c.context) * (kMlaDecodeEntry + kMlaDecodeLora) +
                            static_cast<double>((o.qk_nope + o.v_head) * kMlaDecodeLora));
      r.kv_tbps = kv_bytes / (r.us * 1e-6) / 1e12;
      r.tflops = flops / (r.us * 1e-6) / 1e12;
      r.read_fraction = r.kv_tbps / ceiling;
      const double other_bytes = 2.0 * static_cast<double>(o.n_heads) *
                                 (static_cast<double>((o.qk_nope + o.v_head) * kMlaDecodeLora) +
                                  static_cast<double>(c.batch * (o.qk_nope + kMlaDecodeRope + o.v_head)));
      r.all_bytes_fraction = (kv_bytes + other_bytes) / (r.us * 1e-6) / 1e12 / ceiling;
      r.attention_read_fraction = kv_bytes / (r.attention_us * 1e-6) / 1e12 / ceiling;
      const MlaDecodeKernelInfo info = mla_decode_attention_kernel_info(plan);
      r.registers = info.registers;
      r.smem_bytes = static_cast<int64_t>(info.smem_bytes);
      r.spill_bytes = static_cast<int64_t>(info.local_bytes);
      std::printf("%-9s %5lld %7lld | %9.1f %8.3f %8.1f %8.3f %8.3f | %9.1f %8.3f | %4d %7lld %5lld\n",
                  mla_decode_mma_name(mma), static_cast<long long>(c.batch), static_cast<long long>(c.context), r.us,
                  r.kv_tbps, r.tflops, r.read_fraction, r.all_bytes_fraction, r.attention_us,
                  r.attention_read_fraction, r.registers, static_cast<long long>(r.smem_bytes),
                  static_cast<long long>(r.spill_bytes));
      std::fflush(stdout);
      results.push_back(r);
    }
  }
  return results;
}

}  // namespace bg::ops
