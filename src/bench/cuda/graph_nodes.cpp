// What each kernel node of a captured graph is: its launch shape, and registers, static shared memory, max threads
// and resident CTAs per SM of its function. Read through the driver API (reached via cudaGetDriverEntryPointByVersion,
// so the binary does not link libcuda), which sees every kernel: this file's, the repository's, and cuBLAS's (a
// library's kernels are unknown to this binary's runtime, so cudaFuncGetAttributes cannot see them).
#include <cuda.h>

#include <map>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "bench/cuda/graph_nodes.h"
#include "core/log.h"

namespace bg::bench::cuda {
namespace {

struct DriverApi {
  decltype(&::cuGraphKernelNodeGetParams) node_params = nullptr;
  decltype(&::cuKernelGetFunction) kernel_function = nullptr;
  decltype(&::cuFuncGetAttribute) func_attribute = nullptr;
  decltype(&::cuFuncGetName) func_name = nullptr;
  decltype(&::cuOccupancyMaxActiveBlocksPerMultiprocessor) occupancy = nullptr;
  bool ok = false;
};

template <typename Fn>
void resolve(const char* name, Fn& fn, bool& ok) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status{};
  // ABI of CUDA 12.8: cuGraphKernelNodeGetParams resolves to its _v2 form (CUDA_KERNEL_NODE_PARAMS_v2, as declared).
  if (cudaGetDriverEntryPointByVersion(name, &p, 12080, cudaEnableDefault, &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    ok = false;
    return;
  }
  fn = reinterpret_cast<Fn>(p);
}

const DriverApi& driver_api() {
  static const DriverApi api = [] {
    DriverApi a;
    a.ok = true;
    resolve("cuGraphKernelNodeGetParams", a.node_params, a.ok);
    resolve("cuKernelGetFunction", a.kernel_function, a.ok);
    resolve("cuFuncGetAttribute", a.func_attribute, a.ok);
    resolve("cuFuncGetName", a.func_name, a.ok);
    resolve("cuOccupancyMaxActiveBlocksPerMultiprocessor", a.occupancy, a.ok);
    if (!a.ok) log::warn("bench: driver entry points for graph-node inspection are missing; registers and occupancy "
                         "are reported as null");
    return a;
  }();
  return api;
}

std::optional<int64_t> attribute(const DriverApi& api, CUfunction f, CUfunction_attribute which) {
  int v = 0;
  if (api.func_attribute(&v, which, f) != CUDA_SUCCESS) return std::nullopt;
  return v;
}

}  // namespace

std::vector<LaunchInfo> inspect_kernel_nodes(cudaGraph_t graph) {
  size_t n = 0;
  BG_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  BG_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  const DriverApi& api = driver_api();
  std::vector<LaunchInfo> out;
  std::map<std::string, size_t> seen;  // one entry per distinct (function, launch shape)
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    BG_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeKernel || !api.ok) continue;
    CUDA_KERNEL_NODE_PARAMS p{};
    if (api.node_params(reinterpret_cast<CUgraphNode>(node), &p) != CUDA_SUCCESS) continue;
    CUfunction f = p.func;
    if (f == nullptr && p.kern != nullptr && api.kernel_function(&f, p.kern) != CUDA_SUCCESS) f = nullptr;
    LaunchInfo li;
    li.grid = static_cast<int64_t>(p.gridDimX) * p.gridDimY * p.gridDimZ;
    li.block = static_cast<int64_t>(p.blockDimX) * p.blockDimY * p.blockDimZ;
    li.dynamic_smem = p.sharedMemBytes;
    li.kernel = "?";
    if (f != nullptr) {
      const char* name = nullptr;
      if (api.func_name(&name, f) == CUDA_SUCCESS && name != nullptr) li.kernel = name;
      li.registers = attribute(api, f, CU_FUNC_ATTRIBUTE_NUM_REGS);
      li.static_smem = attribute(api, f, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES);
      li.max_threads = attribute(api, f, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
      int blocks = 0;
      if (api.occupancy(&blocks, f, static_cast<int>(li.block), p.sharedMemBytes) == CUDA_SUCCESS) {
        li.blocks_per_sm = blocks;
      }
    }
    const std::string key = li.kernel + "/" + std::to_string(li.grid) + "/" + std::to_string(li.block);
    if (seen.emplace(key, out.size()).second) out.push_back(std::move(li));
  }
  return out;
}

}  // namespace bg::bench::cuda
