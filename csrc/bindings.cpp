// tide_core._C: raw device pointers, byte counts and cudaStream_t handles as Python ints.
// Python owns every buffer's lifetime; nothing here allocates device memory or links libtorch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "common.h"
#include "copy_engine.h"
#include "signals.h"
#include "sum_kernel.h"

namespace py = pybind11;

namespace {

using SegmentTuple = std::tuple<int64_t, int64_t, int64_t, uint64_t>;

void launch_sum_py(uint64_t out, const std::vector<uint64_t>& staged, const std::vector<SegmentTuple>& segments,
                   int64_t first, int64_t count, float alpha, bool accumulate, int dtype, int ctas, uint64_t stream) {
  std::vector<tide::SumSegment> segs;
  segs.reserve(segments.size());
  for (const auto& s : segments) {
    segs.push_back(tide::SumSegment{std::get<0>(s), std::get<1>(s), std::get<2>(s), std::get<3>(s)});
  }
  tide::launch_sum(out, staged, segs, first, count, alpha, accumulate, dtype, ctas, stream);
}

int runtime_version() {
  int v = 0;
  TIDE_CUDA_CHECK(cudaRuntimeGetVersion(&v));
  return v;
}

int driver_version() {
  int v = 0;
  TIDE_CUDA_CHECK(cudaDriverGetVersion(&v));
  return v;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "TIDE CUDA core: copy-engine batches, stream memory operations, fp32 reduce-scatter sums";
  m.attr("MAX_SOURCES") = tide::kMaxSources;
  m.attr("MAX_SEGMENTS") = tide::kMaxSegments;
  m.def("memcpy_batch", &tide::memcpy_batch, py::arg("dsts"), py::arg("srcs"), py::arg("sizes"), py::arg("stream"),
        py::arg("prefer_overlap") = true, py::call_guard<py::gil_scoped_release>(),
        "Stream-ordered batch of unordered copies (cudaMemcpyBatchAsync; copy engines).");
  m.def("memcpy_2d", &tide::memcpy_2d, py::arg("dst"), py::arg("dpitch"), py::arg("src"), py::arg("spitch"),
        py::arg("width"), py::arg("height"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  m.def("stream_memops_available", &tide::stream_memops_available);
  m.def("stream_write_u32", &tide::stream_write_u32, py::arg("stream"), py::arg("addresses"), py::arg("value"),
        py::call_guard<py::gil_scoped_release>(), "cuStreamWriteValue32 to each address (with a memory barrier).");
  m.def("stream_wait_u32", &tide::stream_wait_u32, py::arg("stream"), py::arg("addresses"), py::arg("value"),
        py::call_guard<py::gil_scoped_release>(), "cuStreamWaitValue32 GEQ on each address.");
  m.def("launch_sum", &launch_sum_py, py::arg("out"), py::arg("staged"), py::arg("segments"), py::arg("first"),
        py::arg("count"), py::arg("alpha"), py::arg("accumulate"), py::arg("dtype"), py::arg("ctas"),
        py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  m.def("runtime_version", &runtime_version);
  m.def("driver_version", &driver_version);
}
