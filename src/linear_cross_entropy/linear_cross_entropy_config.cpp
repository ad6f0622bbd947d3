#include "linear_cross_entropy/linear_cross_entropy_config.h"

#include <algorithm>
#include <climits>

#include "core/overrides.h"
#include "linear_cross_entropy/linear_cross_entropy_params.h"

namespace fusekit::lxent {

namespace {
std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }
}  // namespace

std::int64_t choose_chunk(const Problem& p, const detail::DeviceInfo&) {
  if (p.tokens <= 0) return 0;
  const std::int64_t row_bytes = std::max<std::int64_t>(1, chunk_row_stride(p.vocab) * p.element_bytes);
  std::int64_t cap = std::clamp(kTargetChunkBytes / row_bytes, kMinChunkTokens,
                                std::max(kMinChunkTokens, kMaxChunkBytes / row_bytes));
  cap = std::min(cap, kMaxChunkBytes / row_bytes);
  cap = std::max(kChunkRowMultiple, cap / kChunkRowMultiple * kChunkRowMultiple);
  if (p.tokens <= cap) return p.tokens;
  const std::int64_t chunks = ceil_div(p.tokens, cap);
  return std::min(cap, ceil_div(ceil_div(p.tokens, chunks), kChunkRowMultiple) * kChunkRowMultiple);
}

std::int64_t chunk_with_overrides(const Problem& p, const detail::DeviceInfo& device) {
  if (p.tokens <= 0) return 0;
  if (const auto forced = detail::override_int("linear_cross_entropy.chunk_tokens", 1, INT_MAX))
    return std::min<std::int64_t>(*forced, p.tokens);
  return choose_chunk(p, device);
}

}  // namespace fusekit::lxent
