// How the GPU backend splits a tensor list into launches: a pure function of the list (no CUDA),
// shared by the launchers, the workspace query and the tests (C++17: the CUDA sources include it).
//
// Every tensor is cut into chunks of kChunkElements elements (the last one shorter); one thread
// block serves one chunk. A launch takes up to `max_tensors` tensors of one dtype combination
// (`key`): their addresses and chunk offsets travel in the kernel's parameters, so the launch's
// table stays a few KB. Tensors are grouped by key in the order of the key's first appearance and
// keep their list order inside a group; empty tensors take no launch.
#pragma once

#include <climits>
#include <cstdint>
#include <vector>

namespace fusekit::optim {

inline constexpr std::int64_t kChunkElements = 16384;
// The largest tensor the launches can index: 2^30 chunks, below a launch's 2^31 - 1 blocks.
inline constexpr std::int64_t kMaxTensorElements = std::int64_t(1) << 44;
inline constexpr std::int64_t kMaxChunksPerLaunch = INT_MAX;

inline std::int64_t chunk_count(std::int64_t numel) {
  return (numel + kChunkElements - 1) / kChunkElements;
}

struct PlannedLaunch {
  int key = 0;
  std::vector<int> tensors;      // indices into the list, in list order
  std::int64_t chunks = 0;       // blocks of this launch
  std::int64_t first_chunk = 0;  // chunks of the launches before it (global_norm's partial index)
};

// keys[i] and numels[i] describe tensor i (numel <= kMaxTensorElements).
inline std::vector<PlannedLaunch> plan_launches(const std::vector<int>& keys,
                                                const std::vector<std::int64_t>& numels,
                                                int max_tensors) {
  std::vector<int> order_of_keys;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (numels[i] == 0) continue;
    bool seen = false;
    for (int k : order_of_keys) seen = seen || k == keys[i];
    if (!seen) order_of_keys.push_back(keys[i]);
  }
  std::vector<PlannedLaunch> launches;
  std::int64_t total_chunks = 0;
  for (int key : order_of_keys) {
    PlannedLaunch current;
    current.key = key;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] != key || numels[i] == 0) continue;
      const std::int64_t chunks = chunk_count(numels[i]);
      if (static_cast<int>(current.tensors.size()) == max_tensors ||
          current.chunks + chunks > kMaxChunksPerLaunch) {
        launches.push_back(current);
        current = PlannedLaunch{};
        current.key = key;
      }
      if (current.tensors.empty()) current.first_chunk = total_chunks;
      current.tensors.push_back(static_cast<int>(i));
      current.chunks += chunks;
      total_chunks += chunks;
    }
    if (!current.tensors.empty()) launches.push_back(current);
  }
  return launches;
}

// global_norm's GPU scratch: one float32 partial sum per chunk.
inline std::int64_t norm_partial_count(const std::vector<std::int64_t>& numels) {
  std::int64_t total = 0;
  for (std::int64_t n : numels) total += chunk_count(n);
  return total;
}

}  // namespace fusekit::optim
