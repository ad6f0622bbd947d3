// The gated forward GEMM instantiated for f16 (one translation unit per dtype, built in parallel).
#include <cutlass/half.h>

#include "linear/linear_gated_sm90.cuh"

namespace fusekit::linear::sm90 {

void gated_forward_f16(const char* op, const FusedForwardArgs& a, void* stream) {
  gated_forward<cutlass::half_t>(op, a, stream);
}

}  // namespace fusekit::linear::sm90
