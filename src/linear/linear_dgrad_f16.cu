// The dx GEMM with dz formed inside, instantiated for f16 (one translation unit per dtype so
// that the heavy CUTLASS instantiations build in parallel).
#include <cuda_fp16.h>
#include <cutlass/half.h>

#include "linear/linear_dgrad_sm90.cuh"

namespace fusekit::linear::sm90 {

void dgrad_forming_f16(const char* op, const DgradFormingArgs& a, void* stream) {
  run_dgrad_forming<cutlass::half_t, __half>(op, a, stream);
}

}  // namespace fusekit::linear::sm90
