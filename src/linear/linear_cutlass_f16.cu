// The fused forward GEMM instantiated for f16 (see linear_cutlass_bf16.cu).
#include <cutlass/half.h>

#include "linear/linear_cutlass_sm90.cuh"

namespace fusekit::linear::sm90 {

void fused_forward_f16(const char* op, const FusedForwardArgs& a, void* stream) {
  fused_forward<cutlass::half_t>(op, a, stream);
}

}  // namespace fusekit::linear::sm90
