#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"
#include "sum_kernel.h"

namespace tide {
namespace {

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_f32<float>(float v) {
  return v;
}

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
    // clang-format off
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    // clang-format on
  }
}

__device__ __forceinline__ int find_segment(const SumArgs& a, int64_t i) {
  int lo = 0, hi = a.n_segments - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (a.segments[mid].offset <= i) lo = mid;
    else hi = mid - 1;
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

// Elements [i, stop) one at a time: segment boundaries, padding, misalignment, the tail. Out of
// line: inlined, this rare path took registers from the vector paths (sum_fast_kernel<T, 1, 8>
// spilled on sm_90, several instances on sm_100).
template <typename T>
__device__ __noinline__ void sum_elements(const SumArgs& a, int64_t i, int64_t stop) {
  for (; i < stop; ++i) {
    const SumSegment& s = a.segments[find_segment(a, i)];
    a.out[i] = finish(a, element_sum<T>(a, s, i), a.accumulate ? a.out[i] : 0.0f);
  }
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
        if (a.accumulate) {
          p0 = out[0];
          p1 = out[1];
        }
        out[0] = make_float4(finish(a, acc[j][0], p0.x), finish(a, acc[j][1], p0.y), finish(a, acc[j][2], p0.z),
                             finish(a, acc[j][3], p0.w));
        out[1] = make_float4(finish(a, acc[j][4], p1.x), finish(a, acc[j][5], p1.y), finish(a, acc[j][6], p1.z),
                             finish(a, acc[j][7], p1.w));
      } else if (own[j] != nullptr) {  // segment boundary, padding, misalignment or the tail
        sum_elements<T>(a, i0[j], i0[j] + 8 < end ? i0[j] + 8 : end);
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
        for (int s = 0; s < NS; ++s)
          raw[j][s] = __ldcs(reinterpret_cast<const uint4*>(reinterpret_cast<const T*>(a.staged[s]) + i0[j]));
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
        if (a.accumulate) {
          p0 = out[0];
          p1 = out[1];
        }
        __stcs(out, make_float4(finish(a, acc[0], p0.x), finish(a, acc[1], p0.y), finish(a, acc[2], p0.z),
                                finish(a, acc[3], p0.w)));
        __stcs(out + 1, make_float4(finish(a, acc[4], p1.x), finish(a, acc[5], p1.y), finish(a, acc[6], p1.z),
                                    finish(a, acc[7], p1.w)));
      } else if (own[j] != nullptr) {
        sum_elements<T>(a, i0[j], i0[j] + 8 < end ? i0[j] + 8 : end);
      }
    }
  }
}

template <typename T>
bool launch_fast(const SumArgs& a, int blocks, cudaStream_t s) {
  // clang-format off: one line per case reads as a table
  switch (a.n_staged) {
    case 1:
      sum_fast_kernel<T, 1, 8><<<blocks, kThreads, 0, s>>>(a);
      return true;
    case 2:
      sum_fast_kernel<T, 2, 4><<<blocks, kThreads, 0, s>>>(a);
      return true;
    case 3:
      sum_fast_kernel<T, 3, 4><<<blocks, kThreads, 0, s>>>(a);
      return true;
    case 4:
      sum_fast_kernel<T, 4, 2><<<blocks, kThreads, 0, s>>>(a);
      return true;
    case 5:
      sum_fast_kernel<T, 5, 2><<<blocks, kThreads, 0, s>>>(a);
      return true;
    case 6:
      sum_fast_kernel<T, 6, 2><<<blocks, kThreads, 0, s>>>(a);
      return true;
    case 7:
      sum_fast_kernel<T, 7, 2><<<blocks, kThreads, 0, s>>>(a);
      return true;
    default:
      return false;
  }
  // clang-format on
}

// TMA pipeline (sm_90+), 16-bit gradients with NS <= kTmaMaxStaged staged sources. In the register
// kernels every thread locates its units (a binary search each), loads, waits, then adds and
// stores, so an SM's reads in flight come in bursts (measured: ~56 GB/s per SM on H200). Here one
// producer thread per CTA streams tiles of every source into shared memory with bulk copies, up
// to kTmaMaxStages deep, so a CTA keeps ~100-200 KB of reads in flight at all times while its
// consumer warps convert, add (same association order, same rounding) and store fp32 output.
constexpr int kTmaConsumers = 512;               // threads converting, adding and storing
constexpr int kTmaThreads = kTmaConsumers + 32;  // + the producer's warp
constexpr int kTmaMaxStages = 12;
constexpr int kTmaMaxPieces = 16;  // own-row bulk copies per tile; more segments go per element
constexpr int kTmaSmemBudget = 200 * 1024;

