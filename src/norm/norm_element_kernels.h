// The element kernels (norm_element_kernels.cu): LayerNorm / RMSNorm rows held in registers one
// element at a time, for rows whose strides or pointers the 16-byte vectors cannot take. The
// shape (threads per row, elements per thread) comes from element_shape (norm_config.h).
#pragma once

#include <cuda_runtime.h>

#include "norm/norm_config.h"
#include "norm/norm_params.h"

namespace fusekit::norm {

// Forward: grid-stride over rows, kElementBlockThreads / shape.threads_per_row rows at a time per
// block.
template <typename T, typename W>
void launch_forward_elements(const ForwardParams& p, const ElementShape& shape, int grid, cudaStream_t stream);

// Backward: the same walk; block b's dweight / dbias sums go to workspace row b of partial_dw /
// partial_db (both null: no gradients asked for).
template <typename T, typename W>
void launch_backward_elements(const BackwardParams& p, const ElementShape& shape, int grid, float* partial_dw,
                              float* partial_db, cudaStream_t stream);

}  // namespace fusekit::norm
