#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common.h"
#include "sum_kernel.h"

namespace tide {
namespace {

// What kSumAuto runs, per number of staged sources: the kernel and its TMA tile (elements; 0:
// planned). 1 and 3: measured fastest by scripts/sum_kernel_bench.py on one H200 at 16 and 32 CTAs,
// 16 MiB bf16 chunks (benchmarks/results/2026-12-01-sum-kernels.md). 0, 2 and 4-7 were not
// measured: sum_lean_kernel is one pipeline for any NS <= kTmaMaxStaged (only the number of rows a
// step reads and a tile's bulk copies change with NS), so they take the measured choice; where
// fewer than kAutoMinStages of its tile fit (4-7 staged, or accumulating), the tile is halved,
// to the 4096 that 3 staged measured at 0.98 of the copy kernel (docs/design.md "Kernels").
// The one place to change after a new measurement.
struct AutoChoice {
  SumKernel kernel;
  int tile;
};
constexpr AutoChoice kAutoChoice[kTmaMaxStaged + 1] = {
    {kSumTmaLean, 8192},  // 0 staged sources: by argument
    {kSumTmaLean, 8192},  // 1: 47.0 us at 16 CTAs, 1.023 of the copy kernel's rate; 32 CTAs 0.978
    {kSumTmaLean, 8192},  // 2: by argument
    {kSumTmaLean, 8192},  // 3: 62.3 us at 16 CTAs, 1.156; 32 CTAs 1.069
    {kSumTmaLean, 8192},  // 4-7: by argument (planned with 4096-element tiles)
    {kSumTmaLean, 8192},
    {kSumTmaLean, 8192},
    {kSumTmaLean, 8192},
};
// An auto tile is halved until it leaves this many stages (an accumulating sum also stages the
// previous output): two stages measured far slower than three or more (3 staged, tile 8192: 80.5
// against 62.3 us; 1 staged, tile 16384: 57.0 against 48.3 us).
constexpr int kAutoMinStages = 3;

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

// A unit's eight sums, finished, as two 16-byte streaming stores at `out` (previous output read
// there when accumulating).
__device__ __forceinline__ void store_unit(const SumArgs& a, float* out, const float (&acc)[8]) {
  float4* out4 = reinterpret_cast<float4*>(out);
  float4 p0 = make_float4(0.f, 0.f, 0.f, 0.f), p1 = p0;
  if (a.accumulate) {
    p0 = out4[0];
    p1 = out4[1];
  }
  __stcs(out4, make_float4(finish(a, acc[0], p0.x), finish(a, acc[1], p0.y), finish(a, acc[2], p0.z),
                           finish(a, acc[3], p0.w)));
  __stcs(out4 + 1, make_float4(finish(a, acc[4], p1.x), finish(a, acc[5], p1.y), finish(a, acc[6], p1.z),
                               finish(a, acc[7], p1.w)));
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

// The owner's own rows at unit start i0 of segment seg, and whether the unit can take the vector
// path (whole, inside the segment's valid rows, 16-byte aligned).
template <typename T>
__device__ __forceinline__ void unit_in_segment(const SumSegment& seg, int64_t i0, int64_t end, const T*& own,
                                                bool& fast) {
  const int64_t local = i0 - seg.offset;
  own = reinterpret_cast<const T*>(seg.own) + local;
  fast = i0 + 8 <= end && local + 8 <= seg.valid && (reinterpret_cast<uintptr_t>(own) & 15) == 0;
}

// Unit u (8 elements from a.first + 8u): its first element, the owner's own rows there, and whether
// it can take the vector path.
template <typename T>
__device__ __forceinline__ void locate_unit(const SumArgs& a, int64_t u, int64_t units, int64_t end, int64_t& i0,
                                            const T*& own, bool& fast) {
  i0 = a.first + 8 * u;
  own = nullptr;
  fast = false;
  if (u < units) unit_in_segment<T>(a.segments[find_segment(a, i0)], i0, end, own, fast);
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
        store_unit(a, a.out + i0[j], acc);
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

// The lean kernel's step: 8 elements per consumer (two rows of 4), 4096 per CTA; whole tiles are
// whole steps.
constexpr int kLeanStep = 8 * kTmaConsumers;

// A tile's own-row pieces [begin, end) (tile-relative elements, whole units) that are 16-byte
// aligned at the source and fully valid; units outside every piece take the per-element path.
struct TilePieces {
  int count;
  int whole;  // lean kernel: the pieces cover the whole (full-length) tile, so its rows take the lean loop
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

// The producer's arrival and the transaction bytes the phase still waits for, in one operation
// (release semantics, as mbarrier_arrive).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

// `bytes` (a multiple of 16) from global `src` to shared `dst`, both 16-byte aligned; completes
// `bytes` of the barrier's transaction count, which someone must expect.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :
               : "r"(smem_address(dst)), "l"(src), "r"(bytes), "r"(smem_address(bar))
               : "memory");
}

// bulk_copy, expecting its bytes first.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  mbarrier_expect_tx(bar, bytes);
  bulk_copy(dst, src, bytes, bar);
}

// One tile's bulk copies from segment g (the one holding t0) on: the owner's pieces, then, if there
// is any, the staged rows and the previous output of [t0, whole_end); then the producer's arrival.
// pieces.whole: rows_fit and the pieces cover the whole tile without gaps (whole_end = t0 + tile).
template <typename T, int NS>
__device__ __forceinline__ void produce_tile(const SumArgs& a, int g, int64_t t0, int64_t whole_end, T* stage, int tile,
                                             bool rows_fit, TilePieces& pieces, uint64_t* full) {
  T* own_tile = stage + NS * tile;
  int n = 0, covered = 0;
  for (; g < a.n_segments && a.segments[g].offset < whole_end && n < kTmaMaxPieces; ++g) {
    const SumSegment& seg = a.segments[g];
    const int64_t lo = ((seg.offset > t0 ? seg.offset : t0) + 7) & ~int64_t{7};
    const int64_t valid_end = seg.offset + seg.valid;
    const int64_t hi = valid_end < whole_end ? valid_end : whole_end;
    const T* own = reinterpret_cast<const T*>(seg.own) + (lo - seg.offset);
    if (hi - lo < 8 || (reinterpret_cast<uintptr_t>(own) & 15) != 0) continue;
    const int begin = static_cast<int>(lo - t0);
    const int len = static_cast<int>((hi - lo) & ~int64_t{7});
    if (begin == covered) covered = begin + len;
    pieces.piece[n++] = make_int2(begin, begin + len);
    bulk_load(own_tile + begin, own, len * sizeof(T), full);
  }
  pieces.count = n;
  pieces.whole = rows_fit && whole_end - t0 == tile && covered == tile;
  if (n > 0) {
    const uint32_t elems = static_cast<uint32_t>(whole_end - t0);
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      bulk_load(stage + j * tile, reinterpret_cast<const T*>(a.staged[j]) + t0, elems * sizeof(T), full);
    }
    if (a.accumulate) bulk_load(stage + (NS + 1) * tile, a.out + t0, elems * 4, full);
  }
  mbarrier_arrive(full);
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
    produce_tile<T, NS>(a, find_segment(a, t0), t0, whole_end, stage, tile, false, pieces[s], &full[s]);
  }
}

