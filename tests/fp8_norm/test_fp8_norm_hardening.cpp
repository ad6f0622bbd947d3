// FP8 RMSNorm's guards (CPU backend; the checks run before either backend): eps range, exact
// shapes of x against dy, and the workspace queries' argument ranges.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "fusekit/error.h"
#include "fusekit/fp8_norm.h"
#include "tests/harness/error_testing.h"

namespace fusekit {
namespace {

using testing::expect_error;

// Every tensor of a (2, 3, 16) problem with group size 16, on the CPU.
struct Fp8Problem {
  std::vector<std::uint8_t> x = std::vector<std::uint8_t>(96, 0x38), qy = std::vector<std::uint8_t>(96),
                            qy_t = std::vector<std::uint8_t>(96);
  std::vector<float> scales = std::vector<float>(6, 1.0f), weight = std::vector<float>(16, 1.0f),
                     y_scale = std::vector<float>(1), rstd = std::vector<float>(6), dweight = std::vector<float>(16);
  std::vector<std::uint16_t> dy = std::vector<std::uint16_t>(96, 0x3f80), dx = std::vector<std::uint16_t>(96);
  TensorView X(std::initializer_list<std::int64_t> s) { return TensorView(x.data(), DType::f8e4m3, Device::cpu(), s); }
  TensorView Scales(std::initializer_list<std::int64_t> s) { return TensorView(scales.data(), DType::f32, Device::cpu(), s); }
  TensorView W() { return TensorView(weight.data(), DType::f32, Device::cpu(), {16}); }
  TensorView F32(std::vector<float>& b, std::initializer_list<std::int64_t> s) {
    return TensorView(b.data(), DType::f32, Device::cpu(), s);
  }
  TensorView Bf16(std::vector<std::uint16_t>& b, std::initializer_list<std::int64_t> s) {
    return TensorView(b.data(), DType::bf16, Device::cpu(), s);
  }
  void forward(float eps) {
    fp8_rms_norm_forward(X({2, 3, 16}), Scales({2, 3, 1}), W(), eps,
                         TensorView(qy.data(), DType::f8e4m3, Device::cpu(), {2, 3, 16}),
                         TensorView(qy_t.data(), DType::f8e4m3, Device::cpu(), {16, 6}), F32(y_scale, {1}),
                         F32(rstd, {6}), std::nullopt, std::nullopt);
  }
};

TEST(Fp8NormHardening, EpsMustBePositiveAndFinite) {
  Fp8Problem p;
  for (float eps : {std::numeric_limits<float>::infinity(), std::nanf(""), 0.0f, -1.0f})
    expect_error([&] { p.forward(eps); }, ErrorKind::invalid_argument, "eps");
  p.forward(1e-5f);
  for (float r : p.rstd) EXPECT_TRUE(std::isfinite(r));
}

TEST(Fp8NormHardening, BackwardComparesXAndDyShapesExactly) {
  Fp8Problem p;
  p.forward(1e-5f);
  expect_error([&] {
    fp8_rms_norm_backward(p.Bf16(p.dy, {2, 3, 16}), p.X({3, 2, 16}), p.Scales({3, 2, 1}), p.W(), p.F32(p.rstd, {6}),
                          p.Bf16(p.dx, {2, 3, 16}), std::nullopt, std::nullopt);
  },
               ErrorKind::invalid_argument, "x", "expected shape (2, 3, 16) (as 'dy'), got (3, 2, 16)");
  expect_error([&] {
    fp8_rms_norm_backward(p.Bf16(p.dy, {2, 3, 16}), p.X({2, 3, 16}), p.Scales({2, 3, 1}), p.W(), p.F32(p.rstd, {6}),
                          p.Bf16(p.dx, {6, 16}), std::nullopt, std::nullopt);
  },
               ErrorKind::invalid_argument, "dx");
  fp8_rms_norm_backward(p.Bf16(p.dy, {2, 3, 16}), p.X({2, 3, 16}), p.Scales({2, 3, 1}), p.W(), p.F32(p.rstd, {6}),
                        p.Bf16(p.dx, {2, 3, 16}), p.F32(p.dweight, {16}), std::nullopt);
}

TEST(Fp8NormHardening, WorkspaceQueriesCheckTheirArguments) {
  EXPECT_EQ(fp8_rms_norm_forward_workspace_size(4096, 4096, Device::cpu()), 0u);
  EXPECT_EQ(fp8_rms_norm_backward_workspace_size(0, 0, Device::cpu()), 0u);
  using Query = std::size_t (*)(std::int64_t, std::int64_t, Device);
  for (Query query : {Query(&fp8_rms_norm_forward_workspace_size), Query(&fp8_rms_norm_backward_workspace_size)}) {
    for (Device device : {Device::cpu(), Device::cuda(0)}) {  // refused before any CUDA call
      expect_error([&] { query(-1, 64, device); }, ErrorKind::invalid_argument, "rows", "got -1");
      expect_error([&] { query(std::int64_t{1} << 31, 64, device); }, ErrorKind::invalid_argument, "rows");
      expect_error([&] { query(64, kFp8NormMaxCols + 1, device); }, ErrorKind::invalid_argument, "cols");
      expect_error([&] { query(64, -1, device); }, ErrorKind::invalid_argument, "cols");
    }
  }
}

}  // namespace
}  // namespace fusekit
