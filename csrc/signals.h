// Cross-GPU ordering with stream memory operations: epoch counters written after the data and
// waited on (cyclic >=) by the consumer. These orders are invisible to CUDA events, so callers
// record events too. Driver entry points are fetched at run time: no libcuda link needed.
#pragma once

#include <cstdint>
#include <vector>

namespace tide {

bool stream_memops_available();
// Write `value` to each address, in stream order, each preceded by a memory barrier.
void stream_write_u32(uint64_t stream, const std::vector<uint64_t>& addresses, uint32_t value);
// Block the stream until every address holds a value v with (int32)(v - value) >= 0.
void stream_wait_u32(uint64_t stream, const std::vector<uint64_t>& addresses, uint32_t value);

}  // namespace tide
