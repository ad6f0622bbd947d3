// The norm family's guards (CPU backend; the checks run before either backend): eps range, exact
// output shapes, a zero weight element in the *_from_output backwards, and the workspace query's
// argument ranges.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "fusekit/error.h"
#include "fusekit/norm.h"
#include "tests/harness/error_testing.h"

namespace fusekit {
namespace {

using testing::expect_error;
using testing::view;
using testing::ramp;

TEST(NormHardening, EpsMustBeFiniteAndNonNegative) {
  std::vector<float> x = ramp(48), y(48), rstd(6);
  for (float eps : {std::numeric_limits<float>::infinity(), std::nanf(""), -1e-6f}) {
    expect_error([&] { rms_norm_forward(view(x, {6, 8}), std::nullopt, eps, view(y, {6, 8}), view(rstd, {6})); },
                 ErrorKind::invalid_argument, "eps");
    expect_error([&] {
      layer_norm_forward(view(x, {6, 8}), std::nullopt, std::nullopt, eps, view(y, {6, 8}), std::nullopt, std::nullopt);
    },
                 ErrorKind::invalid_argument, "eps");
  }
  // The largest float32 is accepted: every y is then ~0, as the formula says.
  rms_norm_forward(view(x, {6, 8}), std::nullopt, std::numeric_limits<float>::max(), view(y, {6, 8}), view(rstd, {6}));
  for (float v : y) EXPECT_TRUE(std::isfinite(v));
}

TEST(NormHardening, OutputsHaveExactlyTheInputShape) {
  std::vector<float> x = ramp(48), y(48), rstd(6), dy = ramp(48, -0.2f), dx(48);
  expect_error([&] { rms_norm_forward(view(x, {2, 3, 8}), std::nullopt, 1e-5f, view(y, {3, 2, 8}), view(rstd, {6})); },
               ErrorKind::invalid_argument, "y", "expected shape (2, 3, 8) (as 'x'), got (3, 2, 8)");
  expect_error([&] { rms_norm_forward(view(x, {2, 3, 8}), std::nullopt, 1e-5f, view(y, {6, 8}), view(rstd, {6})); },
               ErrorKind::invalid_argument, "y");
  rms_norm_forward(view(x, {2, 3, 8}), std::nullopt, 1e-5f, view(y, {2, 3, 8}), view(rstd, {2, 3}));
  expect_error([&] {
    rms_norm_backward(view(dy, {2, 3, 8}), view(x, {3, 2, 8}), std::nullopt, view(rstd, {6}), view(dx, {2, 3, 8}),
                      std::nullopt, std::nullopt);
  },
               ErrorKind::invalid_argument, "x");
  expect_error([&] {
    rms_norm_backward(view(dy, {2, 3, 8}), view(x, {2, 3, 8}), std::nullopt, view(rstd, {6}), view(dx, {6, 8}),
                      std::nullopt, std::nullopt);
  },
               ErrorKind::invalid_argument, "dx");
}

TEST(NormHardening, BackwardFromOutputRefusesAZeroWeightOnTheCpu) {
  std::vector<float> x = ramp(48), y(48), rstd(6), mean(6), dy = ramp(48, -0.2f), dx(48), dw(8), db(8);
  std::vector<float> w = ramp(8, 0.5f), b = ramp(8, 0.0f);
  w[5] = 0.0f;
  rms_norm_forward(view(x, {6, 8}), view(w, {8}), 1e-5f, view(y, {6, 8}), view(rstd, {6}));
  expect_error([&] {
    rms_norm_backward_from_output(view(dy, {6, 8}), view(y, {6, 8}), view(w, {8}), view(rstd, {6}), view(dx, {6, 8}),
                                  view(dw, {8}), std::nullopt);
  },
               ErrorKind::invalid_argument, "weight", "weight[5] = 0");
  layer_norm_forward(view(x, {6, 8}), view(w, {8}), view(b, {8}), 1e-5f, view(y, {6, 8}), view(mean, {6}),
                     view(rstd, {6}));
  expect_error([&] {
    layer_norm_backward_from_output(view(dy, {6, 8}), view(y, {6, 8}), view(w, {8}), view(b, {8}), view(rstd, {6}),
                                    view(dx, {6, 8}), view(dw, {8}), view(db, {8}), std::nullopt);
  },
               ErrorKind::invalid_argument, "weight", "weight[5] = 0");
  // The backward from x divides by nothing: a zero weight is fine there.
  layer_norm_backward(view(dy, {6, 8}), view(x, {6, 8}), view(w, {8}), view(mean, {6}), view(rstd, {6}),
                      view(dx, {6, 8}), view(dw, {8}), view(db, {8}), std::nullopt);
  for (float v : dx) EXPECT_TRUE(std::isfinite(v));
}

TEST(NormHardening, WorkspaceQueryChecksItsArguments) {
  EXPECT_EQ(norm_backward_workspace_size(1024, 1024, DType::bf16, Device::cpu()), 0u);
  EXPECT_EQ(norm_backward_workspace_size(0, 0, DType::f32, Device::cpu()), 0u);
  for (Device device : {Device::cpu(), Device::cuda(0)}) {  // refused before any CUDA call
    expect_error([&] { norm_backward_workspace_size(-1, 1024, DType::bf16, device); }, ErrorKind::invalid_argument,
                 "rows", "got -1");
    expect_error([&] { norm_backward_workspace_size(std::int64_t{1} << 40, 1024, DType::bf16, device); },
                 ErrorKind::invalid_argument, "rows");
    expect_error([&] { norm_backward_workspace_size(16, -5, DType::bf16, device); }, ErrorKind::invalid_argument,
                 "cols");
    expect_error([&] { norm_backward_workspace_size(16, kNormMaxCols + 1, DType::bf16, device); },
                 ErrorKind::invalid_argument, "cols", "0..65536");
    expect_error([&] { norm_backward_workspace_size(16, 64, DType::f8e4m3, device); }, ErrorKind::invalid_argument,
                 "dtype", "got f8e4m3");
  }
}

}  // namespace
}  // namespace fusekit
