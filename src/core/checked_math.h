// Size arithmetic that cannot wrap. Element counts, byte counts and workspace sizes that the
// argument checks, the workspace queries and the CPU references compute go through these, so an
// absurd size is refused with an Error instead of wrapping to a small (or zero) number.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "fusekit/error.h"

namespace fusekit::detail {

// The largest byte count fusekit accepts for one tensor, workspace or scratch buffer: PTRDIFF_MAX,
// the size of the largest object C++ (and any allocator) can describe.
inline constexpr std::int64_t kMaxBytes = INT64_MAX;

// a * b of non-negative a and b; nullopt when the product exceeds INT64_MAX.
inline std::optional<std::int64_t> checked_mul(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// a + b of non-negative a and b; nullopt when the sum exceeds INT64_MAX.
inline std::optional<std::int64_t> checked_add(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// The product of non-negative factors; nullopt when it exceeds INT64_MAX (or a factor is negative).
inline std::optional<std::int64_t> checked_product(std::initializer_list<std::int64_t> factors) {
  std::int64_t r = 1;
  for (std::int64_t f : factors) {
    const std::optional<std::int64_t> next = checked_mul(r, f);
    if (!next) return std::nullopt;
    r = *next;
  }
  return r;
}

// "a x b x c", for messages.
inline std::string product_string(std::initializer_list<std::int64_t> factors) {
  std::string s;
  for (std::int64_t f : factors) {
    if (!s.empty()) s += " x ";
    s += std::to_string(f);
  }
  return s;
}

// The product of `factors` (a byte count when the last factor is an element size), or
// Error(invalid_argument) naming `op`, `argument` and the factors when it exceeds kMaxBytes.
// `what` names the product, e.g. "the float32 dq accumulator (B x Sq x Hq x D x 4 bytes)".
inline std::int64_t size_product(const char* op, const char* argument, const char* what,
                                 std::initializer_list<std::int64_t> factors) {
  const std::optional<std::int64_t> r = checked_product(factors);
  if (!r)
    throw Error(ErrorKind::invalid_argument, op, argument,
                std::string("sizes for which ") + what + " fits in 2^63 - 1",
                product_string(factors) + ", which does not");
  return *r;
}

}  // namespace fusekit::detail
