// The CPU backend: fp32 activations, every op is the reference `*_cpu` function. With bf16 emulation ("cpu-bf16")
// it rounds to bf16 exactly where the CUDA backend stores bf16 (activations, the MLA cache, W_UK/W_UV, F32/F16 dense
// weights, the expert GLU output), computing in fp32 in between: the model's own bf16 sensitivity, measured without a
// GPU (docs/GPU.md).
#pragma once

#include <memory>

#include "backend/backend.h"

namespace bg {

std::unique_ptr<Backend> make_cpu_backend(bool emulate_bf16 = false);

}  // namespace bg
