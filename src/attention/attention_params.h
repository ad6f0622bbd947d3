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
