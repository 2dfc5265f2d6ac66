// RoPE rotation layout, shared by the CPU reference and the CUDA launcher (kept apart from rope.h so CUDA code does
// not pull in the model config parser).
#pragma once

#include <cstdint>

namespace bg::ops {

struct RopeParams {
  int64_t n_tokens = 0;
  int64_t n_heads = 0;
  int64_t head_stride = 0;   // elements between consecutive heads of one token
  int64_t token_stride = 0;  // elements between consecutive tokens
  int64_t rope_offset = 0;   // first rotated dim inside a head
  int64_t rope_dim = 0;
  bool interleaved = true;
};

}  // namespace bg::ops
