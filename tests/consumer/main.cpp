// One CPU op through the installed (or add_subdirectory'd) library: RMSNorm of a small float32
// matrix against the formula, computed here in double.
#include <fusekit/fusekit.h>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  using namespace fusekit;
  const std::int64_t rows = 3, n = 8;
  std::vector<float> x(rows * n), w(n), y(rows * n, NAN), rstd(rows, NAN);
  for (std::int64_t i = 0; i < rows * n; ++i) x[i] = std::sin(0.7 * double(i)) + 0.1 * double(i % 5);
  for (std::int64_t j = 0; j < n; ++j) w[j] = 0.5f + 0.125f * float(j);
  const Device cpu = Device::cpu();
  TensorView xv(x.data(), DType::f32, cpu, {rows, n}), wv(w.data(), DType::f32, cpu, {n});
  TensorView yv(y.data(), DType::f32, cpu, {rows, n}), rv(rstd.data(), DType::f32, cpu, {rows});
  rms_norm_forward(xv, wv, 1e-6f, yv, rv, nullptr);
  double worst = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (std::int64_t j = 0; j < n; ++j) ss += double(x[r * n + j]) * x[r * n + j];
    const double inv = 1.0 / std::sqrt(ss / n + 1e-6);
    for (std::int64_t j = 0; j < n; ++j)
      worst = std::fmax(worst, std::fabs(y[r * n + j] - x[r * n + j] * inv * w[j]));
  }
  std::printf("fusekit %s: rms_norm_forward on the CPU, max error %.3g\n", version(), worst);
  return worst < 1e-5 ? 0 : 1;
}
