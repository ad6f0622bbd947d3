// The Hopper (wgmma + TMA) attention forward: attention_sm90.cu. Internal to the CUDA backend.
#pragma once

#include <cuda_runtime.h>

#include "attention/attention_kernels.cuh"
#include "attention/attention_params.h"

namespace fusekit::attention::sm90 {

// Whether the Hopper forward serves this call: an sm_90 GPU, f16 / bf16, D = Dv = 64 or 128, no
// bias, no dropout, scale > 0, and FUSEKIT_ATTENTION_SM90 not set to 0 (the switch that keeps the
// mma.sync kernel reachable for comparisons).
bool forward_supported(const Problem& p, int device_index);

// Launches the Hopper forward on `stream`; `k` holds the kernel parameters the mma.sync path uses.
void forward(const Problem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream);

}  // namespace fusekit::attention::sm90
