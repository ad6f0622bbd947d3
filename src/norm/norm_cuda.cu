// CUDA launchers for LayerNorm / RMSNorm: choose a kernel configuration from the row length and
// alignment, size the persistent backward grid, and dispatch on the element types.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_info.h"
#include "core/launch_tuning.h"
#include "norm/norm_kernels.cuh"
#include "norm/norm_params.h"

namespace fusekit::norm {
namespace {

using namespace kernels;
using detail::blocks_per_sm;
using detail::env_knob;

bool aligned16(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

// The streaming kernels move 16-byte vectors: every row start and pointer must be 16-byte
// aligned and N a multiple of the vector width. Anything else takes the generic kernel.
template <typename T>
bool vector_path_ok(std::int64_t cols, std::initializer_list<std::int64_t> row_strides,
                    std::initializer_list<const void*> pointers) {
  constexpr int kVec = 16 / sizeof(T);
  if (cols % kVec != 0) return false;
  for (std::int64_t s : row_strides)
    if (s % kVec != 0) return false;
  for (const void* ptr : pointers)
    if (ptr && !aligned16(ptr)) return false;
  return true;
}

// Calls f(T{}, W{}) with the storage types of (dtype, weight dtype).
template <typename F>
void dispatch_types(DType dtype, DType weight_dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f(float{}, float{}); return;
    case DType::f16:
      if (weight_dtype == DType::f32) f(__half{}, float{});
      else f(__half{}, __half{});
      return;
    case DType::bf16:
      if (weight_dtype == DType::f32) f(__nv_bfloat16{}, float{});
      else f(__nv_bfloat16{}, __nv_bfloat16{});
      return;
    default: return;  // rejected by argument checks
  }
}

// How a row is spread over threads: `iters` 16-byte vectors per thread (the kernel's template
// parameter), `geometry.threads_per_row` threads. Short rows get one warp each; longer rows 4
// vectors per thread and as many warps as that takes, so that N = 5120 or 12288 waste no thread.
// The forward holds its row (packed) and the backward its per-column sums (~2 floats per element)
// in registers, which caps both at 512 threads per row: N <= 16384 in 16-bit types, 8192 in f32.
// Longer rows take the generic kernel. The backward ring depth (stages) and shared memory are sized
// per kernel afterwards (ring_budget, ring_stages), from the blocks per SM its registers allow.
struct RowPlan {
  int iters = 0;  // 0: generic kernel
  RowGeometry geometry{};
  std::size_t smem_bytes = 0;
  int block_threads() const { return geometry.threads_per_row * geometry.rows_per_block; }
};

// backward_iters: the backward's vectors per thread for rows longer than a warp;
// backward_short_row_threads: its threads per row for rows of at most one warp's 4 vectors (32,
// or 64 to split them over two warps). Both from backward_choice.
RowPlan plan_rows(std::int64_t vectors, bool backward, int backward_iters = 4, int backward_short_row_threads = 32) {
  RowPlan plan;
  if (vectors <= 128 && backward && backward_short_row_threads > 32) {
    plan.geometry.threads_per_row = backward_short_row_threads;
    plan.iters = static_cast<int>((vectors + backward_short_row_threads - 1) / backward_short_row_threads);
  } else if (vectors <= 128) {
    // The forward's rows of exactly 128 vectors (N = 1024 in 16-bit types) run on two warps at two
    // vectors per lane, which also turns on the next wave's L2 request (launch_forward: rows longer
    // than a warp). H200, session 31, us, one warp -> two: LayerNorm (16384, 1024) 21.9 -> 21.3-21.4,
    // (32768, 1024) 37.9 -> 36.9-37.1; RMSNorm 20.9 -> 20.5-20.8 and 37.1 -> 36.3-36.4. Rows with a
    // partly empty second vector lost (N = 768: 17.8 -> 21.2), four warps per row lost 1-48% at
    // every row length, and N = 512 (one vector per lane) was even. FUSEKIT_NORM_FWD_SHORT_TPR (32,
    // 64 or 128) sets the threads per row of every forward row of 33..128 vectors (tuning knob).
    static const int forward_short_tpr = env_knob("FUSEKIT_NORM_FWD_SHORT_TPR", 32, 128, 0);
    int tpr = 32;
    if (!backward && forward_short_tpr > 0 && forward_short_tpr % 32 == 0 && vectors > 32) tpr = forward_short_tpr;
    else if (!backward && forward_short_tpr == 0 && vectors == 128) tpr = 64;
    plan.iters = static_cast<int>((vectors + tpr - 1) / tpr);
    plan.geometry.threads_per_row = tpr;
  } else {
    // FUSEKIT_NORM_FWD_ITERS (1..4) overrides the forward's vectors per thread (tuning knob).
    static const int forward_iters = env_knob("FUSEKIT_NORM_FWD_ITERS", 1, 4, 4);
    plan.iters = backward ? backward_iters : forward_iters;
    plan.geometry.threads_per_row =
        static_cast<int>((vectors + plan.iters * 32 - 1) / (plan.iters * 32) * 32);
    if (plan.geometry.threads_per_row > 512) return RowPlan{};
  }
  const int tpr = plan.geometry.threads_per_row;
  if (!backward) {
    // Forward: one row per block, so that a block's slot frees as soon as its row is written
    // (with several rows per block it waits for the slowest): one-warp blocks for N <= 1024 in
    // 16-bit types, as torch.compile's kernel has (Nsight, (16384, 1024): 18.2 us against 23.4
    // for 128-thread blocks of four rows, both at 64 registers and 3.88 waves); measured 3.5%
    // faster at N = 1024 and 2% at N = 2048 than 128-thread blocks (H200, session 10). The
    // launch caps the grid by row length (launch_forward). FUSEKIT_NORM_FWD_BLOCK (32..512) sets
    // a block size instead (tuning knob).
    static const int forward_block = env_knob("FUSEKIT_NORM_FWD_BLOCK", 32, 512, 32);
    plan.geometry.rows_per_block = std::max(1, forward_block / tpr);
    return plan;
  }
  // Backward: several row groups per block (each with its own barrier) so that the block writes
  // one dweight/dbias partial row and keeps one float copy of the weight columns. 512 threads (one
  // block per SM at ~128 registers); FUSEKIT_NORM_BWD_BLOCK (128..512) overrides (tuning knob).
  // Rows of up to 4 warps are grouped into blocks of at most 384 threads (N = 2048: 4 rows of
  // 96 threads, 7% faster than 5 rows in 480 threads).
  // Rows of 33..128 vectors (N = 264..1024 in 16-bit types; one warp per row, or two) go 256
  // threads to a block. H200, session 30, one warp per row, us, 512 -> 256 threads: RMSNorm
  // (16384, 640 / 768 / 1024) 29.2 / 32.5 / 38.0 -> 28.6 / 31.5 / 36.7, LayerNorm with dbias
  // (16384, 512 / 640 / 768) 27.6 / 32.2 / 36.0 -> 26.3 / 31.2 / 34.3; at N = 128 and 256 (one
  // vector per lane) LayerNorm lost 0.4-1.1 us and RMSNorm was even: they keep 512.
  static const int backward_block = env_knob("FUSEKIT_NORM_BWD_BLOCK", 128, 512, 0);
  const bool short_row = vectors > 32 && vectors <= 128;
  const int block = backward_block > 0 ? backward_block : (short_row ? 256 : tpr > 32 && tpr <= 128 ? 384 : 512);
  plan.geometry.rows_per_block =
      std::max(1, std::min(block / tpr, tpr > 32 ? kMaxGroups - 1 : kMaxGroups));
  return plan;
}

// Calls f(std::integral_constant<int, ITERS>) for iters in 1..4.
template <typename F>
void dispatch_iters(int iters, F&& f) {
  switch (iters) {
    case 1: f(std::integral_constant<int, 1>{}); return;
    case 2: f(std::integral_constant<int, 2>{}); return;
    case 3: f(std::integral_constant<int, 3>{}); return;
    case 4: f(std::integral_constant<int, 4>{}); return;
    default: return;
  }
}

// Persistent grid: every resident block slot filled once (or fewer blocks when rows are few).
// FUSEKIT_NORM_BLOCKS_PER_SM caps the blocks per SM (a tuning knob for benchmarks).
template <typename Kernel>
int persistent_grid(const char* op, Kernel kernel, int block_threads, std::size_t smem,
                    int rows_per_block, std::int64_t rows, int device_index) {
  static const int cap = [] {
    const char* env = std::getenv("FUSEKIT_NORM_BLOCKS_PER_SM");
    return env ? std::atoi(env) : 0;
  }();
  int per_sm = blocks_per_sm(op, kernel, block_threads, smem, device_index);
  if (cap > 0) per_sm = std::min(per_sm, cap);
  const int sms = detail::device_info(op, device_index).sm_count;
  const std::int64_t needed = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(needed, std::int64_t(sms) * per_sm)));
}

