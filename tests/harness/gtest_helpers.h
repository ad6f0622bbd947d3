// GoogleTest glue for the harness: GPU skips and reference comparisons as assertions.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

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

// Checks a reduced output (a weight or bias gradient, a column sum over rows) against `ref`: no
// non-finite values and rel_l2 within twice the larger of the dtype's rounding, its accumulation
// floor and `reduction_baseline`, the error a float32 reduction of the same terms makes (see
// f32_column_sum_error).
::testing::AssertionResult reduction_close(const std::vector<double>& got,
                                           const std::vector<double>& ref, DType dtype,
                                           double reduction_baseline, const std::string& what);

// Runs `run` three times and succeeds when `outputs` hold the same bytes (row padding included)
// after every run.
::testing::AssertionResult same_bytes_every_run(const std::function<void()>& run,
                                                std::initializer_list<const Buffer*> outputs);

// The message of the fusekit::Error that `call` throws, or "no error".
std::string error_of(const std::function<void()>& call);

}  // namespace fusekit::testing