// Stage layout (16-bit elements): n_staged staged tiles, the owner's tile (elements of bulk-copied
// pieces only), then the previous output (fp32, accumulate only).
__host__ __device__ constexpr int tma_stage_bytes(int n_staged, int tile, bool accumulate) {
  return tile * 2 * (n_staged + 1) + (accumulate ? tile * 4 : 0);
}

// A tile's own-row pieces [begin, end) (tile-relative elements, whole units) that are 16-byte
// aligned at the source and fully valid; units outside every piece take the per-element path.
struct TilePieces {
  int count;
  int2 piece[kTmaMaxPieces];
};

// Device code below this line up to the kernel is sm_90+ only (bulk copies, transaction counts).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

// Release semantics: the producer's piece table and the consumers' shared-memory reads are
// ordered before the waiting side's acquire.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n"
      :
      : "r"(smem_address(bar)), "r"(parity)
      : "memory");
}

// `bytes` (a multiple of 16) from global `src` to shared `dst`, both 16-byte aligned; completes
// `bytes` of the barrier's transaction count.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  mbarrier_expect_tx(bar, bytes);
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :
               : "r"(smem_address(dst)), "l"(src), "r"(bytes), "r"(smem_address(bar))
               : "memory");
}

template <typename T, int NS>
__device__ void produce_tiles(const SumArgs& a, unsigned char* stages_mem, uint64_t* full, uint64_t* empty,
                              TilePieces* pieces, int tile, int stages) {
  const int64_t end = a.first + a.count;
  const int64_t n_tiles = (a.count + tile - 1) / tile;
  const int stage_bytes = tma_stage_bytes(NS, tile, a.accumulate);
  int k = 0;
  for (int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x, ++k) {
    const int s = k % stages;
    if (k >= stages) mbarrier_wait(&empty[s], (k / stages - 1) & 1);
    const int64_t t0 = a.first + t * tile;
    // Bulk copies cover whole units; the tail's partial unit goes per element.
    const int64_t whole_end = t0 + ((end - t0 < tile ? end - t0 : tile) & ~int64_t{7});
    T* stage = reinterpret_cast<T*>(stages_mem + static_cast<size_t>(s) * stage_bytes);
    T* own_tile = stage + NS * tile;
    int n = 0;
    for (int g = find_segment(a, t0); g < a.n_segments && a.segments[g].offset < whole_end && n < kTmaMaxPieces; ++g) {
      const SumSegment& seg = a.segments[g];
      const int64_t lo = ((seg.offset > t0 ? seg.offset : t0) + 7) & ~int64_t{7};
      const int64_t valid_end = seg.offset + seg.valid;
      const int64_t hi = valid_end < whole_end ? valid_end : whole_end;
      const T* own = reinterpret_cast<const T*>(seg.own) + (lo - seg.offset);
      if (hi - lo < 8 || (reinterpret_cast<uintptr_t>(own) & 15) != 0) continue;
      const int begin = static_cast<int>(lo - t0);
      const int len = static_cast<int>((hi - lo) & ~int64_t{7});
      pieces[s].piece[n++] = make_int2(begin, begin + len);
      bulk_load(own_tile + begin, own, len * sizeof(T), &full[s]);
    }
    pieces[s].count = n;
    if (n > 0) {
      const uint32_t elems = static_cast<uint32_t>(whole_end - t0);
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        bulk_load(stage + j * tile, reinterpret_cast<const T*>(a.staged[j]) + t0, elems * sizeof(T), &full[s]);
      }
      if (a.accumulate) bulk_load(stage + (NS + 1) * tile, a.out + t0, elems * 4, &full[s]);
    }
    mbarrier_arrive(&full[s]);
  }
}

