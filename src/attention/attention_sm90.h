// The Hopper (wgmma + TMA) attention kernels: attention_sm90_forward.cu, attention_sm90_backward.cu.
// Internal to the CUDA backend.
#pragma once

#include <cuda_runtime.h>

#include "attention/attention_params.h"

namespace fusekit::attention::sm90 {

// The Hopper kernels serve the calls attention_config.h's sm90_forward_supported and
// sm90_backward_supported accept.

// Launches the Hopper forward on `stream`; `k` holds the kernel parameters the mma.sync path uses.
void forward(const Problem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream);

// Launches the Hopper dK / dV kernel (with the dQ parts added to k.dq_accum when k.atomic_dq):
// the step between the preprocess kernel and the dq conversion of attention_cuda.cu. `cta_group`:
// BackwardConfig::cta_group.
void dkdv(const BackwardProblem& p, const kernels::KernelParams& k, int cta_group, int device_index,
          cudaStream_t stream);

}  // namespace fusekit::attention::sm90
