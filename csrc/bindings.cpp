// tide_core._C: raw device pointers, byte counts and cudaStream_t handles as Python ints.
// Python owns every buffer's lifetime; nothing here allocates device memory or links libtorch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "common.h"
#include "copy_engine.h"
#include "copy_kernel.h"
#include "program.h"
#include "signals.h"
#include "sum_kernel.h"

namespace py = pybind11;

namespace {

using SegmentTuple = std::tuple<int64_t, int64_t, int64_t, uint64_t>;

tide::SumLaunch sum_launch(uint64_t out, const std::vector<uint64_t>& staged, const std::vector<SegmentTuple>& segments,
                           int64_t first, int64_t count, float alpha, bool accumulate, int dtype, int ctas, int kernel,
                           int tma_tile = 0, int tma_stages = 0) {
  std::vector<tide::SumSegment> segs;
  segs.reserve(segments.size());
  for (const auto& s : segments) {
    segs.push_back(tide::SumSegment{std::get<0>(s), std::get<1>(s), std::get<2>(s), std::get<3>(s)});
  }
  return tide::make_sum_launch(out, staged, segs, first, count, alpha, accumulate, dtype, ctas, kernel, tma_tile,
                               tma_stages);
}

void launch_sum_py(uint64_t out, const std::vector<uint64_t>& staged, const std::vector<SegmentTuple>& segments,
                   int64_t first, int64_t count, float alpha, bool accumulate, int dtype, int ctas, uint64_t stream,
                   int kernel, int tma_tile, int tma_stages) {
  tide::launch_sum(
      sum_launch(out, staged, segments, first, count, alpha, accumulate, dtype, ctas, kernel, tma_tile, tma_stages),
      stream);
}

void copy_kernel_py(const std::vector<uint64_t>& dsts, const std::vector<uint64_t>& srcs,
                    const std::vector<uint64_t>& sizes, int ctas, uint64_t stream) {
  tide::check_ctas(ctas, "copy");
  for (const auto& args : tide::make_copy_args(dsts, srcs, sizes)) tide::launch_copy(args, ctas, stream);
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

// How this module was built (the doctor compares it with the driver and the GPUs).
py::dict build_info() {
  py::dict info;
  info["cuda_runtime"] = CUDART_VERSION;  // the runtime linked in (statically), e.g. 13000
  info["architectures"] = TIDE_CUDA_ARCHS;
  info["compiler"] = TIDE_CUDA_COMPILER_VERSION;
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "TIDE CUDA core: copy-engine batches, stream memory operations, fp32 reduce-scatter sums";
  // tide::Error -> RuntimeError by this module's own translator, tried before the global ones, which
  // every extension built with the same pybind11 ABI shares (and can add to). Python callers check
  // their arguments first (tide_core.runtime.device), so a C++ exception is a last resort.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tide::Error& e) {
      py::set_error(PyExc_RuntimeError, e.what());
    }
  });
  m.attr("MAX_SOURCES") = tide::kMaxSources;
  m.attr("MAX_SEGMENTS") = tide::kMaxSegments;
  m.attr("MAX_CTAS") = tide::kMaxCtas;
  m.attr("MAX_TMA_TILE") = tide::kTmaMaxTile;
  // CudaOptions.sum_kernel's names, and tma_lean (auto's choice where TMA applies) for measurements.
  m.attr("SUM_KERNELS") =
      py::dict(py::arg("auto") = static_cast<int>(tide::kSumAuto), py::arg("regs") = static_cast<int>(tide::kSumRegs),
               py::arg("tma") = static_cast<int>(tide::kSumTma),
               py::arg("tma_lean") = static_cast<int>(tide::kSumTmaLean));
  m.def("memcpy_batch", &tide::memcpy_batch, py::arg("dsts"), py::arg("srcs"), py::arg("sizes"), py::arg("stream"),
        py::arg("prefer_overlap") = true, py::call_guard<py::gil_scoped_release>(),
        "Stream-ordered batch of unordered copies (cudaMemcpyBatchAsync; copy engines).");
  m.def("memcpy_2d", &tide::memcpy_2d, py::arg("dst"), py::arg("dpitch"), py::arg("src"), py::arg("spitch"),
        py::arg("width"), py::arg("height"), py::arg("stream"), py::call_guard<py::gil_scoped_release>());
  m.def("memcpy_2d_probe", &tide::memcpy_2d_probe, py::arg("dst"), py::arg("src"), py::arg("pitch"), py::arg("width"),
        py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        "Whether the driver takes a one-row 2-D copy with this pitch: the cudaError_t, 0 if taken.");
  m.def("device_max_pitch", &tide::device_max_pitch, "The current device's cudaDevAttrMaxPitch.");
  m.def("stream_memops_available", &tide::stream_memops_available);
  m.def("stream_write_u32", &tide::stream_write_u32, py::arg("stream"), py::arg("addresses"), py::arg("value"),
        py::call_guard<py::gil_scoped_release>(), "cuStreamWriteValue32 to each address (with a memory barrier).");
  m.def("stream_wait_u32", &tide::stream_wait_u32, py::arg("stream"), py::arg("addresses"), py::arg("value"),
        py::call_guard<py::gil_scoped_release>(), "cuStreamWaitValue32 GEQ on each address.");
  m.def("launch_sum", &launch_sum_py, py::arg("out"), py::arg("staged"), py::arg("segments"), py::arg("first"),
        py::arg("count"), py::arg("alpha"), py::arg("accumulate"), py::arg("dtype"), py::arg("ctas"), py::arg("stream"),
        py::arg("kernel") = static_cast<int>(tide::kSumAuto), py::arg("tma_tile") = 0, py::arg("tma_stages") = 0,
        py::call_guard<py::gil_scoped_release>(),
        "kernel: a SUM_KERNELS value (TIDEConfig.sum_kernel); tma_tile, tma_stages: the TMA kernels' tile "
        "(elements) and depth, 0 = planned (for measurements).");
  m.def("copy_kernel", &copy_kernel_py, py::arg("dsts"), py::arg("srcs"), py::arg("sizes"), py::arg("ctas"),
        py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        "Same-GPU copies of many segments in one kernel launch per 96 segments.");
  m.attr("CALLER_STREAM") = tide::kCallerStream;
  py::class_<tide::StreamProgram>(m, "StreamProgram",
                                  "Device work recorded once, replayed per call with flag values relative to a base.")
      .def(py::init<int>(), py::arg("num_events"))
      .def("record", &tide::StreamProgram::record, py::arg("stream"), py::arg("event"))
      .def("wait_event", &tide::StreamProgram::wait_event, py::arg("stream"), py::arg("event"))
      .def("write_flags", &tide::StreamProgram::write_flags, py::arg("stream"), py::arg("addresses"),
           py::arg("value_offset"))
      .def("wait_flags", &tide::StreamProgram::wait_flags, py::arg("stream"), py::arg("addresses"),
           py::arg("value_offset"))
      .def("copy_batch", &tide::StreamProgram::copy_batch, py::arg("stream"), py::arg("dsts"), py::arg("srcs"),
           py::arg("sizes"))
      .def("copy_2d", &tide::StreamProgram::copy_2d, py::arg("stream"), py::arg("dst"), py::arg("dpitch"),
           py::arg("src"), py::arg("spitch"), py::arg("width"), py::arg("height"))
      .def("copy_kernel", &tide::StreamProgram::copy_kernel, py::arg("stream"), py::arg("dsts"), py::arg("srcs"),
           py::arg("sizes"), py::arg("ctas"))
      .def(
          "sum",
          [](tide::StreamProgram& p, uint64_t stream, uint64_t out, const std::vector<uint64_t>& staged,
             const std::vector<SegmentTuple>& segments, int64_t first, int64_t count, float alpha, bool accumulate,
             int dtype, int ctas, int kernel) {
            p.sum(stream, sum_launch(out, staged, segments, first, count, alpha, accumulate, dtype, ctas, kernel));
          },
          py::arg("stream"), py::arg("out"), py::arg("staged"), py::arg("segments"), py::arg("first"), py::arg("count"),
          py::arg("alpha"), py::arg("accumulate"), py::arg("dtype"), py::arg("ctas"),
          py::arg("kernel") = static_cast<int>(tide::kSumAuto))
      .def("set_outputs", &tide::StreamProgram::set_outputs, py::arg("events"), py::arg("ring"))
      .def("replay", &tide::StreamProgram::replay, py::arg("caller_stream"), py::arg("base"),
           py::call_guard<py::gil_scoped_release>())
      .def("__len__", &tide::StreamProgram::size);
  m.def("event_query", &tide::event_query, py::arg("event"), py::call_guard<py::gil_scoped_release>());
  m.def("stream_wait_event", &tide::stream_wait_event, py::arg("stream"), py::arg("event"),
        py::call_guard<py::gil_scoped_release>());
  m.def("tma_available", &tide::tma_available,
        "Whether the current GPU runs the TMA sum kernels (compute capability 9.0+, an sm_90+ kernel image).");
  m.def("runtime_version", &runtime_version);
  m.def("driver_version", &driver_version);
  m.def("build_info", &build_info);
}