// Shared memory one block of `kernel` may use for its ring without lowering the blocks per SM
// below what its registers and threads allow, or below `blocks_cap` when that is smaller (an SM
// holds about the opt-in limit plus 1 KB, and 1 KB of it is reserved per block).
template <typename Kernel>
std::size_t ring_budget(const char* op, Kernel kernel, int block_threads, int device_index, int blocks_cap = 0) {
  struct Key {
    const void* kernel;
    int block, device, cap;
    bool operator==(const Key& o) const {
      return kernel == o.kernel && block == o.block && device == o.device && cap == o.cap;
    }
  };
  static std::mutex mutex;
  static std::vector<std::pair<Key, std::size_t>> cache;
  const Key key{reinterpret_cast<const void*>(kernel), block_threads, device_index, blocks_cap};
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& [k, v] : cache)
      if (k == key) return v;
  }
  int blocks = blocks_per_sm(op, kernel, block_threads, 0, device_index);
  if (blocks_cap > 0) blocks = std::min(blocks, blocks_cap);
  cudaFuncAttributes attributes{};
  detail::check_cuda(cudaFuncGetAttributes(&attributes, kernel), op, "cudaFuncGetAttributes");
  const std::size_t optin = detail::device_info(op, device_index).max_smem_per_block_optin;
  const std::size_t per_block = (optin + 1024) / std::max(1, blocks) - 1024;
  const std::size_t limit = std::min(per_block, optin);
  const std::size_t budget = limit - std::min(limit, std::size_t(attributes.sharedSizeBytes));
  std::lock_guard<std::mutex> lock(mutex);
  cache.push_back({key, budget});
  return budget;
}

