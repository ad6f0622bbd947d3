// Host-side launch helpers shared by the op families: the dynamic shared-memory opt-in and the
// occupancy of a kernel at a launch shape, cached.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_info.h"
#include "fusekit/error.h"

namespace fusekit::detail {

// Lets `kernel` take `smem` bytes of dynamic shared memory (`what` names it in the error): raises
// its limit, once per kernel and device, to all that the GPU allows a block beside the kernel's
// static shared memory, and throws when `smem` is more than that. Without the opt-in a block may
// have 48 KB of static and dynamic shared memory together, so a launch with, say, 48 KB of dynamic
// memory fails with cudaErrorInvalidValue as soon as the kernel declares any static shared memory:
// a test of "dynamic bytes over 48 KB" is not enough (48 KB of dynamic beside 1.1 KB of static
// shared memory fails).
template <typename Kernel>
void allow_dynamic_smem(const char* op, Kernel kernel, std::size_t smem, int device_index,
                        const std::string& what = "a kernel") {
  struct Entry {
    const void* kernel;
    int device;
    std::size_t dynamic_limit;
  };
  static std::mutex mutex;
  static std::vector<Entry> opted_in;
  const void* key = reinterpret_cast<const void*>(kernel);
  std::size_t dynamic_limit = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const Entry& e : opted_in)
      if (e.kernel == key && e.device == device_index) dynamic_limit = e.dynamic_limit;
    if (dynamic_limit == 0) {
      // The opt-in limit covers static plus dynamic shared memory.
      cudaFuncAttributes attributes{};
      check_cuda(cudaFuncGetAttributes(&attributes, kernel), op, "cudaFuncGetAttributes");
      dynamic_limit = device_info(op, device_index).max_smem_per_block_optin - attributes.sharedSizeBytes;
      check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dynamic_limit)),
                 op, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
      opted_in.push_back({key, device_index, dynamic_limit});
    }
  }
  if (smem > dynamic_limit)
    throw Error(ErrorKind::unsupported, op,
                what + " needs " + std::to_string(smem) + " bytes of dynamic shared memory per block; the GPU allows it " +
                    std::to_string(dynamic_limit) + " beside its static shared memory");
}

// Resident blocks per SM for a kernel at a block size and dynamic shared memory, cached: the
// occupancy calculator costs microseconds, which small launches cannot afford on every call.
// Also raises the kernel's dynamic shared-memory limit (allow_dynamic_smem).
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
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& [k, v] : cache)
      if (k == key) return v;
  }
  allow_dynamic_smem(op, kernel, smem, device_index);
  int blocks = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, block_threads, smem), op,
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  blocks = std::max(1, blocks);
  std::lock_guard<std::mutex> lock(mutex);
  cache.push_back({key, blocks});
  return blocks;
}

}  // namespace fusekit::detail
