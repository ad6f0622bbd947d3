// The validated, backend-neutral description of one rotary-embedding call. The public entry points
// (rope.cpp) check the arguments and fill these; each backend reads them. Forward and backward
// share them: the backward is the forward with the angles negated.
#pragma once

#include <cstdint>

#include "fusekit/rope.h"
#include "fusekit/tensor.h"

namespace fusekit::rope {

// One of q, k, q_out, k_out as a (batch, sequence, heads, head_dim) view; strides in elements
// (a packed (T, H, D) tensor has batch 1 and b_stride 0).
struct Operand {
  void* data = nullptr;
  std::int64_t b_stride = 0, s_stride = 0, h_stride = 0;
};

enum class AngleSource : std::uint8_t {
  theta,     // inv_freq computed from theta and linear_scaling (Params::inv_freq)
  inv_freq,  // the caller's float32 table (Params::inv_freq_table)
  cos_sin,   // the caller's float32 cos / sin tables, read at row p
};

struct Params {
  DType dtype = DType::f32;
  RopeStyle style = RopeStyle::rotate_half;
  std::int64_t batch = 0, seqlen = 0;  // tokens = batch * seqlen
  std::int64_t heads_q = 0, heads_k = 0;
  std::int64_t head_dim = 0, rotary_dim = 0;
  Operand q_in, q_out, k_in, k_out;  // k's are unused when heads_k = 0
  // The output is the input itself: the passed-through dims are not copied.
  bool q_in_place = false, k_in_place = false;
  // The backward: rotate by -a (sin negated).
  bool transpose = false;
  float attention_scaling = 1.0f;

  // Positions: null for the sequence index; else int32 or int64 at b * pos_b_stride + s *
  // pos_s_stride (pos_b_stride 0 for (1, S) ids and for packed tensors).
  const void* positions = nullptr;
  DType position_dtype = DType::i64;
  std::int64_t pos_b_stride = 0, pos_s_stride = 0;

  AngleSource source = AngleSource::theta;
  // theta: fl32(theta^(-2i / r) / linear_scaling) for i < r / 2, computed by the entry point.
  float inv_freq[kRopeMaxHeadDim / 2] = {};
  const float* inv_freq_table = nullptr;      // inv_freq: r / 2 values, contiguous
  const float* cos_table = nullptr;           // cos_sin: (table_rows, r / 2)
  const float* sin_table = nullptr;
  std::int64_t cos_row_stride = 0, sin_row_stride = 0;
  std::int64_t table_rows = 0;                // P

  std::int64_t tokens() const { return batch * seqlen; }
};

void rotate_cpu(const Params& p);
void rotate_cuda(const Params& p, int device_index, Stream stream);

}  // namespace fusekit::rope
