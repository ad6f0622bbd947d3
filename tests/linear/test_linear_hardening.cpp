// The linear family's guards (CPU backend; the checks run before either backend): exact output
// shapes and the workspace queries' argument ranges.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fusekit/error.h"
#include "fusekit/linear.h"
#include "tests/harness/error_testing.h"

namespace fusekit {
namespace {

using testing::expect_error;
using testing::view;

TEST(LinearHardening, OutputsHaveExactlyTheLeadingShapeOfX) {
  std::vector<float> x(48, 0.5f), w(40, 0.25f), y(30), pre(30), dout(30, 1.0f), dx(48), dw(40);
  expect_error([&] { linear_forward(view(x, {2, 3, 8}), view(w, {5, 8}), std::nullopt, Activation::none,
                                    view(y, {3, 2, 5}), std::nullopt, std::nullopt); },
               ErrorKind::invalid_argument, "y", "expected shape (2, 3, 5)");
  expect_error([&] { linear_forward(view(x, {2, 3, 8}), view(w, {5, 8}), std::nullopt, Activation::relu,
                                    view(y, {2, 3, 5}), view(pre, {6, 5}), std::nullopt); },
               ErrorKind::invalid_argument, "pre_activation");
  linear_forward(view(x, {2, 3, 8}), view(w, {5, 8}), std::nullopt, Activation::relu, view(y, {2, 3, 5}),
                 view(pre, {2, 3, 5}), std::nullopt);
  expect_error([&] { linear_backward(view(dout, {3, 2, 5}), view(x, {2, 3, 8}), view(w, {5, 8}), view(pre, {2, 3, 5}),
                                     Activation::relu, view(dx, {2, 3, 8}), std::nullopt, std::nullopt, std::nullopt); },
               ErrorKind::invalid_argument, "dout");
  expect_error([&] { linear_backward(view(dout, {2, 3, 5}), view(x, {2, 3, 8}), view(w, {5, 8}), view(pre, {2, 3, 5}),
                                     Activation::relu, view(dx, {6, 8}), std::nullopt, std::nullopt, std::nullopt); },
               ErrorKind::invalid_argument, "dx", "expected shape (2, 3, 8)");
  linear_backward(view(dout, {2, 3, 5}), view(x, {2, 3, 8}), view(w, {5, 8}), view(pre, {2, 3, 5}), Activation::relu,
                  view(dx, {2, 3, 8}), view(dw, {5, 8}), std::nullopt, std::nullopt);
}

TEST(LinearHardening, WorkspaceQueriesCheckEveryArgument) {
  EXPECT_EQ(linear_forward_workspace_size(1024, 1024, 1024, DType::bf16, Activation::gelu_tanh, Device::cpu()), 0u);
  EXPECT_EQ(linear_backward_workspace_size(0, 0, 0, DType::f32, Activation::none, Device::cpu()), 0u);
  using Query = std::size_t (*)(std::int64_t, std::int64_t, std::int64_t, DType, Activation, Device);
  for (Query query : {Query(&linear_forward_workspace_size), Query(&linear_backward_workspace_size)}) {
    for (Device device : {Device::cpu(), Device::cuda(0)}) {  // refused before any CUDA call
      expect_error([&] { query(-1, 64, 64, DType::bf16, Activation::none, device); }, ErrorKind::invalid_argument,
                   "m", "got -1");
      expect_error([&] { query(64, std::int64_t{1} << 62, 64, DType::bf16, Activation::none, device); },
                   ErrorKind::invalid_argument, "n", "0..2147483647");
      expect_error([&] { query(64, 64, -7, DType::bf16, Activation::none, device); }, ErrorKind::invalid_argument,
                   "k");
      expect_error([&] { query(64, 64, 64, DType::u8, Activation::none, device); }, ErrorKind::invalid_argument,
                   "dtype");
      expect_error([&] { query(64, 64, 64, DType::bf16, Activation::leaky_relu, device); },
                   ErrorKind::invalid_argument, "activation");
      // Each extent within 2^31 - 1, but M x N too large for any scratch size to be formed.
      expect_error([&] { query(2147483647, 2147483647, 64, DType::bf16, Activation::gelu_tanh, device); },
                   ErrorKind::invalid_argument, "m", "2147483647 x 2147483648 x 16");
    }
  }
}

}  // namespace
}  // namespace fusekit
