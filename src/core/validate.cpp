#include "core/validate.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "core/format.h"

namespace fusekit::detail {

std::string dtype_list(std::initializer_list<DType> dtypes) {
  std::string s;
  std::size_t i = 0;
  for (DType d : dtypes) {
    if (i > 0) s += (i + 1 == dtypes.size()) ? " or " : ", ";
    s += dtype_name(d);
    ++i;
  }
  return s;
}

void ArgCheck::fail(const char* arg, const std::string& expected, const std::string& got) const {
  throw Error(ErrorKind::invalid_argument, op_, arg, expected, got);
}

namespace {

struct ByteSpan {
  std::uintptr_t begin = 0, end = 0;  // [begin, end); empty when begin == end
};

ByteSpan byte_span(const TensorView& t) {
  if (!t.data || t.numel() == 0) return {};
  std::int64_t low = 0, high = 0;  // element offsets of the lowest and highest element
  for (int d = 0; d < t.ndim; ++d) {
    const std::int64_t reach = (t.shape[d] - 1) * t.strides[d];
    (reach < 0 ? low : high) += reach;
  }
  const auto base = reinterpret_cast<std::uintptr_t>(t.data);
  const auto size = static_cast<std::int64_t>(dtype_size(t.dtype));
  return {base + static_cast<std::uintptr_t>(low * size),
          base + static_cast<std::uintptr_t>((high + 1) * size)};
}

// A view as nested blocks of bytes: `levels` dimensions, outermost first, each repeating the
// block inside it `count` times `stride` bytes apart, around an innermost contiguous segment of
// `segment` bytes. Dimensions of size 1 are dropped, the contiguous innermost dimensions merge into
// the segment, and a dimension that continues the one inside it (stride = inner count x inner
// stride, e.g. batch and sequence of a (B, S, N) tensor) merges with it, so that equal layouts
// get equal strides whatever their rank. Nested: every stride is at least the extent of the block
// it repeats, so a view's own blocks never interleave; other views (stride 0, negative strides,
// interleaved dims) are not described (ok = false).
struct NestedBlocks {
  bool ok = false;
  std::uintptr_t base = 0;
  int levels = 0;
  std::int64_t stride[kMaxDims] = {}, count[kMaxDims] = {};
  std::int64_t extent[kMaxDims + 1] = {};  // bytes spanned by the levels from l inward
  std::int64_t segment = 0;
};

NestedBlocks nested_blocks(const TensorView& t) {
  NestedBlocks r;
  const auto size = static_cast<std::int64_t>(dtype_size(t.dtype));
  struct Dim {
    std::int64_t stride, count;
  };
  Dim dims[kMaxDims];
  int n = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 1) continue;
    if (t.strides[d] <= 0) return r;
    dims[n++] = {t.strides[d] * size, t.shape[d]};
  }
  std::stable_sort(dims, dims + n, [](const Dim& a, const Dim& b) { return a.stride > b.stride; });
  r.segment = size;
  while (n > 0 && dims[n - 1].stride == r.segment) r.segment *= dims[--n].count;
  for (int d = 0; d < n; ++d) {
    if (r.levels > 0 && r.stride[r.levels - 1] == dims[d].stride * dims[d].count) {
      r.stride[r.levels - 1] = dims[d].stride;  // continues the level outside it: one level
      r.count[r.levels - 1] *= dims[d].count;
    } else {
      r.stride[r.levels] = dims[d].stride;
      r.count[r.levels] = dims[d].count;
      ++r.levels;
    }
  }
  r.extent[r.levels] = r.segment;
  for (int l = r.levels - 1; l >= 0; --l) {
    if (r.stride[l] < r.extent[l + 1]) return r;  // blocks of this level interleave
    r.extent[l] = (r.count[l] - 1) * r.stride[l] + r.extent[l + 1];
  }
  r.base = reinterpret_cast<std::uintptr_t>(t.data);
  r.ok = true;
  return r;
}

