#include "signals.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <mutex>

#include "common.h"

namespace tide {
namespace {

struct DriverOps {
  PFN_cuStreamBatchMemOp_v11070 batch = nullptr;
  std::string error;
};

const DriverOps& driver_ops() {
  static DriverOps ops;
  static std::once_flag once;
  std::call_once(once, [] {
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    void* fn = nullptr;
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuStreamBatchMemOp", &fn, 12000, cudaEnableDefault, &status);
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr) {
      ops.error = std::string("cuStreamBatchMemOp is unavailable: ") + cudaGetErrorString(err);
      cudaGetLastError();
      return;
    }
    ops.batch = reinterpret_cast<PFN_cuStreamBatchMemOp_v11070>(fn);
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
      fail("cuStreamBatchMemOp failed with CUresult " + std::to_string(static_cast<int>(res)), __FILE__, __LINE__);
    }
  }
}

}  // namespace

bool stream_memops_available() { return driver_ops().batch != nullptr; }

void stream_write_u32(uint64_t stream, const std::vector<uint64_t>& addresses, uint32_t value) {
  if (addresses.empty()) return;
  std::vector<CUstreamBatchMemOpParams> params(addresses.size());
  for (size_t i = 0; i < addresses.size(); ++i) {
    params[i] = {};
    params[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
    params[i].writeValue.address = static_cast<CUdeviceptr>(addresses[i]);
    params[i].writeValue.value = value;
    params[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;  // with a preceding memory barrier
  }
  run_batch(stream, params);
}

void stream_wait_u32(uint64_t stream, const std::vector<uint64_t>& addresses, uint32_t value) {
  if (addresses.empty()) return;
  std::vector<CUstreamBatchMemOpParams> params(addresses.size());
  for (size_t i = 0; i < addresses.size(); ++i) {
    params[i] = {};
    params[i].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
    params[i].waitValue.address = static_cast<CUdeviceptr>(addresses[i]);
    params[i].waitValue.value = value;
    params[i].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
  }
  run_batch(stream, params);
}

}  // namespace tide
