// CUDA launchers for attention: translate the validated Problem into kernel parameters, pick the
// head-dim bucket (64, 128 or 256: the larger of D and Dv, rounded up), lay out the caller's
// workspace, and launch the kernels of attention_mma_kernels.cuh in order on the caller's stream.
//
// Instantiations: 2 dtypes x 3 buckets x 4 tile kernels (forward, dk/dv, dq, dbias) plus the
// small row kernels. Everything else (masks, bias and its dtype, dropout, varlen, GQA, which
// gradients) is a run-time parameter, uniform per CTA.
//
// Backward launch order (stream-ordered, so each kernel sees the previous one's results):
//   zero_dbias   (dbias wanted, written directly by dkdv: clears what dkdv will not visit)
//   preprocess   (delta; zeroes the dq accumulator in the non-deterministic mode)
//   dkdv         (dk, dv; dq atomics in the non-deterministic mode; direct dbias)
//   dq           (deterministic mode)   or   convert_dq (non-deterministic mode)
//   dbias        (dbias reduced over a broadcast dim)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "attention/attention_config.h"
#include "attention/attention_mma_kernels.cuh"
#include "attention/attention_params.h"
#include "attention/attention_sm90.h"
#include "core/cuda_check.h"
#include "core/device_info.h"
#include "core/launch_tuning.h"
#include "core/overrides.h"
#include "fusekit/error.h"

