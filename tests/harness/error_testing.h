// Helpers of the argument-check tests: the Error a call must raise, and small CPU views.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "fusekit/error.h"
#include "fusekit/tensor.h"

namespace fusekit::testing {

// `f` must throw fusekit::Error of `kind` about `argument`, its message containing `text`.
template <typename F>
void expect_error(F&& f, ErrorKind kind, const std::string& argument, const std::string& text = "") {
  try {
    f();
    ADD_FAILURE() << "no Error thrown (expected one about '" << argument << "')";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

// A contiguous float32 CPU view of `buf`.
inline TensorView view(std::vector<float>& buf, std::initializer_list<std::int64_t> shape) {
  return TensorView(buf.data(), DType::f32, Device::cpu(), shape);
}

// n values that are nonzero and not all equal.
inline std::vector<float> ramp(std::size_t n, float start = 0.1f) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = start + 0.01f * static_cast<float>(i % 37);
  return v;
}

}  // namespace fusekit::testing
