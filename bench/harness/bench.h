// Benchmark harness: CUDA-event timing (warm-up, median of many runs, inputs rotated so that the
// working set exceeds L2), the two ceilings measured in the same process (device-to-device copy
// bandwidth, cuBLAS bf16 GEMM), and a report printed as a table and written as JSON.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace fusekit::bench {

// What `fusekit bench` was asked for beyond the op list (its command-line flags); the benches and
// the timing loop read them through options().
struct Options {
  std::string shapes;       // --shapes: "RxC,RxC" for the (rows, cols) benches, "MxKxN" for linear,
                            // a case-name filter for attention; empty: every default shape
  std::string activations;  // --activations "silu,gelu_tanh": linear's activations; empty: all
  bool diagnostics = false; // --diagnostics: extra rows (e.g. backward without dweight, bwd-det)
  std::int64_t row_pad = 0; // --row-pad P: row stride cols + P elements (a multiple of 16)
  int batch = 1;            // --batch B: calls per event pair (1..256)
  unsigned gap_us = 0;      // --gap-us N: GPU idle N us before each timed run
  bool l2_flush = false;    // --l2-flush: read a 256 MB buffer before each timed run
};
void set_options(const Options& o);  // validates; throws std::runtime_error naming the flag
const Options& options();

struct Ceilings {
  std::string device;
  double copy_gbps = 0;     // cudaMemcpy device-to-device, bytes read + written per second
  double gemm_tflops = 0;   // cuBLAS bf16 8192^3, fp32 accumulation
};

// The copy ceiling is measured before the benchmarks, the GEMM ceiling after them: a power-hungry
// GEMM run first left the memory-bound kernels timed right after it 10-14% slower (H200, the
// first dropout shape), as if at a lower clock.
Ceilings measure_copy_ceiling();
double measure_gemm_ceiling();

struct Timing {
  double median_us = 0, min_us = 0, max_us = 0;
  int runs = 0;
};

// Times fn(rotation) with CUDA events, one event pair per call; rotation cycles through
// [0, rotations) so that consecutive calls touch different buffers. Calls run back to back, as in
// a training step. Two diagnostics change that, outside the timed span: --l2-flush reads a 256 MB
// buffer before each call (L2 then holds no dirty lines from the previous call), --gap-us N keeps
// the GPU idle N us before each call. A kernel that is faster alone (Nsight) than back to back is
// told apart with them (bench: rms_norm bwd (16384, 5120), H200).
Timing time_kernel(const std::function<void(int rotation)>& fn, int rotations, int warmup = 10,
                   int runs = 100);

// Calls per event pair in time_kernel (--batch, default 1, at most 256): with B > 1
// each timed run is B consecutive calls (rotations continuing) between one event pair, and the
// run's time is divided by B. The flush and gap diagnostics then apply once per run.
int batch_calls();

// Times two implementations of the same computation alternately (a, b, a, b, ...), one event
// pair per call, and returns both medians. For comparisons that must hold within a few percent
// (the fused GEMM against the plain one): compute-bound kernels run at clocks that drift with the
// power and thermal state, so two back-to-back measurement blocks can differ by more than what
// is compared; interleaved, both see the same states.
std::pair<Timing, Timing> time_interleaved(const std::function<void(int rotation)>& a,
                                           const std::function<void(int rotation)>& b,
                                           int rotations, int warmup = 10, int runs = 100);
// The same for any number of implementations, called in turns (fns[0], fns[1], ..., fns[0], ...):
// one Timing each, in order.
std::vector<Timing> time_in_turns(const std::vector<std::function<void(int rotation)>>& fns, int rotations,
                                  int warmup = 10, int runs = 100);

// A device-to-device cudaMemcpy of `bytes` per call, from src(r) to dst(r) for rotation r, timed
// like a kernel: what a plain memcpy of an op's bytes reaches at that size, where launch and ramp
// costs are not amortized as in the 1 GiB copy ceiling. The memory-bound benches report it as
// impl "copy" beside their rows.
Timing time_same_size_copy(std::size_t bytes, int rotations, const std::function<void*(int rotation)>& dst,
                           const std::function<const void*(int rotation)>& src);

// --shapes "16384x4096,4096x6144" replaces a (rows, cols) bench's shapes (for tuning and
// profiling); without it, `defaults`. A malformed list throws, naming the flag.
std::vector<std::pair<std::int64_t, std::int64_t>> selected_shapes(
    const std::vector<std::pair<std::int64_t, std::int64_t>>& defaults);

// --row-pad P (a diagnostic, default 0, a multiple of 16): the (rows, cols) benches
// lay their row-major tensors out with row strides of cols + P elements, so that one call can tell
// whether a shape's time depends on where its rows start (DRAM address mapping) rather than on
// its size. Rows are labelled with the padding ("(8192, 8192) +256").
std::int64_t row_pad_elements();

// A (rows, cols) bf16 problem's row-major tensors: `bytes` of data each, laid out `ld` elements
// apart (cols + --row-pad) in allocations of `alloc` bytes.
struct RowTensors {
  std::size_t elems, bytes;
  std::int64_t ld;
  std::size_t alloc;
};
inline RowTensors bf16_row_tensors(std::int64_t rows, std::int64_t cols) {
  const std::size_t elems = std::size_t(rows) * cols;
  const std::int64_t ld = cols + row_pad_elements();
  return {elems, elems * 2, ld, std::size_t(rows) * ld * 2};
}
std::string padded_shape_label(std::int64_t rows, std::int64_t cols);

// How many copies of a working set of `bytes` are needed so that cycling through them overflows
// L2 twice over (at least 2).
int rotations_for(std::size_t bytes);

struct Row {
  std::string op;         // "layer_norm"
  std::string direction;  // "fwd" / "bwd"
  std::string shape;      // "(16384, 1024)"
  std::string impl;       // "fusekit"
  double time_us = 0;
  double bytes = 0;       // bytes counted as moved (each input once, each output once)
  double flops = 0;       // for matrix ops
  double gbps() const { return time_us > 0 ? bytes / time_us / 1e3 : 0; }
  double tflops() const { return time_us > 0 ? flops / time_us / 1e6 : 0; }
};

class Report {
 public:
  explicit Report(Ceilings c) : ceilings_(std::move(c)) {}
  void add(const Row& r) { rows_.push_back(r); }
  void print() const;
  std::string json() const;
  const Ceilings& ceilings() const { return ceilings_; }
  void set_gemm_ceiling(double tflops) { ceilings_.gemm_tflops = tflops; }

 private:
  Ceilings ceilings_;
  std::vector<Row> rows_;
};

// A device buffer for benchmarks, filled with random normal values of the dtype (never zeros).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes);
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  ~DeviceBuffer();
  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }
  // Fills with normal(mean, stddev) values stored as bf16 / f16 / f32 (elem_size 2 means bf16
  // unless half is set).
  void fill_random_bf16(std::uint64_t seed, float mean = 0.f, float stddev = 1.f);
  void fill_random_f32(std::uint64_t seed, float mean = 0.f, float stddev = 1.f);

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

void check(bool ok, const std::string& what);
void cuda_check(int status, const char* what);

}  // namespace fusekit::bench
