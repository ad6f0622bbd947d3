// core/launch_tuning.h's shared-memory opt-in on the GPU: a kernel with static shared memory and
// exactly 48 KB of dynamic shared memory (the launch the FP8 statistics launcher once got wrong).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <string>

#include "core/launch_tuning.h"
#include "fusekit/error.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kDynamicBytes = 48 * 1024;

// Fills 1 KB of static and `dynamic_bytes` of dynamic shared memory, then sums both back: the
// result proves the block really had all of it. `kInstance` gives each test its own kernel, so
// that one test's opt-in cannot help another.
template <int kInstance>
__global__ void fill_and_sum_kernel(std::size_t dynamic_bytes, unsigned long long* out) {
  __shared__ unsigned fixed[kThreads];
  extern __shared__ unsigned dynamic_words[];
  const std::size_t words = dynamic_bytes / sizeof(unsigned);
  fixed[threadIdx.x] = threadIdx.x;
  for (std::size_t i = threadIdx.x; i < words; i += blockDim.x) dynamic_words[i] = static_cast<unsigned>(i);
  __syncthreads();
  unsigned long long sum = 0;
  for (std::size_t i = threadIdx.x; i < words; i += blockDim.x) sum += dynamic_words[i];
  sum += fixed[(threadIdx.x + 1) % kThreads];
  atomicAdd(out, sum);
}

unsigned long long expected_sum(std::size_t dynamic_bytes) {
  const unsigned long long words = dynamic_bytes / sizeof(unsigned);
  return words * (words - 1) / 2 + static_cast<unsigned long long>(kThreads) * (kThreads - 1) / 2;
}

// Launches one block; the sum it wrote, or the launch error.
template <int kInstance>
cudaError_t launch_and_sum(std::size_t dynamic_bytes, unsigned long long* sum) {
  unsigned long long* out = nullptr;
  cudaError_t status = cudaMalloc(&out, sizeof *out);
  if (status != cudaSuccess) return status;
  status = cudaMemset(out, 0, sizeof *out);
  if (status == cudaSuccess) {
    fill_and_sum_kernel<kInstance><<<1, kThreads, dynamic_bytes>>>(dynamic_bytes, out);
    status = cudaGetLastError();
  }
  if (status == cudaSuccess) status = cudaDeviceSynchronize();
  if (status == cudaSuccess) status = cudaMemcpy(sum, out, sizeof *sum, cudaMemcpyDeviceToHost);
  cudaFree(out);
  return status;
}

// The precondition the fix is for: without the opt-in this launch is refused even though its
// dynamic part is not over 48 KB. (If a driver ever accepts it, this test says so instead of
// passing on a launch that no longer exercises anything.)
TEST(LaunchTuningGpu, StaticPlusDefaultDynamicNeedsTheOptIn) {
  FUSEKIT_REQUIRE_GPU();
  unsigned long long sum = 0;
  EXPECT_EQ(launch_and_sum<0>(kDynamicBytes, &sum), cudaErrorInvalidValue);
  cudaGetLastError();  // clear the refusal for the tests after this one
}

TEST(LaunchTuningGpu, AllowDynamicSmemCountsStaticSharedMemory) {
  FUSEKIT_REQUIRE_GPU();
  detail::allow_dynamic_smem("launch_tuning_test", fill_and_sum_kernel<1>, kDynamicBytes, 0);
  unsigned long long sum = 0;
  ASSERT_EQ(launch_and_sum<1>(kDynamicBytes, &sum), cudaSuccess);
  EXPECT_EQ(sum, expected_sum(kDynamicBytes));
  // The cached opt-in also serves a larger request up to the GPU's limit.
  const std::size_t more = 96 * 1024;
  detail::allow_dynamic_smem("launch_tuning_test", fill_and_sum_kernel<1>, more, 0);
  ASSERT_EQ(launch_and_sum<1>(more, &sum), cudaSuccess);
  EXPECT_EQ(sum, expected_sum(more));
}

TEST(LaunchTuningGpu, BlocksPerSmOptsInAndCounts) {
  FUSEKIT_REQUIRE_GPU();
  const int blocks = detail::blocks_per_sm("launch_tuning_test", fill_and_sum_kernel<2>, kThreads, kDynamicBytes, 0);
  EXPECT_GE(blocks, 1);
  unsigned long long sum = 0;
  ASSERT_EQ(launch_and_sum<2>(kDynamicBytes, &sum), cudaSuccess);
  EXPECT_EQ(sum, expected_sum(kDynamicBytes));
}

TEST(LaunchTuningGpu, TooMuchSharedMemoryIsAClearError) {
  FUSEKIT_REQUIRE_GPU();
  // 1 KB of static memory leaves less than the whole opt-in limit (227 KB on sm_90) for the rest.
  int optin = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0), cudaSuccess);
  try {
    detail::allow_dynamic_smem("launch_tuning_test", fill_and_sum_kernel<3>, static_cast<std::size_t>(optin), 0,
                               "the test kernel");
    FAIL() << "expected an error for " << optin << " bytes of dynamic shared memory";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::unsupported);
    const std::string what = e.what();
    EXPECT_NE(what.find("the test kernel needs " + std::to_string(optin) + " bytes"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace fusekit
