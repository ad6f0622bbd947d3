// Shared pieces of the fusekit._C bindings: turning Python arrays into TensorViews, the stream
// and device of a call, and the list of per-family binding functions.
//
// Adding an op family's bindings: write python/src/bind_<family>.cpp defining
// `void bind_<family>(nb::module_&)`, declare it below and call it from module.cpp (one line).
// Each binding mirrors the C++ entry point: arrays and scalars come in as nb::handle (marked
// .none(), so that None reaches the conversion and gets its named error), pass through an OpCall
// (which names the op and the argument in every conversion error: c.tensor(), c.f32(), ...; the
// workspace-size queries, without arrays, use its base ScalarArgs), and the op runs inside
// OpCall::run. See bind_norm.cpp.
//
// Private bindings (fusekit.torch's calls) are named `_<C++ entry point>_alloc`: the same op with
// fusekit._C allocating through the caller's framework (OpCall::new_arrays, new_f32_capsule,
// auto_workspace) what the public binding takes as arguments; each returns what it allocated.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>  // every file casts with std::string alike (ODR)

#include <array>
#include <deque>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fusekit/activation.h"
#include "fusekit/cross_entropy.h"
#include "fusekit/error.h"
#include "fusekit/gated_act.h"
#include "fusekit/tensor.h"

namespace fusekit::python {

namespace nb = nanobind;

// A scalar or option argument of the wrong Python type, worded as PyTorch's argument parser words
// it: "fusekit.<op>: argument '<argument>' must be <expected>, not <got>". module.cpp raises it as
// fusekit.ArgumentTypeError, a TypeError and also an InvalidArgumentError (like every other bad
// argument), with the parts as attributes.
class ArgumentTypeError : public std::exception {
 public:
  ArgumentTypeError(std::string op, std::string argument, std::string expected, std::string got);
  const char* what() const noexcept override { return message_.c_str(); }
  const std::string& op() const { return op_; }
  const std::string& argument() const { return argument_; }
  const std::string& expected() const { return expected_; }
  const std::string& got() const { return got_; }

 private:
  std::string op_, argument_, expected_, got_, message_;
};

// Whether the op only reads an argument (read-only arrays such as JAX's are accepted) or writes it.
enum class Access { read, write };

// The scalar arguments of one call of `op` (scalar_args.cpp), and its errors. Each conversion
// takes one Python value to the C++ parameter's type and names the op and `name` in its errors:
// a value of the wrong Python type raises ArgumentTypeError; one of the right type that the C++
// type cannot hold raises InvalidArgumentError (expected, got). What the op itself checks (eps >=
// 0, p in [0, 1), a finite scale, ...) is left to it. As PyTorch's parser: NumPy scalars are
// accepted, an int where a float is expected too; unlike it, a bool where a number is expected is
// refused (as an int for a bool is by both). Bindings without arrays (the workspace-size
// queries) use it alone; OpCall adds the arrays.
class ScalarArgs {
 public:
  explicit ScalarArgs(const char* op) : op_(op) {}
  const char* op() const { return op_; }

  // float32: a real number (float, int, anything with __index__ or __float__ but a bool or a
  // complex number) whose magnitude float32 can hold (inf and NaN pass as they are).
  float f32(nb::handle value, const char* name) const;
  // f32, or None.
  std::optional<float> optional_f32(nb::handle value, const char* name) const;
  // An int (anything with __index__ but a bool: NumPy integer scalars) in the C++ type's range.
  std::int64_t i64(nb::handle value, const char* name) const;
  int i32(nb::handle value, const char* name) const;
  std::uint64_t u64(nb::handle value, const char* name) const;
  // A bool or numpy.bool_.
  bool flag(nb::handle value, const char* name) const;
  // A fusekit.DType.
  DType dtype(nb::handle value, const char* name) const;
  // A device name: 'cpu', 'cuda' (device 0) or 'cuda:N'.
  Device device(nb::handle value, const char* name) const;
  // A fusekit.Activation or its name (bind_activation.cpp).
  Activation activation(nb::handle value, const char* name = "activation") const;
  // An option: a member of the bound enum `Enum` (its Python type named `type_name`) or the name
  // of one of `values` (`name_of` gives the names).
  template <typename Enum, std::size_t N>
  Enum option(nb::handle value, const char* name, const char* type_name, const Enum (&values)[N],
              const char* (*name_of)(Enum)) const {
    Enum parsed;
    if (nb::try_cast<Enum>(value, parsed, /*convert=*/false)) return parsed;
    const char* names[N];
    for (std::size_t i = 0; i < N; ++i) names[i] = name_of(values[i]);
    return values[option_index(value, name, type_name, names, static_cast<int>(N))];
  }

