#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "fusekit/error.h"
#include "fusekit/norm.h"
#include "fusekit/runtime.h"
#include "fusekit/tensor.h"
#include "tests/harness/error_testing.h"

namespace fusekit {
namespace {

TEST(TensorView, ContiguousStridesAndSizes) {
  float buf[24];
  TensorView t(buf, DType::f32, Device::cpu(), {2, 3, 4});
  EXPECT_EQ(t.ndim, 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_EQ(t.stride(-1), 1);
  EXPECT_EQ(t.size(-2), 3);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.shape_string(), "(2, 3, 4)");
}

TEST(TensorView, StridedViewIsNotContiguous) {
  float buf[64];
  TensorView t(buf, DType::f32, Device::cpu(), {4, 8}, {16, 1});
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.strides_string(), "(16, 1)");
}

TEST(TensorView, RejectsBadConstruction) {
  float buf[4];
  EXPECT_THROW(TensorView(buf, DType::f32, Device::cpu(), {2, 2}, {1}), Error);
  const std::int64_t shape[] = {1, 2, 3, 4, 5, 6, 7};
  EXPECT_THROW(TensorView::from_arrays(buf, DType::f32, Device::cpu(), 7, shape, nullptr), Error);
  const std::int64_t negative[] = {-1};
  EXPECT_THROW(TensorView::from_arrays(buf, DType::f32, Device::cpu(), 1, negative, nullptr), Error);
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f8e4m3), 1u);
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_STREQ(dtype_name(DType::f8e5m2), "f8e5m2");
}

TEST(Error, MessageNamesOpArgumentExpectedAndGot) {
  const Error e(ErrorKind::invalid_argument, "some_op", "weight", "shape (8)", "(7)");
  EXPECT_STREQ(e.what(), "fusekit.some_op: argument 'weight': expected shape (8), got (7)");
  EXPECT_EQ(e.argument(), "weight");
  EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
}

TEST(Runtime, DeviceQueriesDoNotThrowWithoutGpu) {
  const int n = cuda_device_count();
  EXPECT_GE(n, 0);
  EXPECT_STRNE(built_cuda_architectures(), "unknown");
  if (n == 0) {
    // An op aimed at a GPU that does not exist names the device in its error.
    EXPECT_THROW(require_supported_gpu("test", 0), Error);
  }
  EXPECT_FALSE(cuda_device_supported(-1));
  EXPECT_FALSE(cuda_device_supported(n));
  EXPECT_STRNE(version(), "unknown");
}

TEST(Runtime, AMissingDeviceIsNamedWithTheDevicesPresent) {
  // The first index past the devices present (0 without a GPU): an error about 'device' that says
  // what is there, also from a workspace-size query, before any CUDA call fails on the device.
  const int n = cuda_device_count();
  const std::string says = n == 0 ? "it has none: no GPU or no CUDA driver" : "below " + std::to_string(n);
  testing::expect_error([&] { require_supported_gpu("test", n); }, ErrorKind::invalid_argument, "device", says);
  testing::expect_error([&] { norm_backward_workspace_size(4, 8, DType::f32, Device::cuda(n)); },
                        ErrorKind::invalid_argument, "device", says);
}

TEST(Runtime, KernelsExistForHopperOnly) {
  EXPECT_TRUE(supports_compute_capability(9, 0));
  for (const auto& [major, minor] : {std::pair{8, 0}, {8, 6}, {8, 9}, {9, 1}, {10, 0}, {12, 0}, {7, 5}})
    EXPECT_FALSE(supports_compute_capability(major, minor)) << major << "." << minor;
}

}  // namespace
}  // namespace fusekit
