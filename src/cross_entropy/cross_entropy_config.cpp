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

}  // namespace

LaunchOverrides read_launch_overrides() {
  LaunchOverrides o;
  if (auto v = detail::override_choice<int>("cross_entropy.threads", {{"64", 64}, {"128", 128}, {"256", 256}}))
    o.threads = *v;
  if (auto v = detail::override_choice<int>("cross_entropy.cluster", {{"1", 1}, {"2", 2}, {"4", 4}, {"8", 8}}))
    o.cluster = *v;
  if (auto v = detail::override_int("cross_entropy.backward.chunks", 1, kMaxChunks)) o.chunks = static_cast<int>(*v);
  if (auto v = detail::override_choice<int>("cross_entropy.staged", {{"on", 1}, {"off", -1}})) o.staged = *v;
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
    // The staged kernel holds a row's vectors up to kStagedRowBytes; the rest streams.
    const std::int64_t vector_bytes = ceil_div(row_bytes, kVectorBytes) * kVectorBytes;
    const std::int64_t held = std::min(vector_bytes, kStagedRowBytes);
    const bool streamed_in_l2 = 2 * std::int64_t(device.sm_count) * (vector_bytes - held) <= kStagedStreamedL2Bytes;
    l.staged = o.staged != 0 ? o.staged > 0
                             : streamed_in_l2 && p.pass == Pass::forward_backward && row_bytes >= kStagedMinRowBytes &&
                                   o.cluster == 0 && p.rows >= std::int64_t(kStagedMinRowsPerSm) * device.sm_count;
    if (l.staged) {
      l.blocks = p.rows;
      l.smem_bytes = static_cast<std::size_t>(held);
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