// Ring depth for `row_slot_bytes` per stage plus `fixed_bytes` within `budget`: the deepest of
// 2..kMaxStages that fits (FUSEKIT_NORM_STAGES caps it, a tuning knob), or 0.
int ring_stages(std::size_t row_slot_bytes, std::size_t fixed_bytes, std::size_t budget) {
  static const int max_stages = env_knob("FUSEKIT_NORM_STAGES", 2, kMaxStages, kMaxStages);
  for (int stages = max_stages; stages >= 2; --stages)
    if (fixed_bytes + stages * row_slot_bytes <= budget) return stages;
  return 0;
}

using BackwardKernel = void (*)(BackwardParams, RowGeometry, float*, float*);

// The backward's vectors per thread for rows longer than a warp, and whether g = dy * w stays in
// registers between the two passes (KEEP_G: the second pass then reads only x from the ring and
// skips the weight loads and a multiply per element; it costs a register per element). From x,
// bf16, H200, session 26, us, 16384 rows unless named (old rule: 3 vectors up to 640, else 4):
//   with dbias (LayerNorm)    N = 2048 64.1 -> 62.5, 4096 117.8 -> 111.6, 4608 124.6 -> 120.4,
//                             5120 140.7 -> 137.5; (8192, 10240) 157.4 -> 146.8 and (8192, 12288)
//                             165.7 -> 163.3 at 3 vectors with KEEP_G; N = 5128..8192 keep 4
//                             without (3 vectors lost 1-17% there, KEEP_G at 4 spills).
//   without dbias (RMSNorm)   N = 2048 61.2 -> 59.5, 4096 112.4 -> 106.4 with KEEP_G; at 4608 it
//                             is even and at 5120 7% slower (in back-to-back runs only: after an
//                             L2 flush it is 2% faster, so the cost comes from the previous run's
//                             dirty lines), so 513..640 vectors keep 3 without it. N = 5128..8192
//                             take 2 vectors (64 registers: two 512-thread blocks per SM):
//                             6144 173.1 -> 160.4, 7168 199.0 -> 185.4, 8192 224.5 -> 211.6;
//                             (8192, 8192) 120.6 -> 111.2. N = 8200..10240 keep 4 vectors with
//                             KEEP_G: (8192, 10240) 147.2 -> 132.0 (one 320-thread block per SM
//                             either way); at N = 12288 and 16384 KEEP_G lost 12% and 8%.
// From y the old rule stands (not measured). FUSEKIT_NORM_BWD_ITERS (1..4) overrides the vectors
// (without KEEP_G) and FUSEKIT_NORM_BWD_TABLE=0 restores the old rule (tuning knobs).
//
// Rows of at most 128 vectors (one warp at 4 vectors per lane) run one warp per row, except
// LayerNorm with dbias from x in rows of 97..128 vectors: two warps per row at 2 vectors per lane,
// which halves the 64 registers of dweight and dbias sums each lane would hold. H200, session 30,
// 256 threads per block, us: (16384, 1024) 42.0-42.5 -> 40.1-40.3, (32768, 1024) 67.6-67.8 ->
// 64.9-65.1; at N = 768 even (34.3 / 34.5), at N = 640 (a second vector for a quarter of the
// lanes) 31.2 -> 33.7; RMSNorm lost 3-10% with two warps. From y one warp per row stays (not
// measured). FUSEKIT_NORM_BWD_SHORT_TPR (32, 64 or 128) sets those threads per row (tuning knob).
struct BackwardChoice {
  int iters = 4;
  bool keep_g = false;
  int short_row_threads = 32;
};
BackwardChoice backward_choice(std::int64_t vectors, bool from_output, bool bias_grad) {
  static const int iters_knob = env_knob("FUSEKIT_NORM_BWD_ITERS", 1, 4, 0);
  static const int table_knob = env_knob("FUSEKIT_NORM_BWD_TABLE", 0, 1, 1);
  static const int short_tpr_knob = env_knob("FUSEKIT_NORM_BWD_SHORT_TPR", 32, 128, 0) / 32 * 32;
  if (vectors <= 128) {
    if (short_tpr_knob > 0) return {4, false, short_tpr_knob};
    return {4, false, bias_grad && !from_output && vectors > 96 ? 64 : 32};
  }
  if (iters_knob > 0) return {iters_knob, false};
  if (table_knob == 0 || from_output) return {vectors <= 640 ? 3 : 4, false};
  if (bias_grad) {
    if (vectors <= 640 || (vectors > 1024 && vectors <= 1536)) return {3, true};
    return {4, false};
  }
  if (vectors <= 512) return {3, true};
  if (vectors <= 640) return {3, false};
  if (vectors <= 1024) return {2, false};
  if (vectors <= 1280) return {4, true};
  return {4, false};
}

