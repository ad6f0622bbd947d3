// CPU reference for the linear family: float64 arithmetic throughout (the inputs are converted to
// double once, every sum accumulates in double, the activation and its derivative are evaluated in
// double), OpenMP over independent rows. Outputs are rounded once to the tensors' dtype. It is the
// ground truth the CUDA paths are tested against, and the CPU backend of the ops.
#include <algorithm>
#include <vector>

#include "core/activation.h"
#include "core/convert.h"
#include "linear/linear_params.h"

namespace fusekit::linear {

using detail::load_as_double;
using detail::store_from_double;
using Math = detail::ActivationMath<double>;

namespace {

// Element (r, c) of a (rows, cols) matrix with leading dimension ld: row-major, or column-major
// (W and dW may be either, linear_params.h).
std::int64_t offset(std::int64_t r, std::int64_t c, std::int64_t ld, bool col_major) {
  return col_major ? r + c * ld : r * ld + c;
}

// A (rows, cols) matrix as a dense row-major double array.
std::vector<double> to_double(const void* data, DType dtype, std::int64_t rows, std::int64_t cols,
                              std::int64_t ld, bool col_major = false) {
  std::vector<double> out(static_cast<std::size_t>(rows * cols));
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = load_as_double(data, dtype, offset(r, c, ld, col_major));
  return out;
}

}  // namespace

void forward_cpu(const ForwardParams& p) {
  const std::int64_t m = p.m, n = p.n, k = p.k;
  const std::vector<double> x = to_double(p.x, p.dtype, m, k, p.ldx);
  const std::vector<double> w = to_double(p.w, p.dtype, n, k, p.ldw, p.w_col_major);
  const std::vector<double> b = p.bias ? to_double(p.bias, p.dtype, 1, n, n) : std::vector<double>(n, 0.0);
#pragma omp parallel for schedule(dynamic, 4)
  for (std::int64_t r = 0; r < m; ++r) {
    const double* xr = x.data() + r * k;
    for (std::int64_t c = 0; c < n; ++c) {
      const double* wc = w.data() + c * k;
      double z = 0.0;
      for (std::int64_t i = 0; i < k; ++i) z += xr[i] * wc[i];
      z += b[c];
      if (p.pre) store_from_double(p.pre, p.dtype, r * p.ldpre + c, z);
      store_from_double(p.y, p.dtype, r * p.ldy + c, Math::forward(p.activation, z, 0.0));
    }
  }
}

namespace {

// dx, dW and dbias of p from dz (m x n, dense, double); p's dout, pre and activation are not read.
void backward_from_dz(const BackwardParams& p, const std::vector<double>& dz) {
  const std::int64_t m = p.m, n = p.n, k = p.k;
  const std::vector<double> x = (p.dw && k > 0) ? to_double(p.x, p.dtype, m, k, p.ldx) : std::vector<double>();
  const std::vector<double> w =
      (p.dx && k > 0) ? to_double(p.w, p.dtype, n, k, p.ldw, p.w_col_major) : std::vector<double>();

  if (p.dx) {  // dx[r, :] = sum_c dz[r, c] * w[c, :], times x_activation'(x_pre[r, :]) when asked
    const bool through = p.through_input_activation;
    const std::vector<double> x_pre = through ? to_double(p.x_pre, p.dtype, m, k, p.ldx_pre) : std::vector<double>();
    std::vector<double> dx(through && p.dx_sum ? static_cast<std::size_t>(m * k) : 0);
#pragma omp parallel for schedule(dynamic, 4)
    for (std::int64_t r = 0; r < m; ++r) {
      std::vector<double> acc(static_cast<std::size_t>(k), 0.0);
      for (std::int64_t c = 0; c < n; ++c) {
        const double g = dz[r * n + c];
        const double* wc = w.data() + c * k;
        for (std::int64_t i = 0; i < k; ++i) acc[i] += g * wc[i];
      }
      if (through)
        for (std::int64_t i = 0; i < k; ++i) acc[i] *= Math::derivative(p.x_activation, x_pre[r * k + i], 0.0);
      if (!dx.empty()) std::copy(acc.begin(), acc.end(), dx.begin() + r * k);
      for (std::int64_t i = 0; i < k; ++i) store_from_double(p.dx, p.dtype, r * p.lddx + i, acc[i]);
    }
    if (through && p.dx_sum) {  // dx_sum[i] = sum_r dx[r, i] (0 without rows)
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < k; ++i) {
        double s = 0.0;
        for (std::int64_t r = 0; r < m; ++r) s += dx[r * k + i];
        store_from_double(p.dx_sum, p.dtype, i, s);
      }
    }
  }
  if (p.dw || p.dbias) {  // dw[c, :] = sum_r dz[r, c] * x[r, :];  dbias[c] = sum_r dz[r, c]
#pragma omp parallel for schedule(dynamic, 4)
    for (std::int64_t c = 0; c < n; ++c) {
      std::vector<double> acc(p.dw ? static_cast<std::size_t>(k) : 0, 0.0);
      double db = 0.0;
      for (std::int64_t r = 0; r < m; ++r) {
        const double g = dz[r * n + c];
        db += g;
        if (p.dw) {
          const double* xr = x.data() + r * k;
          for (std::int64_t i = 0; i < k; ++i) acc[i] += g * xr[i];
        }
      }
      if (p.dw)
        for (std::int64_t i = 0; i < k; ++i)
          store_from_double(p.dw, p.dtype, offset(c, i, p.lddw, p.dw_col_major), acc[i]);
      if (p.dbias) store_from_double(p.dbias, p.dtype, c, db);
    }
  }
}

}  // namespace

