// The row kernels' tail variants (rows whose N is not a multiple of the 16-byte vector), compiled
// in their own translation unit (norm_tail_kernels.cu) beside the other variants in norm_cuda.cu,
// so that the two compile in parallel.
#pragma once

#include "norm/norm_config.h"
#include "norm/norm_params.h"

namespace fusekit::norm {

using ForwardKernel = void (*)(ForwardParams, RowGeometry);
using BackwardKernel = void (*)(BackwardParams, RowGeometry, float*, float*);

// The compiled forward kernel of a tail variant (v.tail; rows any) of element type T and weight W.
template <typename T, typename W>
ForwardKernel forward_tail_kernel(const ForwardVariant& v);

// The compiled backward kernel of a tail variant (is_compiled(v), v.tail), or null.
template <typename T, typename W>
BackwardKernel backward_tail_kernel(const BackwardVariant& v);

}  // namespace fusekit::norm