// One backward specialization with its launch shape; kernel == nullptr: the generic kernel.
struct BackwardVariant {
  BackwardKernel kernel = nullptr;
  // The same kernel for a launch in clusters (cluster_sum_partials), where that pays: nullptr
  // elsewhere.
  BackwardKernel cluster_kernel = nullptr;
  RowPlan plan;
};

// The backward kernel for (from x or y, with or without dbias) at N = cols on the vector path,
// with its ring sized for its own occupancy. From y, 1/w and -b/w go to shared memory when they
// fit beside a two-row ring (kFromY), else they are recomputed per use (kFromYUncached).
template <typename T, typename W>
BackwardVariant backward_variant(const char* op, std::int64_t cols, bool from_output, bool bias_grad,
                                 int device_index) {
  constexpr int kVec = 16 / sizeof(T);
  BackwardVariant v;
  if (cols % kVec != 0) return v;
  const BackwardChoice choice = backward_choice(cols / kVec, from_output, bias_grad);
  RowPlan plan = plan_rows(cols / kVec, true, choice.iters, choice.short_row_threads);
  if (plan.iters == 0) return v;
  const bool keep_g = choice.keep_g && plan.geometry.threads_per_row > 32;
  // Without dbias, rows that fill 4 vectors of every thread in rows of up to 8 warps (N = 1024
  // and 8192 in 16-bit types) take the kernel without bounds tests (FULL). H200, session 18,
  // RMSNorm, two alternating runs each: (16384, 1024) 39.9 / 39.7 -> 38.8 / 38.7 us, (8192, 8192)
  // 124.9 / 123.8 -> 121.6 / 122.7; at 3 vectors per thread (N = 2048, 4096, 5120) it measured
  // even, and in longer rows slower (N = 12288: 161 -> 177 us, N = 16384: 119 -> 123.5; its
  // loads hoisted at 102 registers). FUSEKIT_NORM_BWD_FULL=0 turns it off (tuning knob).
  static const int full_knob = env_knob("FUSEKIT_NORM_BWD_FULL", 0, 1, 1);
  const bool full = full_knob == 1 && !bias_grad && plan.iters == 4 && plan.geometry.threads_per_row <= 256 &&
                    cols == std::int64_t(plan.geometry.threads_per_row) * plan.iters * kVec;
  dispatch_iters(plan.iters, [&](auto iters) {
    constexpr int I = iters.value;
    auto pick = [&](auto source) -> BackwardKernel {
      constexpr int S = decltype(source)::value;
      if constexpr (S == kFromX && I == 4) {
        if (keep_g && !bias_grad && !full) return backward_streaming_kernel<T, W, I, S, false, false, false, true>;
      }
      if constexpr (S == kFromX && I == 3) {
        if (keep_g)
          return bias_grad ? backward_streaming_kernel<T, W, I, S, true, false, false, true>
                           : backward_streaming_kernel<T, W, I, S, false, false, false, true>;
      }
      if constexpr (S != kFromYUncached && I == 4) {
        if (full) return backward_streaming_kernel<T, W, I, S, false, true>;
      }
      return bias_grad ? backward_streaming_kernel<T, W, I, S, true> : backward_streaming_kernel<T, W, I, S, false>;
    };
    const std::size_t slot = std::size_t(plan.geometry.rows_per_block) * 2 * cols * sizeof(T);
    const std::size_t column = std::size_t(cols) * sizeof(float);
    BackwardKernel kernel = pick(std::integral_constant<int, kFromX>{});
    int arrays = 1;
    if (from_output) {
      kernel = pick(std::integral_constant<int, kFromY>{});
      arrays = 3;
      if (ring_stages(slot, 3 * column, ring_budget(op, kernel, plan.block_threads(), device_index)) == 0) {
        kernel = pick(std::integral_constant<int, kFromYUncached>{});
        arrays = 1;
      }
    }
    plan.geometry.cached_columns = arrays == 3;
    plan.geometry.stages =
        ring_stages(slot, arrays * column, ring_budget(op, kernel, plan.block_threads(), device_index));
    // Where two rows of ring do not fit beside the columns at the blocks per SM the registers
    // allow, fewer blocks per SM get the room: RMSNorm at N = 10240 in bf16 (95 registers, two
    // 320-thread blocks per SM) fell to the generic kernel, 5.7x slower (H200, session 26:
    // (8192, 10240) 755 us, against 147 with one block per SM).
    for (int cap = blocks_per_sm(op, kernel, plan.block_threads(), 0, device_index) - 1;
         plan.geometry.stages < 2 && cap >= 1; --cap)
      plan.geometry.stages =
          ring_stages(slot, arrays * column, ring_budget(op, kernel, plan.block_threads(), device_index, cap));
    plan.smem_bytes = arrays * column + plan.geometry.stages * slot;
    // Clusters of two blocks pre-sum their partial rows where those are largest: dweight and
    // dbias at N = 16384 (128 KB per block). H200, session 22, LayerNorm (4096, 16384), two runs
    // each: 118.1-118.4 -> 112.8-113.0 us. At N = 12288 it measured even (165.3 -> 166.8 in one
    // call, 168.1 -> 166.1 in another), and at N = 8192 (128.6 -> 129.1), for RMSNorm's dweight
    // alone at N = 16384 (112.9 -> 113.2) and at every shorter row it did not pay; clusters of
    // four fit only 120 of the 132 SMs and lost 5-9% on most shapes.
    BackwardKernel cluster_kernel = nullptr;
    if constexpr (I == 4) {
      if (bias_grad && cols >= 16384) {
        cluster_kernel = backward_streaming_kernel<T, W, I, kFromX, true, false, true>;
        if (from_output)
          cluster_kernel = arrays == 3 ? backward_streaming_kernel<T, W, I, kFromY, true, false, true>
                                       : backward_streaming_kernel<T, W, I, kFromYUncached, true, false, true>;
      }
    }
    if (plan.geometry.stages >= 2) v = {kernel, cluster_kernel, plan};
  });
  return v;
}