// One tile of len elements from t0 in `stage`, unit by unit: units in pieces from shared memory,
// the others per element.
template <typename T, int NS>
__device__ __forceinline__ void consume_tile(const SumArgs& a, const T* stage, const TilePieces& pieces, int64_t t0,
                                             int len, int tile) {
  const float* previous = reinterpret_cast<const float*>(stage + (NS + 1) * tile);
  const int n_pieces = pieces.count;
  for (int e0 = 8 * static_cast<int>(threadIdx.x); e0 < len; e0 += 8 * kTmaConsumers) {
    bool own_in_smem = false;  // pieces start and end on unit boundaries: inside one = whole
    for (int p = 0; p < n_pieces; ++p) {
      const int2 piece = pieces.piece[p];
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
    consume_tile<T, NS>(a, stage, pieces[s], t0, len, tile);
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
  }
}

// Lean kernel. Four 16-bit elements at p (one 8-byte shared load) as fp32. bf16 -> fp32 places
// the 16 bits high (as __bfloat162float does): one shift or one mask per element.
template <typename T>
__device__ __forceinline__ void load_row(const T* p, float (&v)[4]) {
  const uint2 r = *reinterpret_cast<const uint2*>(p);
  const uint32_t w[2] = {r.x, r.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
}

// A row of 4 elements per consumer at src (source j at src + j * tile) into out.
template <typename T, int NS, bool Accumulate>
__device__ __forceinline__ void lean_row(const T* src, int tile, const float* previous, float* out, float alpha) {
  float acc[4], v[4];
  load_row<T>(src, acc);
#pragma unroll
  for (int j = 1; j <= NS; ++j) {
    load_row<T>(src + j * tile, v);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = __fadd_rn(acc[i], v[i]);
  }
  // Two separately rounded operations, as finish(): t = alpha * T, then out + t.
  float4 t = make_float4(__fmul_rn(alpha, acc[0]), __fmul_rn(alpha, acc[1]), __fmul_rn(alpha, acc[2]),
                         __fmul_rn(alpha, acc[3]));
  if constexpr (Accumulate) {
    const float4 p = *reinterpret_cast<const float4*>(previous);
    t = make_float4(__fadd_rn(p.x, t.x), __fadd_rn(p.y, t.y), __fadd_rn(p.z, t.z), __fadd_rn(p.w, t.w));
  }
  __stcs(reinterpret_cast<float4*>(out), t);
}

// A whole tile, step by step from shared memory: no checks, no predication (Accumulate is a
// template argument), addresses advanced by a constant. In a step, consumer i takes elements
// [4i, 4i + 4) and 2048 on (a warp's 16-byte stores are 512 contiguous bytes).
template <typename T, int NS, bool Accumulate>
__device__ __forceinline__ void lean_tile(const T* stage, int tile, float* out, float alpha) {
  const int e0 = 4 * static_cast<int>(threadIdx.x);
  const T* src = stage + e0;
  const float* previous = reinterpret_cast<const float*>(stage + (NS + 1) * tile) + e0;
  out += e0;
#pragma unroll 1
  for (int done = 0; done < tile; done += kLeanStep) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int at = h * 4 * kTmaConsumers;
      lean_row<T, NS, Accumulate>(src + at, tile, previous + at, out + at, alpha);
    }
    src += kLeanStep;
    previous += kLeanStep;
    out += kLeanStep;
  }
}

