// Same-GPU placement of many segments in one short kernel launch. A batch of same-device copies
// costs the driver ~7 us of host time per descriptor (measured on H200: 30 descriptors took
// 220-256 us to enqueue, see docs/design.md); one launch costs ~5 us whatever the segment count.
#pragma once

#include <cstdint>
#include <vector>

namespace tide {

constexpr int kMaxCopySegments = 96;  // per launch (keeps the kernel arguments < 4 KB)

struct CopyArgs {
  int n;
  uint64_t dst[kMaxCopySegments];
  uint64_t src[kMaxCopySegments];
  uint64_t bytes[kMaxCopySegments];
};

// One CopyArgs per launch of at most kMaxCopySegments segments; zero-byte segments are dropped.
std::vector<CopyArgs> make_copy_args(const std::vector<uint64_t>& dsts, const std::vector<uint64_t>& srcs,
                                     const std::vector<uint64_t>& sizes);
void launch_copy(const CopyArgs& args, int ctas, uint64_t stream);

}  // namespace tide