// The persistent grid of one backward specialization (the generic kernel where v has none).
template <typename T, typename W>
int variant_grid(const char* op, const BackwardVariant& v, std::int64_t rows, int device_index) {
  if (!v.kernel)
    return persistent_grid(op, backward_generic_kernel<T, W>, kGenericThreads, 0, 1, rows, device_index);
  return persistent_grid(op, v.kernel, v.plan.block_threads(), v.plan.smem_bytes, v.plan.geometry.rows_per_block,
                         rows, device_index);
}

// Blocks per thread-block cluster for the backward's partial-row pre-sum (cluster_sum_partials):
// 2; FUSEKIT_NORM_BWD_CLUSTER (1, 2, 4 or 8; 1 = no cluster) overrides (tuning knob).
int backward_cluster_blocks() {
  static const int knob = env_knob("FUSEKIT_NORM_BWD_CLUSTER", 1, 8, 2);
  return (knob & (knob - 1)) == 0 ? knob : 1;
}

// A launch configuration for clusters of `cluster` blocks along x. The configuration points at
// its attribute, so the two live together (not copyable).
struct ClusterLaunch {
  cudaLaunchAttribute attribute[1] = {};
  cudaLaunchConfig_t config = {};
  ClusterLaunch(int grid, int block_threads, std::size_t smem, int cluster, cudaStream_t stream) {
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = static_cast<unsigned>(cluster);
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = 1;
    config.gridDim = dim3(static_cast<unsigned>(grid));
    config.blockDim = dim3(static_cast<unsigned>(block_threads));
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// How many clusters of `cluster` blocks of a backward kernel can be resident at once (a
// cluster's blocks must share a GPC, so whole clusters can hold fewer blocks than the SMs times
// the blocks per SM); 0 when one does not fit. Cached like blocks_per_sm.
template <typename Kernel>
int max_active_clusters(const char* op, Kernel kernel, int block_threads, std::size_t smem, int cluster,
                        int device_index) {
  struct Key {
    const void* kernel;
    int block, device, cluster;
    std::size_t smem;
    bool operator==(const Key& o) const {
      return kernel == o.kernel && block == o.block && device == o.device && cluster == o.cluster && smem == o.smem;
    }
  };
  static std::mutex mutex;
  static std::vector<std::pair<Key, int>> cache;
  const Key key{reinterpret_cast<const void*>(kernel), block_threads, device_index, cluster, smem};
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& [k, v] : cache)
      if (k == key) return v;
  }
  const int per_sm = blocks_per_sm(op, kernel, block_threads, smem, device_index);  // sets the smem limit
  const int sms = detail::device_info(op, device_index).sm_count;
  const ClusterLaunch launch((sms * per_sm + cluster - 1) / cluster * cluster, block_threads, smem, cluster, nullptr);
  int clusters = 0;
  detail::check_cuda(cudaOccupancyMaxActiveClusters(&clusters, kernel, &launch.config), op,
                     "cudaOccupancyMaxActiveClusters");
  std::lock_guard<std::mutex> lock(mutex);
  cache.push_back({key, clusters});
  return clusters;
}

