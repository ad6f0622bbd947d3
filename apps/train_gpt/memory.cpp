#include "memory.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace train_gpt {
namespace {

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(status));
}

}  // namespace

Arena::~Arena() {
  for (void* block : blocks_) {
    if (device_.is_cuda())
      (void)cudaFree(block);
    else
      std::free(block);
  }
}

void* Arena::allocate(std::size_t bytes) {
  const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + 255) / 256 * 256;
  void* block = nullptr;
  if (device_.is_cuda()) {
    use_device(device_);
    cuda_check(cudaMalloc(&block, rounded), "cudaMalloc");
    cuda_check(cudaMemset(block, 0, rounded), "cudaMemset");
  } else {
    block = std::aligned_alloc(256, rounded);
    if (!block) throw std::runtime_error("out of host memory allocating " + std::to_string(rounded) + " bytes");
    std::memset(block, 0, rounded);
  }
  blocks_.push_back(block);
  bytes_ += rounded;
  return block;
}

fusekit::TensorView Arena::tensor(fusekit::DType dtype, std::initializer_list<std::int64_t> shape) {
  return tensor(dtype, std::vector<std::int64_t>(shape));
}

fusekit::TensorView Arena::tensor(fusekit::DType dtype, const std::vector<std::int64_t>& shape) {
  std::int64_t count = 1;
  for (std::int64_t s : shape) count *= s;
  return contiguous_view(allocate(static_cast<std::size_t>(count) * fusekit::dtype_size(dtype)), dtype,
                         device_, shape);
}

fusekit::TensorView contiguous_view(void* data, fusekit::DType dtype, fusekit::Device device,
                                    const std::vector<std::int64_t>& shape) {
  return fusekit::TensorView::from_arrays(data, dtype, device, static_cast<int>(shape.size()),
                                          shape.data(), nullptr);
}

std::size_t tensor_bytes(const fusekit::TensorView& t) {
  return static_cast<std::size_t>(t.numel()) * fusekit::dtype_size(t.dtype);
}

void copy_to_host(void* host, const fusekit::TensorView& t) {
  if (!t.is_contiguous()) throw std::logic_error("copy_to_host: tensor not contiguous");
  if (t.device.is_cuda())
    cuda_check(cudaMemcpy(host, t.data, tensor_bytes(t), cudaMemcpyDeviceToHost), "cudaMemcpy to host");
  else
    std::memcpy(host, t.data, tensor_bytes(t));
}

void copy_from_host(const fusekit::TensorView& t, const void* host) {
  if (!t.is_contiguous()) throw std::logic_error("copy_from_host: tensor not contiguous");
  if (t.device.is_cuda())
    cuda_check(cudaMemcpy(t.data, host, tensor_bytes(t), cudaMemcpyHostToDevice), "cudaMemcpy to device");
  else
    std::memcpy(t.data, host, tensor_bytes(t));
}

void zero_fill(const fusekit::TensorView& t, fusekit::Stream stream) {
  if (!t.is_contiguous()) throw std::logic_error("zero_fill: tensor not contiguous");
  if (t.device.is_cuda())
    cuda_check(cudaMemsetAsync(t.data, 0, tensor_bytes(t), static_cast<cudaStream_t>(stream)), "cudaMemsetAsync");
  else
    std::memset(t.data, 0, tensor_bytes(t));
}

DeviceStream::DeviceStream(fusekit::Device device) {
  if (!device.is_cuda()) return;
  use_device(device);
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
  stream_ = stream;
}

DeviceStream::~DeviceStream() {
  if (stream_) (void)cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

StreamGraph::~StreamGraph() { release(); }

void StreamGraph::release() noexcept {
  if (exec_) (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_) (void)cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
  exec_ = graph_ = nullptr;
}

void StreamGraph::record(fusekit::Stream stream, const std::function<void()>& enqueue) {
  if (!stream) throw std::logic_error("StreamGraph::record: needs a GPU stream");
  release();
  const auto s = static_cast<cudaStream_t>(stream);
  cuda_check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  cudaGraph_t graph = nullptr;
  try {
    enqueue();
  } catch (...) {
    (void)cudaStreamEndCapture(s, &graph);  // leaves the stream usable; the partial graph is dropped
    if (graph) (void)cudaGraphDestroy(graph);
    throw;
  }
  cuda_check(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
  graph_ = graph;
  cudaGraphExec_t exec = nullptr;
  cuda_check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  exec_ = exec;
}

void StreamGraph::replay(fusekit::Stream stream) const {
  if (!exec_) throw std::logic_error("StreamGraph::replay: nothing recorded");
  cuda_check(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), static_cast<cudaStream_t>(stream)),
             "cudaGraphLaunch");
}

void synchronize(fusekit::Device device) {
  if (device.is_cuda()) cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

void use_device(fusekit::Device device) {
  if (device.is_cuda()) cuda_check(cudaSetDevice(device.index), "cudaSetDevice");
}

std::size_t device_bytes_in_use(fusekit::Device device) {
  if (!device.is_cuda()) return 0;
  std::size_t free_bytes = 0, total_bytes = 0;
  cuda_check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return total_bytes - free_bytes;
}

std::uint16_t float_to_bf16(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu)) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  return static_cast<std::uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

float bf16_to_float(std::uint16_t bits) {
  const std::uint32_t wide = std::uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}

}  // namespace train_gpt
