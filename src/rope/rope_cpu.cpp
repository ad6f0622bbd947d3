// CPU reference for rotary embeddings: plain loops in float64, OpenMP over tokens. The angles are
// the float32 values the header defines (rope_math.h, as the kernels form them); cos, sin and the
// rotation are float64. It is the ground truth the CUDA kernels are tested against, and the CPU
// backend of the ops.
#include <cmath>
#include <limits>
#include <vector>

#include "core/convert.h"
#include "rope/rope_math.h"
#include "rope/rope_params.h"

namespace fusekit::rope {

using detail::load_as_double;
using detail::store_from_double;

namespace {

std::int64_t position_at(const Params& p, std::int64_t b, std::int64_t s) {
  if (!p.positions) return s;
  const std::int64_t i = b * p.pos_b_stride + s * p.pos_s_stride;
  return p.position_dtype == DType::i32 ? static_cast<const std::int32_t*>(p.positions)[i]
                                        : static_cast<const std::int64_t*>(p.positions)[i];
}

// m cos a_i and m sin a_i (the sine negated for the backward) of one token, i < r / 2.
void token_angles(const Params& p, std::int64_t position, std::vector<double>& cos_m, std::vector<double>& sin_m) {
  const std::int64_t half = p.rotary_dim / 2;
  const double m = p.attention_scaling, sign = p.transpose ? -1.0 : 1.0;
  for (std::int64_t i = 0; i < half; ++i) {
    double c, s;
    if (p.source == AngleSource::cos_sin) {
      if (position < 0 || position >= p.table_rows) {  // refused by the entry point's checks
        c = s = std::numeric_limits<double>::quiet_NaN();
      } else {
        c = p.cos_table[position * p.cos_row_stride + i];
        s = p.sin_table[position * p.sin_row_stride + i];
      }
    } else {
      const float inv_freq = p.source == AngleSource::theta ? p.inv_freq[i] : p.inv_freq_table[i];
      const double a = rotary_angle(position_as_float(position), inv_freq);
      c = std::cos(a);
      s = std::sin(a);
    }
    cos_m[i] = m * c;
    sin_m[i] = sign * m * s;
  }
}

// One head: the whole head read first, so that in place is safe.
void rotate_head(const Params& p, const void* in, std::int64_t in_offset, void* out, std::int64_t out_offset,
                 bool in_place, const std::vector<double>& cos_m, const std::vector<double>& sin_m,
                 std::vector<double>& x) {
  const std::int64_t d = p.head_dim, r = p.rotary_dim, half = r / 2;
  for (std::int64_t j = 0; j < d; ++j) x[j] = load_as_double(in, p.dtype, in_offset + j);
  for (std::int64_t i = 0; i < half; ++i) {
    const std::int64_t first = p.style == RopeStyle::rotate_half ? i : 2 * i;
    const std::int64_t second = p.style == RopeStyle::rotate_half ? i + half : 2 * i + 1;
    const double u = x[first], v = x[second];
    store_from_double(out, p.dtype, out_offset + first, u * cos_m[i] - v * sin_m[i]);
    store_from_double(out, p.dtype, out_offset + second, v * cos_m[i] + u * sin_m[i]);
  }
  if (!in_place)
    for (std::int64_t j = r; j < d; ++j) store_from_double(out, p.dtype, out_offset + j, x[j]);
}

}  // namespace

void rotate_cpu(const Params& p) {
  const std::int64_t tokens = p.tokens();
  // Threads only where there is work for them: a parallel region costs more than a small call.
  const bool parallel = tokens * (p.heads_q + p.heads_k) * p.head_dim >= (std::int64_t{1} << 16);
#pragma omp parallel if (parallel)
  {
    std::vector<double> cos_m(p.rotary_dim / 2), sin_m(p.rotary_dim / 2), x(p.head_dim);
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int64_t b = t / p.seqlen, s = t % p.seqlen;
      token_angles(p, position_at(p, b, s), cos_m, sin_m);
      for (std::int64_t h = 0; h < p.heads_q; ++h)
        rotate_head(p, p.q_in.data, b * p.q_in.b_stride + s * p.q_in.s_stride + h * p.q_in.h_stride, p.q_out.data,
                    b * p.q_out.b_stride + s * p.q_out.s_stride + h * p.q_out.h_stride, p.q_in_place, cos_m, sin_m, x);
      for (std::int64_t h = 0; h < p.heads_k; ++h)
        rotate_head(p, p.k_in.data, b * p.k_in.b_stride + s * p.k_in.s_stride + h * p.k_in.h_stride, p.k_out.data,
                    b * p.k_out.b_stride + s * p.k_out.s_stride + h * p.k_out.h_stride, p.k_in_place, cos_m, sin_m, x);
    }
  }
}

}  // namespace fusekit::rope