// Tiles that are not whole (segment boundaries, padding, misaligned own rows, the last tile): the
// TMA kernel's per-unit path, out of line so that it takes no registers from the lean loop.
template <typename T, int NS>
__device__ __noinline__ void consume_tile_per_unit(const SumArgs& a, const T* stage, const TilePieces& pieces,
                                                   int64_t t0, int len, int tile) {
  consume_tile<T, NS>(a, stage, pieces, t0, len, tile);
}

// The stage, its phase and the output advance by one tile each (no division by the runtime depth,
// no per-tile address arithmetic beyond the increments).
template <typename T, int NS>
__device__ void consume_tiles_lean(const SumArgs& a, const unsigned char* stages_mem, uint64_t* full, uint64_t* empty,
                                   const TilePieces* pieces, int tile, int stages) {
  const int64_t end = a.first + a.count;
  const int64_t n_tiles = (a.count + tile - 1) / tile;
  const int stage_bytes = tma_stage_bytes(NS, tile, a.accumulate);
  const int64_t out_stride = static_cast<int64_t>(gridDim.x) * tile;
  const T* stage = reinterpret_cast<const T*>(stages_mem);
  float* out = a.out + a.first + static_cast<int64_t>(blockIdx.x) * tile;
  int s = 0;
  uint32_t phase = 0;
  for (int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x) {
    mbarrier_wait(&full[s], phase);
    if (pieces[s].whole) {
      if (a.accumulate) lean_tile<T, NS, true>(stage, tile, out, a.alpha);
      else lean_tile<T, NS, false>(stage, tile, out, a.alpha);
    } else {
      const int64_t t0 = a.first + t * tile;
      consume_tile_per_unit<T, NS>(a, stage, pieces[s], t0, static_cast<int>(end - t0 < tile ? end - t0 : tile), tile);
    }
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
    out += out_stride;
    if (++s == stages) {
      s = 0;
      phase ^= 1;
      stage = reinterpret_cast<const T*>(stages_mem);
    } else {
      stage = reinterpret_cast<const T*>(reinterpret_cast<const unsigned char*>(stage) + stage_bytes);
    }
  }
}

