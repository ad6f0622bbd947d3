// The gated forward GEMM instantiated for bf16 (one translation unit per dtype, built in parallel).
#include <cutlass/bfloat16.h>

#include "linear/linear_gated_sm90.cuh"

namespace fusekit::linear::sm90 {

void gated_forward_bf16(const char* op, const FusedForwardArgs& a, void* stream) {
  gated_forward<cutlass::bfloat16_t>(op, a, stream);
}

}  // namespace fusekit::linear::sm90