std::int64_t floor_div(std::int64_t a, std::int64_t b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// Whether blocks of level l of a and b, b's starting `delta` bytes after a's, share a byte. Block
// i of a and block j of b can meet only if k = i - j satisfies delta - extent_a < k S < delta +
// extent_b (S the level's stride), with -(count_b - 1) <= k <= count_a - 1; since both views are
// nested (S >= either extent) at most two k qualify, and each is decided one level further in.
bool blocks_meet(const NestedBlocks& a, const NestedBlocks& b, int l, std::int64_t delta) {
  if (l == a.levels) return -b.segment < delta && delta < a.segment;
  const std::int64_t S = a.stride[l];
  const std::int64_t k_low = std::max(floor_div(delta - a.extent[l + 1], S) + 1, -(b.count[l] - 1));
  const std::int64_t k_high = std::min(floor_div(delta + b.extent[l + 1] - 1, S), a.count[l] - 1);
  for (std::int64_t k = k_low; k <= k_high; ++k)
    if (blocks_meet(a, b, l + 1, delta - k * S)) return true;
  return false;
}

// Whether two non-empty views share at least one byte: exact for nested views with the same
// strides level by level (rows of one row stride, column blocks of one matrix, q / k / v heads
// packed in one buffer), otherwise whether their spans (lowest to highest byte) meet.
bool share_bytes(const TensorView& a, const TensorView& b) {
  const ByteSpan sa = byte_span(a), sb = byte_span(b);
  if (sa.begin == sa.end || sb.begin == sb.end) return false;
  if (!(sa.begin < sb.end && sb.begin < sa.end)) return false;
  const NestedBlocks na = nested_blocks(a), nb = nested_blocks(b);
  if (!na.ok || !nb.ok || na.levels != nb.levels) return true;
  for (int l = 0; l < na.levels; ++l)
    if (na.stride[l] != nb.stride[l]) return true;
  return blocks_meet(na, nb, 0, static_cast<std::int64_t>(nb.base - na.base));
}

}  // namespace

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim) return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.shape[d] != b.shape[d] || (a.shape[d] > 1 && a.strides[d] != b.strides[d])) return false;
  return true;
}

void ArgCheck::no_overlap(std::initializer_list<NamedArg> outputs,
                          std::initializer_list<NamedArg> inputs) const {
  auto check_pair = [this](const NamedArg& out, const NamedArg& other) {
    if (!out.view || !other.view) return;
    if (share_bytes(*out.view, *other.view))
      fail(out.name, std::string("memory that does not overlap '") + other.name + "'",
           std::string("a view sharing bytes with '") + other.name + "'");
  };
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    if (out->view && out->view->data && out->view->numel() > 1 && !nested_blocks(*out->view).ok)
      fail(out->name,
           "a view whose elements do not overlap (no stride 0 over a dimension longer than 1, no "
           "interleaved dimensions): each element is written",
           "shape " + out->view->shape_string() + " with strides " + out->view->strides_string());
    for (auto later = out + 1; later != outputs.end(); ++later) check_pair(*out, *later);
    for (const NamedArg& in : inputs) check_pair(*out, in);
  }
}

void ArgCheck::dtype_in(const TensorView& t, const char* arg,
                        std::initializer_list<DType> allowed) const {
  for (DType d : allowed)
    if (t.dtype == d) return;
  fail(arg, "dtype " + dtype_list(allowed), dtype_name(t.dtype));
}

void ArgCheck::dtype_arg_in(DType d, const char* arg, std::initializer_list<DType> allowed) const {
  for (DType a : allowed)
    if (d == a) return;
  const bool known = dtype_size(d) != 0;
  fail(arg, "dtype " + dtype_list(allowed),
       known ? std::string(dtype_name(d)) : "dtype code " + std::to_string(static_cast<int>(d)));
}

void ArgCheck::dtype_is(const TensorView& t, const char* arg, DType expected,
                        const char* why) const {
  if (t.dtype != expected)
    fail(arg, std::string("dtype ") + dtype_name(expected) + " (" + why + ")", dtype_name(t.dtype));
}

void ArgCheck::has_data(const TensorView& t, const char* arg) const {
  if (t.data == nullptr && t.numel() > 0) fail(arg, "a non-null data pointer", "nullptr");
}

