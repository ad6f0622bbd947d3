// The trainer's host-side random numbers: SplitMix64, simple enough that reference.py reproduces
// the data order with a few lines of Python.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

namespace train_gpt {

// SplitMix64 (Steele, Lea, Flood 2014): state += golden gamma, then a 64-bit finalizer.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n) (n >= 1); the modulo bias is below 2^-40 for the sizes used here.
  std::uint64_t below(std::uint64_t n) { return next() % n; }

 private:
  std::uint64_t state_;
};

// A seed for stream `stream`, item `index` derived from `seed`, so that independent uses of one
// run seed (initialization, data order, sampling) never share a stream.
inline std::uint64_t mix_seed(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  SplitMix64 a(seed ^ (stream * 0xD1B54A32D192ED03ull));
  SplitMix64 b(a.next() + index);
  return b.next();
}

// Standard normal numbers (Box-Muller on SplitMix64's uniforms).
class NormalRng {
 public:
  explicit NormalRng(std::uint64_t seed) : bits_(seed) {}
  float next() {
    if (has_spare_) {
      has_spare_ = false;
      return static_cast<float>(spare_);
    }
    const double u1 = 1.0 - bits_.uniform();  // (0, 1]: log is finite
    const double u2 = bits_.uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * std::numbers::pi * u2);
    has_spare_ = true;
    return static_cast<float>(r * std::cos(2.0 * std::numbers::pi * u2));
  }

 private:
  SplitMix64 bits_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

// A permutation of 0 .. n-1 (Fisher-Yates, from the last element down).
inline std::vector<std::int64_t> permutation(std::int64_t n, std::uint64_t seed) {
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  SplitMix64 rng(seed);
  for (std::int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(i) + 1));
    std::swap(order[static_cast<std::size_t>(i)], order[static_cast<std::size_t>(j)]);
  }
  return order;
}

}  // namespace train_gpt
