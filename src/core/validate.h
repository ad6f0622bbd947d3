// Argument checking shared by every op. Each failure throws fusekit::Error naming the op, the
// argument, what was expected and what came.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "fusekit/error.h"
#include "fusekit/tensor.h"

namespace fusekit::detail {

// A (..., N) tensor seen as M rows of N contiguous elements, `row_stride` elements apart.
struct RowLayout {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_stride = 0;
};

// One argument of an op: its name and, if given, its view.
struct NamedArg {
  const char* name;
  const TensorView* view;  // nullptr when the optional argument is absent
};

inline NamedArg arg(const char* name, const TensorView& t) { return {name, &t}; }
inline NamedArg arg(const char* name, const OptionalTensor& t) {
  return {name, t ? &*t : nullptr};
}

std::string dtype_list(std::initializer_list<DType> dtypes);

class ArgCheck {
 public:
  explicit ArgCheck(const char* op) : op_(op) {}
  const char* op() const { return op_; }

  [[noreturn]] void fail(const char* arg, const std::string& expected,
                         const std::string& got) const;

  void dtype_in(const TensorView& t, const char* arg, std::initializer_list<DType> allowed) const;
  void dtype_is(const TensorView& t, const char* arg, DType expected, const char* why) const;
  // Non-null data for any non-empty tensor.
  void has_data(const TensorView& t, const char* arg) const;
  // Flattens (..., N) to rows; the last dim must be contiguous and the leading dims collapsible
  // into one row stride.
  RowLayout rows(const TensorView& t, const char* arg) const;
  // A contiguous tensor of exactly `n` elements (any shape), e.g. per-row statistics.
  void contiguous_numel(const TensorView& t, const char* arg, std::int64_t n) const;
  // A 1-D contiguous vector of length n.
  void vector(const TensorView& t, const char* arg, std::int64_t n) const;
  // Every present argument lives on the same device; returns it.
  Device same_device(std::initializer_list<NamedArg> args) const;
  // Row count and length limits shared by the row-wise ops.
  void row_limits(const RowLayout& layout, const char* arg, std::int64_t max_cols) const;

 private:
  const char* op_;
};

}  // namespace fusekit::detail
