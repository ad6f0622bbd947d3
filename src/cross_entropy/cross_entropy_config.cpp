#include "cross_entropy/cross_entropy_config.h"

#include <algorithm>
#include <climits>

#include "core/overrides.h"

namespace fusekit::cross_entropy {

namespace {

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Blocks per row: `parts` to start with, doubled (row kernel: clusters are powers of two) or
// incremented while the grid has fewer than kMinBlocksPerSm blocks per SM and the slices stay at
// least kMinSliceBytes.
int spread_small_batches(const Problem& p, int parts, int limit, bool powers_of_two, int sm_count) {
  const std::int64_t row_bytes = p.cols * p.element_bytes;
  const std::int64_t want = std::int64_t(kMinBlocksPerSm) * sm_count;
  while (parts < limit && p.rows * parts < want) {
    const int next = powers_of_two ? 2 * parts : parts + 1;
    if (next > limit || row_bytes / next < kMinSliceBytes) break;
    parts = next;
  }
  return parts;
}

// The power of two in [kMinThreads, kMaxThreads] whose one sweep covers `slice` bytes.
int threads_for(std::int64_t slice) {
  const std::int64_t vectors = ceil_div(slice, kVectorBytes);
  int threads = kMinThreads;
  while (threads < kMaxThreads && std::int64_t(threads) * kVectorsPerThread < vectors) threads *= 2;
  return threads;
}

// The staged kernel's shared memory for a row of `row_bytes`: the whole row's vectors at two
// blocks per SM where they fit, else the most blocks per SM (2, then 1) whose streamed remainder
// stays within kStagedStreamedL2Bytes over the GPU (`fits`: one does); `forced_blocks` (1, 2)
// decides instead where nonzero.
struct StagedShape {
  std::int64_t held_bytes;
  int blocks_per_sm;
  bool fits;
};
StagedShape staged_shape(std::int64_t row_bytes, const detail::DeviceInfo& device, int forced_blocks) {
  const std::int64_t vector_bytes = ceil_div(row_bytes, kVectorBytes) * kVectorBytes;
  auto shape_at = [&](int blocks) {
    const std::int64_t capacity = blocks == 2 ? kStagedRowBytes : kStagedSoleBlockBytes;
    const std::int64_t held = std::min(vector_bytes, capacity);
    const std::int64_t streamed = std::int64_t(blocks) * device.sm_count * (vector_bytes - held);
    return StagedShape{held, blocks, streamed <= kStagedStreamedL2Bytes};
  };
  if (forced_blocks > 0) return shape_at(forced_blocks);
  for (int blocks : {2, 1})
    if (const StagedShape s = shape_at(blocks); s.fits) return s;
  return shape_at(1);
}

}  // namespace

LaunchOverrides read_launch_overrides() {
  LaunchOverrides o;
  if (auto v = detail::override_choice<int>("cross_entropy.threads", {{"64", 64}, {"128", 128}, {"256", 256}}))
    o.threads = *v;
  if (auto v = detail::override_choice<int>("cross_entropy.cluster", {{"1", 1}, {"2", 2}, {"4", 4}, {"8", 8}}))
    o.cluster = *v;
  if (auto v = detail::override_int("cross_entropy.backward.chunks", 1, kMaxChunks)) o.chunks = static_cast<int>(*v);
  if (auto v = detail::override_choice<int>("cross_entropy.staged", {{"on", 1}, {"off", -1}})) o.staged = *v;
  if (auto v = detail::override_choice<int>("cross_entropy.staged.blocks_per_sm", {{"1", 1}, {"2", 2}}))
    o.staged_blocks_per_sm = *v;
  return o;
}

bool fused_slice_resident(const Problem& problem, const Launch& launch) {
  if (problem.pass != Pass::forward_backward || launch.staged) return false;
  // The kernel's test: a block's aligned vectors (at most the slice's bytes over 16, rounded up)
  // within one sweep of its threads.
  return ceil_div(slice_bytes(problem, launch), kVectorBytes) <= std::int64_t(launch.threads) * kVectorsPerThread;
}

std::int64_t slice_bytes(const Problem& problem, const Launch& launch) {
  const int parts = problem.pass == Pass::backward ? launch.chunks : launch.cluster;
  return ceil_div(problem.cols * problem.element_bytes, parts);
}

Launch choose_launch(const Problem& p, const detail::DeviceInfo& device, const LaunchOverrides& o) {
  Launch l;
  const std::int64_t row_bytes = p.cols * p.element_bytes;
  if (p.pass == Pass::backward) {
    l.chunks = spread_small_batches(p, 1, kMaxChunks, false, device.sm_count);
    if (o.chunks > 0) l.chunks = o.chunks;
    l.blocks = p.rows;
  } else {
    const StagedShape shape = staged_shape(row_bytes, device, o.staged_blocks_per_sm);
    l.staged = o.staged != 0 ? o.staged > 0
                             : shape.fits && p.pass == Pass::forward_backward && row_bytes >= kStagedMinRowBytes &&
                                   o.cluster == 0 && p.rows >= std::int64_t(kStagedMinRowsPerSm) * device.sm_count;
    if (l.staged) {
      l.blocks = p.rows;
      l.smem_bytes = static_cast<std::size_t>(shape.held_bytes);
      l.staged_blocks_per_sm = shape.blocks_per_sm;
      l.threads = o.threads > 0 ? o.threads : threads_for(row_bytes);
      return l;
    }
    if (p.pass == Pass::forward_backward)
      while (l.cluster < kMaxCluster && ceil_div(row_bytes, l.cluster) > kFusedSliceBytes) l.cluster *= 2;
    l.cluster = spread_small_batches(p, l.cluster, kMaxCluster, true, device.sm_count);
    if (o.cluster > 0) l.cluster = o.cluster;
    // grid.x holds at most 2^31 - 1 blocks.
    while (l.cluster > 1 && p.rows * l.cluster > INT_MAX) l.cluster /= 2;
    l.blocks = p.rows * l.cluster;
  }
  l.threads = o.threads > 0 ? o.threads : threads_for(slice_bytes(p, l));
  return l;
}

}  // namespace fusekit::cross_entropy
