#include "attention/attention_config.h"

#include <algorithm>
#include <climits>

#include "fusekit/error.h"

namespace fusekit::attention {

namespace {

// Whether TMA can describe the operand: every dim it steps has a positive stride (the argument
// checks allow 0, a view broadcast over heads or tokens; the mma.sync kernels take those).
bool tma_describable(const Operand& op, std::int64_t tokens, std::int64_t heads, std::int64_t batch) {
  return (tokens <= 1 || op.s_stride > 0) && (heads <= 1 || op.h_stride > 0) && (batch <= 1 || op.b_stride > 0);
}

// Whether the Hopper kernels can take this bias: in the input dtype (the tile shares the dS
// buffer's layout), fixed lengths, and a materialized query dim (TMA cannot repeat a row).
bool bias_on_tma(const Problem& p) {
  const BiasOperand& b = p.bias;
  return b.data == nullptr ||
         (b.dtype == p.dtype && !p.varlen && (b.i_stride > 0 || p.seqlen_q == 1) && b.shape[3] == p.seqlen_k);
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

[[noreturn]] void sm90_refused(const char* op) {
  throw Error(ErrorKind::unsupported, op, kPathOverrideKey, "auto or mma for a call the Hopper kernels cannot serve",
              "sm90");
}

}  // namespace

int head_dim_bucket(std::int64_t head_dim, std::int64_t head_dim_v) {
  const std::int64_t m = std::max(head_dim, head_dim_v);
  return m <= 64 ? 64 : m <= 128 ? 128 : 256;
}

TmaExtents tma_extents(const Problem& p) {
  return {p.varlen ? 1 : p.batch, p.varlen ? p.total_q : p.seqlen_q, p.varlen ? p.total_k : p.seqlen_k};
}

bool sm90_forward_supported(const Problem& p, const detail::DeviceInfo& device) {
  if (device.major != 9) return false;
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return false;
  if (p.head_dim != p.head_dim_v || (p.head_dim != 64 && p.head_dim != 128)) return false;
  // A TMA descriptor needs every extent >= 1: no query or no key tokens at all (variable lengths
  // that are all 0) stay with the mma.sync kernels, which define those outputs (zeros, -inf).
  if (p.total_q == 0 || p.total_k == 0 || p.heads_q == 0 || p.heads_kv == 0 || p.batch == 0) return false;
  const TmaExtents x = tma_extents(p);
  if (!tma_describable(p.q, x.tokens_q, p.heads_q, x.batch) || !tma_describable(p.k, x.tokens_k, p.heads_kv, x.batch) ||
      !tma_describable(p.v, x.tokens_k, p.heads_kv, x.batch))
    return false;
  return bias_on_tma(p) && p.scale > 0.0;
}

bool sm90_backward_supported(const BackwardProblem& p, const detail::DeviceInfo& device) {
  const TmaExtents x = tma_extents(p);
  if (!sm90_forward_supported(p, device) || !tma_describable(p.dout, x.tokens_q, p.heads_q, x.batch)) return false;
  // one CTA per (key block, kv head, batch) in a 1-D grid of int-indexed CTAs (dkdv_block_of)
  if ((p.seqlen_k + kSm90BackwardKeyBlock - 1) / kSm90BackwardKeyBlock * p.heads_kv * p.batch > INT_MAX) return false;
  // A bias (and dbias) rides on the dS tiles of the dQ product: the atomic-dQ mode only.
  if (p.bias.data != nullptr && (p.dq.data == nullptr || p.deterministic)) return false;
  if (p.bias.data != nullptr && p.dropout_p > 0.0f && !sm90_dropout_with_bias_fits(p.head_dim)) return false;
  return dbias_on_tma(p);
}

ForwardConfig choose_forward(const Problem& p, const detail::DeviceInfo& device, PathChoice choice) {
  ForwardConfig c;
  c.bucket = head_dim_bucket(p.head_dim, p.head_dim_v);
  if (choice != PathChoice::mma && sm90_forward_supported(p, device)) c.path = KernelPath::sm90;
  else if (choice == PathChoice::sm90) sm90_refused("attention_forward");
  return c;
}

int sm90_cta_group(const BackwardProblem& p) {
  if (p.mask == AttentionMask::none) return 1;
  const std::int64_t bytes_per_pair = p.seqlen_q * (p.heads_q / p.heads_kv) * p.head_dim * 2 * 2;
  const std::int64_t fit = (std::int64_t{16} << 20) / std::max<std::int64_t>(bytes_per_pair, 1);
  return fit < 8 ? 1 : static_cast<int>(std::min<std::int64_t>(fit, 16));
}

bool dbias_needs_reduction(const BackwardProblem& p) {
  const std::int64_t full[3] = {p.batch, p.heads_q, p.seqlen_q};
  for (int d = 0; d < 3; ++d)
    if (p.dbias.shape[d] == 1 && full[d] > 1) return true;
  return false;
}

BackwardConfig choose_backward(const BackwardProblem& p, const detail::DeviceInfo& device, PathChoice choice) {
  BackwardConfig c;
  c.bucket = head_dim_bucket(p.head_dim, p.head_dim_v);
  const bool want_dbias = p.dbias.data != nullptr;
  c.atomic_dq = p.dq.data != nullptr && !p.deterministic;
  c.dbias_reduce = want_dbias && dbias_needs_reduction(p);
  const bool dbias_direct = want_dbias && !c.dbias_reduce;
  // dK, dV and the atomic dQ parts come from the dK / dV kernel; so does a direct dbias, which
  // only the mma.sync kernel writes without them.
  const bool dkdv_products = p.dk.data != nullptr || p.dv.data != nullptr || c.atomic_dq;
  if (dkdv_products && choice != PathChoice::mma && sm90_backward_supported(p, device)) {
    c.dkdv = DkdvKernel::sm90;
    c.cta_group = sm90_cta_group(p);
  } else if (dkdv_products && choice == PathChoice::sm90) {
    sm90_refused("attention_backward");
  } else if (dkdv_products || dbias_direct) {
    c.dkdv = DkdvKernel::mma;
  }
  return c;
}

}  // namespace fusekit::attention
