#include "tests/harness/gtest_helpers.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "fusekit/error.h"

namespace fusekit::testing {

::testing::AssertionResult close_to_reference(const std::vector<double>& got,
                                              const std::vector<double>& ref, DType dtype,
                                              const std::string& what, double scale_floor) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " vs reference " << ref.size();
  ErrorStats s = compare(got, ref);
  double ref_norm = 0.0;
  const std::int64_t n = static_cast<std::int64_t>(ref.size());
#pragma omp parallel for schedule(static) reduction(+ : ref_norm)
  for (std::int64_t i = 0; i < n; ++i) ref_norm += ref[i] * ref[i];
  ref_norm = std::sqrt(ref_norm);
  constexpr double kFloorFraction = 0.1;
  if (scale_floor > 0.0 && ref_norm < kFloorFraction * scale_floor)
    s.rel_l2 = s.rel_l2 * ref_norm / (kFloorFraction * scale_floor);  // measured against the floor
  const double tol = tolerance(dtype, ref);
  std::ostringstream msg;
  msg << what << " [" << dtype_name(dtype) << "]: rel_l2 " << s.rel_l2 << " (tolerance " << tol
      << ", rounding baseline " << rounding_error(dtype, ref) << "), max_abs " << s.max_abs
      << ", non-finite " << s.non_finite << " of " << s.count;
  if (s.non_finite > 0 || !(s.rel_l2 <= tol)) return ::testing::AssertionFailure() << msg.str();
  return ::testing::AssertionSuccess() << msg.str();
}

::testing::AssertionResult reduction_close(const std::vector<double>& got,
                                           const std::vector<double>& ref, DType dtype,
                                           double reduction_baseline, const std::string& what) {
  const ErrorStats s = compare(got, ref);
  const double tol =
      2.0 * std::max({rounding_error(dtype, ref), reduction_baseline, accumulation_floor(dtype)});
  const std::string msg = what + " [" + dtype_name(dtype) + "]: rel_l2 " + std::to_string(s.rel_l2) +
                          " tolerance " + std::to_string(tol) + " non-finite " +
                          std::to_string(s.non_finite);
  if (s.non_finite > 0 || !(s.rel_l2 <= tol)) return ::testing::AssertionFailure() << msg;
  return ::testing::AssertionSuccess() << msg;
}

::testing::AssertionResult same_bytes_every_run(const std::function<void()>& run,
                                                std::initializer_list<const Buffer*> outputs) {
  constexpr int kRuns = 3;
  std::vector<std::vector<unsigned char>> runs;
  for (int i = 0; i < kRuns; ++i) {
    run();
    std::vector<unsigned char> bytes;
    for (const Buffer* b : outputs) {
      const auto raw = b->raw_bytes();
      bytes.insert(bytes.end(), raw.begin(), raw.end());
    }
    runs.push_back(std::move(bytes));
  }
  for (int i = 1; i < kRuns; ++i)
    if (runs[i] != runs[0])
      return ::testing::AssertionFailure() << "run " << i << " wrote other bytes than run 0";
  return ::testing::AssertionSuccess();
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace fusekit::testing