template <typename T, int NS>
__device__ void consume_tiles(const SumArgs& a, const unsigned char* stages_mem, uint64_t* full, uint64_t* empty,
                              const TilePieces* pieces, int tile, int stages) {
  const int64_t end = a.first + a.count;
  const int64_t n_tiles = (a.count + tile - 1) / tile;
  const int stage_bytes = tma_stage_bytes(NS, tile, a.accumulate);
  int k = 0;
  for (int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x, ++k) {
    const int s = k % stages;
    mbarrier_wait(&full[s], (k / stages) & 1);
    const int64_t t0 = a.first + t * tile;
    const int len = static_cast<int>(end - t0 < tile ? end - t0 : tile);
    const T* stage = reinterpret_cast<const T*>(stages_mem + static_cast<size_t>(s) * stage_bytes);
    const float* previous = reinterpret_cast<const float*>(stage + (NS + 1) * tile);
    const int n_pieces = pieces[s].count;
    for (int e0 = 8 * static_cast<int>(threadIdx.x); e0 < len; e0 += 8 * kTmaConsumers) {
      bool own_in_smem = false;  // pieces start and end on unit boundaries: inside one = whole
      for (int p = 0; p < n_pieces; ++p) {
        const int2 piece = pieces[s].piece[p];
        own_in_smem |= piece.x <= e0 && e0 < piece.y;
      }
      if (!own_in_smem) {
        sum_elements<T>(a, t0 + e0, t0 + (e0 + 8 < len ? e0 + 8 : len));
        continue;
      }
      uint4 raw[NS + 1];
#pragma unroll
      for (int j = 0; j <= NS; ++j) raw[j] = *reinterpret_cast<const uint4*>(stage + j * tile + e0);
      float acc[8], v[8];
      unpack8<T>(raw[0], acc);
#pragma unroll
      for (int j = 1; j <= NS; ++j) {
        unpack8<T>(raw[j], v);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], v[i]);
      }
      float4 p0 = make_float4(0.f, 0.f, 0.f, 0.f), p1 = p0;
      if (a.accumulate) {
        p0 = *reinterpret_cast<const float4*>(previous + e0);
        p1 = *reinterpret_cast<const float4*>(previous + e0 + 4);
      }
      float4* out = reinterpret_cast<float4*>(a.out + t0 + e0);
      __stcs(out, make_float4(finish(a, acc[0], p0.x), finish(a, acc[1], p0.y), finish(a, acc[2], p0.z),
                              finish(a, acc[3], p0.w)));
      __stcs(out + 1, make_float4(finish(a, acc[4], p1.x), finish(a, acc[5], p1.y), finish(a, acc[6], p1.z),
                                  finish(a, acc[7], p1.w)));
    }
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
  }
}

#endif  // __CUDA_ARCH__ >= 900

template <typename T, int NS>
__global__ void __launch_bounds__(kTmaThreads, 1)
    sum_tma_kernel(const __grid_constant__ SumArgs a, int tile, int stages) {
  static_assert(sizeof(T) == 2, "the TMA kernel reads 16-bit gradients");
  // Compiled out below sm_90; the host launches it only where the kernel image is sm_90+ (the trap
  // turns a mistaken launch into an error instead of an unwritten output).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char stages_mem[];
  __shared__ __align__(8) uint64_t full[kTmaMaxStages];
  __shared__ __align__(8) uint64_t empty[kTmaMaxStages];
  __shared__ TilePieces pieces[kTmaMaxStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kTmaConsumers / 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the async proxy
  }
  __syncthreads();
  if (threadIdx.x < kTmaConsumers) {
    consume_tiles<T, NS>(a, stages_mem, full, empty, pieces, tile, stages);
  } else if (threadIdx.x == kTmaConsumers) {
    produce_tiles<T, NS>(a, stages_mem, full, empty, pieces, tile, stages);
  }
#else
  __trap();
#endif
}

using TmaKernel = void (*)(SumArgs, int, int);

template <typename T>
TmaKernel tma_kernel(int n_staged) {
  // clang-format off: one line per case reads as a table
  switch (n_staged) {
    case 0:
      return sum_tma_kernel<T, 0>;
    case 1:
      return sum_tma_kernel<T, 1>;
    case 2:
      return sum_tma_kernel<T, 2>;
    case 3:
      return sum_tma_kernel<T, 3>;
    case 4:
      return sum_tma_kernel<T, 4>;
    case 5:
      return sum_tma_kernel<T, 5>;
    case 6:
      return sum_tma_kernel<T, 6>;
    default:
      return sum_tma_kernel<T, 7>;
  }
  // clang-format on
}

TmaKernel tma_kernel(int dtype, int n_staged) {
  return dtype == 0 ? tma_kernel<__nv_bfloat16>(n_staged) : tma_kernel<__half>(n_staged);
}

