// Copy-engine data movement: batched 1-D copies and strided 2-D copies (no SM kernels).
#pragma once

#include <cstdint>
#include <vector>

namespace tide {

// One stream-ordered batch of independent copies; copies inside a batch are unordered.
void memcpy_batch(const std::vector<uint64_t>& dsts, const std::vector<uint64_t>& srcs,
                  const std::vector<uint64_t>& sizes, uint64_t stream, bool prefer_overlap);

// `height` rows of `width` bytes, source pitch `spitch`, destination pitch `dpitch`.
// A 2-D copy's rows must not overlap: width <= both pitches (where there is more than one row).
void check_copy_2d(uint64_t dpitch, uint64_t spitch, uint64_t width, uint64_t height);
void memcpy_2d(uint64_t dst, uint64_t dpitch, uint64_t src, uint64_t spitch, uint64_t width, uint64_t height,
               uint64_t stream);

// Whether the driver takes a 2-D copy with pitches `pitch`: one row of `width` bytes from src to
// dst, so nothing past either is touched. Returns the cudaError_t (0: taken), cleared if not.
int memcpy_2d_probe(uint64_t dst, uint64_t src, uint64_t pitch, uint64_t width, uint64_t stream);

// The current device's reported maximum pitch (cudaDevAttrMaxPitch).
int64_t device_max_pitch();

}  // namespace tide
