// The trainer's memory: every tensor of a run (parameters, gradients, optimizer state,
// activations, scratch) is carved out of buffers this arena owns, on the CPU or on one GPU
// (cudaMalloc). fusekit itself never allocates; the arena is the caller's side of that contract.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

#include <fusekit/tensor.h>

namespace train_gpt {

class Arena {
 public:
  explicit Arena(fusekit::Device device) : device_(device) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // A zero-filled buffer of `bytes`, 256-byte aligned.
  void* allocate(std::size_t bytes);
  // A contiguous tensor of `shape` and `dtype`, zero-filled.
  fusekit::TensorView tensor(fusekit::DType dtype, std::initializer_list<std::int64_t> shape);
  fusekit::TensorView tensor(fusekit::DType dtype, const std::vector<std::int64_t>& shape);

  fusekit::Device device() const { return device_; }
  std::size_t bytes() const { return bytes_; }

 private:
  fusekit::Device device_;
  std::vector<void*> blocks_;
  std::size_t bytes_ = 0;
};

// A contiguous view of `shape` over `data`.
fusekit::TensorView contiguous_view(void* data, fusekit::DType dtype, fusekit::Device device,
                                    const std::vector<std::int64_t>& shape);

// Copies between host memory and a tensor's memory (contiguous tensors only), synchronously.
void copy_to_host(void* host, const fusekit::TensorView& tensor);
void copy_from_host(const fusekit::TensorView& tensor, const void* host);
std::size_t tensor_bytes(const fusekit::TensorView& tensor);
// Sets a contiguous tensor's bytes to 0 (on the GPU: queued on `stream`).
void zero_fill(const fusekit::TensorView& tensor, fusekit::Stream stream = nullptr);

// A CUDA stream of one replica's own on `device` (none on the CPU), destroyed with the object.
// It is a blocking stream: the synchronous copies above run on the device's legacy default
// stream, which waits for the blocking streams' earlier work, so they stay ordered after it.
class DeviceStream {
 public:
  explicit DeviceStream(fusekit::Device device);
  ~DeviceStream();
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;
  fusekit::Stream get() const { return stream_; }

 private:
  fusekit::Stream stream_ = nullptr;
};

// Work queued on a GPU stream, recorded once as a CUDA graph and then replayed with one launch: a
// training step's ~400 kernels run back to back without a launch each. Replay repeats the recorded
// kernels with their recorded arguments and buffers, so what changes from call to call must live
// in those buffers (the batch's tokens), not in arguments.
class StreamGraph {
 public:
  StreamGraph() = default;
  ~StreamGraph();
  StreamGraph(const StreamGraph&) = delete;
  StreamGraph& operator=(const StreamGraph&) = delete;

  bool recorded() const { return exec_ != nullptr; }
  // Records what `enqueue` queues on `stream` (a GPU stream; nothing runs), replacing any earlier
  // recording. Only the calling thread's CUDA calls are restricted while it records.
  void record(fusekit::Stream stream, const std::function<void()>& enqueue);
  // Queues the recorded work on `stream`.
  void replay(fusekit::Stream stream) const;

 private:
  void release() noexcept;
  void* graph_ = nullptr;  // cudaGraph_t
  void* exec_ = nullptr;   // cudaGraphExec_t
};

// Waits for the device's work to finish (nothing on the CPU).
void synchronize(fusekit::Device device);

// Selects the GPU for this thread's later CUDA calls (nothing on the CPU).
void use_device(fusekit::Device device);

// Bytes in use on the GPU (cudaMemGetInfo: total - free), 0 on the CPU.
std::size_t device_bytes_in_use(fusekit::Device device);

// float <-> bfloat16 bits on the host, rounding to nearest even (NaN stays NaN).
std::uint16_t float_to_bf16(float value);
float bf16_to_float(std::uint16_t bits);

}  // namespace train_gpt