// Whether the current GPU runs the TMA kernel's sm_90+ code: the code it runs must come from
// compute_90+ PTX (an sm_90 GPU JIT-compiling compute_80 PTX gets the compiled-out body).
bool tma_available() {
  cudaFuncAttributes attr{};
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(sum_tma_kernel<__nv_bfloat16, 0>)));
  return attr.binaryVersion >= 90 && attr.ptxVersion >= 90;
}

// Tile and depth: the largest tile of 8192, 4096 or 2048 elements (two units per consumer down to
// half a unit) that leaves at least four stages, so the single producer thread's per-tile work is
// spread over ~32-64 KB of traffic; then as many stages as the shared-memory budget holds.
void plan_tma(SumLaunch& l, int ctas) {
  const SumArgs& a = l.args;
  const TmaKernel kernel = tma_kernel(l.dtype, a.n_staged);
  cudaFuncAttributes attr{};
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel)));
  int device = 0, optin = 0;
  TIDE_CUDA_CHECK(cudaGetDevice(&device));
  TIDE_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int budget = std::min(kTmaSmemBudget, optin - static_cast<int>(attr.sharedSizeBytes));
  int tile = 16 * kTmaConsumers;
  while (tile > 4 * kTmaConsumers && budget / tma_stage_bytes(a.n_staged, tile, a.accumulate) < 4) tile /= 2;
  const int stages = std::min(kTmaMaxStages, budget / tma_stage_bytes(a.n_staged, tile, a.accumulate));
  TIDE_CHECK(stages >= 2, "launch_sum: not enough shared memory for the TMA sum kernel");
  l.kernel = kSumTma;
  l.tile = tile;
  l.stages = stages;
  l.smem_bytes = stages * tma_stage_bytes(a.n_staged, tile, a.accumulate);
  const int64_t tiles = (a.count + tile - 1) / tile;
  l.blocks = static_cast<int>(std::min<int64_t>(std::max(ctas, 1), std::max<int64_t>(1, tiles)));
  TIDE_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, l.smem_bytes));
}

}  // namespace

SumLaunch make_sum_launch(uint64_t out, const std::vector<uint64_t>& staged, const std::vector<SumSegment>& segments,
                          int64_t first, int64_t count, float alpha, bool accumulate, int dtype, int ctas, int kernel) {
  TIDE_CHECK(kernel == kSumAuto || kernel == kSumRegs || kernel == kSumTma,
             "launch_sum: kernel must be 0 (auto), 1 (regs) or 2 (tma)");
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
  l.blocks =
      static_cast<int>(std::min<int64_t>(std::max(ctas, 1), std::max<int64_t>(1, (units + kThreads - 1) / kThreads)));
  l.dtype = dtype;
  l.kernel = kSumRegs;
  const bool tma_applies = dtype != 2 && a.n_staged <= kTmaMaxStaged && count > 0;
  if (kernel == kSumTma || (kernel == kSumAuto && tma_applies && a.n_staged <= kTmaAutoMaxStaged)) {
    const bool available = tma_available();
    TIDE_CHECK(available || kernel == kSumAuto,
               "launch_sum: sum_kernel='tma' needs a GPU of compute capability "
               "9.0+ and an extension built for it (TMA bulk copies)");
    if (available && tma_applies) plan_tma(l, ctas);
  }
  return l;
}

void launch_sum(const SumLaunch& l, uint64_t stream) {
  if (l.args.count <= 0) return;
  cudaStream_t s = as_stream(stream);
  const SumArgs& a = l.args;
  if (l.kernel == kSumTma) {
    int tile = l.tile, stages = l.stages;
    void* params[] = {const_cast<SumArgs*>(&a), &tile, &stages};
    TIDE_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(tma_kernel(l.dtype, a.n_staged)), l.blocks,
                                     kTmaThreads, params, l.smem_bytes, s));
    return;
  }
  switch (l.dtype) {
    case 0:
      if (!launch_fast<__nv_bfloat16>(a, l.blocks, s)) sum_kernel<__nv_bfloat16><<<l.blocks, kThreads, 0, s>>>(a);
      break;
    case 1:
      if (!launch_fast<__half>(a, l.blocks, s)) sum_kernel<__half><<<l.blocks, kThreads, 0, s>>>(a);
      break;
    default:
      sum_kernel<float><<<l.blocks, kThreads, 0, s>>>(a);
      break;
  }
  TIDE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tide
