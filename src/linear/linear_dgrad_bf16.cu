// The dx GEMM with dz formed inside, instantiated for bf16 (one translation unit per dtype so
// that the heavy CUTLASS instantiations build in parallel).
#include <cuda_bf16.h>
#include <cutlass/bfloat16.h>

#include "linear/linear_dgrad_sm90.cuh"

namespace fusekit::linear::sm90 {

void dgrad_forming_bf16(const char* op, const DgradFormingArgs& a, void* stream) {
  run_dgrad_forming<cutlass::bfloat16_t, __nv_bfloat16>(op, a, stream);
}

}  // namespace fusekit::linear::sm90
