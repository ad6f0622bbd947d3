// Philox4x32-10 against the published known-answer vectors (Random123's kat_vectors), which
// cuRAND's Philox4_32_10 reproduces; test_philox_curand.cu checks cuRAND itself on a GPU.
#include <gtest/gtest.h>

#include "fusekit/philox.h"

namespace fusekit {
namespace {

struct Kat {
  philox::Words4 counter;
  std::uint32_t key0, key1;
  philox::Words4 expected;
};

TEST(Philox, KnownAnswerVectors) {
  const Kat kats[] = {
      {{0, 0, 0, 0}, 0, 0, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       0xffffffffu,
       0xffffffffu,
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       0xa4093822u,
       0x299f31d0u,
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    const philox::Words4 r = philox::philox4x32_10(k.counter, k.key0, k.key1);
    EXPECT_EQ(r.x, k.expected.x);
    EXPECT_EQ(r.y, k.expected.y);
    EXPECT_EQ(r.z, k.expected.z);
    EXPECT_EQ(r.w, k.expected.w);
  }
}

TEST(Philox, CounterLayoutMatchesCurand) {
  // random4(seed, subsequence, n) puts n in counter words 0-1 and the subsequence in words 2-3,
  // with the seed as key: cuRAND's curand_init(seed, subsequence, 4n) layout.
  const std::uint64_t seed = 0x0123456789abcdefull, sub = 0x1122334455667788ull, n = 0xdeadbeefcafef00dull;
  const philox::Words4 a = philox::random4(seed, sub, n);
  const philox::Words4 b = philox::philox4x32_10(
      {static_cast<std::uint32_t>(n), static_cast<std::uint32_t>(n >> 32),
       static_cast<std::uint32_t>(sub), static_cast<std::uint32_t>(sub >> 32)},
      static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
  EXPECT_EQ(a.x, b.x);
  EXPECT_EQ(a.w, b.w);
  // Neighbouring counters, subsequences and seeds give unrelated words.
  EXPECT_NE(philox::random4(seed, sub, n + 1).x, a.x);
  EXPECT_NE(philox::random4(seed, sub + 1, n).x, a.x);
  EXPECT_NE(philox::random4(seed + 1, sub, n).x, a.x);
}

TEST(Philox, UniformMappingIsInHalfOpenUnitInterval) {
  EXPECT_GT(philox::to_uniform(0u), 0.0f);
  EXPECT_LE(philox::to_uniform(0xffffffffu), 1.0f);
  // The mean of many draws is close to 1/2 (the bits are uniform).
  double sum = 0.0;
  const int n = 1 << 16;
  for (int i = 0; i < n / 4; ++i) {
    const philox::Words4 r = philox::random4(42, 7, i);
    sum += philox::to_uniform(r.x) + philox::to_uniform(r.y) + philox::to_uniform(r.z) +
           philox::to_uniform(r.w);
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);  // 4.5 standard deviations of the mean
}

}  // namespace
}  // namespace fusekit
