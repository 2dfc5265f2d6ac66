// XXH64 (seed 0) checksums of tensor bytes: one-shot and streaming (a tensor read in chunks).
#pragma once

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <span>

namespace bg::weights {

inline uint64_t xxh64(std::span<const std::byte> bytes) { return XXH64(bytes.data(), bytes.size(), 0); }

// Streaming XXH64 over consecutive pieces of one tensor.
class Xxh64Stream {
 public:
  Xxh64Stream() : state_(XXH64_createState()) { XXH64_reset(state_, 0); }
  ~Xxh64Stream() { XXH64_freeState(state_); }
  Xxh64Stream(const Xxh64Stream&) = delete;
  Xxh64Stream& operator=(const Xxh64Stream&) = delete;
  void reset() { XXH64_reset(state_, 0); }
  void update(const std::byte* data, size_t bytes) { XXH64_update(state_, data, bytes); }
  uint64_t digest() const { return XXH64_digest(state_); }

 private:
  XXH64_state_t* state_;
};

}  // namespace bg::weights
