// `batchgen bench exchange`: the ll expert exchange's dispatch and combine latency between `ranks` ranks of this
// process (one thread, CUDA backend and stream each, all on the current GPU), K3's shape by default: hidden 7168,
// top-16, 56 experts per rank. Rank 0's stream is timed with events: dispatch = plan .. unpack, combine = return ..
// reduce; a host barrier lines the ranks up before every call, so the figures include the skew of one launch, not
// of a slow host. The experts are not run (their rows are only returned), so this measures the exchange alone.
#include "bench/exchange_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <numeric>
#include <random>
#include <thread>

#include "backend/cuda/cuda_backend.h"
#include "bench/device_bench.h"
#include "core/error.h"
#include "core/log.h"
#include "moe/cuda_exchange.h"
#include "moe/expert_table.h"

namespace bg::bench {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("bench exchange: CUDA {}: {}", what, cudaGetErrorString(e));
}

struct Timing {
  std::vector<double> dispatch_ms, combine_ms;
};

// One point: every rank sends `tokens` tokens per call for warmup + timed calls; returns rank 0's timings.
Timing run_point(const ExchangeBenchOptions& o, int64_t ranks, int64_t tokens) {
  const int64_t experts = o.experts_per_rank * ranks;
  auto config = [&](int64_t rank) {
    moe::LlExchangeConfig c;
    c.placement = moe::ExpertPlacement::contiguous(experts, ranks, rank);
    c.top_k = o.top_k;
    c.hidden = o.hidden;
    c.max_tokens = tokens;
    c.timeout_s = 60.0;
    return c;
  };
  const size_t bytes = moe::ll_exchange_region_bytes(config(0));
  std::vector<std::byte*> regions;
  for (int64_t r = 0; r < ranks; ++r) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "region alloc");
    check(cudaMemset(p, 0, bytes), "region clear");
    regions.push_back(static_cast<std::byte*>(p));
  }
  check(cudaDeviceSynchronize(), "region clear");
  Timing timing;  // written by rank 0's thread only
  std::barrier sync(static_cast<std::ptrdiff_t>(ranks));
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto be = make_cuda_backend();
        const moe::LlExchangeConfig c = config(r);
        // The table only needs handles: one tiny dense weight stands for every local expert (never multiplied).
        const std::vector<float> zeros(64, 0.0f);
        const QuantWeight w{WeightFormat::kDense, 8, 8,
                            TensorView{DType::kF32, {8, 8}, reinterpret_cast<const std::byte*>(zeros.data()),
                                       zeros.size() * 4, "bench"},
                            {}, "bench", {}};
        const auto h = be->prepare_linear(w);
        ExpertWeights all;
        for (int64_t e = 0; e < experts; ++e) {
          const bool here = c.placement.owner(e) == r;
          all.gate.push_back(here ? h.get() : nullptr);
          all.up.push_back(here ? h.get() : nullptr);
          all.down.push_back(here ? h.get() : nullptr);
        }
        const moe::ExpertTable table(*be, c.placement, all);
        auto ex = moe::make_ll_exchange(*be, c, moe::LlPeerRegions{regions, nullptr});
        ex->set_step_tokens(tokens);
        std::mt19937 rng(static_cast<uint32_t>(17 + r));
        std::vector<int32_t> ids;
        std::vector<float> wts;
        for (int64_t t = 0; t < tokens; ++t) {
          std::vector<int32_t> e(static_cast<size_t>(experts));
          std::iota(e.begin(), e.end(), 0);
          std::shuffle(e.begin(), e.end(), rng);
          for (int64_t k = 0; k < o.top_k; ++k) {
            ids.push_back(e[static_cast<size_t>(k)]);
            wts.push_back(1.0f / static_cast<float>(o.top_k));
          }
        }
        Tensor tid = be->alloc({tokens, o.top_k}, DType::kI32);
        be->write_bytes(tid, std::as_bytes(std::span<const int32_t>(ids)));
        const Tensor tw = be->upload_f32(wts, {tokens, o.top_k}, DType::kF32);
        const Tensor tx = be->upload_f32(std::vector<float>(static_cast<size_t>(tokens * o.hidden), 0.5f),
                                         {tokens, o.hidden}, DType::kBF16);
        Tensor out = be->zeros({tokens, o.hidden}, DType::kBF16);
        auto* stream = static_cast<cudaStream_t>(cuda_stream_context(*be).stream);
        cudaEvent_t ev[4];
        for (auto& e : ev) check(cudaEventCreate(&e), "event");
        be->synchronize();
        for (int call = 0; call < o.warmup + o.calls; ++call) {
          sync.arrive_and_wait();
          moe::ExpertRows rows;
          check(cudaEventRecord(ev[0], stream), "record");
          ex->begin_dispatch(*be, table, {&tid, &tw, &tx}, rows);
          ex->finish_dispatch(*be, rows);
          check(cudaEventRecord(ev[1], stream), "record");
          check(cudaEventRecord(ev[2], stream), "record");
          ex->begin_combine(*be, rows, out);
          ex->finish_combine(*be, out);
          check(cudaEventRecord(ev[3], stream), "record");
          check(cudaEventSynchronize(ev[3]), "sync");
          if (r == 0 && call >= o.warmup) {
            float d = 0, cm = 0;
            check(cudaEventElapsedTime(&d, ev[0], ev[1]), "elapsed");
            check(cudaEventElapsedTime(&cm, ev[2], ev[3]), "elapsed");
            timing.dispatch_ms.push_back(d);
            timing.combine_ms.push_back(cm);
          }
        }
        be->synchronize();  // raises a kernel error flag of the exchange, if any
        for (auto& e : ev) cudaEventDestroy(e);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        sync.arrive_and_drop();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (std::byte* p : regions) cudaFree(p);
  for (int64_t r = 0; r < ranks; ++r) {
    BG_CHECK(errors[static_cast<size_t>(r)].empty(), "bench exchange: rank {} of {}: {}", r, ranks,
             errors[static_cast<size_t>(r)]);
  }
  return timing;
}

}  // namespace

