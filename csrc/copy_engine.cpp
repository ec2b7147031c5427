#include "copy_engine.h"

#include "common.h"

namespace tide {

void memcpy_batch(const std::vector<uint64_t>& dsts, const std::vector<uint64_t>& srcs,
                  const std::vector<uint64_t>& sizes, uint64_t stream, bool prefer_overlap) {
  TIDE_CHECK(dsts.size() == srcs.size() && srcs.size() == sizes.size(),
             "memcpy_batch: dsts, srcs and sizes must have the same length");
  if (dsts.empty()) return;
  std::vector<void*> d(dsts.size());
  std::vector<const void*> s(srcs.size());
  std::vector<size_t> n(sizes.size());
  size_t count = 0;
  for (size_t i = 0; i < dsts.size(); ++i) {
    if (sizes[i] == 0) continue;  // zero-byte copies are not valid batch entries
    TIDE_CHECK(sizes[i] <= UINT64_MAX - dsts[i] && sizes[i] <= UINT64_MAX - srcs[i],
               "memcpy_batch: a copy runs past the end of the address space");
    d[count] = as_ptr(dsts[i]);
    s[count] = as_ptr(srcs[i]);
    n[count] = sizes[i];
    ++count;
  }
  if (count == 0) return;
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = prefer_overlap ? cudaMemcpyFlagPreferOverlapWithCompute : cudaMemcpyFlagDefault;
  size_t attr_index = 0;
  cudaError_t err = cudaMemcpyBatchAsync(d.data(), s.data(), n.data(), count, &attr, &attr_index, 1, as_stream(stream));
  if (err == cudaErrorNotSupported || err == cudaErrorInvalidValue) {
    // Older drivers or capture: fall back to one copy per descriptor (same stream order).
    cudaGetLastError();
    for (size_t i = 0; i < count; ++i) {
      TIDE_CUDA_CHECK(cudaMemcpyAsync(d[i], s[i], n[i], cudaMemcpyDefault, as_stream(stream)));
    }
    return;
  }
  TIDE_CUDA_CHECK(err);
}

void check_copy_2d(uint64_t dpitch, uint64_t spitch, uint64_t width, uint64_t height) {
  TIDE_CHECK(height <= 1 || (width <= dpitch && width <= spitch), "memcpy_2d: width must be at most dpitch and spitch");
}

void memcpy_2d(uint64_t dst, uint64_t dpitch, uint64_t src, uint64_t spitch, uint64_t width, uint64_t height,
               uint64_t stream) {
  check_copy_2d(dpitch, spitch, width, height);
  if (width == 0 || height == 0) return;
  TIDE_CUDA_CHECK(
      cudaMemcpy2DAsync(as_ptr(dst), dpitch, as_ptr(src), spitch, width, height, cudaMemcpyDefault, as_stream(stream)));
}

int memcpy_2d_probe(uint64_t dst, uint64_t src, uint64_t pitch, uint64_t width, uint64_t stream) {
  const cudaError_t err =
      cudaMemcpy2DAsync(as_ptr(dst), pitch, as_ptr(src), pitch, width, 1, cudaMemcpyDefault, as_stream(stream));
  if (err != cudaSuccess) cudaGetLastError();  // a refused argument is not sticky: clear it
  return static_cast<int>(err);
}

int64_t device_max_pitch() {
  int device = 0, pitch = 0;
  TIDE_CUDA_CHECK(cudaGetDevice(&device));
  TIDE_CUDA_CHECK(cudaDeviceGetAttribute(&pitch, cudaDevAttrMaxPitch, device));
  return pitch;
}

}  // namespace tide