namespace fusekit::attention {
namespace {

using kernels::KernelParams;

std::size_t align256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }
std::int64_t round_up16(std::int64_t x) { return (x + 15) / 16 * 16; }

// The tile configuration of one head-dim bucket.
template <typename T_, int kD_>
struct Bucket {
  using T = T_;
  static constexpr int kD = kD_;
  static constexpr int kBN = kD > 128 ? 32 : 64;        // forward, dq, dbias key block
  static constexpr int kDkdvWarps = kD > 64 ? 8 : 4;    // dk/dv kernel: 64 keys x 64 queries
  static constexpr int kDkdvBM = 64, kDkdvBN = 64;
};

template <typename T, typename F>
void dispatch_bucket(int bucket, F&& f) {
  switch (bucket) {
    case 64: f(Bucket<T, 64>{}); return;
    case 128: f(Bucket<T, 128>{}); return;
    default: f(Bucket<T, 256>{}); return;
  }
}

template <typename F>
void dispatch(DType dtype, int bucket, F&& f) {
  if (dtype == DType::bf16) dispatch_bucket<__nv_bfloat16>(bucket, f);
  else dispatch_bucket<__half>(bucket, f);
}

[[noreturn]] void too_large(const char* op, const char* argument, const std::string& expected,
                            const std::string& got) {
  throw Error(ErrorKind::invalid_argument, op, argument, expected, got);
}

// Sizes the kernels index with 32-bit ints (sequence positions, heads, batch) and the grid limits.
void check_limits(const char* op, const Problem& p) {
  constexpr std::int64_t kMaxLen = INT_MAX - 1024;  // positions plus a tile stay below 2^31
  if (p.seqlen_q > kMaxLen) too_large(op, "q", "a sequence length below 2^31 - 1024", std::to_string(p.seqlen_q));
  if (p.seqlen_k > kMaxLen) too_large(op, "k", "a sequence length below 2^31 - 1024", std::to_string(p.seqlen_k));
  if (p.batch > 65535) too_large(op, "q", "a batch (sequence count) of at most 65535 (CUDA grid)", std::to_string(p.batch));
  if (p.heads_q > 65535) too_large(op, "q", "at most 65535 heads (CUDA grid)", std::to_string(p.heads_q));
  if ((p.total_q * p.heads_q + 7) / 8 > INT_MAX)
    too_large(op, "q", "fewer than 2^34 (token, head) rows", std::to_string(p.total_q * p.heads_q));
}

kernels::OperandArg operand(const Operand& op) { return {op.data, op.b_stride, op.s_stride, op.h_stride}; }

// Whether a bias (or dbias) can move in 16-byte pieces: pointer and every stride (in bytes)
// multiples of 16 (key offsets of tiles are multiples of 8 elements).
bool bias_is_16b_aligned(const kernels::BiasArg& a) {
  const std::int64_t elt = a.dtype == kernels::kBiasF32 ? 4 : 2;
  return a.data != nullptr && reinterpret_cast<std::uintptr_t>(a.data) % 16 == 0 && (a.b * elt) % 16 == 0 &&
         (a.h * elt) % 16 == 0 && (a.i * elt) % 16 == 0;
}

kernels::BiasArg bias_arg(const BiasOperand& b) {
  kernels::BiasArg a;
  a.data = b.data;
  a.dtype = b.dtype == DType::f16 ? kernels::kBiasF16 : b.dtype == DType::bf16 ? kernels::kBiasBf16 : kernels::kBiasF32;
  for (int d = 0; d < 4; ++d) a.shape[d] = b.shape[d];
  a.b = b.b_stride, a.h = b.h_stride, a.i = b.i_stride;
  return a;
}

KernelParams make_params(const Problem& p) {
  KernelParams k;
  k.batch = static_cast<int>(p.batch);
  k.heads_q = static_cast<int>(p.heads_q);
  k.heads_kv = static_cast<int>(p.heads_kv);
  k.group = static_cast<int>(p.heads_q / p.heads_kv);
  k.d = static_cast<int>(p.head_dim);
  k.dv = static_cast<int>(p.head_dim_v);
  k.dp = static_cast<int>(round_up16(p.head_dim));
  k.dvp = static_cast<int>(round_up16(p.head_dim_v));
  k.seqlen_q = static_cast<int>(p.seqlen_q);
  k.seqlen_k = static_cast<int>(p.seqlen_k);
  k.total_q = p.total_q;
  if (p.varlen) {
    k.cu_q = p.cu_seqlens_q;
    k.cu_k = p.cu_seqlens_k;
  }
  k.scale = static_cast<float>(p.scale);
  k.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  k.causal = p.mask != AttentionMask::none;
  k.top_left = p.mask == AttentionMask::causal_top_left;
  // A window of 2^32 or more keys bounds nothing (positions are below 2^31): unbounded, which
  // also keeps i + d +- window far from int64 overflow.
  constexpr std::int64_t kUnbounded = std::int64_t{1} << 32;
  k.window_left = p.window_left >= kUnbounded ? -1 : p.window_left;
  k.window_right = p.window_right >= kUnbounded ? -1 : p.window_right;
  k.dropout = p.dropout_p > 0.0f;
  k.threshold = dropout_keep_threshold(p.dropout_p);
  k.keep_scale = 1.0f / (1.0f - p.dropout_p);
  k.seed = p.seed;
  k.offset = p.offset;
  k.q = operand(p.q);
  k.k = operand(p.k);
  k.v = operand(p.v);
  k.out = operand(p.out);
  k.bias = bias_arg(p.bias);
  k.bias_tile = bias_is_16b_aligned(k.bias);
  k.lse = p.lse;
  return k;
}

// Launches kernel<<<grid, block, smem>>>(k) after opting it in to `smem` bytes of dynamic shared memory.
void launch(const char* op, const char* name, void (*kernel)(KernelParams), dim3 grid, int threads, int smem,
            cudaStream_t stream, const KernelParams& k, int device_index) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  detail::allow_dynamic_smem(op, kernel, static_cast<std::size_t>(smem), device_index, name);
  kernel<<<grid, threads, smem, stream>>>(k);
  detail::check_launch(op, name);
}

unsigned blocks(std::int64_t n, std::int64_t per_block) { return static_cast<unsigned>((n + per_block - 1) / per_block); }

// The "attention.path" override (attention_config.h): tests force the mma.sync kernels with it.
PathChoice path_choice() {
  return detail::override_choice<PathChoice>(
             kPathOverrideKey, {{"auto", PathChoice::automatic}, {"sm90", PathChoice::sm90}, {"mma", PathChoice::mma}})
      .value_or(PathChoice::automatic);
}

}  // namespace

