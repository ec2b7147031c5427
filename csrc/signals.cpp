#include "signals.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <mutex>

#include "common.h"

namespace tide {
namespace {

struct DriverOps {
  PFN_cuStreamBatchMemOp_v11070 batch = nullptr;
  PFN_cuGraphAddBatchMemOpNode_v11070 add_node = nullptr;
  PFN_cuGraphExecBatchMemOpNodeSetParams_v11070 exec_set = nullptr;
  PFN_cuCtxGetCurrent_v4000 current_context = nullptr;
  std::string error;
};

template <typename F>
bool entry_point(const char* name, F& fn, std::string& error) {
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  void* address = nullptr;
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &address, 12000, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || address == nullptr) {
    error = std::string(name) + " is unavailable: " + cudaGetErrorString(err);
    cudaGetLastError();
    return false;
  }
  fn = reinterpret_cast<F>(address);
  return true;
}

const DriverOps& driver_ops() {
  static DriverOps ops;
  static std::once_flag once;
  std::call_once(once, [] {
    // The graph entry points are only needed by graph replay; their absence is reported there.
    if (!entry_point("cuStreamBatchMemOp", ops.batch, ops.error)) return;
    std::string graph_error;
    if (!entry_point("cuGraphAddBatchMemOpNode", ops.add_node, graph_error) ||
        !entry_point("cuGraphExecBatchMemOpNodeSetParams", ops.exec_set, graph_error) ||
        !entry_point("cuCtxGetCurrent", ops.current_context, graph_error)) {
      ops.add_node = nullptr;
      ops.error = graph_error;
    }
  });
  return ops;
}

void run_batch(uint64_t stream, std::vector<CUstreamBatchMemOpParams>& params) {
  const DriverOps& ops = driver_ops();
  TIDE_CHECK(ops.batch != nullptr, ops.error);
  // The driver limits one batch to 256 operations.
  for (size_t first = 0; first < params.size(); first += 256) {
    unsigned int count = static_cast<unsigned int>(std::min<size_t>(256, params.size() - first));
    CUresult res = ops.batch(reinterpret_cast<CUstream>(as_stream(stream)), count, params.data() + first, 0);
    if (res != CUDA_SUCCESS) {
      fail("cuStreamBatchMemOp failed with CUresult " + std::to_string(static_cast<int>(res)), __FILE__,
           __LINE__);
    }
  }
}

// Writes (each preceded by a memory barrier) or cyclic >= waits of `value` at each address.
std::vector<CUstreamBatchMemOpParams> flag_params(bool wait, const std::vector<uint64_t>& addresses, uint32_t value) {
  std::vector<CUstreamBatchMemOpParams> params(addresses.size());
  for (size_t i = 0; i < addresses.size(); ++i) {
    params[i] = {};
    if (wait) {
      params[i].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
      params[i].waitValue.address = static_cast<CUdeviceptr>(addresses[i]);
      params[i].waitValue.value = value;
      params[i].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    } else {
      params[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      params[i].writeValue.address = static_cast<CUdeviceptr>(addresses[i]);
      params[i].writeValue.value = value;
      params[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
  }
  return params;
}

}  // namespace

bool stream_memops_available() { return driver_ops().batch != nullptr; }

void stream_write_u32(uint64_t stream, const std::vector<uint64_t>& addresses, uint32_t value) {
  if (addresses.empty()) return;
  std::vector<CUstreamBatchMemOpParams> params = flag_params(false, addresses, value);
  run_batch(stream, params);
}

void stream_wait_u32(uint64_t stream, const std::vector<uint64_t>& addresses, uint32_t value) {
  if (addresses.empty()) return;
  std::vector<CUstreamBatchMemOpParams> params = flag_params(true, addresses, value);
  run_batch(stream, params);
}

namespace {

const DriverOps& graph_ops() {
  const DriverOps& ops = driver_ops();
  TIDE_CHECK(ops.add_node != nullptr, ops.error);
  return ops;
}

CUDA_BATCH_MEM_OP_NODE_PARAMS node_params(const DriverOps& ops, std::vector<CUstreamBatchMemOpParams>& params) {
  TIDE_CHECK(!params.empty() && params.size() <= 256, "graph flag node: 1 to 256 addresses");
  CUDA_BATCH_MEM_OP_NODE_PARAMS node = {};
  CUresult res = ops.current_context(&node.ctx);
  TIDE_CHECK(res == CUDA_SUCCESS, "cuCtxGetCurrent failed with CUresult " + std::to_string(static_cast<int>(res)));
  node.count = static_cast<unsigned int>(params.size());
  node.paramArray = params.data();
  return node;
}

}  // namespace

cudaGraphNode_t graph_add_flags(cudaGraph_t graph, const std::vector<cudaGraphNode_t>& deps, bool wait,
                                const std::vector<uint64_t>& addresses, uint32_t value) {
  const DriverOps& ops = graph_ops();
  std::vector<CUstreamBatchMemOpParams> params = flag_params(wait, addresses, value);
  CUDA_BATCH_MEM_OP_NODE_PARAMS node = node_params(ops, params);
  CUgraphNode added = nullptr;
  CUresult res = ops.add_node(&added, reinterpret_cast<CUgraph>(graph), reinterpret_cast<const CUgraphNode*>(deps.data()),
                              deps.size(), &node);
  TIDE_CHECK(res == CUDA_SUCCESS, "cuGraphAddBatchMemOpNode failed with CUresult " + std::to_string(static_cast<int>(res)));
  return reinterpret_cast<cudaGraphNode_t>(added);
}

void graph_exec_set_flags(cudaGraphExec_t exec, cudaGraphNode_t graph_node, bool wait,
                          const std::vector<uint64_t>& addresses, uint32_t value) {
  const DriverOps& ops = graph_ops();
  std::vector<CUstreamBatchMemOpParams> params = flag_params(wait, addresses, value);
  CUDA_BATCH_MEM_OP_NODE_PARAMS node = node_params(ops, params);
  CUresult res = ops.exec_set(reinterpret_cast<CUgraphExec>(exec), reinterpret_cast<CUgraphNode>(graph_node), &node);
  TIDE_CHECK(res == CUDA_SUCCESS,
             "cuGraphExecBatchMemOpNodeSetParams failed with CUresult " + std::to_string(static_cast<int>(res)));
}

}  // namespace tide
