// Test harness (no GoogleTest dependency, shared with the CLI's `fusekit check`): owned buffers on either device, random fills, output poisoning, and comparison
// against a float64 reference with a per-dtype tolerance.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "fusekit/tensor.h"

namespace fusekit::testing {

// Empty when a supported GPU is present; otherwise why GPU tests are skipped.
const std::string& gpu_skip_reason();

// A test tensor: host bytes always, plus a device copy when it lives on a GPU.
class Buffer {
 public:
  // `lead` elements of storage come before the view's first element: the data pointer is then
  // lead * element size bytes past the allocation's (256-byte aligned) start, for tests of
  // pointers that are not 16-byte aligned. The lead is poisoned like the rest.
  Buffer(DType dtype, Device device, std::vector<std::int64_t> shape,
         std::vector<std::int64_t> strides = {}, std::int64_t lead = 0);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  TensorView view() const;
  DType dtype() const { return dtype_; }
  std::int64_t numel() const;

  // Logical elements (row-major order over the shape) as doubles, read from the device if any.
  std::vector<double> values() const;
  // Writes logical elements (rounded to the dtype) and uploads.
  void set_values(const std::vector<double>& v);
  // Normal(mean, stddev) values, rounded to the dtype.
  void fill_normal(std::mt19937_64& rng, double mean = 0.0, double stddev = 1.0);
  // Every byte of the storage set to 0xFF: NaN in every float type, so an unwritten output
  // element shows up as NaN.
  void poison();
  // Raw storage bytes from the view's first element on (padding included, the lead not), read
  // from the device if any.
  std::vector<unsigned char> raw_bytes() const;
  // Whether every byte of the lead still holds the poison (nothing wrote before the view).
  bool lead_untouched() const;

 private:
  std::int64_t offset_of(std::int64_t linear) const;
  void upload();
  void download() const;

  DType dtype_;
  Device device_;
  std::vector<std::int64_t> shape_, strides_;
  std::size_t lead_bytes_ = 0;
  std::size_t storage_bytes_ = 0;  // the lead included
  mutable std::vector<unsigned char> host_;
  void* device_ptr_ = nullptr;
};

struct ErrorStats {
  double rel_l2 = 0.0;    // ||got - ref|| / ||ref||
  double max_abs = 0.0;   // max |got - ref|
  std::int64_t non_finite = 0;  // NaN or Inf in `got` where ref is finite
  std::int64_t count = 0;
};

ErrorStats compare(const std::vector<double>& got, const std::vector<double>& ref);

// The error of the float64 reference merely rounded to `dtype`: the least error any
// implementation that stores `dtype` can have (PyTorch's own error in that dtype is at least this).
double rounding_error(DType dtype, const std::vector<double>& ref);

// Accumulation-error floor per dtype (matters for f32, where rounding alone is ~1e-8).
double accumulation_floor(DType dtype);

// The bar: twice the larger of the rounding baseline and the accumulation floor (and, below 64
// values, the unit roundoff: one value may round to the neighbour of the reference's rounding).
double tolerance(DType dtype, const std::vector<double>& ref);

std::mt19937_64 make_rng(std::uint64_t salt);

// The generator of stream `index` under `base`: independent streams for parallel fills.
std::mt19937_64 stream_rng(std::uint64_t base, std::uint64_t index);

// Calls fill(i, rng_i) for i in [0, count), in parallel (OpenMP). Item i draws from its own
// generator, stream i under one draw of `rng`: the values depend on rng's state only, not on the
// thread count or schedule, so a run replays from FUSEKIT_TEST_SEED. The large benchmark-shape
// tests spent most of their time in serial random fills.
template <class F>
void parallel_fill(std::int64_t count, std::mt19937_64& rng, F&& fill) {
  const std::uint64_t base = rng();
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < count; ++i) {
    std::mt19937_64 item_rng = stream_rng(base, static_cast<std::uint64_t>(i));
    fill(i, item_rng);
  }
}

// Error of a float32 two-level column sum of `terms` (rows x cols, row-major; chunks of 32 rows,
// then the chunk sums in order) against `ref`: what a typical float32 GPU reduction achieves, i.e.
// PyTorch's own error level for a weight or bias gradient. At least the expected (RMS) error of that
// sum's roundings (see harness.cpp: one cancelling column must not make the bar a lucky draw).
double f32_column_sum_error(const std::vector<double>& terms, std::int64_t rows, std::int64_t cols,
                            const std::vector<double>& ref);

// How many padding elements of a (rows, cols) buffer with `pad` extra elements per row still hold
// the poison (every byte 0xFF). Storage ends with the last row's data, so rows - 1 rows have
// padding: (rows - 1) * pad when nothing wrote there.
std::int64_t poisoned_padding(const Buffer& b, std::int64_t rows, std::int64_t cols, std::int64_t pad);

// (loss(v + h) - loss(v - h)) / 2h, v being element `i` of `param` (restored afterwards).
double central_difference(Buffer& param, std::int64_t i, double h,
                          const std::function<double()>& loss);

}  // namespace fusekit::testing