void ArgCheck::element_aligned(const TensorView& t, const char* arg) const {
  const std::size_t e = dtype_size(t.dtype);
  const std::uintptr_t past = reinterpret_cast<std::uintptr_t>(t.data) % e;
  if (t.numel() > 0 && past != 0)
    fail(arg, "a data pointer aligned to " + std::to_string(e) + " bytes (the " + dtype_name(t.dtype) +
                  " element size)",
         "an address " + std::to_string(past) + " bytes past such a boundary");
}

RowLayout ArgCheck::rows(const TensorView& t, const char* arg) const {
  if (t.ndim < 1) fail(arg, "at least 1 dimension (..., N)", "a 0-dimensional tensor");
  has_data(t, arg);
  RowLayout layout;
  layout.cols = t.size(-1);
  if (layout.cols > 1 && t.stride(-1) != 1)
    fail(arg, "a contiguous last dimension (stride 1)", "strides " + t.strides_string());
  layout.rows = 1;
  for (int d = 0; d < t.ndim - 1; ++d) layout.rows *= t.shape[d];
  // Leading dims must collapse into one row stride: stride[d] == stride[d+1] * shape[d+1].
  layout.row_stride = t.ndim >= 2 ? t.stride(-2) : layout.cols;
  for (int d = t.ndim - 3; d >= 0; --d) {
    if (t.shape[d] > 1 && t.strides[d] != t.strides[d + 1] * t.shape[d + 1])
      fail(arg, "leading dimensions that flatten into one row stride",
           "shape " + t.shape_string() + " with strides " + t.strides_string());
  }
  if (layout.rows > 1 && layout.row_stride < layout.cols)
    fail(arg, "a row stride of at least N = " + std::to_string(layout.cols),
         "row stride " + std::to_string(layout.row_stride));
  if (layout.rows <= 1) layout.row_stride = layout.cols;
  return layout;
}

void ArgCheck::contiguous_numel(const TensorView& t, const char* arg, std::int64_t n) const {
  has_data(t, arg);
  if (t.numel() != n)
    fail(arg, std::to_string(n) + " elements", std::to_string(t.numel()) + " (shape " +
                                                   t.shape_string() + ")");
  if (!t.is_contiguous()) fail(arg, "a contiguous tensor", "strides " + t.strides_string());
}

void ArgCheck::vector(const TensorView& t, const char* arg, std::int64_t n) const {
  has_data(t, arg);
  if (t.ndim != 1 || t.shape[0] != n)
    fail(arg, "shape (" + std::to_string(n) + ")", t.shape_string());
  if (n > 1 && t.strides[0] != 1) fail(arg, "a contiguous vector", "stride " + t.strides_string());
}

void ArgCheck::well_formed(const TensorView& t, const char* arg) const {
  if (t.ndim < 0 || t.ndim > kMaxDims)
    fail(arg, "0.." + std::to_string(kMaxDims) + " dimensions", std::to_string(t.ndim));
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] < 0) fail(arg, "non-negative sizes", "shape " + t.shape_string());
  if (dtype_size(t.dtype) == 0)
    fail(arg, "a known dtype", "dtype code " + std::to_string(static_cast<int>(t.dtype)));
  // The element count, and the span in elements from the lowest to the highest element.
  std::optional<std::int64_t> numel = 1, span = 1;
  for (int d = 0; d < t.ndim; ++d) numel = numel ? checked_mul(*numel, t.shape[d]) : std::nullopt;
  for (int d = 0; d < t.ndim && numel && *numel > 0; ++d) {
    if (t.shape[d] <= 1) continue;  // the stride of a dimension of size 1 is never applied
    const std::int64_t s = t.strides[d];
    const std::optional<std::int64_t> reach =
        s == INT64_MIN ? std::nullopt : checked_mul(t.shape[d] - 1, s < 0 ? -s : s);
    span = span && reach ? checked_add(*span, *reach) : std::nullopt;
  }
  const bool fits = numel && span &&
                    checked_mul(*span, static_cast<std::int64_t>(dtype_size(t.dtype))).has_value();
  if (!fits)
    fail(arg, "a view whose elements and byte span fit in 2^63 - 1 bytes",
         "shape " + t.shape_string() + " with strides " + t.strides_string() + " of " +
             dtype_name(t.dtype));
}