  [[noreturn]] void fail(const char* name, const std::string& expected, const std::string& got) const;
  // Raises ArgumentTypeError: `name` must be `expected` (a type), not the type of `value`.
  [[noreturn]] void fail_type(const char* name, const char* expected, nb::handle value) const;

 protected:
  // The unsigned 64-bit value of an integral `value` (`type` in a type error, range text `range`).
  std::uint64_t unsigned_integer(nb::handle value, const char* name, const char* type,
                                 const char* range) const;

  const char* op_;

 private:
  // The value of an integral `value` in [lo, hi] (range text `range` in the error).
  std::int64_t signed_integer(nb::handle value, const char* name, std::int64_t lo, std::int64_t hi,
                              const char* range) const;
  // The index in `names` of `value`, a str; raises for another name or another type.
  int option_index(nb::handle value, const char* name, const char* type_name,
                   const char* const* names, int count) const;
};

// Converts the array arguments of one op call and keeps what the conversion made alive until the
// call returns. Accepted: any object the framework exports through the DLPack C exchange table
// (PyTorch >= 2.10: no Python-level work per tensor), through __dlpack__() or the buffer protocol
// (NumPy, CuPy, JAX, older PyTorch), and NumPy arrays of ml_dtypes' bfloat16 / float8 types.
class OpCall : public ScalarArgs {
 public:
  explicit OpCall(const char* op) : ScalarArgs(op) {}
  ~OpCall();
  OpCall(const OpCall&) = delete;
  OpCall& operator=(const OpCall&) = delete;

  // A required array; None or a non-array raises InvalidArgumentError naming `name`.
  TensorView tensor(nb::handle obj, const char* name, Access access);
  // None gives an empty OptionalTensor.
  OptionalTensor optional(nb::handle obj, const char* name, Access access);
  // A list or tuple of arrays (the multi-tensor ops); element i is named `name[i]` in errors.
  std::vector<TensorView> tensor_list(nb::handle obj, const char* name, Access access);

  // tensor() for fusekit.torch's calls, which take any layout: an array that is not
  // contiguous is replaced by its `.contiguous()` (kept alive until the call returns), which the
  // Python side would otherwise call on every argument of every call.
  TensorView contiguous(nb::handle obj, const char* name);
  OptionalTensor optional_contiguous(nb::handle obj, const char* name);

  // A `workspace` argument: an array, None, or the string 'auto'. 'auto' asks `size()` (the op's
  // *_workspace_size query, from the converted arrays) and takes that many bytes from the
  // allocator of the framework that owns the CUDA arrays (the DLPack exchange table's, PyTorch >=
  // 2.10: its caching allocator on the current stream), held until the call returns. That is
  // stream-ordered like any temporary of the framework's own ops, and CUDA-graph safe. Call it
  // after every array argument has been converted. A query that throws gives no workspace: the
  // op then reports the bad argument itself.
  template <typename SizeFn>
  OptionalTensor workspace(nb::handle obj, SizeFn&& size) {
    if (!is_auto(obj)) {
      if (obj.is_valid() && PyUnicode_Check(obj.ptr()))
        fail("workspace", "an array, None or 'auto'", "the string '" + nb::cast<std::string>(obj) + "'");
      return optional(obj, "workspace", Access::write);
    }
    return auto_workspace(std::forward<SizeFn>(size));
  }

