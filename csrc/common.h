// Shared helpers for tide_core._C: error checks that raise Python exceptions with context.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace tide {

[[noreturn]] inline void fail(const std::string& what, const char* file, int line) {
  std::ostringstream msg;
  msg << "tide_core._C: " << what << " (" << file << ":" << line << ")";
  throw std::runtime_error(msg.str());
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

inline cudaStream_t as_stream(uint64_t handle) { return reinterpret_cast<cudaStream_t>(handle); }
inline void* as_ptr(uint64_t address) { return reinterpret_cast<void*>(address); }

}  // namespace tide
