// Test helper: the ranks of a CPU rank set as threads of this process (each with its own shm mapping, comms and
// backend, exactly as rank processes would have), running one function per rank.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dist/rank_context.h"
#include "dist/shm_comm.h"

namespace bg::testing {

// Runs fn(ctx) on every rank of `layout` in its own thread; rethrows the first rank's exception (by rank order).
inline void run_ranks(const dist::ParallelLayout& layout, const std::function<void(dist::RankContext&)>& fn,
                      dist::ShmCommOptions options = {.slot_bytes = size_t{16} << 10, .timeout_s = 60.0}) {
  const std::string name = dist::unique_shm_name("test");
  std::shared_ptr<dist::ShmRankSet> first = dist::ShmRankSet::create(name, {layout, 0}, options);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(layout.world()));
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < layout.world(); ++r) {
    threads.emplace_back([&, r] {
      auto ctx = std::make_shared<dist::RankContext>();
      try {
        ctx->place = {layout, r};
        std::shared_ptr<dist::ShmRankSet> set = r == 0 ? first : dist::ShmRankSet::open(name, {layout, r}, options);
        set->attach_and_wait();
        ctx->world = set->world_comm();
        ctx->tp = set->tp_comm();
        ctx->shm = set;
        ctx->exchange = "shm";
        fn(*ctx);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        if (ctx->world) ctx->world->mark_failed("a test rank threw");  // the others stop waiting for it
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace bg::testing
