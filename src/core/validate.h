// Argument checking shared by every op. Each failure throws fusekit::Error naming the op, the
// argument, what was expected and what came.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "core/checked_math.h"
#include "fusekit/error.h"
#include "fusekit/tensor.h"

namespace fusekit::detail {

// The activation dtypes of the elementwise and normalization families.
inline constexpr std::initializer_list<DType> kFloatDtypes = {DType::f32, DType::f16, DType::bf16};

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

// Whether two views are the same elements in the same order (same data, dtype, shape, and strides
// wherever a dimension is longer than 1): the one overlap an in-place op allows.
bool same_view(const TensorView& a, const TensorView& b);

// A caller-owned workspace that passed ArgCheck::workspace.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

std::string dtype_list(std::initializer_list<DType> dtypes);

class ArgCheck {
 public:
  explicit ArgCheck(const char* op) : op_(op) {}
  const char* op() const { return op_; }

  [[noreturn]] void fail(const char* arg, const std::string& expected,
                         const std::string& got) const;

  void dtype_in(const TensorView& t, const char* arg, std::initializer_list<DType> allowed) const;
  // A dtype passed by value (the size queries' `dtype`): one of `allowed`.
  void dtype_arg_in(DType d, const char* arg, std::initializer_list<DType> allowed) const;
  void dtype_is(const TensorView& t, const char* arg, DType expected, const char* why) const;
  // Non-null data for any non-empty tensor.
  void has_data(const TensorView& t, const char* arg) const;
  // A non-empty tensor's data pointer aligned to its element size.
  void element_aligned(const TensorView& t, const char* arg) const;
  // Flattens (..., N) to rows; the last dim must be contiguous and the leading dims collapsible
  // into one row stride.
  RowLayout rows(const TensorView& t, const char* arg) const;
  // A contiguous tensor of exactly `n` elements (any shape), e.g. per-row statistics.
  void contiguous_numel(const TensorView& t, const char* arg, std::int64_t n) const;
  // A 1-D contiguous vector of length n.
  void vector(const TensorView& t, const char* arg, std::int64_t n) const;
  // A well-formed view: 0..kMaxDims dims, non-negative sizes, and an element count and a byte
  // reach (lowest to highest element) within kMaxBytes (core/checked_math.h), so that the size
  // arithmetic of the checks and of the backends cannot wrap.
  void well_formed(const TensorView& t, const char* arg) const;
  // Every present argument is well formed and lives on the same device; returns that device.
  Device same_device(std::initializer_list<NamedArg> args) const;
  // An integer argument of a size query (rows, cols, m, n, k, batch, ...) in [lo, hi].
  void size_in(std::int64_t v, const char* arg, std::int64_t lo, std::int64_t hi) const;
  // eps: finite, >= 0 (> 0 when `positive`). The float API argument cannot hold more than
  // float32's range; a caller's larger value arrives as inf and is refused here.
  void eps(float v, bool positive) const;
  // Row count and length limits shared by the row-wise ops.
  void row_limits(const RowLayout& layout, const char* arg, std::int64_t max_cols) const;
  // A row-wise op's main input (x, or dy backward): one of `allowed` dtypes, flattened to rows
  // within row_limits.
  RowLayout leading_rows(const TensorView& t, const char* arg, std::initializer_list<DType> allowed,
                         std::int64_t max_cols) const;
  // Exactly `ref`'s shape (every dimension, not only the flattened rows and columns), laid out as
  // rows with a row stride of its own.
  RowLayout rows_as(const TensorView& t, const char* arg, const TensorView& ref,
                    const RowLayout& ref_layout, const char* ref_name) const;
  // rows_as, and `ref`'s dtype too.
  RowLayout rows_and_dtype_as(const TensorView& t, const char* arg, const TensorView& ref,
                              const RowLayout& ref_layout, const char* ref_name) const;
  // Every present output has distinct elements (no stride 0 over a dimension longer than 1, no
  // dimensions that interleave: each stride, sorted, at least the extent of the dimensions inside
  // it), and no present output shares a byte with another present argument (output or input): kernels
  // that read an input while writing an output, or that run twice (autotuning), would give a
  // silent wrong answer. Exact for views of rows with one row stride (column blocks of one matrix
  // pass); other layouts are compared by their spans, so views that interleave otherwise are
  // refused too.
  void no_overlap(std::initializer_list<NamedArg> outputs, std::initializer_list<NamedArg> inputs) const;
  // The caller's scratch memory: a contiguous u8 tensor of at least `need` bytes whose data is
  // `alignment`-byte aligned. `size_function` is the public query that reports `need`; the
  // message names it so that the caller knows how to size the buffer.
  Workspace workspace(const OptionalTensor& workspace, std::size_t need, const char* size_function,
                      std::size_t alignment) const;

 private:
  const char* op_;
};

}  // namespace fusekit::detail
