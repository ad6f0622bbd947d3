// Counter-based Philox4x32-10, usable from host and device code.
//
// Bit-identical to cuRAND's Philox4_32_10 generator: random4(seed, subsequence, n) returns the
// four 32-bit words that curand4() yields after curand_init(seed, subsequence, 4 * n, &state).
// Being counter-based, any element's random bits are a pure function of (seed, subsequence,
// counter), so a CPU reference, a forward kernel and a backward kernel can all regenerate the
// same dropout mask without storing it, whatever their launch configuration.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FUSEKIT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FUSEKIT_HOST_DEVICE inline
#endif

namespace fusekit::philox {

struct Words4 {
  std::uint32_t x, y, z, w;
};

inline constexpr std::uint32_t kMul0 = 0xD2511F53u;
inline constexpr std::uint32_t kMul1 = 0xCD9E8D57u;
inline constexpr std::uint32_t kWeyl0 = 0x9E3779B9u;  // golden ratio
inline constexpr std::uint32_t kWeyl1 = 0xBB67AE85u;  // sqrt(3) - 1

FUSEKIT_HOST_DEVICE std::uint32_t mul_hi(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<std::uint32_t>((static_cast<std::uint64_t>(a) * b) >> 32);
#endif
}

FUSEKIT_HOST_DEVICE Words4 round(Words4 c, std::uint32_t k0, std::uint32_t k1) {
  const std::uint32_t hi0 = mul_hi(kMul0, c.x), lo0 = kMul0 * c.x;
  const std::uint32_t hi1 = mul_hi(kMul1, c.z), lo1 = kMul1 * c.z;
  return {hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
}

// The raw block function: ten rounds over a 128-bit counter with a 64-bit key.
FUSEKIT_HOST_DEVICE Words4 philox4x32_10(Words4 counter, std::uint32_t key0, std::uint32_t key1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 9; ++i) {
    counter = round(counter, key0, key1);
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return round(counter, key0, key1);
}

// cuRAND's layout: key = seed, counter = (n, subsequence) as two 64-bit halves, low word first.
FUSEKIT_HOST_DEVICE Words4 random4(std::uint64_t seed, std::uint64_t subsequence, std::uint64_t n) {
  const Words4 counter{static_cast<std::uint32_t>(n), static_cast<std::uint32_t>(n >> 32),
                       static_cast<std::uint32_t>(subsequence),
                       static_cast<std::uint32_t>(subsequence >> 32)};
  return philox4x32_10(counter, static_cast<std::uint32_t>(seed),
                       static_cast<std::uint32_t>(seed >> 32));
}

// cuRAND's mapping of a 32-bit word to a float in (0, 1]: x * 2^-32 + 2^-33.
FUSEKIT_HOST_DEVICE float to_uniform(std::uint32_t bits) {
  return static_cast<float>(bits) * 2.3283064365386963e-10f + 1.1641532182693481e-10f;
}

}  // namespace fusekit::philox