std::vector<ExchangeResult> run_exchange_bench(const ExchangeBenchOptions& o) {
  BG_CHECK(o.top_k >= 1 && o.hidden >= 8 && o.hidden % 8 == 0 && o.experts_per_rank >= 1 && o.calls >= 1,
           "bench exchange: top_k {}, hidden {} (a multiple of 8), experts per rank {}, calls {}", o.top_k, o.hidden,
           o.experts_per_rank, o.calls);
  std::vector<ExchangeResult> results;
  for (int64_t ranks : o.ranks) {
    BG_CHECK(ranks >= 1 && ranks <= 64, "bench exchange: --ranks value {} must be in [1, 64]", ranks);
    BG_CHECK(o.experts_per_rank * ranks >= o.top_k, "bench exchange: {} experts for top-{}",
             o.experts_per_rank * ranks, o.top_k);
    for (int64_t tokens : o.tokens) {
      BG_CHECK(tokens >= 1 && tokens <= 4096, "bench exchange: --exchange-tokens value {} must be in [1, 4096]",
               tokens);
      log::info("bench exchange: ll, {} ranks, {} tokens per rank", ranks, tokens);
      const Timing t = run_point(o, ranks, tokens);
      ExchangeResult e;
      e.exchange = "ll";
      e.ranks = ranks;
      e.tokens_per_rank = tokens;
      e.top_k = o.top_k;
      e.hidden = o.hidden;
      e.experts = o.experts_per_rank * ranks;
      e.dispatch_us = 1e3 * median(t.dispatch_ms);
      e.combine_us = 1e3 * median(t.combine_ms);
      const double pairs = static_cast<double>(tokens * o.top_k);
      const double dispatch_bytes = pairs * static_cast<double>(o.hidden * 2 + ops::kLlMsgHeaderBytes);
      const double combine_bytes = pairs * static_cast<double>(o.hidden * 2);
      e.dispatch_gb_s = e.dispatch_us > 0 ? dispatch_bytes / (e.dispatch_us * 1e3) : 0.0;
      e.combine_gb_s = e.combine_us > 0 ? combine_bytes / (e.combine_us * 1e3) : 0.0;
      results.push_back(e);
    }
  }
  return results;
}

}  // namespace bg::bench