// The fewest blocks (a multiple of `multiple`, at most `max_blocks`, itself a multiple) whose
// row groups take no more rows each than `max_blocks` blocks would: rows = 4096 on 132 one-group
// blocks are 31.03 rows per group, so 4 groups take a 32nd row while 128 wait for them; 128
// blocks take exactly 32 each. FUSEKIT_NORM_BWD_BALANCE=0 keeps max_blocks (tuning knob).
int balanced_blocks(int max_blocks, int rows_per_block, std::int64_t rows, int multiple) {
  static const int knob = env_knob("FUSEKIT_NORM_BWD_BALANCE", 0, 1, 1);
  const std::int64_t needed = (rows + rows_per_block - 1) / rows_per_block;
  std::int64_t blocks = std::min<std::int64_t>(needed, max_blocks);
  if (knob == 1) {
    const std::int64_t per_group = (rows + std::int64_t(max_blocks) * rows_per_block - 1) /
                                   (std::int64_t(max_blocks) * rows_per_block);
    const std::int64_t groups = (rows + per_group - 1) / per_group;
    blocks = std::min<std::int64_t>(blocks, (groups + rows_per_block - 1) / rows_per_block);
  }
  blocks = (blocks + multiple - 1) / multiple * multiple;
  return static_cast<int>(std::max<std::int64_t>(multiple, blocks));
}

// The largest backward grid any specialization (from x or y, with or without dbias, vector or
// generic path) launches for a shape: the workspace query sizes one partial row per block of it,
// so it needs no more than the shape, and every launch (with its own, possibly smaller, grid)
// fits. A given call always takes the same specialization and grid, so its dweight / dbias sum
// in a fixed order.
template <typename T, typename W>
int backward_grid_bound(const char* op, std::int64_t cols, bool vector_path, std::int64_t rows, int device_index) {
  int grid = variant_grid<T, W>(op, BackwardVariant{}, rows, device_index);
  if (!vector_path) return grid;
  for (bool from_output : {false, true}) {
    for (bool bias_grad : {false, true}) {
      const BackwardVariant v = backward_variant<T, W>(op, cols, from_output, bias_grad, device_index);
      grid = std::max(grid, variant_grid<T, W>(op, v, rows, device_index));
    }
  }
  return grid;
}

std::size_t partial_bytes(int slots, std::int64_t cols) {
  const std::size_t bytes = 2 * static_cast<std::size_t>(slots) * cols * sizeof(float);
  return (bytes + 255) / 256 * 256;
}

template <typename T, typename W>
void launch_forward(const ForwardParams& p, int device_index, cudaStream_t stream) {
  const char* op = "norm_forward";
  constexpr int kVec = 16 / sizeof(T);
  const RowPlan plan = vector_path_ok<T>(p.cols, {p.x_row_stride, p.y_row_stride}, {p.x, p.y, p.weight, p.bias})
                           ? plan_rows(p.cols / kVec, false)
                           : RowPlan{};
  if (plan.iters > 0) {
    dispatch_iters(plan.iters, [&](auto iters) {
      constexpr int I = iters.value;
      const int rpb = plan.geometry.rows_per_block;
      const std::int64_t needed = (p.rows + rpb - 1) / rpb;
      // Not persistent: one row group per block slot, the block scheduler hides the latency.
      const int sms = detail::device_info(op, device_index).sm_count;
      const int block = plan.block_threads();
      const int tpr = plan.geometry.threads_per_row;
      // Full rows with the usual affine parameters take the specialized kernels.
      const bool full = p.cols == std::int64_t(tpr) * I * kVec && p.weight != nullptr;
      const bool full_layer_norm = full && p.kind == Kind::layer_norm && p.bias != nullptr;
      const bool full_rms_norm = full && p.kind == Kind::rms_norm && p.bias == nullptr;
      // One-warp rows (N <= 1024 in 16-bit types): at most `cap` blocks per SM in the grid;
      // beyond, blocks walk rows. Swept on the H200 (session 11, caps 32..256), 128 ran best.
      // FUSEKIT_NORM_FWD_CAP caps every row length (tuning knob).
      //
      // Longer rows take one block per row and ask L2 for the row of the block that will take
      // their slot in the next wave (one resident grid ahead), so that a new block's loads find
      // L2 instead of waiting a DRAM latency with few threads resident. Against the session-21
      // grids (H200, session 25, us): LayerNorm (4096, 16384) 78.6 -> 71.9, (8192, 8192) 71.6 ->
      // 70.2, RMSNorm (4096, 16384) 70.4 -> 68.5, 1-2% at N = 2048, 4096, 5120. At N = 12288
      // (two 384-thread blocks per SM) it replaces the grid that walked rows with the next row
      // loaded into registers before the current one's reduction (sessions 10-21): LayerNorm
      // 109.7 -> 103.1, RMSNorm 104.4 -> 98.7. Where blocks walk rows the wave ahead is no longer
      // one grid ahead: prefetching it lost 15-20% (caps 128 and 64, N = 2048 and 5120); a walking
      // block prefetching its own next row was even. One-warp rows are even or 1% slower with the
      // prefetch (32 blocks per SM already hide the latency).
      static const int cap_knob = env_knob("FUSEKIT_NORM_FWD_CAP", 1, 1024, 0);
      const bool l2_prefetch = tpr > 32 && cap_knob == 0;
      const int cap = cap_knob > 0 ? cap_knob : 128;
      const int grid = static_cast<int>(l2_prefetch ? needed : std::min<std::int64_t>(needed, std::int64_t(sms) * cap));
      RowGeometry geo = plan.geometry;
      auto launch = [&](auto kernel) {
        if (l2_prefetch) geo.l2_prefetch_rows = blocks_per_sm(op, kernel, block, 0, device_index) * sms * rpb;
        kernel<<<grid, block, 0, stream>>>(p, geo);
      };
      if (full_layer_norm)
        launch(forward_registers_kernel<T, W, I, kFullLayerNorm>);
      else if (full_rms_norm)
        launch(forward_registers_kernel<T, W, I, kFullRmsNorm>);
      else
        launch(forward_registers_kernel<T, W, I>);
    });
  } else {
    const int grid = persistent_grid(op, forward_generic_kernel<T, W>, kGenericThreads, 0, 1, p.rows, device_index);
    forward_generic_kernel<T, W><<<grid, kGenericThreads, 0, stream>>>(p);
  }
  detail::check_launch(op, "norm forward kernel");
}