namespace {

// A gated backward's dz (dpre): [dy * up * act'(gate), dy * act(gate)] in pre's layout, in double.
std::vector<double> gated_dz(const BackwardParams& p) {
  const std::int64_t m = p.m, n = p.n, f = p.n / 2;
  const std::vector<double> dy = to_double(p.dout, p.dtype, m, f, p.lddout);
  const std::vector<double> pre = to_double(p.pre, p.dtype, m, n, p.ldpre);
  std::vector<double> dz(static_cast<std::size_t>(m * n));
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < m; ++r)
    for (std::int64_t j = 0; j < f; ++j) {
      const std::int64_t gc = r * n + gate_column(p.gated_layout, j), uc = r * n + up_column(p.gated_layout, f, j);
      const double g = dy[r * f + j];
      dz[gc] = g * pre[uc] * Math::derivative(p.activation, pre[gc], 0.0);
      dz[uc] = g * Math::forward(p.activation, pre[gc], 0.0);
    }
  return dz;
}

}  // namespace

void backward_cpu(const BackwardParams& p) {
  if (p.gated) {
    backward_from_dz(p, gated_dz(p));
    return;
  }
  // dz = dout * act'(pre), exact in double (no rounding to the dtype in between).
  std::vector<double> dz = to_double(p.dout, p.dtype, p.m, p.n, p.lddout);
  if (p.activation != Activation::none) {
    const std::vector<double> pre = to_double(p.pre, p.dtype, p.m, p.n, p.ldpre);
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < p.m * p.n; ++i) dz[i] *= Math::derivative(p.activation, pre[i], 0.0);
  }
  backward_from_dz(p, dz);
}

// The gated forward: pre = x W^T + b in double over all 2f columns, y = act(gate) * up in double,
// each output rounded once (its backward is backward_cpu with p.gated).
void gated_forward_cpu(const GatedForwardParams& p) {
  const std::int64_t m = p.m, f = p.f, n = 2 * p.f, k = p.k;
  const std::vector<double> x = to_double(p.x, p.dtype, m, k, p.ldx);
  const std::vector<double> w = to_double(p.w, p.dtype, n, k, p.ldw, p.w_col_major);
  const std::vector<double> b = p.bias ? to_double(p.bias, p.dtype, 1, n, n) : std::vector<double>(n, 0.0);
#pragma omp parallel for schedule(dynamic, 4)
  for (std::int64_t r = 0; r < m; ++r) {
    const double* xr = x.data() + r * k;
    std::vector<double> z(static_cast<std::size_t>(n));
    for (std::int64_t c = 0; c < n; ++c) {
      const double* wc = w.data() + c * k;
      double acc = 0.0;
      for (std::int64_t i = 0; i < k; ++i) acc += xr[i] * wc[i];
      z[c] = acc + b[c];
      if (p.pre) store_from_double(p.pre, p.dtype, r * p.ldpre + c, z[c]);
    }
    for (std::int64_t j = 0; j < f; ++j) {
      const double gate = z[gate_column(p.layout, j)], up = z[up_column(p.layout, f, j)];
      store_from_double(p.y, p.dtype, r * p.ldy + j, Math::forward(p.activation, gate, 0.0) * up);
    }
  }
}

}  // namespace fusekit::linear
