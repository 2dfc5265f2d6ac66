// Linear CPU reference: rows of W are dequantized one at a time into a per-thread buffer and dotted with every token,
// so quantized weights are never materialized whole.
#include "ops/linear/linear.h"

#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"

namespace bg::ops {
namespace {

// Eight partial sums so the compiler can vectorize without reassociating a single accumulator.
float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void linear_cpu(const QuantWeight& w, const float* x, int64_t n_tokens, float* y) {
  BG_CHECK(w.n_out > 0 && w.n_in > 0, "linear '{}': empty weight", w.name);
  if (n_tokens == 0) return;
  parallel_for(w.n_out, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(w.n_in));
    for (int64_t r = begin; r < end; ++r) {
      w.decode_row(r, row.data());
      for (int64_t t = 0; t < n_tokens; ++t) y[t * w.n_out + r] = dot(row.data(), x + t * w.n_in, w.n_in);
    }
  });
}

void embedding_cpu(const TensorView& table, const int32_t* ids, int64_t n_tokens, float* y) {
  int64_t vocab = table.dim(0), dim = table.dim(1);
  for (int64_t t = 0; t < n_tokens; ++t) {
    BG_CHECK(ids[t] >= 0 && ids[t] < vocab, "token id {} at position {} is outside the vocabulary [0, {})", ids[t], t,
             vocab);
    int64_t base = static_cast<int64_t>(ids[t]) * dim;
    for (int64_t i = 0; i < dim; ++i) y[t * dim + i] = table.get_f32(base + i);
  }
}

}  // namespace bg::ops
