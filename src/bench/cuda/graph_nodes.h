// Launch shapes and resources of the kernel nodes of a captured graph (graph_nodes.cpp).
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "bench/bench_report.h"

namespace bg::bench::cuda {

// One LaunchInfo per distinct (kernel, grid, block) among the graph's kernel nodes, in node order. Resource fields
// stay empty where the driver cannot tell (logged once).
std::vector<LaunchInfo> inspect_kernel_nodes(cudaGraph_t graph);

}  // namespace bg::bench::cuda
