#include "program.h"

#include "common.h"
#include "copy_engine.h"
#include "signals.h"

namespace tide {

struct StreamProgram::Op {
  enum Kind { kRecord, kWaitEvent, kWriteFlags, kWaitFlags, kCopyBatch, kCopy2D, kCopyKernel, kSum } kind;
  uint64_t stream = 0;
  int event = -1;
  int64_t value_offset = 0;
  std::vector<uint64_t> addresses;  // flags, or copy destinations
  std::vector<uint64_t> srcs;
  std::vector<uint64_t> sizes;
  std::vector<CopyArgs> copies;
  int ctas = 0;
  std::shared_ptr<SumLaunch> sum;  // SumArgs is ~3.6 KB: keep ops small to move
};

StreamProgram::StreamProgram(int num_events) {
  TIDE_CHECK(num_events >= 0, "StreamProgram: num_events must be >= 0");
  events_.resize(num_events);
  for (auto& e : events_) TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

StreamProgram::~StreamProgram() {
  for (auto e : events_) cudaEventDestroy(e);
  for (auto& ring : output_ring_)
    for (auto e : ring) cudaEventDestroy(e);
}

void StreamProgram::record(uint64_t stream, int event) {
  TIDE_CHECK(event >= 0 && event < static_cast<int>(events_.size()), "StreamProgram.record: bad event index");
  Op op{Op::kRecord};
  op.stream = stream;
  op.event = event;
  ops_.push_back(std::move(op));
}

void StreamProgram::wait_event(uint64_t stream, int event) {
  TIDE_CHECK(event >= 0 && event < static_cast<int>(events_.size()), "StreamProgram.wait_event: bad event index");
  Op op{Op::kWaitEvent};
  op.stream = stream;
  op.event = event;
  ops_.push_back(std::move(op));
}

void StreamProgram::write_flags(uint64_t stream, const std::vector<uint64_t>& addresses, int64_t value_offset) {
  add_flag_op(Op::kWriteFlags, stream, addresses, value_offset);
}

void StreamProgram::wait_flags(uint64_t stream, const std::vector<uint64_t>& addresses, int64_t value_offset) {
  add_flag_op(Op::kWaitFlags, stream, addresses, value_offset);
}

void StreamProgram::add_flag_op(int kind, uint64_t stream, const std::vector<uint64_t>& addresses,
                                int64_t value_offset) {
  Op op{static_cast<Op::Kind>(kind)};
  op.stream = stream;
  op.addresses = addresses;
  op.value_offset = value_offset;
  ops_.push_back(std::move(op));
}

void StreamProgram::copy_batch(uint64_t stream, const std::vector<uint64_t>& dsts, const std::vector<uint64_t>& srcs,
                               const std::vector<uint64_t>& sizes) {
  TIDE_CHECK(dsts.size() == srcs.size() && srcs.size() == sizes.size(),
             "StreamProgram.copy_batch: dsts, srcs and sizes must have the same length");
  Op op{Op::kCopyBatch};
  op.stream = stream;
  op.addresses = dsts;
  op.srcs = srcs;
  op.sizes = sizes;
  ops_.push_back(std::move(op));
}

void StreamProgram::copy_2d(uint64_t stream, uint64_t dst, uint64_t dpitch, uint64_t src, uint64_t spitch,
                            uint64_t width, uint64_t height) {
  check_copy_2d(dpitch, spitch, width, height);
  Op op{Op::kCopy2D};
  op.stream = stream;
  op.addresses = {dst, dpitch};
  op.srcs = {src, spitch};
  op.sizes = {width, height};
  ops_.push_back(std::move(op));
}

void StreamProgram::copy_kernel(uint64_t stream, const std::vector<uint64_t>& dsts, const std::vector<uint64_t>& srcs,
                                const std::vector<uint64_t>& sizes, int ctas) {
  check_ctas(ctas, "StreamProgram.copy_kernel");
  Op op{Op::kCopyKernel};
  op.stream = stream;
  op.copies = make_copy_args(dsts, srcs, sizes);
  op.ctas = ctas;
  ops_.push_back(std::move(op));
}

void StreamProgram::sum(uint64_t stream, const SumLaunch& launch) {
  Op op{Op::kSum};
  op.stream = stream;
  op.sum = std::make_shared<SumLaunch>(launch);
  ops_.push_back(std::move(op));
}

void StreamProgram::set_outputs(const std::vector<int>& events, int ring) {
  TIDE_CHECK(ring >= 1, "StreamProgram.set_outputs: ring must be >= 1");
  for (int e : events)
    TIDE_CHECK(e >= 0 && e < static_cast<int>(events_.size()), "StreamProgram.set_outputs: bad event index");
  outputs_ = events;
  output_ring_.assign(events.size(), std::vector<cudaEvent_t>(ring));
  for (auto& r : output_ring_)
    for (auto& e : r) TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

std::vector<uint64_t> StreamProgram::replay(uint64_t caller_stream, int64_t base) {
  // Output events come from a ring: each replay records them into its own ring entry, so a
  // handle the caller still holds is not moved to a later call until `ring` replays have passed.
  const size_t slot = output_ring_.empty() ? 0 : replays_ % output_ring_[0].size();
  ++replays_;
  auto event_of = [&](int e) {
    for (size_t k = 0; k < outputs_.size(); ++k)
      if (outputs_[k] == e) return output_ring_[k][slot];
    return events_[e];
  };
  for (const Op& op : ops_) {
    const uint64_t stream = op.stream == kCallerStream ? caller_stream : op.stream;
    switch (op.kind) {
      case Op::kRecord:
        TIDE_CUDA_CHECK(cudaEventRecord(event_of(op.event), as_stream(stream)));
        break;
      case Op::kWaitEvent:
        TIDE_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), event_of(op.event), 0));
        break;
      case Op::kWriteFlags:
        stream_write_u32(stream, op.addresses, static_cast<uint32_t>(base + op.value_offset));
        break;
      case Op::kWaitFlags:
        stream_wait_u32(stream, op.addresses, static_cast<uint32_t>(base + op.value_offset));
        break;
      case Op::kCopyBatch:
        memcpy_batch(op.addresses, op.srcs, op.sizes, stream, true);
        break;
      case Op::kCopy2D:
        memcpy_2d(op.addresses[0], op.addresses[1], op.srcs[0], op.srcs[1], op.sizes[0], op.sizes[1], stream);
        break;
      case Op::kCopyKernel:
        for (const CopyArgs& args : op.copies) launch_copy(args, op.ctas, stream);
        break;
      case Op::kSum:
        launch_sum(*op.sum, stream);
        break;
    }
  }
  std::vector<uint64_t> handles;
  for (size_t k = 0; k < outputs_.size(); ++k) handles.push_back(reinterpret_cast<uint64_t>(output_ring_[k][slot]));
  return handles;
}

size_t StreamProgram::size() const { return ops_.size(); }

bool event_query(uint64_t event) {
  cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  TIDE_CUDA_CHECK(err);
  return true;
}

void stream_wait_event(uint64_t stream, uint64_t event) {
  TIDE_CUDA_CHECK(cudaStreamWaitEvent(as_stream(stream), reinterpret_cast<cudaEvent_t>(event), 0));
}

}  // namespace tide
