// Test tensors of the gated-activation family: views inside padded, optionally misaligned buffers,
// one problem's tensors in any input form, and running the ops on them.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fusekit/gated_act.h"
#include "tests/harness/harness.h"

namespace fusekit::testing {

// A (rows, cols) view inside a buffer of rows x (shift + cols + pad) elements: row stride
// shift + cols + pad, data `shift` elements past the buffer's start (shift > 0 misaligns it for
// 16-byte accesses). With lead0 > 1 the rows are split into leading dimensions (lead0, rows / lead0).
class Strided {
 public:
  Strided(DType dtype, Device device, std::int64_t rows, std::int64_t cols, std::int64_t shift = 0,
          std::int64_t pad = 0, std::int64_t lead0 = 1)
      : storage_(dtype, device, {rows, shift + cols + pad}), dtype_(dtype), device_(device), rows_(rows),
        cols_(cols), shift_(shift), width_(shift + cols + pad), lead0_(lead0) {}

  TensorView view() const {
    const TensorView base = storage_.view();
    void* data = base.data ? static_cast<char*>(base.data) + shift_ * dtype_size(dtype_) : nullptr;
    if (lead0_ > 1)
      return TensorView(data, dtype_, device_, {lead0_, rows_ / lead0_, cols_}, {rows_ / lead0_ * width_, width_, 1});
    return TensorView(data, dtype_, device_, {rows_, cols_}, {width_, 1});
  }

  // The view's elements, row by row.
  std::vector<double> values() const {
    const std::vector<double> all = storage_.values();
    std::vector<double> out(static_cast<std::size_t>(rows_ * cols_));
    for (std::int64_t r = 0; r < rows_; ++r)
      for (std::int64_t c = 0; c < cols_; ++c) out[r * cols_ + c] = all[r * width_ + shift_ + c];
    return out;
  }
  // Writes the view's elements (rounded to the dtype). The rest of the buffer is rewritten with the
  // values it held (a poison's NaN may come back as another NaN pattern).
  void set_values(const std::vector<double>& v) {
    std::vector<double> all = storage_.values();
    for (std::int64_t r = 0; r < rows_; ++r)
      for (std::int64_t c = 0; c < cols_; ++c) all[r * width_ + shift_ + c] = v[r * cols_ + c];
    storage_.set_values(all);
  }
  void poison() { storage_.poison(); }
  std::vector<unsigned char> raw_bytes() const { return storage_.raw_bytes(); }
  // Whether every byte outside the view equals `before`'s (a raw_bytes() taken before the op ran).
  bool padding_unchanged(const std::vector<unsigned char>& before) const {
    const std::vector<unsigned char> now = storage_.raw_bytes();
    const std::size_t size = dtype_size(dtype_);
    for (std::int64_t r = 0; r < rows_; ++r)
      for (std::int64_t k = 0; k < width_; ++k)
        if (k < shift_ || k >= shift_ + cols_)
          for (std::size_t b = 0; b < size; ++b)
            if (now[(r * width_ + k) * size + b] != before[(r * width_ + k) * size + b]) return false;
    return true;
  }
  Buffer& storage() { return storage_; }
  // The storage index of view element (r, c).
  std::int64_t storage_index(std::int64_t r, std::int64_t c) const { return r * width_ + shift_ + c; }

 private:
  Buffer storage_;
  DType dtype_;
  Device device_;
  std::int64_t rows_, cols_, shift_, width_, lead0_;
};

// The three input forms: one tensor in either layout, or two tensors.
enum class GatedForm { halves, interleaved, separate };
const char* form_name(GatedForm f);

struct GatedCase {
  DType dtype = DType::bf16;
  Activation activation = Activation::silu;
  GatedForm form = GatedForm::halves;
  std::int64_t rows = 1, cols = 1;  // M, F
  std::int64_t pad = 0;             // extra elements after each row (the separate form's up: pad + 8)
  std::int64_t shift = 0;           // elements each view starts past its buffer's start
  std::int64_t lead0 = 1;           // rows as (lead0, rows / lead0)
  bool in_place = false;            // gradients written over their inputs
  std::string str() const;
};

// The values of one problem, (rows x F) each, rounded to the dtype by the buffers they go into.
struct GatedInputs {
  std::vector<double> gate, up, dy;
};
// gate ~ N(0, 1.5) (both sides of every activation's bend), up and dy ~ N(0, 1).
GatedInputs random_gated_inputs(const GatedCase& c, std::mt19937_64& rng);

// Every tensor of one problem on one device. In place, the gradients go into the input buffers.
class GatedTensors {
 public:
  GatedTensors(const GatedCase& c, Device device);
  void set_inputs(const GatedInputs& in);
  void poison_outputs();
  void forward();
  void backward();
  // dgate and dup: present unless left out (separate form); each may be left out.
  void backward_with(bool want_dgate, bool want_dup);
  std::vector<double> y() const { return y_.values(); }
  std::vector<double> dgate() const;
  std::vector<double> dup() const;
  // The buffers the ops write (y and the gradients'), for the padding checks.
  std::vector<Strided*> written();
  GatedActConfig config() const;

 private:
  Strided& grad_gate_up();
  Strided& grad_gate();
  Strided& grad_up();
  const Strided& grad_gate_up() const;
  const Strided& grad_gate() const;
  const Strided& grad_up() const;

  GatedCase c_;
  std::optional<Strided> gate_up_, dgate_up_, gate_, up_, dgate_, dup_;
  Strided y_, dy_;
};

}  // namespace fusekit::testing