// The common tile (full length, inside one segment's valid rows, own rows 16-byte aligned) costs
// a few compares: the segment is followed (this CTA's tiles ascend) with its bounds in registers,
// not searched, and one arrival expects all of the tile's bytes. Other tiles go through
// produce_tile.
template <typename T, int NS>
__device__ void produce_tiles_lean(const SumArgs& a, unsigned char* stages_mem, uint64_t* full, uint64_t* empty,
                                   TilePieces* pieces, int tile, int stages) {
  const int64_t end = a.first + a.count;
  const int64_t n_tiles = (a.count + tile - 1) / tile;
  const int stage_bytes = tma_stage_bytes(NS, tile, a.accumulate);
  const bool rows_fit = tile % kLeanStep == 0;
  const uint32_t row_bytes = tile * sizeof(T);
  const uint32_t tile_bytes = (NS + 1) * row_bytes + (a.accumulate ? tile * 4 : 0);
  // Segment g: where it starts, where its valid rows end, its own rows, where the next one starts.
  int g = 0;
  int64_t seg_offset = a.segments[0].offset, valid_end = seg_offset + a.segments[0].valid;
  const T* seg_own = reinterpret_cast<const T*>(a.segments[0].own);
  int64_t next_offset = a.n_segments > 1 ? a.segments[1].offset : INT64_MAX;
  int s = 0;
  uint32_t phase = 0;
  bool reuse = false;  // every stage filled once: wait until the consumers released it
  for (int64_t t = blockIdx.x; t < n_tiles; t += gridDim.x) {
    if (reuse) mbarrier_wait(&empty[s], phase ^ 1);
    const int64_t t0 = a.first + t * tile;
    while (next_offset <= t0) {
      const SumSegment& seg = a.segments[++g];
      seg_offset = seg.offset;
      valid_end = seg.offset + seg.valid;
      seg_own = reinterpret_cast<const T*>(seg.own);
      next_offset = g + 1 < a.n_segments ? a.segments[g + 1].offset : INT64_MAX;
    }
    T* stage = reinterpret_cast<T*>(stages_mem + s * stage_bytes);
    const T* own = seg_own + (t0 - seg_offset);
    if (rows_fit && t0 + tile <= end && seg_offset <= t0 && t0 + tile <= valid_end &&
        (reinterpret_cast<uintptr_t>(own) & 15) == 0) {
      pieces[s].whole = 1;  // before the arrival, which releases it
      mbarrier_arrive_expect_tx(&full[s], tile_bytes);
      bulk_copy(stage + NS * tile, own, row_bytes, &full[s]);
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        bulk_copy(stage + j * tile, reinterpret_cast<const T*>(a.staged[j]) + t0, row_bytes, &full[s]);
      }
      if (a.accumulate) bulk_copy(stage + (NS + 1) * tile, a.out + t0, tile * 4, &full[s]);
    } else {
      const int64_t whole_end = t0 + ((end - t0 < tile ? end - t0 : tile) & ~int64_t{7});
      produce_tile<T, NS>(a, g, t0, whole_end, stage, tile, rows_fit, pieces[s], &full[s]);
    }
    if (++s == stages) {
      s = 0;
      phase ^= 1;
      reuse = true;
    }
  }
}

#endif  // __CUDA_ARCH__ >= 900

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void init_pipeline(uint64_t* full, uint64_t* empty, int stages) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kTmaConsumers / 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the async proxy
  }
  __syncthreads();
}
#endif

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
  init_pipeline(full, empty, stages);
  if (threadIdx.x < kTmaConsumers) {
    consume_tiles<T, NS>(a, stages_mem, full, empty, pieces, tile, stages);
  } else if (threadIdx.x == kTmaConsumers) {
    produce_tiles<T, NS>(a, stages_mem, full, empty, pieces, tile, stages);
  }
#else
  __trap();
#endif
}

// The lean kernel: sum_tma_kernel's pipeline and shared-memory layout, lean loops.
template <typename T, int NS>
__global__ void __launch_bounds__(kTmaThreads, 1)
    sum_lean_kernel(const __grid_constant__ SumArgs a, int tile, int stages) {
  static_assert(sizeof(T) == 2, "the TMA kernel reads 16-bit gradients");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char stages_mem[];
  __shared__ __align__(8) uint64_t full[kTmaMaxStages];
  __shared__ __align__(8) uint64_t empty[kTmaMaxStages];
  __shared__ TilePieces pieces[kTmaMaxStages];
  init_pipeline(full, empty, stages);
  if (threadIdx.x < kTmaConsumers) {
    consume_tiles_lean<T, NS>(a, stages_mem, full, empty, pieces, tile, stages);
  } else if (threadIdx.x == kTmaConsumers) {
    produce_tiles_lean<T, NS>(a, stages_mem, full, empty, pieces, tile, stages);
  }
#else
  __trap();
#endif
}

