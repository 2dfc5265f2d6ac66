// Tensor-parallel shares of weights: a linear split by output rows (column parallel: q/k/v, gate/up, lm_head by
// vocab) or by input columns (row parallel: o_proj, down), in equal parts. The share keeps the stored format when the
// cut lines up with the format's blocks (FP8: 128 x 128, MXFP4: 32 columns); otherwise it is stored dequantized as
// fp32 (exact values; logged), which only the tiny test models need.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "formats/quant.h"

namespace bg {

enum class ShareKind : uint8_t {
  kAll,   // the whole weight (replicated on every TP rank)
  kSkip,  // not on this rank (another rank's expert; a weight the model reads on the host instead)
  kRows,  // output rows [part * n_out / parts, (part + 1) * n_out / parts)
  kCols,  // input columns, likewise
};

struct LinearShare {
  ShareKind kind = ShareKind::kAll;
  int32_t parts = 1;
  int32_t part = 0;
};

// A share of a weight: the QuantWeight views either the original storage or `storage` (owned here).
struct SharedWeight {
  QuantWeight w;
  std::vector<std::shared_ptr<HostTensor>> storage;  // what the share had to copy (codes, scales)
  bool dequantized = false;             // stored as fp32 because the cut splits the format's blocks
};

// kRows / kCols / kAll only; throws when `parts` does not divide the split dimension.
SharedWeight share_linear(const QuantWeight& w, const LinearShare& share);

// Rows [part * n / parts, ...) of a row-major host array of n rows of `row_len` values.
std::vector<float> share_rows(const std::vector<float>& v, int64_t n_rows, int32_t parts, int32_t part,
                              const char* what);

}  // namespace bg