  // workspace('auto') for bindings that always take the framework's memory.
  template <typename SizeFn>
  OptionalTensor auto_workspace(SizeFn&& size) {
    std::size_t bytes = 0;
    try {
      bytes = std::forward<SizeFn>(size)();
    } catch (const Error&) {
      return std::nullopt;
    }
    if (bytes == 0) return std::nullopt;
    return framework_scratch(bytes);
  }

  // Several new contiguous (or, by spec, transposed 2-D) arrays carved from ONE framework
  // allocation (each 256-byte aligned), plus optionally `scratch_bytes` of u8 scratch memory for
  // this call: one allocator call instead of one per array, which is most of the host time of an
  // op with several outputs. The memory goes back to the framework when the last of the arrays is
  // released, so group only arrays that live and die together. Each spec becomes the framework's
  // tensor object, or an opaque capsule (float32 specs only) as new_f32_capsule makes.
  struct ArraySpec {
    DType dtype;
    int ndim;
    std::int64_t shape[kMaxDims];
    bool capsule = false;
    // 2-D only: laid out as its transpose, strides (1, shape[0]) (a column-major matrix, as the
    // gradient of a weight that is the transposed view of a row-major one).
    bool transposed = false;
  };
  static ArraySpec spec(DType dtype, std::initializer_list<std::int64_t> shape, bool capsule = false);
  // The shape of `like` with its last size replaced by `last` (a 0-d `like` gives shape (last)).
  static ArraySpec spec_like(const TensorView& like, DType dtype, std::int64_t last);
  void new_arrays(int count, const ArraySpec* specs, nb::object* objects, TensorView* views,
                  std::size_t scratch_bytes = 0, OptionalTensor* scratch = nullptr);

  // One new contiguous (or transposed 2-D) array from the framework's allocator (see new_arrays),
  // as the framework's tensor object: fusekit.torch allocates its outputs this way, in the call.
  nb::object new_array(const ArraySpec& spec, TensorView* view);
  // new_array when `wanted`, else None and an empty `view` (an output the caller did not ask for).
  nb::object new_optional(bool wanted, const ArraySpec& spec, OptionalTensor* view);

  // A new float32 array of `count` values on the device of the first array argument, from the
  // allocator of that array's framework (its DLPack exchange table), handed to Python as an opaque
  // capsule rather than a tensor: fusekit.torch saves row statistics this way, which costs less
  // host time than allocating a tensor from Python. tensor() accepts such capsules as arrays. The
  // framework frees the memory when the capsule is released (stream-ordered, as its own
  // temporaries). Raises when the first array came without an exchange table.
  nb::object new_f32_capsule(std::int64_t count, TensorView* view);
  // The same with a shape of 1..kMaxDims sizes.
  nb::object new_f32_capsule(int ndim, const std::int64_t* shape, TensorView* view);

  // Runs `op(stream)` with the GIL released and, for CUDA tensors, their device made current.
  // `stream` is None (the current stream of the framework that owns the CUDA tensors when it
  // publishes one through the DLPack exchange table, otherwise the legacy default stream) or an
  // int holding a cudaStream_t (0 = legacy default stream). CPU ops ignore it.
  template <typename Op>
  void run(nb::handle stream, Op&& op) {
    const Stream s = resolve_stream(stream);
    DeviceScope scope(cuda_device_);
    nb::gil_scoped_release no_gil;
    std::forward<Op>(op)(s);
  }

  // Checks the type and range of a `stream` argument (None or a cudaStream_t as an int) now, for
  // bindings that allocate before they run; run() converts it.
  void check_stream(nb::handle stream) const;

 private:
  // Makes `device` current for the call when it is not already (kernels launch on the current
  // device, and a stream belongs to one device); restores the previous device afterwards.
  class DeviceScope {
   public:
    explicit DeviceScope(int device);
    ~DeviceScope();
    DeviceScope(const DeviceScope&) = delete;
    DeviceScope& operator=(const DeviceScope&) = delete;

   private:
    int previous_ = -1;
  };