std::size_t forward_workspace_cuda(std::int64_t, std::int64_t, std::int64_t, std::int64_t) { return 0; }

std::size_t backward_workspace_cuda(std::int64_t batch, std::int64_t seqlen_q, std::int64_t heads_q,
                                    std::int64_t head_dim, bool deterministic) {
  if (batch <= 0 || seqlen_q <= 0 || heads_q <= 0) return 0;
  const std::size_t rows = static_cast<std::size_t>(batch) * static_cast<std::size_t>(seqlen_q) *
                           static_cast<std::size_t>(heads_q);
  const std::size_t delta = align256(rows * sizeof(float));
  const std::size_t dq = deterministic ? 0 : align256(rows * static_cast<std::size_t>(head_dim) * sizeof(float));
  return delta + dq;
}

void forward_cuda(const Problem& p, int device_index, Stream stream) {
  const char* op = "attention_forward";
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0) return;
  check_limits(op, p);
  detail::DeviceGuard guard(op, device_index);
  const auto s = static_cast<cudaStream_t>(stream);
  const ForwardConfig config = choose_forward(p, detail::device_info(op, device_index), path_choice());
  const KernelParams k = make_params(p);
  if (config.path == KernelPath::sm90) {
    sm90::forward(p, k, device_index, s);
    return;
  }
  dispatch(p.dtype, config.bucket, [&](auto cfg) {
    using C = decltype(cfg);
    using Shape = kernels::ForwardShape<C::kD, C::kBN>;
    const dim3 grid(blocks(p.seqlen_q, Shape::kBM), static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
    launch(op, "attention forward kernel", kernels::forward_kernel<typename C::T, C::kD, C::kBN>, grid,
           Shape::kThreads, Shape::smem_bytes(), s, k, device_index);
  });
}

