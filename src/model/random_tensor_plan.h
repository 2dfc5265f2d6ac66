// make-random internals: a table expanded into the tensors to write (names, shapes, storage plans, bytes, shards)
// and the names, dtypes and shapes each one is stored as. Shared by the front (random_checkpoint.cpp) and the writer
// (random_checkpoint_writer.cpp); not part of the public make-random API.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "model/random_checkpoint.h"

namespace bg {

inline constexpr const char* kIndexName = "model.safetensors.index.json";

// One table entry expanded for a layer/expert, with its storage plan.
struct PlannedTensor {
  const TensorSpec* spec = nullptr;
  std::string name;  // kLinear: the prefix ("model.layers.0.self_attn.q_a_proj"); kTensor: the tensor name
  Shape shape;
  TensorPlan plan;
  uint64_t nbytes = 0;  // bytes of every stored tensor of this entry (weight + scales)
  int64_t shard = 0;
};

// One stored safetensors tensor of a planned entry (a dense weight, or FP8 / MXFP4 codes or scales).
struct StoredPart {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
  uint64_t nbytes = 0;
};

// Every tensor of the table in table order (global, then per layer, then per expert), as the loader binds them.
// Checks each plan (dtypes, formats the shape allows); throws naming the tensor.
std::vector<PlannedTensor> plan_tensors(const ArchTable& table, const RandomTensorPolicy& policy,
                                        RandomWeightFormat format);

// Contiguous split in table order with about equal bytes per shard; every shard gets at least one entry.
void assign_shards(std::vector<PlannedTensor>& tensors, int64_t n_shards);

// The stored tensors of one entry, named as load_linear / the table expect them: dense -> the weight; FP8 -> codes
// [out, in] + scale_inv F32 [ceil(out/128), ceil(in/128)]; MXFP4 -> codes U8 [out, in/2] (or gpt-oss blocks
// [out, in/32, 16]) + scales U8 [out, in/32]. Their bytes add up to the entry's nbytes.
std::vector<StoredPart> stored_parts(const PlannedTensor& t);

std::string shard_file_name(int64_t k, int64_t n);

// Elements [first, first + out.size()) of tensor `name`'s Normal(mean, std) values under `seed` (truncated at
// +-4.33 std), exactly as the writer draws them (random_checkpoint_writer.cpp).
void draw_random_normal(uint64_t seed, const std::string& name, int64_t first, std::span<float> out, double mean,
                        double std);

// Writes a whole text file; throws naming the path on failure.
void write_text_file(const std::filesystem::path& path, const std::string& text);

}  // namespace bg
