#include "rope/rope_config.h"

#include <algorithm>

namespace fusekit::rope {

namespace {

// The unit accesses tried, widest first: 16-byte vectors, then 8 and 4 bytes (e.g. GPT-NeoX-20B's
// r = 24 in 16-bit types: halves of 12 elements, 8-byte accesses).
constexpr int kAccessBytes[] = {16, 8, 4};

// Tokens per block: the fewest whose rows fill the block's row batches (rows_in_flight rows of
// every row group) to at least kMinBatchFill, so that a block is one round trip to memory with
// its angles computed under the first loads; else the best fill up to kMaxTokensPerBlock. Fewer
// tokens give a shorter last wave (bench, H200, rope fwd (B=4, S=4096, Hq=32, Hk=8), D = 128:
// 92.8 us at 4 tokens per block, 98.9 at 16).
constexpr double kMinBatchFill = 0.9;
// Blocks a launch should have per SM at least, before tokens_per_block is lowered for them.
constexpr std::int64_t kMinBlocksPerSm = 4;

int next_power_of_two(int v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}

}  // namespace

Launch choose_launch(const Problem& p, const detail::DeviceInfo& device, const ForcedChoices& forced) {
  Launch l;
  const int size = static_cast<int>(dtype_size(p.dtype));
  const std::int64_t half = p.rotary_dim / 2;
  const std::int64_t rotated_span = p.style == RopeStyle::rotate_half ? half : p.rotary_dim;
  const std::int64_t passed = p.head_dim - p.rotary_dim;
  const bool any_copies = p.q_copies || (p.heads_k > 0 && p.k_copies);
  const int min_elements = p.style == RopeStyle::interleaved ? 2 : 1;  // a unit holds whole pairs

  const int max_bytes = forced.max_access_bytes > 0 ? forced.max_access_bytes : 16;
  l.elementwise = true;
  l.access_elements = min_elements;
  for (int bytes : kAccessBytes) {
    const int w = bytes / size;
    if (bytes > max_bytes || w < min_elements || w > p.aligned_elements) continue;
    if (rotated_span % w != 0 || (any_copies && passed % w != 0)) continue;
    l.elementwise = false;
    l.access_elements = w;
    break;
  }
  l.rotation_units = static_cast<int>(rotated_span / l.access_elements);
  l.pass_accesses = p.style == RopeStyle::rotate_half && passed > 0 && passed % (2 * l.access_elements) == 0 ? 2 : 1;
  l.pass_units = static_cast<int>(passed / (l.pass_accesses * l.access_elements));

  const int units = std::max(row_units(l, p.q_copies), p.heads_k > 0 ? row_units(l, p.k_copies) : 0);
  l.lanes_per_row = std::min(32, next_power_of_two(units));
  l.rows_in_flight = rows_in_flight(p.style);
  l.threads = kThreads;

  const std::int64_t heads = p.heads_q + p.heads_k;
  const std::int64_t batch_rows = (l.threads / l.lanes_per_row) * l.rows_in_flight;  // rows of one batch
  auto fill = [&](std::int64_t tokens) {
    const std::int64_t rows = tokens * heads;
    return static_cast<double>(rows) / static_cast<double>((rows + batch_rows - 1) / batch_rows * batch_rows);
  };
  std::int64_t tpb = 1;
  for (std::int64_t t = 1; t <= kMaxTokensPerBlock; ++t) {
    if (fill(t) > fill(tpb) + 1e-9) tpb = t;
    if (fill(tpb) >= kMinBatchFill) break;
  }
  const std::int64_t min_blocks = kMinBlocksPerSm * std::max(1, device.sm_count);
  tpb = std::min(tpb, std::max<std::int64_t>(1, p.tokens / min_blocks));
  if (forced.tokens_per_block > 0) tpb = std::min(forced.tokens_per_block, kMaxTokensPerBlock);
  l.tokens_per_block = static_cast<int>(tpb);
  l.blocks = (p.tokens + tpb - 1) / tpb;

  l.cos_sin_stride = static_cast<int>((half + 1) / 2 * 2);
  // The angles, then each token's four base pointers (kernels::TokenBases).
  l.smem_bytes = static_cast<std::size_t>(l.tokens_per_block) * (l.cos_sin_stride * 2 * sizeof(float) + 4 * sizeof(void*));
  return l;
}

}  // namespace fusekit::rope
