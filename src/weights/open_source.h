// How an engine gets its weights (the one call model loading makes): the checkpoint directory read directly (mmap'd
// safetensors, or a store-layout directory), or the weightd store attached with --weight-store, plus what
// --distributed-weight-config says to fetch from peers. Model code sees a WeightSource either way.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "formats/weight_source.h"

namespace bg::weights {

class StoreSource;

struct SourceOptions {
  std::string weight_store;                 // --weight-store NAME ("" = read the checkpoint directly)
  std::string distributed_weight_config;    // --distributed-weight-config PATH
  int progress_tty = -1;
  int attach_wait_s = 3600;                 // how long to wait for a daemon that is still loading
};

std::shared_ptr<const WeightSource> open_weight_source(const std::filesystem::path& model_dir,
                                                       const SourceOptions& options);

// Attaches to the weightd of `store` (waiting while it loads, with progress), counts this process as its client and
// maps the store read-only; the returned source detaches when destroyed. Checks that the store holds the model of
// `model_dir` (same config.json). Throws naming the store.
std::shared_ptr<StoreSource> attach_store(const std::string& store, const std::filesystem::path& model_dir,
                                          int wait_s);

// Reads every shard of a directly loaded checkpoint once, in parallel, with per-shard progress (bytes, GB/s), so the
// first forward does not fault pages in one by one. Skipped (logged) when the shards exceed half the available memory.
void prefetch_checkpoint(const WeightSource& checkpoint, int progress_tty);

}  // namespace bg::weights
