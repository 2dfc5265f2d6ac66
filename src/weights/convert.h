// `batchgen convert`: re-packs a checkpoint. Routed experts stored as BF16 / F16 / F32 / FP8 blocks can be quantized
// to MXFP4 (OCP Microscaling v1.0: per 32 values one E8M0 scale 2^(floor(log2(amax)) - 2), E2M1 elements rounded to
// nearest, ties to even, saturating at 6; written in the compressed-tensors naming `weight_packed` / `weight_scale`),
// and the whole checkpoint can be written in the weight store's layout (store.manifest + segment files), which
// weightd loads with straight sequential reads and no re-layout. Everything else is copied byte for byte; every
// output tensor is checksummed and the quantization error of every converted expert is measured and reported.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace bg::weights {

struct ConvertOptions {
  std::filesystem::path in;
  std::filesystem::path out;
  bool experts_mxfp4 = false;       // --experts mxfp4
  bool store_layout = false;        // --layout store
  bool w4a16_experts = false;       // --expert-layout w4a16 (with --layout store): MXFP4 experts as W4A16 blocks
  uint64_t segment_max_bytes = uint64_t{8} << 30;
  bool force = false;               // write into a non-empty output directory
  int progress_tty = -1;
};

struct ConvertReport {
  int64_t n_tensors = 0;
  int64_t n_quantized = 0;           // expert linears converted to MXFP4
  double max_rel_rms_error = 0.0;    // over converted linears: ||W - Q(W)||_2 / ||W||_2 (W as stored, dequantized)
  double mean_rel_rms_error = 0.0;
  uint64_t bytes_in = 0;
  uint64_t bytes_out = 0;
  double seconds = 0.0;
  int64_t w4a16_packed = 0;          // experts written as W4A16 blocks
  int64_t w4a16_kept = 0;            // MXFP4 experts the layout cannot hold exactly, left as they are
};

// Throws bg::Error naming the tensor or file; a failed conversion leaves no half-written checkpoint behind (the
// output's checkpoint files are removed).
ConvertReport convert_checkpoint(const ConvertOptions& options);

// One row of OCP MXFP4: n (a multiple of 32) fp32 values -> n/2 code bytes (low nibble = even element) and n/32 E8M0
// scales. Throws on NaN or infinity (naming `what`).
void quantize_row_mxfp4_ocp(const float* x, int64_t n, uint8_t* codes, uint8_t* scales, const std::string& what);

}  // namespace bg::weights
