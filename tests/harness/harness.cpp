#include "tests/harness/harness.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <sstream>

#include "core/convert.h"
#include "fusekit/error.h"
#include "fusekit/runtime.h"

namespace fusekit::testing {

namespace {
void cuda_ok(cudaError_t s, const char* what) {
  if (s != cudaSuccess)
    throw std::runtime_error(std::string("test harness: ") + what + ": " + cudaGetErrorString(s));
}
}  // namespace

const std::string& gpu_skip_reason() {
  static const std::string reason = [] {
    if (cuda_device_count() == 0) return std::string("no CUDA device on this machine: GPU test skipped");
    try {
      require_supported_gpu("tests", 0);
    } catch (const Error& e) {
      return std::string("GPU present but unsupported: ") + e.what();
    }
    return std::string();
  }();
  return reason;
}

Buffer::Buffer(DType dtype, Device device, std::vector<std::int64_t> shape,
               std::vector<std::int64_t> strides, std::int64_t lead)
    : dtype_(dtype), device_(device), shape_(std::move(shape)), strides_(std::move(strides)),
      lead_bytes_(static_cast<std::size_t>(lead) * dtype_size(dtype)) {
  if (strides_.empty()) {
    strides_.resize(shape_.size());
    std::int64_t s = 1;
    for (int d = static_cast<int>(shape_.size()) - 1; d >= 0; --d) {
      strides_[d] = s;
      s *= shape_[d];
    }
  }
  std::int64_t max_offset = 0;
  bool empty = false;
  for (std::size_t d = 0; d < shape_.size(); ++d) {
    if (shape_[d] == 0) empty = true;
    max_offset += (shape_[d] - 1) * strides_[d];
  }
  const std::int64_t elements = empty ? 0 : max_offset + 1;
  storage_bytes_ = lead_bytes_ + static_cast<std::size_t>(elements) * dtype_size(dtype_);
  host_.assign(storage_bytes_, 0);
  if (device_.is_cuda() && storage_bytes_ > lead_bytes_) {
    cuda_ok(cudaSetDevice(device_.index), "cudaSetDevice");
    cuda_ok(cudaMalloc(&device_ptr_, storage_bytes_), "cudaMalloc");
  }
  poison();
}

Buffer::~Buffer() {
  if (device_ptr_) cudaFree(device_ptr_);
}

Buffer::Buffer(Buffer&& o) noexcept
    : dtype_(o.dtype_), device_(o.device_), shape_(std::move(o.shape_)),
      strides_(std::move(o.strides_)), lead_bytes_(o.lead_bytes_), storage_bytes_(o.storage_bytes_),
      host_(std::move(o.host_)),
      device_ptr_(o.device_ptr_) {
  o.device_ptr_ = nullptr;
}

TensorView Buffer::view() const {
  unsigned char* base = device_.is_cuda() ? static_cast<unsigned char*>(device_ptr_) : host_.data();
  void* data = base ? base + lead_bytes_ : nullptr;
  return TensorView::from_arrays(data, dtype_, device_, static_cast<int>(shape_.size()),
                                 shape_.data(), strides_.data());
}

std::int64_t Buffer::numel() const {
  std::int64_t n = 1;
  for (auto s : shape_) n *= s;
  return n;
}

std::int64_t Buffer::offset_of(std::int64_t linear) const {
  std::int64_t offset = 0;
  for (int d = static_cast<int>(shape_.size()) - 1; d >= 0; --d) {
    offset += (linear % shape_[d]) * strides_[d];
    linear /= shape_[d];
  }
  return offset;
}

void Buffer::upload() {
  if (device_ptr_)
    cuda_ok(cudaMemcpy(device_ptr_, host_.data(), storage_bytes_, cudaMemcpyHostToDevice), "upload");
}

void Buffer::download() const {
  if (device_ptr_) {
    cuda_ok(cudaDeviceSynchronize(), "kernel execution (synchronize before download)");
    cuda_ok(cudaMemcpy(host_.data(), device_ptr_, storage_bytes_, cudaMemcpyDeviceToHost), "download");
  }
}

// The element loops below run in parallel (every element has its own bytes): at the benchmark
// shapes (67-134 M elements) they took seconds per call serially.
std::vector<double> Buffer::values() const {
  download();
  const std::int64_t n = numel();
  std::vector<double> out(n);
  const unsigned char* first = host_.data() + lead_bytes_;
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) out[i] = detail::load_as_double(first, dtype_, offset_of(i));
  return out;
}

