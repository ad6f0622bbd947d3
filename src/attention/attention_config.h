// Which CUDA kernels serve an attention call: the Hopper kernels (wgmma + TMA,
// attention_sm90_*.cu) or the mma.sync kernels (attention_mma_kernels.cuh), with their tile
// configs. Pure functions of the validated call and the device's properties (no CUDA call), so
// that tests/attention/test_attention_config.cpp checks them on the CPU.
#pragma once

#include <cstdint>

#include "attention/attention_params.h"
#include "core/device_info.h"

namespace fusekit::attention {

enum class KernelPath { mma, sm90 };

// The override key "attention.path": auto (the choice below), sm90 (the Hopper kernels; an
// Error(unsupported) for a call they cannot serve), mma (the mma.sync kernels for every call:
// what tests use to cover them on an sm_90 GPU).
enum class PathChoice { automatic, sm90, mma };
inline constexpr const char* kPathOverrideKey = "attention.path";

// The mma.sync kernels' head-dim bucket: the larger of D and Dv rounded up to 64, 128 or 256
// (attention_cuda.cu instantiates one tile configuration per bucket and dtype).
int head_dim_bucket(std::int64_t head_dim, std::int64_t head_dim_v);

// Keys per CTA of the Hopper dK / dV kernel (BackwardTraits::kBN).
inline constexpr std::int64_t kSm90BackwardKeyBlock = 128;

// Dropout and a bias together at D = 64 need more registers than a consumer of the Hopper dK / dV
// kernel has: ptxas would serialize its wgmma (C7512). Those calls take the mma.sync kernels,
// and that kernel is not instantiated.
constexpr bool sm90_dropout_with_bias_fits(std::int64_t head_dim) { return head_dim != 64; }

// The call's extents as the Hopper kernels' TMA tensors see them: with variable lengths one
// batch of packed tokens.
struct TmaExtents {
  std::int64_t batch, tokens_q, tokens_k;
};
TmaExtents tma_extents(const Problem& p);

// Whether the Hopper forward can serve the call: an sm_90 GPU, f16 / bf16, D = Dv = 64 or 128,
// scale > 0, at least one query and one key token, views TMA can describe, and no bias or one in
// the input dtype with fixed lengths and a materialized query dim.
bool sm90_forward_supported(const Problem& p, const detail::DeviceInfo& device);

// Whether the Hopper dK / dV kernel can serve the backward: the forward's conditions, dout TMA
// can describe, a grid of int-indexed CTAs, and with a bias the atomic-dQ mode (no dropout at
// D = 64) and a dbias (if any) in the input dtype with no dimension to reduce over.
bool sm90_backward_supported(const BackwardProblem& p, const detail::DeviceInfo& device);

struct ForwardConfig {
  KernelPath path = KernelPath::mma;
  int bucket = 64;  // mma.sync path: head_dim_bucket
};

ForwardConfig choose_forward(const Problem& p, const detail::DeviceInfo& device,
                             PathChoice choice = PathChoice::automatic);

// The dK / dV step of the backward (dQ parts too in the non-deterministic mode, dbias when no
// dimension is reduced): none when none of those is wanted.
enum class DkdvKernel { none, mma, sm90 };

struct BackwardConfig {
  DkdvKernel dkdv = DkdvKernel::none;
  int bucket = 64;     // the mma.sync kernels (preprocess, dq, dbias and their dK / dV kernel)
  int cta_group = 1;   // Hopper dK / dV kernel: (kv head, batch) pairs per group of CTAs
  bool atomic_dq = false;     // dQ through the float32 accumulator (non-deterministic mode)
  bool dbias_reduce = false;  // dbias summed over a broadcast dim (dbias_kernel)
};

BackwardConfig choose_backward(const BackwardProblem& p, const detail::DeviceInfo& device,
                               PathChoice choice = PathChoice::automatic);

// The Hopper dK / dV kernel's CTA order (dkdv_block_of): under a causal mask, groups of (kv head,
// batch) pairs whose Q and dO fit in 16 MB of L2 (at most 16 pairs: enough to fill a wave with
// heavy key blocks first); one pair at a time without a mask, or when fewer than 8 pairs fit.
// (bench: attention backward causal, B = 16 S = 1024 and B = 4 S = 4096, D = 64 and 128, H200:
// 1.5-3.7% faster than one pair; groups of 2 pairs at S = 16384 were 1% slower, and groups
// without a mask 1-3% slower.)
int sm90_cta_group(const BackwardProblem& p);

// dbias needs a reduction when one of its dims is 1 while the problem has more than one batch,
// head or query row there.
bool dbias_needs_reduction(const BackwardProblem& p);

}  // namespace fusekit::attention
