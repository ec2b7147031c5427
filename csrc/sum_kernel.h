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

struct SumLaunch {
  SumArgs args;
  int blocks;
  int dtype;
};

// dtype: 0 = bfloat16, 1 = float16, 2 = float32 (the gradients' and staging's element type).
// out[i] = (accumulate ? out[i] : 0) + alpha * (staged[0][i] + ... + staged[n-1][i] + own[i]),
// summed in fp32 in exactly that order, alpha applied as a separate rounded multiply.
// Checked and prepared once (a stream program keeps it); launched as often as needed.
SumLaunch make_sum_launch(uint64_t out, const std::vector<uint64_t>& staged, const std::vector<SumSegment>& segments,
                          int64_t first, int64_t count, float alpha, bool accumulate, int dtype, int ctas);
void launch_sum(const SumLaunch& launch, uint64_t stream);

}  // namespace tide