void backward_cuda(const BackwardProblem& p, int device_index, Stream stream) {
  const char* op = "attention_backward";
  const bool want_dq = p.dq.data != nullptr, want_dk = p.dk.data != nullptr, want_dv = p.dv.data != nullptr,
             want_dbias = p.dbias.data != nullptr;
  if (!want_dq && !want_dk && !want_dv && !want_dbias) return;
  check_limits(op, p);
  const std::int64_t dbias_numel = want_dbias ? p.dbias.shape[0] * p.dbias.shape[1] * p.dbias.shape[2] * p.dbias.shape[3] : 0;
  const std::size_t need = backward_workspace_cuda(p.batch, p.seqlen_q, p.heads_q, p.head_dim, p.deterministic);
  if (need > 0 && (p.workspace == nullptr || p.workspace_bytes < need))
    throw Error(ErrorKind::invalid_argument, op, "workspace",
                "at least " + std::to_string(need) + " bytes (attention_backward_workspace_size)",
                std::to_string(p.workspace_bytes) + " bytes");

  detail::DeviceGuard guard(op, device_index);
  const BackwardConfig config = choose_backward(p, detail::device_info(op, device_index), path_choice());
  const bool dbias_reduce = config.dbias_reduce;
  const auto s = static_cast<cudaStream_t>(stream);
  KernelParams k = make_params(p);
  k.dout = operand(p.dout);
  k.grad_q = operand(p.dq);
  k.grad_k = operand(p.dk);
  k.grad_v = operand(p.dv);
  k.dbias = kernels::BiasArg{};
  if (want_dbias) k.dbias = bias_arg(p.dbias);
  if (need > 0) {
    k.delta = static_cast<float*>(p.workspace);
    const std::size_t rows = static_cast<std::size_t>(p.batch * p.seqlen_q * p.heads_q);
    if (want_dq && !p.deterministic)
      k.dq_accum = reinterpret_cast<float*>(static_cast<unsigned char*>(p.workspace) + align256(rows * sizeof(float)));
  }
  k.want_dk = want_dk;
  k.want_dv = want_dv;
  k.atomic_dq = config.atomic_dq;
  k.dbias_direct = want_dbias && !dbias_reduce;
  const int input_bias_dtype = p.dtype == DType::bf16 ? kernels::kBiasBf16 : kernels::kBiasF16;
  k.dbias_tile = k.dbias_direct && k.dbias.dtype == input_bias_dtype && bias_is_16b_aligned(k.dbias);
  // Without a mask or variable lengths the direct path writes every element of dbias itself;
  // otherwise elements no visited block produces (masked blocks, padding) are zeroed first.
  const bool every_element_written = !k.causal && k.window_left < 0 && k.window_right < 0 && k.cu_q == nullptr;

  if (k.dbias_direct && dbias_numel > 0 && !every_element_written) {
    const std::int64_t rows = p.dbias.shape[0] * p.dbias.shape[1] * p.dbias.shape[2];
    const unsigned grid = static_cast<unsigned>(rows < 65536 * 8 ? rows : 65536 * 8);
    kernels::zero_dbias_kernel<<<grid, 256, 0, s>>>(k.dbias);
    detail::check_launch(op, "attention dbias zero-fill kernel");
  }
  const std::int64_t rows = p.total_q * p.heads_q;
  const bool any_rows = rows > 0 && p.heads_kv > 0;
  dispatch(p.dtype, config.bucket, [&](auto cfg) {
    using C = decltype(cfg);
    using T = typename C::T;
    constexpr int kRowThreads = C::kD / 8 < 32 ? C::kD / 8 : 32;  // see preprocess_kernel
    constexpr int kRowsPerBlock = 256 / kRowThreads;
    if (any_rows) launch(op, "attention backward preprocess kernel", kernels::preprocess_kernel<T, kRowThreads>,
                         dim3(blocks(rows, kRowsPerBlock)), 256, 0, s, k, device_index);
    if (config.dkdv == DkdvKernel::sm90) {
      sm90::dkdv(p, k, config.cta_group, device_index, s);
    } else if (config.dkdv == DkdvKernel::mma) {
      using Shape = kernels::DkdvShape<C::kD, C::kDkdvWarps, C::kDkdvBM, C::kDkdvBN>;
      const dim3 grid(blocks(p.seqlen_k, Shape::kBN), static_cast<unsigned>(p.heads_kv), static_cast<unsigned>(p.batch));
      launch(op, "attention backward dk/dv kernel",
             kernels::dkdv_kernel<T, C::kD, C::kDkdvWarps, C::kDkdvBM, C::kDkdvBN>, grid, Shape::kThreads,
             Shape::smem_bytes(), s, k, device_index);
    }
    using RowShape = kernels::BwdRowShape<C::kD, C::kBN>;
    if (want_dq && p.deterministic) {
      const dim3 grid(blocks(p.seqlen_q, RowShape::kBM), static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
      launch(op, "attention backward dq kernel", kernels::dq_kernel<T, C::kD, C::kBN>, grid, RowShape::kThreads,
             RowShape::smem_bytes(), s, k, device_index);
    }
    if (k.atomic_dq && any_rows)
      launch(op, "attention backward dq conversion kernel", kernels::convert_dq_kernel<T, kRowThreads>,
             dim3(blocks(rows, kRowsPerBlock)), 256, 0, s, k, device_index);
    if (dbias_reduce && dbias_numel > 0) {
      const std::int64_t row_tiles = p.dbias.shape[2] == 1 ? 1 : (p.dbias.shape[2] + RowShape::kBM - 1) / RowShape::kBM;
      const std::int64_t key_tiles = (p.dbias.shape[3] + C::kBN - 1) / C::kBN;
      const std::int64_t tiles = p.dbias.shape[0] * p.dbias.shape[1] * row_tiles * key_tiles;
      if (tiles > INT_MAX) too_large(op, "dbias", "fewer than 2^31 tiles of 64 x 64", std::to_string(tiles));
      launch(op, "attention backward dbias kernel", kernels::dbias_kernel<T, C::kD, C::kBN>,
             dim3(static_cast<unsigned>(tiles)), RowShape::kThreads, RowShape::smem_bytes(), s, k, device_index);
    }
  });
}

}  // namespace fusekit::attention
