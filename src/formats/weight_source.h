// The seam between model code and where weight bytes live: a checkpoint's mmap'd safetensors (formats/checkpoint.h),
// or the weight store's segments (weights/store_source.h). ModelWeights binds through it; nothing above reads files.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace bg {

// A range of host memory that holds weights (a store segment), for pinning (cudaHostRegister) and DMA.
struct HostRegion {
  const std::byte* data = nullptr;
  size_t bytes = 0;
};

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // What this is, for messages: "checkpoint /path/dir" or "weight store NAME".
  virtual std::string describe() const = 0;
  virtual bool contains(const std::string& name) const = 0;
  virtual std::optional<TensorView> find(const std::string& name) const = 0;
  // The shard file a tensor was read from (for messages); "<none>" when unknown.
  virtual std::string file_of(const std::string& name) const = 0;
  virtual std::vector<std::string> names() const = 0;
  // Memory worth pinning for uploads: the store's segments. Empty for file mappings (pinning page-cache pages of a
  // checkpoint would fault in the whole file first).
  virtual std::vector<HostRegion> pinnable_regions() const { return {}; }
  // A routed expert the source holds as one W4A16 block (a weight store built with --expert-layout w4a16): the bytes
  // the GPU expert kernel reads (ops/moe_w4a16, layout `version`, scale shifts 0), so a CUDA engine copies them into
  // its expert slot as they are. nullopt when the expert is held as in the checkpoint. Its checkpoint tensors are
  // still found by name (unpacked on first use into memory the source owns).
  struct W4a16Block {
    std::span<const std::byte> bytes;
    int64_t hidden = 0;
    int64_t inter = 0;
    uint32_t version = 0;
  };
  virtual std::optional<W4a16Block> w4a16_expert(int64_t /*layer*/, int64_t /*expert*/) const { return std::nullopt; }

  // Throws "<describe()>: missing tensor '<name>'" if absent.
  TensorView get(const std::string& name) const;
};

}  // namespace bg
