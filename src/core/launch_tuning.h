// Host-side launch tuning shared by the op families: benchmark knobs read from the environment, and
// the occupancy of a kernel at a launch shape, cached.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_info.h"
#include "fusekit/error.h"

namespace fusekit::detail {

// An integer knob (benchmarks and tuning sweeps): `fallback` when unset or outside [lo, hi].
inline int env_knob(const char* name, int lo, int hi, int fallback) {
  const char* env = std::getenv(name);
  const int v = env ? std::atoi(env) : fallback;
  return (v >= lo && v <= hi) ? v : fallback;
}

// A switch knob: `fallback` when unset, false for "0", true for anything else.
inline bool env_flag(const char* name, bool fallback) {
  const char* env = std::getenv(name);
  return env ? std::strcmp(env, "0") != 0 : fallback;
}

// Resident blocks per SM for a kernel at a block size and dynamic shared memory, cached: the
// occupancy calculator costs microseconds, which small launches cannot afford on every call.
// Also raises the kernel's dynamic shared-memory limit the first time it is seen.
template <typename Kernel>
int blocks_per_sm(const char* op, Kernel kernel, int block_threads, std::size_t smem, int device_index) {
  struct Key {
    const void* kernel;
    int block, device;
    std::size_t smem;
    bool operator==(const Key& o) const {
      return kernel == o.kernel && block == o.block && device == o.device && smem == o.smem;
    }
  };
  static std::mutex mutex;
  static std::vector<std::pair<Key, int>> cache;
  const Key key{reinterpret_cast<const void*>(kernel), block_threads, device_index, smem};
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [k, v] : cache)
    if (k == key) return v;
  // The opt-in limit covers static plus dynamic shared memory.
  cudaFuncAttributes attributes{};
  check_cuda(cudaFuncGetAttributes(&attributes, kernel), op, "cudaFuncGetAttributes");
  const std::size_t dynamic_limit = device_info(op, device_index).max_smem_per_block_optin - attributes.sharedSizeBytes;
  if (smem > dynamic_limit) {
    throw Error(ErrorKind::unsupported, op,
                "kernel needs " + std::to_string(smem) + " bytes of shared memory, the GPU allows " +
                    std::to_string(dynamic_limit));
  }
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dynamic_limit)),
             op, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  int blocks = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, block_threads, smem), op,
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  blocks = std::max(1, blocks);
  cache.push_back({key, blocks});
  return blocks;
}

}  // namespace fusekit::detail
