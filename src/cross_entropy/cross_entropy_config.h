// Launch choices of cross-entropy: how many blocks share a row and how wide they are. Pure host
// functions of the problem and the device (no CUDA calls), so that the CPU tests check them;
// cross_entropy_cuda.cu launches what they return.
//
// Kernels (cross_entropy_kernels.cuh):
//  * the row kernel (forward, and forward + backward): a row is split over `cluster` blocks, a
//    thread-block cluster whose blocks combine their slices' statistics (max, sum of exp, sum of
//    logits) through distributed shared memory. The fused call then writes the gradient of its
//    slice. A slice of one sweep (kMaxThreads x kVectorsPerThread 16-byte vectors, 32 KB) stays
//    in registers from the statistics to the gradient, so the logits are read once: the fused
//    call's cluster is the smallest that cuts a row into such slices, up to kMaxCluster (16, a
//    non-portable size Hopper allows): rows up to 512 KB (V = 262144 in bf16, 131072 in f32).
//    Longer rows sweep their slices a second time, from L2 while the bytes all resident blocks
//    read between their two sweeps fit in it.
//  * the backward kernel: lse is known, so a row's columns split over `chunks` independent blocks
//    (grid.y) of kBackwardChunkBytes each.
// Few rows (a small batch) spread further, so that the grid still fills the GPU: a row splits
// until there are kMinBlocksPerSm blocks per SM or its slices shrink to kMinSliceBytes.
//
// The threads per block: the power of two in [kMinThreads, kMaxThreads] that covers a block's
// slice in one sweep of kVectorsPerThread 16-byte loads per thread, capped at kMaxThreads.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/device_info.h"
#include "cross_entropy/cross_entropy_params.h"

namespace fusekit::cross_entropy {

inline constexpr int kVectorBytes = 16;
inline constexpr int kVectorsPerThread = 8;  // 16-byte loads each thread has in flight per sweep
inline constexpr int kMinThreads = 64;
inline constexpr int kMaxThreads = 256;
inline constexpr int kMinBlocksPerSm = 4;  // the occupancy the kernels are built for (launch bounds)
inline constexpr int kMaxCluster = 16;          // the fused call's largest (non-portable) cluster
inline constexpr int kMaxPortableCluster = 8;   // the forward's largest: the portable size
inline constexpr int kMaxChunks = 1024;

inline constexpr std::int64_t kFusedSliceBytes = 32 * 1024;
inline constexpr std::int64_t kBackwardChunkBytes = 32 * 1024;
inline constexpr std::int64_t kMinSliceBytes = 8 * 1024;

// The reduction kernels (the mean's gradient scale, the loss over the row losses): one block.
inline constexpr int kReduceThreads = 1024;

struct Problem {
  std::int64_t rows = 0, cols = 0;  // rows >= 1, cols >= 1
  int element_bytes = 2;            // logits: 4 (f32) or 2 (f16, bf16)
  Pass pass = Pass::forward;
};

struct Launch {
  int threads = kMaxThreads;
  int cluster = 1;          // row kernel: blocks per row, one cluster (1: no cluster)
  int chunks = 1;           // backward kernel: blocks per row (grid.y)
  std::int64_t blocks = 0;  // grid.x: rows x cluster (row kernel) or rows (backward kernel)
};

// Forced choices for tests and tuning sweeps (override keys "cross_entropy.*", core/overrides.h);
// 0: the table decides.
struct LaunchOverrides {
  int threads = 0;  // 64, 128 or 256
  int cluster = 0;  // 1, 2, 4, 8 or 16 (forward and fused)
  int chunks = 0;   // 1 .. kMaxChunks (backward)
};
// Reads the cross_entropy.* override keys.
LaunchOverrides read_launch_overrides();

Launch choose_launch(const Problem& problem, const detail::DeviceInfo& device,
                     const LaunchOverrides& overrides = {});

// Whether the fused call's slices are one sweep of its blocks (held in registers: one read).
bool fused_slice_resident(const Problem& problem, const Launch& launch);

// Bytes of the slice one block of `launch` covers in a row of `problem` (rounded up).
std::int64_t slice_bytes(const Problem& problem, const Launch& launch);

}  // namespace fusekit::cross_entropy