template <typename T, typename W>
void launch_backward(const BackwardParams& p, int device_index, cudaStream_t stream) {
  const char* op = "norm_backward";
  const bool partials = p.dweight != nullptr || p.dbias != nullptr;
  const bool vector_path = vector_path_ok<T>(p.cols, {p.dy_row_stride, p.input_row_stride, p.dx_row_stride},
                                             {p.dy, p.input, p.dx, p.weight, p.bias});
  const BackwardVariant variant =
      vector_path ? backward_variant<T, W>(op, p.cols, p.from_output, p.dbias != nullptr, device_index)
                  : BackwardVariant{};
  // Clusters pre-sum their blocks' partial rows (cluster_sum_partials): grid / cluster rows.
  int grid = 0, cluster = 1;
  if (!variant.kernel) {
    grid = variant_grid<T, W>(op, variant, p.rows, device_index);
  } else {
    const RowPlan& plan = variant.plan;
    const int rpb = plan.geometry.rows_per_block;
    int max_blocks = persistent_grid(op, variant.kernel, plan.block_threads(), plan.smem_bytes, 1,
                                     std::numeric_limits<int>::max(), device_index);
    if (partials && variant.cluster_kernel && backward_cluster_blocks() > 1) {
      const int c = backward_cluster_blocks();
      const int clusters =
          max_active_clusters(op, variant.cluster_kernel, plan.block_threads(), plan.smem_bytes, c, device_index);
      if (clusters > 0) {
        cluster = c;
        max_blocks = clusters * c;
      }
    }
    // LayerNorm with dbias from x at 1024 vectors per row (N = 8192 in 16-bit types: 4 vectors
    // per thread, two 256-thread rows per block) runs 27 / 32 of the SMs' blocks. Measured, not
    // explained: back to back, the full grid of 128 blocks ran 128-129 us at (8192, 8192) and
    // 233-235 at (16384, 8192); 111 blocks 116.3-116.7 and 212-213 (H200, session 26; session 22
    // saw the same). It is sharp (104 blocks: 122 / 220 us, 118: 130 / 240) and specific to this
    // row: at N = 5120, 6144 and 7168 the full grid is fastest. With L2 flushed before each run
    // (FUSEKIT_BENCH_L2_FLUSH) the full grid also takes 116 us: what 111 blocks avoid is tied to
    // the previous run's dirty lines in L2.
    constexpr int kVec = 16 / sizeof(T);
    if (p.dbias != nullptr && !p.from_output && p.cols == 1024 * kVec && cluster == 1)
      max_blocks = std::min(max_blocks, detail::device_info(op, device_index).sm_count * 27 / 32);
    // FUSEKIT_NORM_BWD_GRID caps the blocks (tuning knob).
    static const int grid_cap = env_knob("FUSEKIT_NORM_BWD_GRID", 1, 1 << 20, 0);
    if (grid_cap >= cluster) max_blocks = std::min(max_blocks, grid_cap / cluster * cluster);
    grid = balanced_blocks(max_blocks, rpb, p.rows, cluster);
    static const bool debug = std::getenv("FUSEKIT_NORM_DEBUG") != nullptr;  // launch shapes, once each
    if (debug) {
      static std::mutex mutex;
      static std::vector<std::pair<std::int64_t, std::int64_t>> seen;
      std::lock_guard<std::mutex> lock(mutex);
      if (std::find(seen.begin(), seen.end(), std::make_pair(p.rows, p.cols)) == seen.end()) {
        seen.emplace_back(p.rows, p.cols);
        std::fprintf(stderr, "norm_backward (%lld, %lld): grid %d (max %d) cluster %d tpr %d rpb %d stages %d smem %zu\n",
                     static_cast<long long>(p.rows), static_cast<long long>(p.cols), grid, max_blocks, cluster,
                     plan.geometry.threads_per_row, rpb, plan.geometry.stages, plan.smem_bytes);
      }
    }
  }
  const RowGeometry geometry = variant.plan.geometry;
  const int partial_rows = grid / cluster;

  float* partial_dw = nullptr;
  float* partial_db = nullptr;
  if (partials) {
    if (p.workspace_bytes < partial_bytes(partial_rows, p.cols)) {
      throw Error(ErrorKind::invalid_argument, op, "workspace",
                  "at least " + std::to_string(partial_bytes(partial_rows, p.cols)) + " bytes",
                  std::to_string(p.workspace_bytes) + " bytes");
    }
    partial_dw = static_cast<float*>(p.workspace);
    partial_db = partial_dw + std::int64_t(partial_rows) * p.cols;
  }
  if (variant.kernel && cluster > 1) {
    const ClusterLaunch launch(grid, variant.plan.block_threads(), variant.plan.smem_bytes, cluster, stream);
    detail::check_cuda(cudaLaunchKernelEx(&launch.config, variant.cluster_kernel, p, geometry, partial_dw, partial_db), op,
                       "norm backward kernel (clusters)");
  } else if (variant.kernel) {
    variant.kernel<<<grid, variant.plan.block_threads(), variant.plan.smem_bytes, stream>>>(p, geometry, partial_dw,
                                                                                           partial_db);
  } else {
    backward_generic_kernel<T, W><<<grid, kGenericThreads, 0, stream>>>(p, partial_dw, partial_db);
  }
  detail::check_launch(op, "norm backward kernel");
  if (partials) {
    // Programmatic dependent launch: the reduction's launch latency overlaps the main kernel's
    // tail; cudaGridDependencySynchronize() in it waits for the partial sums.
    //
    // One column per thread gives cols / 32 blocks of 1024 threads per gradient: at least 1024
    // blocks (LayerNorm at N >= 16384) are four waves of two blocks per SM, and there four
    // columns per thread (16-byte loads: the workspace is 16-byte aligned) run a quarter of the
    // blocks. H200, session 20, three alternating runs, us: LayerNorm (4096, 16384) 121.5-122.0
    // -> 119.0-119.7; with fewer blocks it lost (RMSNorm (16384, 1024) 38.4-38.8 -> 39.5-39.6,
    // (16384, 4096) 112.0-112.5 -> 113.1-113.4), so smaller grids keep one column per thread.
    const int arrays = p.dbias ? 2 : 1;
    const int vec = p.cols % 4 == 0 && (p.cols + 31) / 32 * arrays >= 1024 ? 4 : 1;
    const std::int64_t col_blocks = (p.cols + 32 * vec - 1) / (32 * vec);
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(col_blocks), arrays);
    config.blockDim = dim3(32, 32);
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    auto* kernel = vec == 4 ? reduce_partials_kernel<W, 4> : reduce_partials_kernel<W, 1>;
    detail::check_cuda(cudaLaunchKernelEx(&config, kernel, static_cast<const float*>(partial_dw),
                                          static_cast<const float*>(partial_db), partial_rows, p.cols,
                                          static_cast<W*>(p.dweight), static_cast<W*>(p.dbias)),
                       op, "norm partial-sum reduction kernel");
  }
}

}  // namespace

