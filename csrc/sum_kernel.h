// Reduce-scatter sum: fp32 accumulation of staged peer contributions and the owner's own rows.
#pragma once

#include <cstdint>
#include <vector>

namespace tide {

constexpr int kMaxSources = 16;   // staged contributions per chunk (L - 1 <= 15)
constexpr int kMaxSegments = 80;  // parameter segments per launch (keeps the kernel arguments < 4 KB)

struct SumSegment {
  int64_t offset;  // element offset of the segment inside the chunk
  int64_t length;  // elements (padding included)
  int64_t valid;   // leading elements that hold data; the rest are rows past D_p and count as 0
  uint64_t own;    // address of the owner's own contribution for the segment's first element
};

struct SumArgs {
  float* out;
  const void* staged[kMaxSources];
  int n_staged;
  int n_segments;
  int64_t first;  // first element (chunk-relative, multiple of 8) this launch covers
  int64_t count;  // elements this launch covers
  SumSegment segments[kMaxSegments];
  float alpha;
  int accumulate;
};

// Which kernel runs a sum. kSumAuto: the kernel (and TMA tile) chosen per number of staged
// sources, from the table kAutoChoice in sum_kernel.cu, where it applies (16-bit gradients,
// <= kTmaMaxStaged staged sources and a kernel image built for sm_90+ for the TMA kernels), else
// the register kernel. kSumTma: the TMA pipeline, an error where the GPU's kernel image has no TMA
// (so an A/B cannot silently measure the wrong kernel). kSumTmaLean: the TMA pipeline with a
// branch-free consumer loop for tiles that are whole (every own row bulk-copied) and a producer
// without per-tile searches or divisions; other tiles take kSumTma's per-unit path (sm_90+, like
// kSumTma). kSumRegs: always the register kernel.
enum SumKernel {
  kSumAuto = 0,
  kSumRegs = 1,
  kSumTma = 2,
  kSumTmaLean = 3,
};
constexpr int kSumKernelCount = 4;
constexpr int kTmaMaxStaged = 7;
// The largest TMA tile (elements) a measurement may fix: its stage bytes (tma_stage_bytes) stay far
// inside int, and no GPU's shared memory holds two stages of a larger one.
constexpr int kTmaMaxTile = 1 << 16;

struct SumLaunch {
  SumArgs args;
  int blocks;
  int dtype;
  int kernel;      // the SumKernel chosen at make time (never kSumAuto)
  int tile;        // TMA: elements per pipeline stage tile
  int stages;      // TMA: pipeline depth
  int smem_bytes;  // TMA: dynamic shared memory per CTA
};

// dtype: 0 = bfloat16, 1 = float16, 2 = float32 (the gradients' and staging's element type).
// out[i] = (accumulate ? out[i] : 0) + alpha * (staged[0][i] + ... + staged[n-1][i] + own[i]),
// summed in fp32 in exactly that order, alpha applied as a separate rounded multiply.
// Checked and prepared once (a stream program keeps it); launched as often as needed, with the
// same device current as at make time (the TMA kernel's shared-memory opt-in is set per device).
// tma_tile / tma_stages (0: planned, or kAutoChoice's tile for kSumAuto) fix the TMA kernels' tile
// and depth, for measurements. Checked: the segments are in order and contiguous (each starts where
// the previous ends), 0 <= valid <= length, and they cover [first, first + count); the staged
// chunks and out are indexed by chunk element, the own rows by segment element.
SumLaunch make_sum_launch(uint64_t out, const std::vector<uint64_t>& staged, const std::vector<SumSegment>& segments,
                          int64_t first, int64_t count, float alpha, bool accumulate, int dtype, int ctas,
                          int kernel = kSumAuto, int tma_tile = 0, int tma_stages = 0);
void launch_sum(const SumLaunch& launch, uint64_t stream);

// Whether the current GPU runs the TMA kernels' sm_90+ code (kSumTma, kSumTmaLean).
bool tma_available();

}  // namespace tide
