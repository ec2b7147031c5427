// Shared helpers for tide_core._C: error checks that raise Python exceptions with context.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace tide {

// What tide_core._C throws; bindings.cpp turns it into RuntimeError with its own translator.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The message is built without iostreams: a stream's number formatting goes through the global
// locale's facets, which another library's copy of the C++ runtime in the process can leave
// inconsistent with ours (a suspect for the interpreter crash on a rejected argument, H200).
[[noreturn]] inline void fail(const std::string& what, const char* file, int line) {
  throw Error("tide_core._C: " + what + " (" + file + ":" + std::to_string(line) + ")");
}

#define TIDE_CUDA_CHECK(expr)                                                                             \
  do {                                                                                                    \
    cudaError_t tide_err_ = (expr);                                                                       \
    if (tide_err_ != cudaSuccess) {                                                                       \
      ::tide::fail(std::string(#expr) + " failed: " + cudaGetErrorString(tide_err_), __FILE__, __LINE__); \
    }                                                                                                     \
  } while (0)

#define TIDE_CHECK(cond, what)                             \
  do {                                                     \
    if (!(cond)) ::tide::fail((what), __FILE__, __LINE__); \
  } while (0)

// CTAs of one sum or copy kernel launch (tide_core.plan.buffers.MAX_CTAS, the settings' bound).
constexpr int kMaxCtas = 1 << 16;

inline void check_ctas(int ctas, const std::string& what) {
  TIDE_CHECK(ctas >= 1 && ctas <= kMaxCtas, what + ": ctas must be in [1, " + std::to_string(kMaxCtas) + "]");
}

inline cudaStream_t as_stream(uint64_t handle) { return reinterpret_cast<cudaStream_t>(handle); }
inline void* as_ptr(uint64_t address) { return reinterpret_cast<void*>(address); }

}  // namespace tide
