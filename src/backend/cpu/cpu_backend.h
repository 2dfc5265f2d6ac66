// The CPU backend: fp32 activations, every op is the reference `*_cpu` function.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace bg {

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace bg