void Buffer::set_values(const std::vector<double>& v) {
  const std::int64_t n = numel();
  unsigned char* first = host_.data() + lead_bytes_;
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) detail::store_from_double(first, dtype_, offset_of(i), v[i]);
  upload();
}

void Buffer::fill_normal(std::mt19937_64& rng, double mean, double stddev) {
  // Chunks of 2^16 values, one generator stream each (parallel_fill).
  constexpr std::int64_t kChunk = std::int64_t(1) << 16;
  const std::int64_t n = numel();
  std::vector<double> v(n);
  parallel_fill((n + kChunk - 1) / kChunk, rng, [&](std::int64_t chunk, std::mt19937_64& chunk_rng) {
    std::normal_distribution<double> dist(mean, stddev);
    const std::int64_t end = std::min(n, (chunk + 1) * kChunk);
    for (std::int64_t i = chunk * kChunk; i < end; ++i) v[i] = dist(chunk_rng);
  });
  set_values(v);
}

void Buffer::poison() {
  std::memset(host_.data(), 0xFF, storage_bytes_);
  if (device_ptr_) cuda_ok(cudaMemset(device_ptr_, 0xFF, storage_bytes_), "poison");
}

std::vector<unsigned char> Buffer::raw_bytes() const {
  download();
  return std::vector<unsigned char>(host_.begin() + static_cast<std::ptrdiff_t>(lead_bytes_), host_.end());
}

bool Buffer::lead_untouched() const {
  download();
  return std::all_of(host_.begin(), host_.begin() + static_cast<std::ptrdiff_t>(lead_bytes_),
                     [](unsigned char byte) { return byte == 0xFF; });
}

ErrorStats compare(const std::vector<double>& got, const std::vector<double>& ref) {
  ErrorStats s;
  s.count = static_cast<std::int64_t>(ref.size());
  double num = 0.0, den = 0.0, max_abs = 0.0;
  std::int64_t non_finite = 0;
  const std::int64_t n = s.count;
#pragma omp parallel for schedule(static) reduction(+ : num, den, non_finite) reduction(max : max_abs)
  for (std::int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(got[i]) && std::isfinite(ref[i])) {
      ++non_finite;
      continue;
    }
    const double d = got[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    max_abs = std::max(max_abs, std::abs(d));
  }
  s.non_finite = non_finite;
  s.max_abs = max_abs;
  s.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return s;
}

double rounding_error(DType dtype, const std::vector<double>& ref) {
  const std::int64_t n = static_cast<std::int64_t>(ref.size());
  std::vector<double> rounded(n);
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) rounded[i] = detail::round_to(dtype, ref[i]);
  return compare(rounded, ref).rel_l2;
}

double accumulation_floor(DType dtype) {
  switch (dtype) {
    case DType::f32: return 2e-6;  // float32 sums over up to 65536 terms
    case DType::f16: return 1e-4;
    case DType::bf16: return 1e-3;
    default: return 1e-6;
  }
}

// Half an ulp relative: the largest relative error of rounding one value to the dtype.
double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::f32: return std::ldexp(1.0, -24);
    case DType::f16: return std::ldexp(1.0, -11);
    case DType::bf16: return std::ldexp(1.0, -8);
    case DType::f8e4m3: return std::ldexp(1.0, -4);
    case DType::f8e5m2: return std::ldexp(1.0, -3);
    default: return std::ldexp(1.0, -53);
  }
}

double tolerance(DType dtype, const std::vector<double>& ref) {
  // The rounding baseline is measured on the reference itself, which for a handful of values can
  // be far below the typical half ulp (values that happen to be nearly representable), while a
  // correct float32 computation rounded to the dtype may still land one ulp away when the exact
  // value sits at a rounding boundary. Below 64 values the baseline is floored at the unit
  // roundoff, so that one such flip passes (an exhaustive sweep of small cases drew an f16
  // RMSNorm of 6 values, reference almost exactly +-1, at 4.0e-4 against a 2e-4 bar).
  const double small_sample = ref.size() < 64 ? unit_roundoff(dtype) : 0.0;
  return 2.0 * std::max({rounding_error(dtype, ref), accumulation_floor(dtype), small_sample});
}

