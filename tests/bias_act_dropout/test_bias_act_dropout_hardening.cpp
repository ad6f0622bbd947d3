// The bias + activation + dropout family's guards (CPU backend; the checks run before either
// backend): exact output shapes, outputs that overlap themselves, and the workspace query's
// argument ranges.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fusekit/bias_act_dropout.h"
#include "fusekit/error.h"
#include "tests/harness/error_testing.h"

namespace fusekit {
namespace {

using testing::expect_error;
using testing::view;

TEST(BiasActDropoutHardening, OutputsHaveExactlyTheInputShape) {
  std::vector<float> x(48, 0.5f), y(48), h(48), dy(48, 1.0f), dx(48);
  const BiasActDropoutConfig cfg;
  expect_error([&] { bias_act_dropout_forward(view(x, {2, 3, 8}), std::nullopt, cfg, view(y, {3, 2, 8})); },
               ErrorKind::invalid_argument, "y", "expected shape (2, 3, 8) (as 'x'), got (3, 2, 8)");
  expect_error([&] {
    bias_act_dropout_forward(view(x, {2, 3, 8}), std::nullopt, cfg, view(y, {2, 3, 8}), view(h, {6, 8}));
  },
               ErrorKind::invalid_argument, "pre_activation");
  expect_error([&] {
    bias_act_dropout_backward(view(dy, {2, 3, 8}), view(x, {2, 3, 8}), std::nullopt, cfg, view(dx, {3, 2, 8}),
                              std::nullopt);
  },
               ErrorKind::invalid_argument, "dx");
  bias_act_dropout_forward(view(x, {2, 3, 8}), std::nullopt, cfg, view(y, {2, 3, 8}), view(h, {2, 3, 8}));
}

TEST(BiasActDropoutHardening, DbiasThatOverlapsItselfIsRefused) {
  std::vector<float> x(48, 0.5f), dy(48, 1.0f), db(8);
  const TensorView expanded(db.data(), DType::f32, Device::cpu(), {8}, {0});
  expect_error([&] {
    bias_act_dropout_backward(view(dy, {6, 8}), view(x, {6, 8}), std::nullopt, {}, std::nullopt, expanded);
  },
               ErrorKind::invalid_argument, "dbias");
}

TEST(BiasActDropoutHardening, WorkspaceQueryChecksItsArguments) {
  EXPECT_EQ(bias_act_dropout_backward_workspace_size(4096, 4096, DType::bf16, Device::cpu()), 0u);
  for (Device device : {Device::cpu(), Device::cuda(0)}) {  // refused before any CUDA call
    expect_error([&] { bias_act_dropout_backward_workspace_size(-1, 64, DType::bf16, device); },
                 ErrorKind::invalid_argument, "rows", "got -1");
    expect_error([&] { bias_act_dropout_backward_workspace_size(64, std::int64_t{1} << 40, DType::bf16, device); },
                 ErrorKind::invalid_argument, "cols");
    expect_error([&] { bias_act_dropout_backward_workspace_size(64, 64, DType::f64, device); },
                 ErrorKind::invalid_argument, "dtype");
  }
}

}  // namespace
}  // namespace fusekit
