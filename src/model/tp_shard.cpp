// Weight shares for tensor parallelism: row/column slices of dense, FP8-block and MXFP4 linears.
#include "model/tp_shard.h"

#include <cstring>

#include "core/error.h"

namespace bg {
namespace {

TensorView sub_rows(const TensorView& v, int64_t r0, int64_t n, int64_t row_bytes) {
  TensorView s = v;
  s.shape[0] = n;
  s.data = v.data + static_cast<size_t>(r0 * row_bytes);
  s.nbytes = static_cast<size_t>(n * row_bytes);
  return s;
}

// Copies columns [c0, c0 + n) (in bytes of a row: [b0, b0 + nb)) of a row-major view into `dst`.
void copy_cols(const TensorView& v, int64_t rows, int64_t row_bytes, int64_t b0, int64_t nb, std::byte* dst) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * nb, v.data + r * row_bytes + b0, static_cast<size_t>(nb));
}

// The share as fp32 [n_out', n_in'] decoded row by row (exact: decode_row computes what the kernels compute).
SharedWeight dequantized(const QuantWeight& w, bool rows, int64_t a0, int64_t n) {
  const int64_t out = rows ? n : w.n_out, in = rows ? w.n_in : n;
  auto storage = std::make_shared<HostTensor>(DType::kF32, Shape{out, in});
  auto* dst = reinterpret_cast<float*>(storage->data());
  std::vector<float> row(static_cast<size_t>(w.n_in));
  for (int64_t r = 0; r < out; ++r) {
    w.decode_row(rows ? a0 + r : r, row.data());
    std::memcpy(dst + r * in, row.data() + (rows ? 0 : a0), static_cast<size_t>(in) * sizeof(float));
  }
  SharedWeight s;
  s.w = QuantWeight{WeightFormat::kDense, out, in, storage->view(w.name), {}, w.name, {}};
  s.storage.push_back(std::move(storage));
  s.dequantized = true;
  return s;
}

SharedWeight share_rows_of(const QuantWeight& w, int64_t r0, int64_t n) {
  SharedWeight s;
  s.w = w;
  s.w.n_out = n;
  switch (w.format) {
    case WeightFormat::kDense:
      s.w.data = sub_rows(w.data, r0, n, w.n_in * static_cast<int64_t>(dtype_size_bytes(w.data.dtype)));
      return s;
    case WeightFormat::kFp8Block: {
      if (r0 % kFp8BlockSize != 0) return dequantized(w, true, r0, n);
      const int64_t col_blocks = (w.n_in + kFp8BlockSize - 1) / kFp8BlockSize;
      s.w.data = sub_rows(w.data, r0, n, w.n_in);
      s.w.scale = sub_rows(w.scale, r0 / kFp8BlockSize, (n + kFp8BlockSize - 1) / kFp8BlockSize, col_blocks * 4);
      return s;
    }
    case WeightFormat::kMxfp4: {
      s.w.data = sub_rows(w.data, r0, n, static_cast<int64_t>(w.data.nbytes) / w.n_out);
      s.w.scale = sub_rows(w.scale, r0, n, static_cast<int64_t>(w.scale.nbytes) / w.n_out);
      return s;
    }
  }
  fail("share of '{}': unknown format", w.name);
}

SharedWeight share_cols_of(const QuantWeight& w, int64_t c0, int64_t n) {
  auto own = [&](const TensorView& v, int64_t rows, int64_t row_bytes, int64_t b0, int64_t nb, Shape shape) {
    auto t = std::make_shared<HostTensor>(v.dtype, std::move(shape));
    BG_CHECK(t->nbytes() == static_cast<size_t>(rows * nb), "share of '{}': {} bytes for [{}, {}]", w.name,
             t->nbytes(), rows, nb);
    copy_cols(v, rows, row_bytes, b0, nb, t->data());
    return t;
  };
  SharedWeight s;
  s.w = w;
  s.w.n_in = n;
  switch (w.format) {
    case WeightFormat::kDense: {
      const auto es = static_cast<int64_t>(dtype_size_bytes(w.data.dtype));
      s.storage.push_back(own(w.data, w.n_out, w.n_in * es, c0 * es, n * es, {w.n_out, n}));
      s.w.data = s.storage[0]->view(w.name);
      return s;
    }
    case WeightFormat::kFp8Block: {
      if (c0 % kFp8BlockSize != 0) return dequantized(w, false, c0, n);
      const int64_t rb = (w.n_out + kFp8BlockSize - 1) / kFp8BlockSize;
      const int64_t cb = (w.n_in + kFp8BlockSize - 1) / kFp8BlockSize, ncb = (n + kFp8BlockSize - 1) / kFp8BlockSize;
      s.storage.push_back(own(w.data, w.n_out, w.n_in, c0, n, {w.n_out, n}));
      s.storage.push_back(own(w.scale, rb, cb * 4, c0 / kFp8BlockSize * 4, ncb * 4, {rb, ncb}));
      s.w.data = s.storage[0]->view(w.name);
      s.w.scale = s.storage[1]->view(w.name + ".scale");
      return s;
    }
    case WeightFormat::kMxfp4: {
      if (c0 % kMxfp4GroupSize != 0 || n % kMxfp4GroupSize != 0) return dequantized(w, false, c0, n);
      s.storage.push_back(own(w.data, w.n_out, w.n_in / 2, c0 / 2, n / 2, {w.n_out, n / 2}));
      s.storage.push_back(own(w.scale, w.n_out, w.n_in / kMxfp4GroupSize, c0 / kMxfp4GroupSize, n / kMxfp4GroupSize,
                              {w.n_out, n / kMxfp4GroupSize}));
      s.w.data = s.storage[0]->view(w.name);
      s.w.scale = s.storage[1]->view(w.name + ".scale");
      return s;
    }
  }
  fail("share of '{}': unknown format", w.name);
}

}  // namespace

SharedWeight share_linear(const QuantWeight& w, const LinearShare& share) {
  if (share.kind == ShareKind::kAll || share.parts == 1) return {w, {}, false};
  BG_CHECK(share.kind == ShareKind::kRows || share.kind == ShareKind::kCols, "share of '{}': not a slice", w.name);
  BG_CHECK(share.parts >= 1 && share.part >= 0 && share.part < share.parts, "share of '{}': part {} of {}", w.name,
           share.part, share.parts);
  const bool rows = share.kind == ShareKind::kRows;
  const int64_t dim = rows ? w.n_out : w.n_in;
  BG_CHECK(dim % share.parts == 0, "'{}': {} {} cannot be split into {} equal tensor-parallel parts", w.name,
           rows ? "output rows" : "input columns", dim, share.parts);
  const int64_t n = dim / share.parts, a0 = share.part * n;
  return rows ? share_rows_of(w, a0, n) : share_cols_of(w, a0, n);
}

std::vector<float> share_rows(const std::vector<float>& v, int64_t n_rows, int32_t parts, int32_t part,
                              const char* what) {
  BG_CHECK(n_rows > 0 && static_cast<int64_t>(v.size()) % n_rows == 0 && n_rows % parts == 0,
           "{}: {} rows cannot be split into {} tensor-parallel parts", what, n_rows, parts);
  const auto row = static_cast<int64_t>(v.size()) / n_rows, n = n_rows / parts;
  return {v.begin() + part * n * row, v.begin() + (part + 1) * n * row};
}

}  // namespace bg