void ArgCheck::size_in(std::int64_t v, const char* arg, std::int64_t lo, std::int64_t hi) const {
  if (v < lo || v > hi)
    fail(arg, "a value in " + std::to_string(lo) + ".." + std::to_string(hi), std::to_string(v));
}

void ArgCheck::eps(float v, bool positive) const {
  const bool ok = std::isfinite(v) && (positive ? v > 0.0f : v >= 0.0f);
  if (!ok)
    fail("eps",
         std::string(positive ? "a positive" : "a non-negative") +
             " finite number (float32: at most 3.4028235e38)",
         format_float(v));
}

Device ArgCheck::same_device(std::initializer_list<NamedArg> args) const {
  const NamedArg* first = nullptr;
  for (const NamedArg& a : args) {
    if (!a.view) continue;
    well_formed(*a.view, a.name);
    if (!first) {
      first = &a;
      continue;
    }
    if (!(a.view->device == first->view->device))
      fail(a.name,
           "a tensor on " + to_string(first->view->device) + " (where '" + first->name + "' is)",
           "a tensor on " + to_string(a.view->device));
  }
  return first ? first->view->device : Device::cpu();
}

void ArgCheck::row_limits(const RowLayout& layout, const char* arg, std::int64_t max_cols) const {
  if (layout.cols < 1 || layout.cols > max_cols)
    fail(arg, "a last dimension N in 1.." + std::to_string(max_cols),
         "N = " + std::to_string(layout.cols));
  if (layout.rows > INT_MAX)
    fail(arg, "at most 2^31 - 1 rows", std::to_string(layout.rows) + " rows");
}

RowLayout ArgCheck::leading_rows(const TensorView& t, const char* arg,
                                 std::initializer_list<DType> allowed, std::int64_t max_cols) const {
  dtype_in(t, arg, allowed);
  const RowLayout layout = rows(t, arg);
  row_limits(layout, arg, max_cols);
  return layout;
}

RowLayout ArgCheck::rows_as(const TensorView& t, const char* arg, const TensorView& ref,
                            const RowLayout& ref_layout, const char* ref_name) const {
  bool same = t.ndim == ref.ndim;
  for (int d = 0; same && d < t.ndim; ++d) same = t.shape[d] == ref.shape[d];
  if (!same) fail(arg, "shape " + ref.shape_string() + " (as '" + ref_name + "')", t.shape_string());
  const RowLayout l = rows(t, arg);
  if (l.rows != ref_layout.rows || l.cols != ref_layout.cols)
    fail(arg, "shape " + ref.shape_string() + " (as '" + ref_name + "')", t.shape_string());
  return l;
}

RowLayout ArgCheck::rows_and_dtype_as(const TensorView& t, const char* arg, const TensorView& ref,
                                      const RowLayout& ref_layout, const char* ref_name) const {
  dtype_is(t, arg, ref.dtype, (std::string("as '") + ref_name + "'").c_str());
  return rows_as(t, arg, ref, ref_layout, ref_name);
}

Workspace ArgCheck::workspace(const OptionalTensor& workspace, std::size_t need,
                              const char* size_function, std::size_t alignment) const {
  const std::string expected = "a contiguous u8 tensor of at least " + std::to_string(need) +
                               " bytes (" + size_function + ")";
  if (!workspace) fail("workspace", expected, "none");
  const TensorView& ws = *workspace;
  has_data(ws, "workspace");
  if (ws.dtype != DType::u8 || static_cast<std::size_t>(ws.numel()) < need || !ws.is_contiguous())
    fail("workspace", expected,
         std::string(dtype_name(ws.dtype)) + " tensor of shape " + ws.shape_string());
  const std::size_t misalignment = reinterpret_cast<std::uintptr_t>(ws.data) % alignment;
  if (misalignment != 0)
    fail("workspace", "a " + std::to_string(alignment) + "-byte aligned pointer",
         "a pointer " + std::to_string(misalignment) + " bytes past a " +
             std::to_string(alignment) + "-byte boundary");
  return {ws.data, static_cast<std::size_t>(ws.numel())};
}

}  // namespace fusekit::detail