  // Raises for an object with a NumPy-like dtype that could not be imported: a dtype error where
  // the dtype is the reason (another byte order, object / string / structured dtypes), else one
  // saying that the export failed. Returns for anything without a dtype.
  void fail_unexported_dtype(nb::handle obj, const char* name) const;
  static bool is_auto(nb::handle obj);
  static bool capsule_view(nb::handle obj, TensorView* out);
  TensorView framework_scratch(std::size_t bytes);
  // A framework allocation (see new_array); the caller owns the result.
  void* allocate(const void* api, Device device, DType dtype, int ndim, const std::int64_t* shape,
                 const char* what);
  Stream resolve_stream(nb::handle stream) const;
  bool import_exchange(nb::handle obj, const char* name, TensorView* out);
  bool import_ndarray(nb::handle obj, const char* name, Access access, TensorView* out,
                      const DType* relabel = nullptr);
  TensorView from_dlpack(const char* name, void* data, std::int32_t device_type,
                         std::int32_t device_id, std::int32_t ndim, std::uint8_t code,
                         std::uint8_t bits, std::uint16_t lanes, const std::int64_t* shape,
                         const std::int64_t* strides);
  void note_device(const TensorView& t, const void* exchange_api);

  static constexpr int kMaxImports = 16;
  int cuda_device_ = -1;                  // the first CUDA tensor's device, -1 when none
  const void* stream_source_ = nullptr;   // exchange table of the first CUDA tensor, if any
  const void* first_api_ = nullptr;       // exchange table of the first array, if any
  Device first_device_{};
  int imports_ = 0;
  int imports_total_ = 0;
  std::array<nb::ndarray<nb::ro>, kMaxImports> keep_alive_;
  std::vector<nb::ndarray<nb::ro>> keep_alive_more_;  // imports past kMaxImports (tensor lists)
  std::deque<std::string> element_names_;             // "name[i]" of tensor_list elements
  std::array<nb::object, 4> contiguous_copies_;  // what contiguous() made
  int contiguous_made_ = 0;
  void* scratch_ = nullptr;  // the framework tensor behind workspace='auto', freed by ~OpCall
  bool auto_workspace_ = false;
};

// (rows, cols) of an array normalized or multiplied over its last dimension: the leading
// dimensions flattened. For workspace queries (an empty or 0-d array gives zeros).
inline std::pair<std::int64_t, std::int64_t> rows_cols(const TensorView& t) {
  const std::int64_t cols = t.ndim > 0 ? t.shape[t.ndim - 1] : 1;
  return {cols > 0 ? t.numel() / cols : 0, cols};
}

// The (seed, offset, p) arguments of the dropout-mask helpers (dropout_keep_mask,
// attention_dropout_keep_mask): seed and offset unsigned 64-bit, p a drop probability in [0, 1).
struct KeepMaskArgs {
  std::uint64_t seed, offset;
  float p;
};
KeepMaskArgs keep_mask_args(const ScalarArgs& c, nb::handle seed, nb::handle offset, nb::handle p);

// A CrossEntropyConfig from its flattened arguments (cross_entropy, linear_cross_entropy):
// `reduction` a fusekit.LossReduction or its name, the others as the C++ fields. Converted before
// the arrays, so a mistyped scalar is reported first.
CrossEntropyConfig cross_entropy_config(const ScalarArgs& c, nb::handle reduction, nb::handle ignore_index,
                                        nb::handle label_smoothing, nb::handle z_loss);
LossReduction loss_reduction_arg(const ScalarArgs& c, nb::handle value);

// A `layout` argument (gated_act, gated_linear): a fusekit.GatedLayout or its name.
GatedLayout gated_layout_arg(const ScalarArgs& c, nb::handle value);

// Family registration (one line each in module.cpp).
void bind_norm(nb::module_& m);
void bind_activation(nb::module_& m);  // the Activation enum (before the families that use it)
void bind_bias_act_dropout(nb::module_& m);
void bind_cross_entropy(nb::module_& m);
void bind_gated_act(nb::module_& m);
void bind_linear(nb::module_& m);
void bind_fp8_norm(nb::module_& m);
void bind_attention(nb::module_& m);
void bind_rope(nb::module_& m);
void bind_embedding(nb::module_& m);
void bind_linear_cross_entropy(nb::module_& m);
void bind_optim(nb::module_& m);

}  // namespace fusekit::python