std::mt19937_64 make_rng(std::uint64_t salt) {
  // Fresh data every run (seeded from the clock), reported so that a failure can be replayed
  // with FUSEKIT_TEST_SEED.
  static const std::uint64_t base = [] {
    if (const char* env = std::getenv("FUSEKIT_TEST_SEED"))
      return static_cast<std::uint64_t>(std::strtoull(env, nullptr, 10));
    const std::uint64_t s = static_cast<std::uint64_t>(
        std::chrono::high_resolution_clock::now().time_since_epoch().count());
    std::printf("[fusekit tests] random seed %llu (set FUSEKIT_TEST_SEED to replay)\n",
                static_cast<unsigned long long>(s));
    return s;
  }();
  return std::mt19937_64(base ^ (salt * 0x9E3779B97F4A7C15ull));
}

std::mt19937_64 stream_rng(std::uint64_t base, std::uint64_t index) {
  // splitmix64 of (base, index): well-separated seeds for neighbouring indices.
  std::uint64_t z = base + (index + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return std::mt19937_64(z ^ (z >> 31));
}

double f32_column_sum_error(const std::vector<double>& terms, std::int64_t rows, std::int64_t cols,
                            const std::vector<double>& ref) {
  // Per column: chunk sums over 32 rows in row order, then the chunk sums in order. Walked a
  // block of 256 columns at a time along rows (the row-major terms stay in cache lines), blocks in
  // parallel; each column's order of additions is the same as column by column.
  //
  // That error is one draw. Where few columns are summed and one of them cancels to near zero (a
  // bias gradient of one column whose terms add up to almost nothing), the draw may be far below
  // what such a sum costs on average, and "twice PyTorch's error" would be a coin toss. So the
  // error returned is at least the expected one: every rounding in this order (each term to
  // float32, each addition) contributes a uniform error of up to half an ulp, variance
  // (2^-24 |v|)^2 / 3 for a result v, summed over all of them, relative to ||ref||. With no
  // cancellation it is below the sampled error and changes nothing.
  constexpr std::int64_t kBlock = 256;
  constexpr double kHalfUlp = 0x1p-24;
  auto rounding_variance = [](double v) { return (kHalfUlp * v) * (kHalfUlp * v) / 3.0; };
  std::vector<double> got(cols);
  double variance = 0.0;
#pragma omp parallel for schedule(dynamic) reduction(+ : variance)
  for (std::int64_t c0 = 0; c0 < cols; c0 += kBlock) {
    const std::int64_t width = std::min(kBlock, cols - c0);
    float total[kBlock] = {}, chunk[kBlock];
    for (std::int64_t r0 = 0; r0 < rows; r0 += 32) {
      std::fill(chunk, chunk + width, 0.0f);
      for (std::int64_t r = r0; r < std::min(rows, r0 + 32); ++r)
        for (std::int64_t j = 0; j < width; ++j) {
          const float term = static_cast<float>(terms[r * cols + c0 + j]);
          chunk[j] += term;
          variance += rounding_variance(term) + (r > r0 ? rounding_variance(chunk[j]) : 0.0);
        }
      for (std::int64_t j = 0; j < width; ++j) {
        total[j] += chunk[j];
        if (r0 > 0) variance += rounding_variance(total[j]);
      }
    }
    for (std::int64_t j = 0; j < width; ++j) got[c0 + j] = total[j];
  }
  double ref_squares = 0.0;
  for (double r : ref) ref_squares += r * r;
  const double expected = ref_squares > 0.0 ? std::sqrt(variance / ref_squares) : 0.0;
  return std::max(compare(got, ref).rel_l2, expected);
}

std::int64_t poisoned_padding(const Buffer& b, std::int64_t rows, std::int64_t cols, std::int64_t pad) {
  const auto raw = b.raw_bytes();
  const std::size_t size = dtype_size(b.dtype());
  std::int64_t poisoned = 0;
  for (std::int64_t r = 0; r + 1 < rows; ++r)
    for (std::int64_t k = cols; k < cols + pad; ++k) {
      const unsigned char* element = raw.data() + static_cast<std::size_t>(r * (cols + pad) + k) * size;
      poisoned += std::all_of(element, element + size, [](unsigned char byte) { return byte == 0xFF; });
    }
  return poisoned;
}

double central_difference(Buffer& param, std::int64_t i, double h,
                          const std::function<double()>& loss) {
  auto v = param.values();
  const double orig = v[i];
  v[i] = orig + h;
  param.set_values(v);
  const double lp = loss();
  v[i] = orig - h;
  param.set_values(v);
  const double lm = loss();
  v[i] = orig;
  param.set_values(v);
  return (lp - lm) / (2 * h);
}

}  // namespace fusekit::testing
