#include "tests/harness/gtest_helpers.h"

#include <sstream>

namespace fusekit::testing {

::testing::AssertionResult close_to_reference(const std::vector<double>& got,
                                              const std::vector<double>& ref, DType dtype,
                                              const std::string& what) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " vs reference " << ref.size();
  const ErrorStats s = compare(got, ref);
  const double tol = tolerance(dtype, ref);
  std::ostringstream msg;
  msg << what << " [" << dtype_name(dtype) << "]: rel_l2 " << s.rel_l2 << " (tolerance " << tol
      << ", rounding baseline " << rounding_error(dtype, ref) << "), max_abs " << s.max_abs
      << ", non-finite " << s.non_finite << " of " << s.count;
  if (s.non_finite > 0 || !(s.rel_l2 <= tol)) return ::testing::AssertionFailure() << msg.str();
  return ::testing::AssertionSuccess() << msg.str();
}

}  // namespace fusekit::testing
