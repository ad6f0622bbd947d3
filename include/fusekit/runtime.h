// What the library can run on, queried without touching a GPU where none exists.
#pragma once

#include <string>

#include "fusekit/tensor.h"

namespace fusekit {

// Number of usable CUDA devices; 0 when there is no driver, no GPU, or CUDA reports an error.
int cuda_device_count();

// Whether this build has kernels for a GPU of compute capability major.minor (9.0, Hopper, today).
bool supports_compute_capability(int major, int minor);

// Whether CUDA device `device_index` exists and this build has kernels for it.
bool cuda_device_supported(int device_index);

// Throws Error(unsupported) naming the GPU and its compute capability when fusekit's kernels were
// not built for it. `op` is the op name used in the message.
void require_supported_gpu(const char* op, int device_index);

// One line describing the device: "NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, 50 MB L2)".
std::string describe_cuda_device(int device_index);

// The CUDA architectures this library was compiled for, e.g. "90a".
const char* built_cuda_architectures();

// This library's version, e.g. "0.1.0" (the repository's VERSION file).
const char* version();

}  // namespace fusekit