void forward_cuda(const ForwardParams& p, int device_index, Stream stream) {
  if (p.rows == 0) return;
  detail::DeviceGuard guard("norm_forward", device_index);
  dispatch_types(p.dtype, p.weight_dtype, [&](auto t, auto w) {
    launch_forward<decltype(t), decltype(w)>(p, device_index, static_cast<cudaStream_t>(stream));
  });
}

void backward_cuda(const BackwardParams& p, int device_index, Stream stream) {
  detail::DeviceGuard guard("norm_backward", device_index);
  auto s = static_cast<cudaStream_t>(stream);
  if (p.rows == 0) {
    // Gradients of an empty batch are zero (all-zero bits are 0.0 in every float type).
    const std::size_t bytes = p.cols * dtype_size(p.weight_dtype);
    if (p.dweight) FUSEKIT_CUDA_CHECK("norm_backward", cudaMemsetAsync(p.dweight, 0, bytes, s));
    if (p.dbias) FUSEKIT_CUDA_CHECK("norm_backward", cudaMemsetAsync(p.dbias, 0, bytes, s));
    return;
  }
  dispatch_types(p.dtype, p.weight_dtype, [&](auto t, auto w) {
    launch_backward<decltype(t), decltype(w)>(p, device_index, s);
  });
}

std::size_t backward_workspace_cuda(std::int64_t rows, std::int64_t cols, DType dtype,
                                    int device_index) {
  if (rows <= 0 || cols <= 0) return 0;
  const char* op = "norm_backward_workspace_size";
  detail::DeviceGuard guard(op, device_index);
  // Either path may run (alignment decides) with either weight dtype (register use, hence
  // occupancy, differs), so size for the largest grid any of them would launch.
  int slots = 0;
  for (DType weight_dtype : {dtype, DType::f32}) {
    dispatch_types(dtype, weight_dtype, [&](auto t, auto w) {
      using T = decltype(t);
      using W = decltype(w);
      slots = std::max(slots, backward_grid_bound<T, W>(op, cols, cols % (16 / sizeof(T)) == 0, rows, device_index));
    });
  }
  const std::size_t bytes = partial_bytes(slots, cols);
  return bytes;
}

}  // namespace fusekit::norm
