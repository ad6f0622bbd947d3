// Launch choices of cross-entropy: how many blocks share a row and how wide they are. Pure host
// functions of the problem and the device (no CUDA calls), so that the CPU tests check them;
// cross_entropy_cuda.cu launches what they return.
//
// Kernels (cross_entropy_kernels.cuh):
//  * the staged row kernel (the fused call on rows of at least kStagedMinRowBytes in a batch of
//    at least kStagedMinRowsPerSm rows per SM, up to kStagedRowBytes and a little past it, below):
//    one block per row, the row's aligned vectors brought into shared memory by bulk copies (TMA)
//    in kStagedChunks pieces, the statistics formed as the pieces arrive, the gradient written from
//    shared memory. The logits are read once, and no cluster: blocks of a cluster are scheduled together and wait for each
//    other, which at these row lengths costs more than the second read it saves (bench, H200:
//    cross_entropy fwd+bwd (8192, 50257) 85% of copy staged, 75% on the row kernel). The forward
//    reads a row once anyway and is faster on the row kernel (bench: cross_entropy fwd
//    (8192, 32000), `--override cross_entropy.staged=on`: 75% against 87%), as are short rows
//    (fwd+bwd (65536, 4096): 72% against 81%).
//  * the row kernel (the forward, and the other fused calls): a row is split over `cluster`
//    blocks, a thread-block cluster whose blocks combine their slices' statistics (max, sum of
//    exp, sum of logits) through distributed shared memory. The fused call then writes the
//    gradient of its slice: from the registers that hold it where the slice is one sweep
//    (kMaxThreads x kVectorsPerThread 16-byte vectors, 32 KB), else by reading the slice again,
//    from L2 while the bytes all resident blocks read between their two sweeps fit in it. The
//    fused call's cluster is the smallest that cuts a row into slices of at most kFusedSliceBytes,
//    up to kMaxCluster: fewer, longer slices read twice beat one-sweep slices of a larger cluster
//    (bench: fwd+bwd (8192, 128256), cluster 4: 80% of copy, cluster 8: 71%).
//  * the backward kernel: lse is known, so a row's columns may split over `chunks` independent
//    blocks (grid.y). One block per row where the batch fills the GPU: more chunks only add
//    blocks whose start and end are not overlapped (bench, H200: cross_entropy bwd (8192, 151936)
//    93% of copy with 1 chunk, 85% with 10; (8192, 50257) 86% with 1, 83% with 4).
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
inline constexpr int kMaxCluster = 8;      // the portable cluster size
inline constexpr int kMaxChunks = 1024;

inline constexpr std::int64_t kFusedSliceBytes = 64 * 1024;
inline constexpr std::int64_t kMinSliceBytes = 8 * 1024;
// Rows the staged kernel takes: at least kStagedMinRowBytes, in batches of at least
// kStagedMinRowsPerSm rows per SM (fewer rows spread over clusters instead, so that the grid fills
// the GPU). A block holds at most kStagedRowBytes of its row (two blocks fit an SM's 227 KB of
// shared memory); the rest of a longer row streams past shared memory and is read again, from
// L2, where the streamed bytes of all resident blocks stay within kStagedStreamedL2Bytes. Past
// that the row kernel is faster (bench, H200, fwd+bwd: (8192, 65536) 81.7% of copy staged, 77.8%
// on the row kernel; (8192, 100000) 69.9% against 75.4%), and so it is with a block alone on its
// SM holding 220 KB ((8192, 128256) 70.7% against 80.5%).
inline constexpr std::int64_t kStagedRowBytes = 108 * 1024;
inline constexpr std::int64_t kStagedStreamedL2Bytes = 8 << 20;
inline constexpr std::int64_t kStagedMinRowBytes = 32 * 1024;
inline constexpr int kStagedMinRowsPerSm = 2;
inline constexpr int kStagedChunks = 4;  // bulk copies (and mbarriers) per row

// The reduction kernels (the mean's gradient scale, the loss over the row losses): one block.
inline constexpr int kReduceThreads = 1024;

struct Problem {
  std::int64_t rows = 0, cols = 0;  // rows >= 1, cols >= 1
  int element_bytes = 2;            // logits: 4 (f32) or 2 (f16, bf16)
  Pass pass = Pass::forward;
};

struct Launch {
  int threads = kMaxThreads;
  bool staged = false;      // the staged row kernel (one block per row, the row in shared memory)
  std::size_t smem_bytes = 0;  // staged: dynamic shared memory per block (the row's vectors it holds)
  int cluster = 1;          // row kernel: blocks per row, one cluster (1: no cluster)
  int chunks = 1;           // backward kernel: blocks per row (grid.y)
  std::int64_t blocks = 0;  // grid.x: rows x cluster (row kernel) or rows (backward kernel)
};

// Forced choices for tests and tuning sweeps (override keys "cross_entropy.*", core/overrides.h);
// 0: the table decides.
struct LaunchOverrides {
  int threads = 0;  // 64, 128 or 256
  int cluster = 0;  // 1, 2, 4 or 8 (forward and fused; forces the row kernel)
  int staged = 0;   // 1: the staged kernel (forward and fused, any row), -1: never
  int chunks = 0;   // 1 .. kMaxChunks (backward)
};
// Reads the cross_entropy.* override keys.
LaunchOverrides read_launch_overrides();

Launch choose_launch(const Problem& problem, const detail::DeviceInfo& device,
                     const LaunchOverrides& overrides = {});

// Whether the fused call's row kernel holds its slices in registers (one sweep of its blocks: the
// logits read once). The staged kernel always reads them once.
bool fused_slice_resident(const Problem& problem, const Launch& launch);

// Bytes of the slice one block of `launch` covers in a row of `problem` (rounded up).
std::int64_t slice_bytes(const Problem& problem, const Launch& launch);

}  // namespace fusekit::cross_entropy
