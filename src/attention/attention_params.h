// The validated, backend-neutral description of one attention call. attention.cpp checks the
// arguments and fills these; each backend (the float64 CPU reference, the CUDA kernels) reads
// them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/attention.h"
#include "fusekit/tensor.h"

namespace fusekit::attention {

// One (b, s, h, d) operand; with variable lengths s is the packed token index and b_stride is 0.
struct Operand {
  void* data = nullptr;  // null: not given (optional outputs)
  std::int64_t b_stride = 0, s_stride = 0, h_stride = 0;  // head-dim stride is 1
  std::int64_t offset(std::int64_t b, std::int64_t s, std::int64_t h) const {
    return b * b_stride + s * s_stride + h * h_stride;
  }
};

// The bias or dbias: (b, h, i, j) with broadcast dimensions at stride 0.
struct BiasOperand {
  void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t shape[4] = {};
  std::int64_t b_stride = 0, h_stride = 0, i_stride = 0;  // key stride is 1
  std::int64_t offset(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    return b * b_stride + h * h_stride + i * i_stride + j;
  }
};

struct Problem {
  std::int64_t batch = 0, heads_q = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0;
  std::int64_t seqlen_q = 0, seqlen_k = 0;  // fixed lengths; the max lengths with varlen
  bool varlen = false;
  const std::int32_t* cu_seqlens_q = nullptr;  // varlen only, (batch + 1), on the tensors' device
  const std::int32_t* cu_seqlens_k = nullptr;
  std::int64_t total_q = 0;  // tokens of q (varlen) or batch * seqlen_q
  std::int64_t total_k = 0;  // tokens of k and v (varlen) or batch * seqlen_k
  DType dtype = DType::bf16;
  double scale = 1.0;
  AttentionMask mask = AttentionMask::none;
  std::int64_t window_left = -1, window_right = -1;
  float dropout_p = 0.0f;
  std::uint64_t seed = 0, offset = 0;
  Operand q, k, v, out;
  float* lse = nullptr;  // (B, Hq, Sq) or (Hq, Tq), contiguous
  BiasOperand bias;      // data null: no bias
  void* workspace = nullptr;  // CUDA only: the caller's scratch memory
  std::size_t workspace_bytes = 0;
};

struct BackwardProblem : Problem {
  Operand dout, dq, dk, dv;  // dq/dk/dv data null: not wanted
  BiasOperand dbias;
  bool deterministic = false;
};

namespace kernels {

// The kernels' view of one call (both the mma.sync and the Hopper kernels read it): sizes as
// ints, strides in elements, the mask and dropout settings, and what the backward produces.

// One (b, s, h, d) operand: element (b, token, h, c) at b * b + token * s + h * h + c.
struct OperandArg {
  void* data = nullptr;
  std::int64_t b = 0, s = 0, h = 0;
};

enum BiasDtype : int { kBiasF32 = 0, kBiasF16 = 1, kBiasBf16 = 2 };

// bias or dbias, (b, h, i, j) with stride 0 on broadcast dims and key stride 1.
struct BiasArg {
  void* data = nullptr;
  int dtype = kBiasF32;
  std::int64_t shape[4] = {};
  std::int64_t b = 0, h = 0, i = 0;
};

struct KernelParams {
  int batch = 0, heads_q = 0, heads_kv = 0, group = 1;
  int d = 0, dv = 0, dp = 0, dvp = 0;  // head dims and their multiples of 16
  int seqlen_q = 0, seqlen_k = 0;      // fixed lengths, or the max lengths with varlen
  std::int64_t total_q = 0;            // tokens of q (varlen) or batch * seqlen_q
  const std::int32_t* cu_q = nullptr;  // null: fixed lengths
  const std::int32_t* cu_k = nullptr;
  float scale = 1.0f, scale_log2 = 1.0f;  // scale and scale * log2(e)
  int causal = 0, top_left = 0;
  std::int64_t window_left = -1, window_right = -1;
  int dropout = 0;
  std::uint32_t threshold = 0;
  float keep_scale = 1.0f;
  std::uint64_t seed = 0, offset = 0;
  OperandArg q, k, v, out, dout, grad_q, grad_k, grad_v;  // grad_*: dq, dk, dv
  BiasArg bias, dbias;  // data null: none
  float* lse = nullptr;
  float* delta = nullptr;     // backward workspace, laid out like lse
  float* dq_accum = nullptr;  // non-deterministic backward: (token, h, d) float32
  // Backward: what the dkdv kernel does.
  int want_dk = 0, want_dv = 0, atomic_dq = 0, dbias_direct = 0;
  // Bias tiles staged in shared memory with 16-byte copies (bias pointer and strides 16-byte
  // aligned), and dbias written from the dS tile in 16-byte rows (dbias in the input dtype, same
  // alignment, direct path); otherwise element by element.
  int bias_tile = 0, dbias_tile = 0;
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace kernels

void forward_cpu(const Problem& p);
void backward_cpu(const BackwardProblem& p);

// The CUDA backend (attention_cuda.cu): f16 / bf16 only (attention.cpp refuses other dtypes
// before calling), any device `device_index` that passed require_supported_gpu.
void forward_cuda(const Problem& p, int device_index, Stream stream);
void backward_cuda(const BackwardProblem& p, int device_index, Stream stream);

// Scratch bytes of the CUDA forward (none) and backward: the float32 delta = rowsum(dout * out)
// (batch * seqlen_q * heads_q floats, seqlen_q the max length with varlen), plus in the
// non-deterministic mode the float32 dq accumulator (times head_dim), each rounded up to 256
// bytes. Pure functions of the sizes: they make no CUDA call.
std::size_t forward_workspace_cuda(std::int64_t batch, std::int64_t seqlen_q, std::int64_t heads_q,
                                   std::int64_t head_dim);
std::size_t backward_workspace_cuda(std::int64_t batch, std::int64_t seqlen_q, std::int64_t heads_q,
                                    std::int64_t head_dim, bool deterministic);

}  // namespace fusekit::attention
