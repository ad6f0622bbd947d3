// Number formatting for error messages, without iostreams.
//
// Why not std::ostringstream: on the GPU machine's Python (a prebuilt interpreter that loads its
// own C++ runtime), building an error message through an ostringstream inside the fusekit._C
// extension crashed the interpreter (SIGSEGV), while messages built from std::string and
// snprintf worked. Error paths must never crash, so the library formats with these instead.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace fusekit::detail {

// Shortest-round-trip-ish float text: 9 significant digits (%g), as "1", "0.100000001", "nan".
inline std::string format_float(double v, int significant_digits = 9) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", significant_digits, v);
  return buf;
}

// "(2, 3, 4)" for a list of sizes or strides; "()" when empty.
inline std::string format_int_list(const std::int64_t* v, int n) {
  std::string s = "(";
  for (int i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + ")";
}

}  // namespace fusekit::detail
