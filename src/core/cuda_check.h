// Checking every CUDA call: a failure becomes fusekit::Error(cuda) naming the op and the call.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "fusekit/error.h"

namespace fusekit::detail {

[[noreturn]] inline void throw_cuda_error(const char* op, const char* what, cudaError_t status) {
  throw Error(ErrorKind::cuda, op,
              std::string(what) + " failed: " + cudaGetErrorName(status) + " (" +
                  cudaGetErrorString(status) + ")");
}

inline void check_cuda(cudaError_t status, const char* op, const char* what) {
  if (status != cudaSuccess) throw_cuda_error(op, what, status);
}

// After a kernel launch: launch-configuration errors surface here, not at the next sync.
inline void check_launch(const char* op, const char* kernel) {
  check_cuda(cudaGetLastError(), op, kernel);
}

}  // namespace fusekit::detail

#define FUSEKIT_CUDA_CHECK(op, call) ::fusekit::detail::check_cuda((call), (op), #call)

namespace fusekit::detail {

// Makes `device_index` current for the scope of a launch and restores the caller's device.
class DeviceGuard {
 public:
  DeviceGuard(const char* op, int device_index) {
    check_cuda(cudaGetDevice(&previous_), op, "cudaGetDevice");
    if (previous_ != device_index) check_cuda(cudaSetDevice(device_index), op, "cudaSetDevice");
    else previous_ = -1;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace fusekit::detail
