#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"
#include "sum_kernel.h"

namespace tide {
namespace {

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }

// Eight consecutive elements as fp32, with 16-byte loads.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  if constexpr (sizeof(T) == 2) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_f32<T>(e[i]);
  } else {
    float4 a = *reinterpret_cast<const float4*>(p);
    float4 b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
}

__device__ __forceinline__ int find_segment(const SumArgs& a, int64_t i) {
  int lo = 0, hi = a.n_segments - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (a.segments[mid].offset <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ float finish(const SumArgs& a, float acc, float previous) {
  // Two separately rounded operations, never a fused multiply-add: the reference transport does
  // t = alpha * T, then out + t.
  float t = __fmul_rn(a.alpha, acc);
  return a.accumulate ? __fadd_rn(previous, t) : t;
}

template <typename T>
__device__ float element_sum(const SumArgs& a, const SumSegment& seg, int64_t i) {
  int64_t local = i - seg.offset;
  if (local >= seg.valid) return 0.0f;
  const T* own = reinterpret_cast<const T*>(seg.own);
  if (a.n_staged == 0) return to_f32<T>(own[local]);
  float acc = to_f32<T>(reinterpret_cast<const T*>(a.staged[0])[i]);
  for (int s = 1; s < a.n_staged; ++s) acc = __fadd_rn(acc, to_f32<T>(reinterpret_cast<const T*>(a.staged[s])[i]));
  return __fadd_rn(acc, to_f32<T>(own[local]));
}

// Unit u (8 elements from a.first + 8u): its first element, the owner's own rows there, and whether
// it can take the vector path (whole, inside one segment's valid rows, 16-byte aligned).
template <typename T>
__device__ __forceinline__ void locate_unit(const SumArgs& a, int64_t u, int64_t units, int64_t end, int64_t& i0,
                                            const T*& own, bool& fast) {
  i0 = a.first + 8 * u;
  own = nullptr;
  fast = false;
  if (u < units) {
    const SumSegment& seg = a.segments[find_segment(a, i0)];
    const int64_t local = i0 - seg.offset;
    own = reinterpret_cast<const T*>(seg.own) + local;
    fast = i0 + 8 <= end && local + 8 <= seg.valid && (reinterpret_cast<uintptr_t>(own) & 15) == 0;
  }
}

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // independent 8-element units per thread per iteration: loads in flight

template <typename T>
__global__ void __launch_bounds__(kThreads) sum_kernel(const __grid_constant__ SumArgs a) {
  const int64_t units = (a.count + 7) / 8;
  const int64_t end = a.first + a.count;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t u0 = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; u0 < units; u0 += stride * kUnroll) {
    int64_t i0[kUnroll];
    const T* own[kUnroll];
    bool fast[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) locate_unit<T>(a, u0 + j * stride, units, end, i0[j], own[j], fast[j]);
    // Whole, aligned units: every source's 16-byte loads for all units are issued before the adds.
    float acc[kUnroll][8];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (fast[j]) load8<T>(a.n_staged ? reinterpret_cast<const T*>(a.staged[0]) + i0[j] : own[j], acc[j]);
    }
    for (int s = 1; s <= a.n_staged; ++s) {  // staged sources 1..n-1, then the owner's own rows
      const T* src = s < a.n_staged ? reinterpret_cast<const T*>(a.staged[s]) : nullptr;
      float v[kUnroll][8];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        if (fast[j]) load8<T>(src ? src + i0[j] : own[j], v[j]);
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        if (fast[j]) {
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[j][k] = __fadd_rn(acc[j][k], v[j][k]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (fast[j]) {
        float4* out = reinterpret_cast<float4*>(a.out + i0[j]);
        float4 p0 = make_float4(0.f, 0.f, 0.f, 0.f), p1 = p0;
        if (a.accumulate) { p0 = out[0]; p1 = out[1]; }
        out[0] = make_float4(finish(a, acc[j][0], p0.x), finish(a, acc[j][1], p0.y), finish(a, acc[j][2], p0.z),
                             finish(a, acc[j][3], p0.w));
        out[1] = make_float4(finish(a, acc[j][4], p1.x), finish(a, acc[j][5], p1.y), finish(a, acc[j][6], p1.z),
                             finish(a, acc[j][7], p1.w));
      } else if (own[j] != nullptr) {  // segment boundary, padding, misalignment or the tail
        for (int64_t i = i0[j]; i < i0[j] + 8 && i < end; ++i) {
          const SumSegment& s = a.segments[find_segment(a, i)];
          a.out[i] = finish(a, element_sum<T>(a, s, i), a.accumulate ? a.out[i] : 0.0f);
        }
      }
    }
  }
}

// 16-bit gradients with a compile-time number of staged sources: every source's loads for U units
// are issued before any add, so each thread keeps U*(NS+1) 16-byte loads in flight (the generic
// kernel above keeps U). The association order is the generic kernel's.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&v)[8]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = to_f32<T>(e[i]);
}

template <typename T, int NS, int U>
__global__ void __launch_bounds__(kThreads) sum_fast_kernel(const __grid_constant__ SumArgs a) {
  static_assert(sizeof(T) == 2, "the fast kernel reads 16-bit gradients");
  const int64_t units = (a.count + 7) / 8;
  const int64_t end = a.first + a.count;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t u0 = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; u0 < units; u0 += stride * U) {
    int64_t i0[U];
    const T* own[U];
    bool fast[U];
#pragma unroll
    for (int j = 0; j < U; ++j) locate_unit<T>(a, u0 + j * stride, units, end, i0[j], own[j], fast[j]);
    uint4 raw[U][NS + 1];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (fast[j]) {
#pragma unroll
        for (int s = 0; s < NS; ++s) raw[j][s] = __ldcs(reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(a.staged[s]) + i0[j]));
        raw[j][NS] = __ldcs(reinterpret_cast<const uint4*>(own[j]));
      }
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (fast[j]) {
        float acc[8], v[8];
        unpack8<T>(raw[j][0], acc);
#pragma unroll
        for (int s = 1; s <= NS; ++s) {
          unpack8<T>(raw[j][s], v);
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[k] = __fadd_rn(acc[k], v[k]);
        }
        float4* out = reinterpret_cast<float4*>(a.out + i0[j]);
        float4 p0 = make_float4(0.f, 0.f, 0.f, 0.f), p1 = p0;
        if (a.accumulate) { p0 = out[0]; p1 = out[1]; }
        __stcs(out, make_float4(finish(a, acc[0], p0.x), finish(a, acc[1], p0.y), finish(a, acc[2], p0.z),
                                finish(a, acc[3], p0.w)));
        __stcs(out + 1, make_float4(finish(a, acc[4], p1.x), finish(a, acc[5], p1.y), finish(a, acc[6], p1.z),
                                    finish(a, acc[7], p1.w)));
      } else if (own[j] != nullptr) {
        for (int64_t i = i0[j]; i < i0[j] + 8 && i < end; ++i) {
          const SumSegment& s = a.segments[find_segment(a, i)];
          a.out[i] = finish(a, element_sum<T>(a, s, i), a.accumulate ? a.out[i] : 0.0f);
        }
      }
    }
  }
}

