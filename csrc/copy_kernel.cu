#include "common.h"
#include "copy_kernel.h"

namespace tide {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 8;  // independent loads in flight per thread

// Copies one segment with every CTA of the grid, in units of W bytes (W divides the addresses
// and the size, so every access is naturally aligned).
template <typename W>
__device__ __forceinline__ void copy_segment(char* dst, const char* src, uint64_t bytes) {
  const uint64_t units = bytes / sizeof(W);
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  const W* s = reinterpret_cast<const W*>(src);
  W* d = reinterpret_cast<W*>(dst);
  uint64_t u = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
  for (; u + (kUnroll - 1) * stride < units; u += kUnroll * stride) {
    W v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) v[j] = s[u + j * stride];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) d[u + j * stride] = v[j];
  }
  for (; u < units; u += stride) d[u] = s[u];
}

__global__ void __launch_bounds__(kThreads) copy_kernel(const __grid_constant__ CopyArgs a) {
  for (int i = 0; i < a.n; ++i) {
    char* dst = reinterpret_cast<char*>(a.dst[i]);
    const char* src = reinterpret_cast<const char*>(a.src[i]);
    const uint64_t bytes = a.bytes[i];
    const uint64_t align = a.dst[i] | a.src[i] | bytes;
    if ((align & 15) == 0) copy_segment<uint4>(dst, src, bytes);
    else if ((align & 7) == 0) copy_segment<uint2>(dst, src, bytes);
    else if ((align & 3) == 0) copy_segment<uint32_t>(dst, src, bytes);
    else if ((align & 1) == 0) copy_segment<uint16_t>(dst, src, bytes);
    else copy_segment<uint8_t>(dst, src, bytes);
  }
}

}  // namespace

std::vector<CopyArgs> make_copy_args(const std::vector<uint64_t>& dsts, const std::vector<uint64_t>& srcs,
                                     const std::vector<uint64_t>& sizes) {
  TIDE_CHECK(dsts.size() == srcs.size() && srcs.size() == sizes.size(),
             "copy: dsts, srcs and sizes must have the same length");
  std::vector<CopyArgs> launches;
  for (size_t i = 0; i < dsts.size(); ++i) {
    if (sizes[i] == 0) continue;
    TIDE_CHECK(sizes[i] <= UINT64_MAX - dsts[i] && sizes[i] <= UINT64_MAX - srcs[i],
               "copy: a copy runs past the end of the address space");
    if (launches.empty() || launches.back().n == kMaxCopySegments) launches.push_back(CopyArgs{});
    CopyArgs& a = launches.back();
    a.dst[a.n] = dsts[i];
    a.src[a.n] = srcs[i];
    a.bytes[a.n] = sizes[i];
    ++a.n;
  }
  return launches;
}

void launch_copy(const CopyArgs& args, int ctas, uint64_t stream) {
  if (args.n == 0) return;
  copy_kernel<<<std::max(ctas, 1), kThreads, 0, as_stream(stream)>>>(args);
  TIDE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tide
