// Token embedding lookup on the GPU: shapes shared by the CUDA launcher. The CPU reference is embedding_cpu in
// ops/linear/linear.h (a table of any float dtype, fp32 out, out-of-range ids throw).
#pragma once

#include <cstdint>

namespace bg::ops {

struct EmbeddingParams {
  int64_t n_tokens = 0;  // ids to look up, may be 0
  int64_t vocab = 0;     // table rows
  int64_t dim = 0;       // table columns (hidden size)
};

}  // namespace bg::ops
