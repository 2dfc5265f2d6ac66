// `batchgen weightd bench`: how fast a store reaches the GPU. Pins every segment (cudaHostRegister), copies each to
// device memory and compares the rate with a cudaMallocHost buffer's (the pinned host-to-device ceiling). CUDA builds
// only; elsewhere an error.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace bg::weights {

// Attaches to `store` (its daemon must be running) and returns the measurements as JSON.
nlohmann::json bench_store_upload(const std::string& store, int device, int repeats);

}  // namespace bg::weights
