// The argument-check layer's guards against sizes that wrap and outputs that overlap themselves:
// core/checked_math.h, TensorView construction and ArgCheck (well_formed, no_overlap, rows_as,
// eps, size_in, dtype_arg_in).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "core/checked_math.h"
#include "core/validate.h"
#include "fusekit/error.h"
#include "fusekit/tensor.h"
#include "tests/harness/error_testing.h"

namespace fusekit {
namespace {

using testing::expect_error;

using detail::arg;
using detail::ArgCheck;

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

// Runs f, which must throw Error of `kind` about `argument` whose message contains `text`.
TEST(CheckedMath, ProductsAndSumsThatWrapAreNone) {
  EXPECT_EQ(detail::checked_mul(3, 4), 12);
  EXPECT_FALSE(detail::checked_mul(std::int64_t{1} << 32, std::int64_t{1} << 31).has_value());
  EXPECT_EQ(detail::checked_mul(std::int64_t{1} << 31, std::int64_t{1} << 31), std::int64_t{1} << 62);
  EXPECT_FALSE(detail::checked_mul(-1, 2).has_value());
  EXPECT_EQ(detail::checked_add(kMax - 1, 1), kMax);
  EXPECT_FALSE(detail::checked_add(kMax, 1).has_value());
  EXPECT_EQ(detail::checked_product({2, 3, 4}), 24);
  EXPECT_EQ(detail::checked_product({std::int64_t{1} << 40, 0, std::int64_t{1} << 40}), 0);
  EXPECT_FALSE(detail::checked_product({std::int64_t{1} << 40, std::int64_t{1} << 40}).has_value());
  EXPECT_EQ(detail::size_product("op", "x", "x's bytes", {1024, 1024, 4}), 4194304);
  expect_error([] { detail::size_product("op", "x", "x's bytes", {std::int64_t{1} << 40, 1 << 20, 1 << 10}); },
               ErrorKind::invalid_argument, "x", "1099511627776 x 1048576 x 1024");
}

TEST(TensorViewHardening, RefusesViewsWhoseSizeWraps) {
  float buf[4];
  const std::int64_t huge[] = {std::int64_t{1} << 40, std::int64_t{1} << 40};
  EXPECT_THROW(TensorView::from_arrays(buf, DType::f32, Device::cpu(), 2, huge, nullptr), Error);
  // 2^62 elements of 4 bytes: the element count fits, the bytes do not.
  const std::int64_t big[] = {std::int64_t{1} << 62};
  EXPECT_THROW(TensorView::from_arrays(buf, DType::f32, Device::cpu(), 1, big, nullptr), Error);
  // A span that wraps through the strides.
  const std::int64_t shape[] = {4}, strides[] = {std::int64_t{1} << 62};
  EXPECT_THROW(TensorView::from_arrays(buf, DType::f32, Device::cpu(), 1, shape, strides), Error);
  // A broadcast view of a huge logical size over one element is fine (its span is one element).
  const std::int64_t wide[] = {std::int64_t{1} << 60}, zero[] = {0};
  const TensorView t = TensorView::from_arrays(buf, DType::f32, Device::cpu(), 1, wide, zero);
  EXPECT_EQ(t.numel(), std::int64_t{1} << 60);
}

TEST(ArgCheckHardening, WellFormedRefusesFieldsSetByHand) {
  float buf[4];
  TensorView t(buf, DType::f32, Device::cpu(), {4});
  t.shape[0] = -3;
  expect_error([&] { ArgCheck("op").same_device({arg("x", t)}); }, ErrorKind::invalid_argument, "x",
               "non-negative sizes");
  t.shape[0] = 4;
  t.strides[0] = std::numeric_limits<std::int64_t>::min();
  expect_error([&] { ArgCheck("op").same_device({arg("x", t)}); }, ErrorKind::invalid_argument, "x",
               "fit in 2^63 - 1 bytes");
}

TEST(ArgCheckHardening, OutputsThatOverlapThemselvesAreRefused) {
  float buf[64];
  const ArgCheck check("op");
  // Stride 0 over a dimension longer than 1: every row is the same memory.
  const TensorView expanded(buf, DType::f32, Device::cpu(), {4, 8}, {0, 1});
  expect_error([&] { check.no_overlap({arg("y", expanded)}, {}); }, ErrorKind::invalid_argument, "y",
               "elements do not overlap");
  // Interleaved dimensions: (2, 4) with strides (2, 1) revisit elements.
  const TensorView interleaved(buf, DType::f32, Device::cpu(), {2, 4}, {2, 1});
  expect_error([&] { check.no_overlap({arg("y", interleaved)}, {}); },
               ErrorKind::invalid_argument, "y");
  // Inputs may broadcast; padded rows and transposed layouts are distinct.
  float out[64];
  const TensorView padded(out, DType::f32, Device::cpu(), {4, 8}, {16, 1});
  const TensorView transposed(out, DType::f32, Device::cpu(), {8, 4}, {1, 8});
  EXPECT_NO_THROW(check.no_overlap({arg("y", padded)}, {arg("x", expanded)}));
  EXPECT_NO_THROW(check.no_overlap({arg("y", transposed)}, {}));
  // One element, or none, cannot overlap itself.
  const TensorView single(buf, DType::f32, Device::cpu(), {1, 1}, {0, 0});
  EXPECT_NO_THROW(check.no_overlap({arg("y", single)}, {}));
}

TEST(ArgCheckHardening, RowsAsComparesEveryDimension) {
  float x_buf[48], y_buf[48];
  const TensorView x(x_buf, DType::f32, Device::cpu(), {2, 3, 8});
  const TensorView y(y_buf, DType::f32, Device::cpu(), {3, 2, 8});
  const ArgCheck check("op");
  const detail::RowLayout xl = check.rows(x, "x");
  expect_error([&] { check.rows_as(y, "y", x, xl, "x"); }, ErrorKind::invalid_argument, "y",
               "expected shape (2, 3, 8) (as 'x'), got (3, 2, 8)");
  const TensorView flat(y_buf, DType::f32, Device::cpu(), {6, 8});
  expect_error([&] { check.rows_as(flat, "y", x, xl, "x"); }, ErrorKind::invalid_argument, "y");
  const TensorView same(y_buf, DType::f32, Device::cpu(), {2, 3, 8});
  EXPECT_NO_THROW(check.rows_as(same, "y", x, xl, "x"));
}

TEST(ArgCheckHardening, EpsSizesAndDtypeArguments) {
  const ArgCheck check("op");
  EXPECT_NO_THROW(check.eps(0.0f, false));
  EXPECT_NO_THROW(check.eps(std::numeric_limits<float>::max(), false));
  expect_error([&] { check.eps(std::numeric_limits<float>::infinity(), false); }, ErrorKind::invalid_argument,
               "eps", "got inf");
  expect_error([&] { check.eps(std::nanf(""), false); }, ErrorKind::invalid_argument, "eps");
  expect_error([&] { check.eps(-1e-5f, false); }, ErrorKind::invalid_argument, "eps");
  expect_error([&] { check.eps(0.0f, true); }, ErrorKind::invalid_argument, "eps", "a positive finite number");
  EXPECT_NO_THROW(check.size_in(5, "rows", 0, 5));
  expect_error([&] { check.size_in(-1, "rows", 0, 5); }, ErrorKind::invalid_argument, "rows",
               "expected a value in 0..5, got -1");
  EXPECT_NO_THROW(check.dtype_arg_in(DType::f16, "dtype", {DType::f32, DType::f16}));
  expect_error([&] { check.dtype_arg_in(DType::u8, "dtype", {DType::f32, DType::f16}); },
               ErrorKind::invalid_argument, "dtype", "got u8");
  expect_error([&] { check.dtype_arg_in(static_cast<DType>(200), "dtype", {DType::f32}); },
               ErrorKind::invalid_argument, "dtype", "dtype code 200");
}

}  // namespace
}  // namespace fusekit
