// Upload of a host QuantWeight (checkpoint view or HostTensor) into device buffers, with the device descriptor.


#include <cuda_bf16.h>

#include <vector>

#include "core/error.h"
#include "ops/linear/linear_cuda.h"

namespace bg::ops {
namespace {

void check_bytes(const TensorView& t, size_t want, const QuantWeight& w, const char* what) {
  BG_CHECK(t.data != nullptr && t.nbytes == want, "upload_weight '{}': {} holds {} bytes, {} expected", w.name, what,
           t.nbytes, want);
}

}  // namespace

DeviceWeightStorage upload_weight(const QuantWeight& w) {
  BG_CHECK(w.n_out > 0 && w.n_in > 0, "upload_weight '{}': empty weight [{}, {}]", w.name, w.n_out, w.n_in);
  const size_t n = static_cast<size_t>(w.n_out) * static_cast<size_t>(w.n_in);
  DeviceWeightStorage s;
  switch (w.format) {
    case WeightFormat::kDense:
      if (w.data.dtype == DType::kBF16) {
        check_bytes(w.data, n * 2, w, "data");
        s.data = cuda::upload_bytes(w.data.data, n * 2);
      } else {
        BG_CHECK(w.data.dtype == DType::kF32 || w.data.dtype == DType::kF16,
                 "upload_weight '{}': dense dtype {} is not F32/F16/BF16", w.name, dtype_name(w.data.dtype));
        check_bytes(w.data, n * dtype_size_bytes(w.data.dtype), w, "data");
        std::vector<uint16_t> bf16(n);
        for (size_t i = 0; i < n; ++i) bf16[i] = f32_to_bf16(w.data.get_f32(static_cast<int64_t>(i)));
        s.data = cuda::upload(bf16);
      }
      break;
    case WeightFormat::kFp8Block: {
      check_bytes(w.data, n, w, "FP8 codes");
      const size_t n_scale = static_cast<size_t>(((w.n_out + 127) / 128) * ((w.n_in + 127) / 128));
      BG_CHECK(w.scale.dtype == DType::kF32, "upload_weight '{}': FP8 scale dtype {} is not F32", w.name,
               dtype_name(w.scale.dtype));
      check_bytes(w.scale, n_scale * sizeof(float), w, "FP8 scale_inv");
      s.data = cuda::upload_bytes(w.data.data, n);
      s.scale = cuda::upload_bytes(w.scale.data, n_scale * sizeof(float));
      break;
    }
    case WeightFormat::kMxfp4: {
      BG_CHECK(w.n_in % kMxfp4GroupSize == 0, "upload_weight '{}': MXFP4 input dim {} is not a multiple of 32",
               w.name, w.n_in);
      check_bytes(w.data, n / 2, w, "MXFP4 codes");
      check_bytes(w.scale, n / kMxfp4GroupSize, w, "MXFP4 scales");
      s.data = cuda::upload_bytes(w.data.data, n / 2);
      s.scale = cuda::upload_bytes(w.scale.data, n / kMxfp4GroupSize);
      break;
    }
  }
  s.desc = DeviceWeight{w.format, w.n_out, w.n_in, s.data.data(), s.scale.data()};
  return s;
}

}  // namespace bg::ops

namespace bg::ops {

std::pair<size_t, size_t> device_weight_bytes(const QuantWeight& w) {
  const size_t n = static_cast<size_t>(w.n_out) * static_cast<size_t>(w.n_in);
  switch (w.format) {
    case WeightFormat::kDense: return {n * 2, 0};
    case WeightFormat::kFp8Block:
      return {n, static_cast<size_t>(((w.n_out + 127) / 128) * ((w.n_in + 127) / 128)) * sizeof(float)};
    case WeightFormat::kMxfp4: return {n / 2, n / kMxfp4GroupSize};
  }
  return {0, 0};
}

}  // namespace bg::ops
