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
::testing::AssertionResult close_to_reference(const std::vector<double>& got,
                                              const std::vector<double>& ref, DType dtype,
                                              const std::string& what);

}  // namespace fusekit::testing
