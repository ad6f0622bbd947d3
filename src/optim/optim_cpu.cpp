// CPU reference for the optimizer family: float64 math over the float32 state, OpenMP over fixed
// chunks (the norm's chunk sums are added in chunk order, so the result does not depend on the
// thread count). It is the ground truth the CUDA kernels are tested against, and the CPU backend.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/convert.h"
#include "optim/optim_params.h"

namespace fusekit::optim {

using detail::load_as_double;
using detail::store_from_double;

namespace {

constexpr std::int64_t kCpuChunk = 1 << 16;

struct Piece {
  std::size_t tensor;
  std::int64_t begin, end;
};

// Every tensor cut into kCpuChunk pieces, in list order.
template <typename Tensor>
std::vector<Piece> pieces_of(const std::vector<Tensor>& tensors) {
  std::vector<Piece> pieces;
  for (std::size_t t = 0; t < tensors.size(); ++t)
    for (std::int64_t b = 0; b < tensors[t].numel; b += kCpuChunk)
      pieces.push_back({t, b, std::min(tensors[t].numel, b + kCpuChunk)});
  return pieces;
}

}  // namespace

void global_norm_cpu(const NormParams& p) {
  const std::vector<Piece> pieces = pieces_of(p.tensors);
  std::vector<double> sums(pieces.size(), 0.0);
  const auto count = static_cast<std::int64_t>(pieces.size());
#pragma omp parallel for schedule(static)
  for (std::int64_t k = 0; k < count; ++k) {
    const Piece& piece = pieces[static_cast<std::size_t>(k)];
    const NormTensor& t = p.tensors[piece.tensor];
    double sum = 0.0;
    for (std::int64_t i = piece.begin; i < piece.end; ++i) {
      const double x = load_as_double(t.data, t.dtype, i);
      sum += x * x;
    }
    sums[static_cast<std::size_t>(k)] = sum;
  }
  double total = 0.0;
  for (double s : sums) total += s;
  *p.norm = static_cast<float>(std::sqrt(total));
}

void adamw_step_cpu(const AdamWParams& p) {
  const AdamWScalars& s = p.s;
  double scale = 1.0;
  if (p.grad_norm) {
    // PyTorch's clip_grad_norm_: min(1, max / (norm + 1e-6)), a NaN norm giving a NaN scale.
    const double coef = s.max_grad_norm / (static_cast<double>(*p.grad_norm) + 1e-6);
    scale = coef >= 1.0 ? 1.0 : coef;
  }
  const double decay = 1.0 - s.lr * s.weight_decay;
  const double step_size = s.lr / s.bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(s.bias_correction2);
  const std::vector<Piece> pieces = pieces_of(p.tensors);
  const auto count = static_cast<std::int64_t>(pieces.size());
#pragma omp parallel for schedule(static)
  for (std::int64_t k = 0; k < count; ++k) {
    const Piece& piece = pieces[static_cast<std::size_t>(k)];
    const AdamWTensor& t = p.tensors[piece.tensor];
    for (std::int64_t i = piece.begin; i < piece.end; ++i) {
      const double g = load_as_double(t.grad, t.grad_dtype, i) * scale;
      const double m = s.beta1 * t.exp_avg[i] + (1.0 - s.beta1) * g;
      const double v = s.beta2 * t.exp_avg_sq[i] + (1.0 - s.beta2) * g * g;
      double param = t.param[i] * decay;
      param -= step_size * m / (std::sqrt(v) / bias_correction2_sqrt + s.eps);
      t.exp_avg[i] = static_cast<float>(m);
      t.exp_avg_sq[i] = static_cast<float>(v);
      t.param[i] = static_cast<float>(param);
      if (t.copy) store_from_double(t.copy, t.copy_dtype, i, param);
    }
  }
}

}  // namespace fusekit::optim
