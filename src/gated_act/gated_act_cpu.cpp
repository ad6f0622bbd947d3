// CPU reference for the gated activations: plain loops in float64, OpenMP over rows, act and act'
// from the same ActivationMath definitions the kernels use (in double). It is the ground truth the
// CUDA kernels are tested against, and the CPU backend of the ops.
#include <cstdint>

#include "core/activation.h"
#include "core/convert.h"
#include "gated_act/gated_act_params.h"

namespace fusekit::gated_act {

using detail::load_as_double;
using detail::store_from_double;
using Math = detail::ActivationMath<double>;

namespace {

// Element offsets of gate and up (or of their gradients) at row r, column c.
struct Offsets {
  std::int64_t gate, up;
};

template <typename Ptr>
Offsets where(const GateUp<Ptr>& t, bool interleaved, std::int64_t r, std::int64_t c) {
  if (interleaved) {
    const std::int64_t at = r * t.gate_row_stride + 2 * c;
    return {at, at + 1};
  }
  return {r * t.gate_row_stride + c, r * t.up_row_stride + c};
}

// The pointer up's offset applies to: the interleaved tensor holds both at `gate`.
template <typename Ptr>
Ptr up_base(const GateUp<Ptr>& t, bool interleaved) {
  return interleaved ? t.gate : t.up;
}

}  // namespace

void forward_cpu(const ForwardParams& p) {
  const void* up = up_base(p.in, p.interleaved);
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < p.rows; ++r) {
    for (std::int64_t c = 0; c < p.cols; ++c) {
      const auto at = where(p.in, p.interleaved, r, c);
      const double g = load_as_double(p.in.gate, p.dtype, at.gate);
      const double u = load_as_double(up, p.dtype, at.up);
      store_from_double(p.y, p.dtype, r * p.y_row_stride + c, Math::forward(p.activation, g, 0.0) * u);
    }
  }
}

// Every element's inputs are read before its gradients are written: a gradient may be exactly its
// input's view (in-place backward).
void backward_cpu(const BackwardParams& p) {
  const void* up = up_base(p.in, p.interleaved);
  void* dup = up_base(p.grad, p.interleaved);
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < p.rows; ++r) {
    for (std::int64_t c = 0; c < p.cols; ++c) {
      const auto at = where(p.in, p.interleaved, r, c);
      const double g = load_as_double(p.in.gate, p.dtype, at.gate);
      const double u = load_as_double(up, p.dtype, at.up);
      const double dy = load_as_double(p.dy, p.dtype, r * p.dy_row_stride + c);
      const double dgate = dy * u * Math::derivative(p.activation, g, 0.0);
      const double dup_value = dy * Math::forward(p.activation, g, 0.0);
      const auto out = where(p.grad, p.interleaved, r, c);
      if (p.grad.gate) store_from_double(p.grad.gate, p.dtype, out.gate, dgate);
      if (dup) store_from_double(dup, p.dtype, out.up, dup_value);
    }
  }
}

}  // namespace fusekit::gated_act
