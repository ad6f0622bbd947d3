// The Hopper (wgmma + TMA) attention kernels: attention_sm90_forward.cu, attention_sm90_backward.cu.
// Internal to the CUDA backend.
#pragma once

#include <cuda_runtime.h>

#include "attention/attention_kernels.cuh"
#include "attention/attention_params.h"

namespace fusekit::attention::sm90 {

// Whether the Hopper forward serves this call: an sm_90 GPU, f16 / bf16, D = Dv = 64 or 128,
// scale > 0, at least one query and one key token, views TMA can describe, no bias or one in the
// input dtype with fixed lengths and a materialized query dim, and FUSEKIT_ATTENTION_SM90 not set
// to 0 (the switch that keeps the mma.sync kernel reachable for comparisons).
bool forward_supported(const Problem& p, int device_index);

// Launches the Hopper forward on `stream`; `k` holds the kernel parameters the mma.sync path uses.
void forward(const Problem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream);

// Whether the Hopper dK / dV kernel serves this backward: the forward's conditions, dout TMA can
// describe, and with a bias the atomic-dQ mode and a dbias (if any) in the input dtype with no
// dimension to reduce over.
bool backward_supported(const BackwardProblem& p, int device_index);

// Launches the Hopper dK / dV kernel (with the dQ parts added to k.dq_accum when k.atomic_dq):
// the step between the preprocess kernel and the dq conversion of attention_cuda.cu.
void dkdv(const BackwardProblem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream);

}  // namespace fusekit::attention::sm90