using TmaKernel = void (*)(SumArgs, int, int);

bool is_tma(int kernel) { return kernel == kSumTma || kernel == kSumTmaLean; }

template <typename T, int NS>
TmaKernel tma_kernel(int kernel) {
  return kernel == kSumTmaLean ? sum_lean_kernel<T, NS> : sum_tma_kernel<T, NS>;
}

template <typename T>
TmaKernel tma_kernel(int n_staged, int kernel) {
  // clang-format off: one line per case reads as a table
  switch (n_staged) {
    case 0:
      return tma_kernel<T, 0>(kernel);
    case 1:
      return tma_kernel<T, 1>(kernel);
    case 2:
      return tma_kernel<T, 2>(kernel);
    case 3:
      return tma_kernel<T, 3>(kernel);
    case 4:
      return tma_kernel<T, 4>(kernel);
    case 5:
      return tma_kernel<T, 5>(kernel);
    case 6:
      return tma_kernel<T, 6>(kernel);
    default:
      return tma_kernel<T, 7>(kernel);
  }
  // clang-format on
}

// kernel: one of the TMA kernels (is_tma).
TmaKernel tma_kernel(int dtype, int n_staged, int kernel) {
  return dtype == 0 ? tma_kernel<__nv_bfloat16>(n_staged, kernel) : tma_kernel<__half>(n_staged, kernel);
}


// Tile and depth: the largest tile of 8192, 4096 or 2048 elements (two units per consumer down to
// half a unit; lean kernels: down to one step) that leaves at least four stages, so the
// single producer thread's per-tile work is spread over ~32-64 KB of traffic; then as many stages as
// the shared-memory budget holds. auto_tile (kAutoChoice's) replaces the planned tile, halved until
// kAutoMinStages fit; fixed_tile / fixed_stages (0: planned) override both, for measurements.
void plan_tma(SumLaunch& l, int ctas, int tma, int fixed_tile, int fixed_stages, int auto_tile) {
  const SumArgs& a = l.args;
  const TmaKernel kernel = tma_kernel(l.dtype, a.n_staged, tma);
  cudaFuncAttributes attr{};
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel)));
  int device = 0, optin = 0;
  TIDE_CUDA_CHECK(cudaGetDevice(&device));
  TIDE_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int budget = std::min(kTmaSmemBudget, optin - static_cast<int>(attr.sharedSizeBytes));
  const auto depth = [&](int tile) { return budget / tma_stage_bytes(a.n_staged, tile, a.accumulate); };
  const int min_tile = tma == kSumTmaLean ? kLeanStep : 4 * kTmaConsumers;
  int tile = 16 * kTmaConsumers;
  while (tile > min_tile && depth(tile) < 4) tile /= 2;
  if (auto_tile > 0) {
    tile = auto_tile;
    while (tile > min_tile && depth(tile) < kAutoMinStages) tile /= 2;
  }
  if (fixed_tile > 0) {
    TIDE_CHECK(fixed_tile % 8 == 0, "launch_sum: tma_tile must be a multiple of 8 elements");
    tile = fixed_tile;
  }
  int stages = std::min(kTmaMaxStages, depth(tile));
  if (fixed_stages > 0) {
    TIDE_CHECK(fixed_stages <= stages, "launch_sum: tma_stages exceeds what shared memory holds at this tile");
    stages = fixed_stages;
  }
  TIDE_CHECK(stages >= 2, "launch_sum: not enough shared memory for the TMA sum kernel");
  l.kernel = tma;
  l.tile = tile;
  l.stages = stages;
  l.smem_bytes = stages * tma_stage_bytes(a.n_staged, tile, a.accumulate);
  const int64_t tiles = (a.count + tile - 1) / tile;
  l.blocks = static_cast<int>(std::min<int64_t>(std::max(ctas, 1), std::max<int64_t>(1, tiles)));
  TIDE_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, l.smem_bytes));
}

}  // namespace

// Whether the current GPU runs the TMA kernel's sm_90+ code: the code it runs must come from
// compute_90+ PTX (an sm_90 GPU JIT-compiling compute_80 PTX gets the compiled-out body).
bool tma_available() {
  cudaFuncAttributes attr{};
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(sum_tma_kernel<__nv_bfloat16, 0>)));
  return attr.binaryVersion >= 90 && attr.ptxVersion >= 90;
}