template <typename T>
bool launch_fast(const SumArgs& a, int blocks, cudaStream_t s) {
  switch (a.n_staged) {
    case 1: sum_fast_kernel<T, 1, 8><<<blocks, kThreads, 0, s>>>(a); return true;
    case 2: sum_fast_kernel<T, 2, 4><<<blocks, kThreads, 0, s>>>(a); return true;
    case 3: sum_fast_kernel<T, 3, 4><<<blocks, kThreads, 0, s>>>(a); return true;
    case 4: sum_fast_kernel<T, 4, 2><<<blocks, kThreads, 0, s>>>(a); return true;
    case 5: sum_fast_kernel<T, 5, 2><<<blocks, kThreads, 0, s>>>(a); return true;
    case 6: sum_fast_kernel<T, 6, 2><<<blocks, kThreads, 0, s>>>(a); return true;
    case 7: sum_fast_kernel<T, 7, 2><<<blocks, kThreads, 0, s>>>(a); return true;
    default: return false;
  }
}

}  // namespace

SumLaunch make_sum_launch(uint64_t out, const std::vector<uint64_t>& staged, const std::vector<SumSegment>& segments,
                          int64_t first, int64_t count, float alpha, bool accumulate, int dtype, int ctas) {
  TIDE_CHECK(staged.size() <= static_cast<size_t>(kMaxSources), "launch_sum: too many staged sources");
  TIDE_CHECK(!segments.empty() && segments.size() <= static_cast<size_t>(kMaxSegments),
             "launch_sum: segment count must be in [1, " + std::to_string(kMaxSegments) + "]");
  TIDE_CHECK(first % 8 == 0, "launch_sum: first element must be a multiple of 8");
  TIDE_CHECK((out & 15) == 0, "launch_sum: out must be 16-byte aligned");
  TIDE_CHECK(dtype >= 0 && dtype <= 2, "launch_sum: dtype must be 0 (bf16), 1 (fp16) or 2 (fp32)");
  SumLaunch l = {};
  SumArgs& a = l.args;
  a.out = reinterpret_cast<float*>(out);
  for (size_t s = 0; s < staged.size(); ++s) {
    TIDE_CHECK((staged[s] & 15) == 0, "launch_sum: staged chunks must be 16-byte aligned");
    a.staged[s] = as_ptr(staged[s]);
  }
  a.n_staged = static_cast<int>(staged.size());
  a.n_segments = static_cast<int>(segments.size());
  for (size_t s = 0; s < segments.size(); ++s) a.segments[s] = segments[s];
  a.first = first;
  a.count = count;
  a.alpha = alpha;
  a.accumulate = accumulate ? 1 : 0;
  const int64_t units = (std::max<int64_t>(count, 0) + 7) / 8;
  l.blocks = static_cast<int>(std::min<int64_t>(std::max(ctas, 1), std::max<int64_t>(1, (units + kThreads - 1) / kThreads)));
  l.dtype = dtype;
  return l;
}

void launch_sum(const SumLaunch& l, uint64_t stream) {
  if (l.args.count <= 0) return;
  cudaStream_t s = as_stream(stream);
  const SumArgs& a = l.args;
  switch (l.dtype) {
    case 0: if (!launch_fast<__nv_bfloat16>(a, l.blocks, s)) sum_kernel<__nv_bfloat16><<<l.blocks, kThreads, 0, s>>>(a); break;
    case 1: if (!launch_fast<__half>(a, l.blocks, s)) sum_kernel<__half><<<l.blocks, kThreads, 0, s>>>(a); break;
    default: sum_kernel<float><<<l.blocks, kThreads, 0, s>>>(a); break;
  }
  TIDE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tide
