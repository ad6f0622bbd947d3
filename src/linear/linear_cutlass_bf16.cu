// The fused forward GEMM instantiated for bf16 (one translation unit per dtype so that the two
// heavy CUTLASS instantiations of each build in parallel).
#include <cutlass/bfloat16.h>

#include "linear/linear_cutlass_sm90.cuh"

namespace fusekit::linear::sm90 {

void fused_forward_bf16(const char* op, const FusedForwardArgs& a, void* stream) {
  fused_forward<cutlass::bfloat16_t>(op, a, stream);
}

}  // namespace fusekit::linear::sm90
