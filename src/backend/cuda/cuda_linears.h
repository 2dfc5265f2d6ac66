// Load-time preparation of the CUDA backend's linear weights: one upload per batch (cuda::WeightUploader), a handle
// per weight, and a fused handle per run of the batch that can be one weight (model/backend_weights.h groups).
#pragma once

#include <span>

#include "backend/backend.h"
#include "backend/cuda/weight_uploader.h"

namespace bg::cuda {

// Whether `parts` can run as one linear: at least two, all dense (bf16 on the device) with one n_in that keeps every
// part's rows 16-byte aligned when they follow each other.
bool fusable_linears(std::span<const QuantWeight* const> parts);

// Uploads the batch (each fusable run's weights back to back) and makes the handles; a run that is not fusable gets a
// null fused handle (its parts run one by one).
PreparedLinears prepare_linears(WeightUploader& uploader, const LinearBatch& batch);

// Output rows of a group above which CudaBackend::linear_group runs the parts one by one: past it the fused GEMM
// saves nothing (each part is a compute-bound GEMM) and the split would copy every output once more.
inline constexpr int64_t kLinearGroupMaxFusedRows = 64;

// BG_LINEAR_GROUPS=0 runs every group part by part (A/B measurement, triage); unset or 1 fuses. Another value throws.
// Read when the backend is made.
bool linear_groups_from_env();
// An on/off switch of the CUDA backend from the environment: unset or "1" on, "0" off, anything else an error.
bool switch_from_env(const char* name);

}  // namespace bg::cuda
