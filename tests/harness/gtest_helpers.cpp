#include "tests/harness/gtest_helpers.h"

#include <cmath>
#include <sstream>

namespace fusekit::testing {

::testing::AssertionResult close_to_reference(const std::vector<double>& got,
                                              const std::vector<double>& ref, DType dtype,
                                              const std::string& what, double scale_floor) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " vs reference " << ref.size();
  ErrorStats s = compare(got, ref);
  double ref_norm = 0.0;
  for (double r : ref) ref_norm += r * r;
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

}  // namespace fusekit::testing
