// Random fp8 inputs for the FP8 RMSNorm benchmark, generated on the device.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <curand_kernel.h>

#include "bench/fp8_norm/bench_fp8_norm.h"

namespace fusekit::bench {
namespace {

__global__ void fill_kernel(__nv_fp8_e4m3* x, std::size_t n, __nv_bfloat16* scales, std::size_t n_scales,
                            std::uint64_t seed) {
  const std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  curandStatePhilox4_32_10_t s;
  curand_init(seed, i, 0, &s);
  if (i < n) x[i] = __nv_fp8_e4m3(150.0f * curand_normal(&s));  // saturating conversion
  if (i < n_scales) scales[i] = __float2bfloat16_rn(0.001f + 0.01f * fabsf(curand_normal(&s)));
}

}  // namespace

void fill_fp8_norm_inputs(void* x_e4m3, std::size_t n, void* scales_bf16, std::size_t n_scales,
                          std::uint64_t seed) {
  const std::size_t total = n > n_scales ? n : n_scales;
  fill_kernel<<<static_cast<unsigned>((total + 255) / 256), 256>>>(
      static_cast<__nv_fp8_e4m3*>(x_e4m3), n, static_cast<__nv_bfloat16*>(scales_bf16), n_scales, seed);
  cuda_check(cudaGetLastError(), "fill_fp8_norm_inputs");
}

}  // namespace fusekit::bench