SumLaunch make_sum_launch(uint64_t out, const std::vector<uint64_t>& staged, const std::vector<SumSegment>& segments,
                          int64_t first, int64_t count, float alpha, bool accumulate, int dtype, int ctas, int kernel,
                          int tma_tile, int tma_stages) {
  TIDE_CHECK(kernel >= 0 && kernel < kSumKernelCount, "launch_sum: kernel must be a SUM_KERNELS value");
  TIDE_CHECK(tma_tile >= 0 && tma_stages >= 0, "launch_sum: tma_tile and tma_stages must be >= 0 (0: planned)");
  TIDE_CHECK(tma_tile <= kTmaMaxTile, "launch_sum: tma_tile must be at most " + std::to_string(kTmaMaxTile));
  check_ctas(ctas, "launch_sum");
  TIDE_CHECK(staged.size() <= static_cast<size_t>(kMaxSources), "launch_sum: too many staged sources");
  TIDE_CHECK(!segments.empty() && segments.size() <= static_cast<size_t>(kMaxSegments),
             "launch_sum: segment count must be in [1, " + std::to_string(kMaxSegments) + "]");
  TIDE_CHECK(first % 8 == 0, "launch_sum: first element must be a multiple of 8");
  TIDE_CHECK(first >= 0 && count >= 0 && count <= INT64_MAX - first, "launch_sum: first and count must be >= 0");
  int64_t end = segments.front().offset;
  TIDE_CHECK(end >= 0, "launch_sum: segment offsets must be >= 0");
  for (size_t s = 0; s < segments.size(); ++s) {
    const SumSegment& g = segments[s];  // messages built only on failure (TIDE_CHECK)
    TIDE_CHECK(g.offset == end, "launch_sum: segment " + std::to_string(s) +
                                    " must start where the previous one ends (in order, contiguous)");
    TIDE_CHECK(g.length >= 0 && g.length <= INT64_MAX - end,
               "launch_sum: segment " + std::to_string(s) + ": length must be >= 0");
    TIDE_CHECK(g.valid >= 0 && g.valid <= g.length,
               "launch_sum: segment " + std::to_string(s) + ": valid must be in [0, length]");
    end += g.length;
  }
  TIDE_CHECK(count == 0 || (segments.front().offset <= first && first + count <= end),
             "launch_sum: the segments must cover elements [first, first + count)");
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
  // The TMA kernels apply to 16-bit gradients with <= kTmaMaxStaged staged sources; elsewhere,
  // and for auto where its choice does not apply, the register kernel runs.
  const bool tma_applies = dtype != 2 && a.n_staged <= kTmaMaxStaged && count > 0;
  int chosen = kernel, auto_tile = 0;
  if (kernel == kSumAuto && tma_applies) {
    chosen = kAutoChoice[a.n_staged].kernel;
    auto_tile = kAutoChoice[a.n_staged].tile;
  }
  l.kernel = kSumRegs;
  if (is_tma(chosen)) {
    const bool available = tma_available();
    TIDE_CHECK(available || kernel == kSumAuto,
               "launch_sum: sum_kernel='tma' needs a GPU of compute capability "
               "9.0+ and an extension built for it (TMA bulk copies)");
    if (available && tma_applies) plan_tma(l, ctas, chosen, tma_tile, tma_stages, auto_tile);
  }
  return l;
}

void launch_sum(const SumLaunch& l, uint64_t stream) {
  if (l.args.count <= 0) return;
  cudaStream_t s = as_stream(stream);
  const SumArgs& a = l.args;
  if (is_tma(l.kernel)) {
    int tile = l.tile, stages = l.stages;
    void* params[] = {const_cast<SumArgs*>(&a), &tile, &stages};
    const TmaKernel kernel = tma_kernel(l.dtype, a.n_staged, l.kernel);
    TIDE_CUDA_CHECK(
        cudaLaunchKernel(reinterpret_cast<const void*>(kernel), l.blocks, kTmaThreads, params, l.smem_bytes, s));
    return;
  }
  switch (l.dtype) {
    case 0:
      if (!launch_fast<__nv_bfloat16>(a, l.blocks, s)) {
        sum_kernel<__nv_bfloat16><<<l.blocks, kThreads, 0, s>>>(a);
      }
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
