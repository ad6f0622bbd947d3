// GoogleTest glue for the harness: GPU skips and reference comparisons as assertions.
#pragma once

#include <gtest/gtest.h>

#include "tests/harness/harness.h"

namespace fusekit::testing {

#define FUSEKIT_REQUIRE_GPU()                                                \
  do {                                                                       \
    if (!::fusekit::testing::gpu_skip_reason().empty())                      \
      GTEST_SKIP() << ::fusekit::testing::gpu_skip_reason();                 \
  } while (0)

// Checks `got` against `ref`: no non-finite values and rel_l2 within tolerance(dtype, ref).
// `scale_floor`: for outputs that are differences of much larger terms (cancellation, or a
// derivative near its zero), the norm of those terms; the error is then measured relative to
// max(||ref||, 0.1 * scale_floor). An error at the dtype's resolution of the terms cannot be told
// apart from rounding, and PyTorch's own result carries the same cancellation error.
::testing::AssertionResult close_to_reference(const std::vector<double>& got,
                                              const std::vector<double>& ref, DType dtype,
                                              const std::string& what, double scale_floor = 0.0);

}  // namespace fusekit::testing
