// fusekit's Philox against cuRAND's device generator, bit for bit, on the GPU.
#include <curand_kernel.h>
#include <gtest/gtest.h>

#include <vector>

#include "fusekit/philox.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

// Thread i draws curand4 twice from curand_init(seed, sub[i], 4 * n[i]) and fusekit's random4 for
// counters n[i] and n[i] + 1, all on the device.
__global__ void compare_kernel(std::uint64_t seed, const std::uint64_t* subs, const std::uint64_t* ns,
                               uint4* curand_out, uint4* fusekit_out, int count) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  curandStatePhilox4_32_10_t state;
  curand_init(seed, subs[i], 4 * ns[i], &state);
  curand_out[2 * i] = curand4(&state);
  curand_out[2 * i + 1] = curand4(&state);
  for (int k = 0; k < 2; ++k) {
    const philox::Words4 w = philox::random4(seed, subs[i], ns[i] + k);
    fusekit_out[2 * i + k] = make_uint4(w.x, w.y, w.z, w.w);
  }
}

TEST(PhiloxGpu, BitIdenticalToCurandDeviceApi) {
  FUSEKIT_REQUIRE_GPU();
  constexpr int kCount = 4096;
  auto rng = testing::make_rng(11);
  std::vector<std::uint64_t> subs(kCount), ns(kCount);
  for (int i = 0; i < kCount; ++i) {
    subs[i] = (i % 3 == 0) ? rng() : rng() % 1000;  // large and small subsequences
    ns[i] = (i % 5 == 0) ? (rng() >> 3) : rng() % 100000;
  }
  const std::uint64_t seed = rng();
  std::uint64_t *d_subs, *d_ns;
  uint4 *d_cur, *d_fk;
  ASSERT_EQ(cudaMalloc(&d_subs, kCount * 8), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_ns, kCount * 8), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_cur, kCount * 2 * sizeof(uint4)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_fk, kCount * 2 * sizeof(uint4)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_subs, subs.data(), kCount * 8, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_ns, ns.data(), kCount * 8, cudaMemcpyHostToDevice), cudaSuccess);
  compare_kernel<<<kCount / 128, 128>>>(seed, d_subs, d_ns, d_cur, d_fk, kCount);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<uint4> cur(2 * kCount), fk(2 * kCount);
  ASSERT_EQ(cudaMemcpy(cur.data(), d_cur, cur.size() * sizeof(uint4), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(fk.data(), d_fk, fk.size() * sizeof(uint4), cudaMemcpyDeviceToHost), cudaSuccess);
  int mismatches = 0;
  for (int i = 0; i < 2 * kCount; ++i) {
    // The host implementation must agree too.
    const philox::Words4 h = philox::random4(seed, subs[i / 2], ns[i / 2] + i % 2);
    if (cur[i].x != fk[i].x || cur[i].y != fk[i].y || cur[i].z != fk[i].z || cur[i].w != fk[i].w ||
        h.x != cur[i].x || h.w != cur[i].w)
      ++mismatches;
  }
  EXPECT_EQ(mismatches, 0);
  cudaFree(d_subs);
  cudaFree(d_ns);
  cudaFree(d_cur);
  cudaFree(d_fk);
}

}  // namespace
}  // namespace fusekit
