// The dropout mask that bias_act_dropout (fusekit/bias_act_dropout.h) and attention
// (fusekit/attention.h) share, for callers that want to reproduce or inspect it.
//
// Element (r, c) of the logical (M, N) tensor has the linear index i = r * N + c (the
// row stride of the memory layout plays no part). Its 16-bit random value is
//     u16(i) = half (i % 2) of word ((i % 8) / 2) of philox::random4(seed, offset, i / 8)
// (words .x, .y, .z, .w = 0..3; half 0 = the low 16 bits, 1 = the high 16 bits), i.e. taken from
// the output of cuRAND's curand4() after curand_init(seed, offset, 4 * (i / 8)): `offset` is the
// Philox subsequence and each group of eight consecutive elements uses one Philox4x32-10 call.
// The element is kept iff
//     u16(i) >= dropout_keep_threshold(p) = min(ceil(p * 65536), 65535)
// so it is kept with probability 1 - threshold / 65536, within 2^-16 of 1 - p (p is resolved to
// 1/65536: 16 random bits per element halve the Philox work against 32). Kept elements are
// scaled by 1 / (1 - p) (computed in float32); dropped elements are exactly 0, whatever the
// input. The mask is a pure function of (seed, offset, p, i): forward, backward, the CPU
// reference and any launch configuration or GPU agree on it bit for bit, and dropout_keeps()
// below reproduces it. Give every call whose mask must be independent its own (seed, offset)
// pair, e.g. one offset per layer and step; the backward must get the same config as its
// forward.
#pragma once

#include <cmath>
#include <cstdint>

#include "fusekit/philox.h"

namespace fusekit {

// min(ceil(p * 65536), 65535) for p in [0, 1) (p outside that range is the caller's error; the
// ops check it).
inline std::uint32_t dropout_keep_threshold(float p) {
  const double t = std::ceil(static_cast<double>(p) * 65536.0);
  return t <= 0.0 ? 0u : (t >= 65535.0 ? 65535u : static_cast<std::uint32_t>(t));
}

// The 16-bit random value of element `index`, given its group's words
// w = philox::random4(seed, offset, index / 8).
FUSEKIT_HOST_DEVICE std::uint32_t dropout_random16_of_group(const philox::Words4& w,
                                                            std::uint64_t index) {
  std::uint32_t word;
  switch ((index % 8) / 2) {
    case 0: word = w.x; break;
    case 1: word = w.y; break;
    case 2: word = w.z; break;
    default: word = w.w; break;
  }
  return index % 2 ? word >> 16 : word & 0xFFFFu;
}

// The 16-bit random value of element `index` (see the mapping above).
FUSEKIT_HOST_DEVICE std::uint32_t dropout_random16(std::uint64_t seed, std::uint64_t offset,
                                                   std::uint64_t index) {
  return dropout_random16_of_group(philox::random4(seed, offset, index / 8), index);
}

// Whether element `index` (= row * N + col) is kept under `threshold` = dropout_keep_threshold(p).
FUSEKIT_HOST_DEVICE bool dropout_keeps(std::uint64_t seed, std::uint64_t offset,
                                       std::uint64_t index, std::uint32_t threshold) {
  return dropout_random16(seed, offset, index) >= threshold;
}

}  // namespace fusekit
