// Launcher of the Hopper attention dK / dV kernel (attention_sm90_kernels.cuh): builds the TMA
// descriptors of q, dout, k, v (and the bias, dbias) from the caller's strides and launches one
// CTA per (key block, kv head, batch).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>

#include "attention/attention_sm90.h"
#include "attention/attention_sm90_launch.h"

namespace fusekit::attention::sm90 {
namespace {

using namespace launch_detail;

// Dropout and a bias together at D = 64 (128 queries per step) need more registers than a
// consumer has: ptxas would serialize the kernel's wgmma (C7512). Those calls take the mma.sync
// kernels (backward_supported), and that kernel is not instantiated.
constexpr bool dropout_with_bias_fits(std::int64_t head_dim) { return head_dim != 64; }

// CTA order (dkdv_block_of): under a causal mask, groups of (kv head, batch) pairs whose Q and
// dO fit in 16 MB of L2 (at most 16 pairs: enough to fill a wave with heavy key blocks first);
// one pair at a time without a mask, or when fewer than 8 pairs fit. Measured on an H200 (B = 16,
// S = 1024 and B = 4, S = 4096, causal, D = 64 and 128): 1.5-3.7% faster; groups of 2 pairs
// (S = 16384) were 1% slower, and groups without a mask 1-3% slower.
int cta_group(const BackwardProblem& p) {
  if (p.mask == AttentionMask::none) return 1;
  const std::int64_t bytes_per_pair = p.seqlen_q * (p.heads_q / p.heads_kv) * p.head_dim * 2 * 2;
  const std::int64_t fit = (std::int64_t{16} << 20) / std::max<std::int64_t>(bytes_per_pair, 1);
  return fit < 8 ? 1 : static_cast<int>(std::min<std::int64_t>(fit, 16));
}

template <typename Traits, bool kAtomicDQ, bool kBias>
void launch_dkdv(const BackwardProblem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream) {
  using namespace cute;
  using E = typename Traits::Element;
  const char* op = "attention_backward";
  const TmaExtents x = tma_extents(p);
  const auto [gq, gk, gv] = qkv_tensors<Traits>(p);
  const auto go = gmem_tensor<Traits>(p.dout, x.tokens_q, p.heads_q, x.batch, p.varlen);
  const auto q_tile = Shape<Int<Traits::kBM>, Int<Traits::kD>>{};
  const auto kv_tile = Shape<Int<Traits::kBN>, Int<Traits::kD>>{};
  BackwardParams<Traits> P{k,
                           make_tma_copy(SM90_TMA_LOAD{}, gq, take<0, 2>(typename Traits::SmemLayoutQ{}), q_tile, _1{}),
                           make_tma_copy(SM90_TMA_LOAD{}, go, take<0, 2>(typename Traits::SmemLayoutQ{}), q_tile, _1{}),
                           make_tma_copy(SM90_TMA_LOAD{}, gk, typename Traits::SmemLayoutKV{}, kv_tile, _1{}),
                           make_tma_copy(SM90_TMA_LOAD{}, gv, typename Traits::SmemLayoutKV{}, kv_tile, _1{}),
                           gq.shape(),
                           go.shape(),
                           gk.shape(),
                           gv.shape(),
                           {}, {}, {}, {}, {},  // the bias's members: below
                           cta_group(p),
                           {},
                           {}};  // the dQ accumulator's members: below
  if constexpr (kAtomicDQ) {
    // the float32 dQ accumulator, (token, head, d) contiguous (batch-major with fixed lengths)
    const std::int64_t row = p.heads_q * Traits::kD;
    const auto shape = make_shape(static_cast<std::int32_t>(x.tokens_q), static_cast<std::int32_t>(Traits::kD),
                                  static_cast<std::int32_t>(p.heads_q), static_cast<std::int32_t>(x.batch));
    auto gdq = make_tensor(make_gmem_ptr(k.dq_accum),
                           make_layout(shape, make_stride(row, _1{}, std::int64_t{Traits::kD},
                                                          p.varlen ? row : p.seqlen_q * row)));
    P.tma_dq = make_tma_copy(SM90_TMA_REDUCE_ADD{}, gdq, typename Traits::SmemLayoutDQBlock{}, Shape<_64, _64>{}, _1{});
    P.shape_dq = gdq.shape();
  }
  if constexpr (kBias) {
    const auto bias_tile = Shape<Int<Traits::kBM>, Int<Traits::kBN>>{};
    auto gb = bias_tensor(p.bias, static_cast<const E*>(p.bias.data));
    P.tma_bias = make_tma_copy(SM90_TMA_LOAD{}, gb, take<0, 2>(typename Traits::SmemLayoutDS{}), bias_tile, _1{});
    P.shape_bias = gb.shape();
    P.bias = bias_coords(p.bias);
    if (k.dbias_direct != 0) {
      auto gdb = bias_tensor(p.dbias, static_cast<E*>(p.dbias.data));
      P.tma_dbias = make_tma_copy(SM90_TMA_STORE{}, gdb, take<0, 2>(typename Traits::SmemLayoutDS{}), bias_tile, _1{});
      P.shape_dbias = gdb.shape();
    }
  }
  auto kernel = dkdv_kernel<Traits, kAtomicDQ, false, kBias>;
  if (k.dropout) {
    if constexpr (dropout_with_bias_fits(Traits::kD) || !kBias) kernel = dkdv_kernel<Traits, kAtomicDQ, true, kBias>;
  }
  const dim3 grid(static_cast<unsigned>((p.seqlen_k + Traits::kBN - 1) / Traits::kBN * p.heads_kv * p.batch));
  launch_kernel(op, "attention backward dk/dv kernel (sm90)", kernel, grid, Traits::kThreads, Traits::smem_bytes(), P,
                device_index, stream);
}

template <typename Traits>
void launch_dkdv(const BackwardProblem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream) {
  // (backward_supported sends a bias here only in the atomic-dQ mode)
  if (k.atomic_dq == 0) launch_dkdv<Traits, false, false>(p, k, device_index, stream);
  else if (p.bias.data != nullptr) launch_dkdv<Traits, true, true>(p, k, device_index, stream);
  else launch_dkdv<Traits, true, false>(p, k, device_index, stream);
}

// dbias straight from the dS tile: no reduction over a broadcast dim, in the input dtype.
bool dbias_on_tma(const BackwardProblem& p) {
  const BiasOperand& d = p.dbias;
  if (d.data == nullptr) return true;
  const std::int64_t full[3] = {p.batch, p.heads_q, p.seqlen_q};
  for (int i = 0; i < 3; ++i)
    if (d.shape[i] != full[i]) return false;
  return d.dtype == p.dtype;
}

}  // namespace

bool backward_supported(const BackwardProblem& p, int device_index) {
  const TmaExtents x = tma_extents(p);
  if (!forward_supported(p, device_index) || !tma_describable(p.dout, x.tokens_q, p.heads_q, x.batch)) return false;
  // one CTA per (key block of 128, kv head, batch) in a 1-D grid of int-indexed CTAs (dkdv_block_of)
  if ((p.seqlen_k + 127) / 128 * p.heads_kv * p.batch > INT_MAX) return false;
  // A bias (and dbias) rides on the dS tiles of the dQ product: the atomic-dQ mode only.
  if (p.bias.data != nullptr && (p.dq.data == nullptr || p.deterministic)) return false;
  if (p.bias.data != nullptr && p.dropout_p > 0.0f && !dropout_with_bias_fits(p.head_dim)) return false;
  return dbias_on_tma(p);
}

void dkdv(const BackwardProblem& p, const kernels::KernelParams& k, int device_index, cudaStream_t stream) {
  with_traits<BackwardTraits>(p, [&](auto traits) { launch_dkdv<decltype(traits)>(p, k, device_index, stream); });
}

}  // namespace fusekit::attention::sm90
