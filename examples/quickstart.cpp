// fusekit quickstart (C++): the ops of a transformer block, forward and backward, through the
// public API. The same function runs them on the CPU (CPU views run the float64 reference) and,
// where a CUDA device is present, on the GPU; the two results are then compared.
//
//   ninja -C build fusekit_quickstart && ./build/fusekit_quickstart     (also a CTest: Examples.quickstart)
//
// fusekit never allocates: the caller owns every output and scratch buffer and hands fusekit
// non-owning TensorViews. Only where the buffers live differs between the CPU and the GPU run.
#include <cuda_runtime.h>
#include <fusekit/fusekit.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

using namespace fusekit;

namespace {

// ---- the example's own memory and data (nothing here is fusekit API) -------------------------

void cuda_ok(cudaError_t status) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(status));
    std::exit(1);
  }
}

// Bytes on one device, 256-byte aligned (fusekit asks 16-byte alignment of most pointers).
class Buffer {
 public:
  Buffer(Device device, std::size_t bytes) : device_(device), bytes_(bytes) {
    const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + 255) / 256 * 256;
    if (device.is_cuda())
      cuda_ok(cudaMalloc(&data_, rounded));
    else
      data_ = std::aligned_alloc(256, rounded);
  }
  ~Buffer() { device_.is_cuda() ? (void)cudaFree(data_) : std::free(data_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  void upload(const void* host) {
    if (device_.is_cuda())
      cuda_ok(cudaMemcpy(data_, host, bytes_, cudaMemcpyHostToDevice));
    else
      std::memcpy(data_, host, bytes_);
  }
  void download(void* host) const {
    if (device_.is_cuda())
      cuda_ok(cudaMemcpy(host, data_, bytes_, cudaMemcpyDeviceToHost));
    else
      std::memcpy(host, data_, bytes_);
  }

 private:
  Device device_;
  std::size_t bytes_;
  void* data_ = nullptr;
};

// bfloat16 <-> float on the host (round to nearest even; the data here has no NaNs).
std::uint16_t to_bf16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<std::uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
float from_bf16(std::uint16_t h) {
  const std::uint32_t bits = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A bf16 or f32 tensor on `device` holding `shape`; random values in [-scale, scale] or a constant.
struct Tensor {
  Buffer buffer;
  TensorView view;

  Tensor(Device device, DType dtype, std::initializer_list<std::int64_t> shape)
      : buffer(device, dtype_size(dtype) * count(shape)),
        view(buffer.data(), dtype, device, shape) {}

  static std::int64_t count(std::initializer_list<std::int64_t> shape) {
    std::int64_t n = 1;
    for (std::int64_t s : shape) n *= s;
    return n;
  }
  void fill(std::uint32_t seed, float scale, bool constant = false) {
    std::vector<float> values(view.numel());
    std::uint32_t state = seed * 2654435761u + 1;
    for (float& v : values) {
      state = state * 1664525u + 1013904223u;
      v = constant ? scale : scale * (2.0f * float(state >> 8) / float(1u << 24) - 1.0f);
    }
    set(values);
  }
  void set(const std::vector<float>& values) {
    if (view.dtype == DType::f32) return buffer.upload(values.data());
    std::vector<std::uint16_t> bits(values.size());
    std::transform(values.begin(), values.end(), bits.begin(), to_bf16);
    buffer.upload(bits.data());
  }
  std::vector<float> get() const {
    std::vector<float> values(view.numel());
    if (view.dtype == DType::f32) {
      buffer.download(values.data());
    } else {
      std::vector<std::uint16_t> bits(values.size());
      buffer.download(bits.data());
      std::transform(bits.begin(), bits.end(), values.begin(), from_bf16);
    }
    return values;
  }
};

// Scratch memory of `bytes` on `device` as a u8 view; none where none is needed (the CPU).
struct Workspace {
  Buffer buffer;
  OptionalTensor view;
  Workspace(Device device, std::size_t bytes) : buffer(device, bytes) {
    if (bytes > 0) view = TensorView(buffer.data(), DType::u8, device, {std::int64_t(bytes)});
  }
};

using Results = std::map<std::string, std::vector<float>>;

// ---- the fusekit calls -------------------------------------------------------------------------

Results run_block(Device dev) {
  const std::int64_t batch = 2, seq = 128, heads = 4, head_dim = 64;
  const std::int64_t tokens = batch * seq, model = heads * head_dim, hidden = 4 * model;
  const DType bf16 = DType::bf16, f32 = DType::f32;
  Results results;

  // LayerNorm: y = (x - mean) * rstd * w + b over each row of x (tokens, model).
  Tensor x(dev, bf16, {tokens, model}), w(dev, bf16, {model}), b(dev, bf16, {model});
  Tensor y(dev, bf16, {tokens, model}), mean(dev, f32, {tokens}), rstd(dev, f32, {tokens});
  x.fill(1, 2.0f);
  w.fill(2, 1.0f, /*constant=*/true);
  b.fill(3, 0.1f);
  layer_norm_forward(x.view, w.view, b.view, 1e-5f, y.view, mean.view, rstd.view);

  // Its backward: ask for the scratch size, allocate it, pass it in. Any of dx/dw/db may be nullopt.
  Tensor dy(dev, bf16, {tokens, model}), dx(dev, bf16, {tokens, model});
  Tensor dw(dev, bf16, {model}), db(dev, bf16, {model});
  dy.fill(4, 1.0f);
  Workspace norm_ws(dev, norm_backward_workspace_size(tokens, model, bf16, dev));
  layer_norm_backward(dy.view, x.view, w.view, mean.view, rstd.view, dx.view, dw.view, db.view,
                      norm_ws.view);

  // Linear with a fused bias and GELU: u = gelu_tanh(y W^T + c), saving the pre-activation.
  Tensor weight(dev, bf16, {hidden, model}), c(dev, bf16, {hidden});
  Tensor u(dev, bf16, {tokens, hidden}), pre(dev, bf16, {tokens, hidden});
  weight.fill(5, 0.06f);
  c.fill(6, 0.1f);
  Workspace linear_ws(dev, linear_forward_workspace_size(tokens, hidden, model, bf16,
                                                         Activation::gelu_tanh, dev));
  linear_forward(y.view, weight.view, c.view, Activation::gelu_tanh, u.view, pre.view,
                 linear_ws.view);

  // Dropout (p = 0.1) with the mask regenerated from (seed, offset): nothing is stored for backward.
  Tensor dropped(dev, bf16, {tokens, hidden});
  BiasActDropoutConfig dropout;
  dropout.p = 0.1f;
  dropout.seed = 42;
  bias_act_dropout_forward(u.view, std::nullopt, dropout, dropped.view);

  // Causal attention, q/k/v/out in the (batch, seq, heads, head_dim) layout; lse saved for backward.
  Tensor q(dev, bf16, {batch, seq, heads, head_dim}), k(dev, bf16, {batch, seq, heads, head_dim});
  Tensor v(dev, bf16, {batch, seq, heads, head_dim}), out(dev, bf16, {batch, seq, heads, head_dim});
  Tensor lse(dev, f32, {batch, heads, seq});
  q.fill(7, 1.0f);
  k.fill(8, 1.0f);
  v.fill(9, 1.0f);
  AttentionConfig causal;
  causal.mask = AttentionMask::causal_top_left;
  attention_forward(q.view, k.view, v.view, /*bias=*/std::nullopt, causal, out.view, lse.view);

  // Attention backward: dq, dk, dv from dout (the GPU needs a workspace; the CPU none).
  Tensor dout(dev, bf16, {batch, seq, heads, head_dim}), dq(dev, bf16, {batch, seq, heads, head_dim});
  Tensor dk(dev, bf16, {batch, seq, heads, head_dim}), dv(dev, bf16, {batch, seq, heads, head_dim});
  dout.fill(10, 1.0f);
  const AttentionShape shape{batch, seq, seq, heads, heads, head_dim, head_dim, bf16};
  Workspace attention_ws(dev, attention_backward_workspace_size(shape, causal, false, dev));
  attention_backward(dout.view, q.view, k.view, v.view, out.view, lse.view, std::nullopt, causal,
                     dq.view, dk.view, dv.view, /*dbias=*/std::nullopt, /*varlen=*/std::nullopt,
                     /*deterministic=*/false, attention_ws.view);

  if (dev.is_cuda()) cuda_ok(cudaDeviceSynchronize());
  const std::vector<std::pair<const char*, const Tensor*>> outputs = {
      {"layer_norm y", &y}, {"layer_norm dx", &dx}, {"layer_norm dw", &dw}, {"linear u", &u},
      {"dropout", &dropped}, {"attention out", &out}, {"attention dq", &dq}, {"attention dv", &dv}};
  for (const auto& [name, t] : outputs) results[name] = t->get();
  return results;
}

// ||a - b|| / ||b|| (relative L2): GPU against the CPU reference, both rounded to bf16.
double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 1e-300;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

}  // namespace

int main() {
  try {
    const Results cpu = run_block(Device::cpu());
    std::printf("CPU (float64 reference): %zu outputs, e.g. layer_norm y[0] = %.4f, attention out[0] = %.4f\n",
                cpu.size(), cpu.at("layer_norm y")[0], cpu.at("attention out")[0]);

    if (cuda_device_count() == 0) {
      std::printf("no CUDA device: ran on the CPU only\n");
      return 0;
    }
    std::printf("GPU: %s\n", describe_cuda_device(0).c_str());
    const Results gpu = run_block(Device::cuda(0));
    bool ok = true;
    for (const auto& [name, reference] : cpu) {
      const double d = relative_difference(gpu.at(name), reference);
      ok = ok && d < 2e-2;  // bf16 rounding alone is ~2e-3
      std::printf("  %-14s GPU vs CPU: relative L2 difference %.1e\n", name.c_str(), d);
    }
    std::puts(ok ? "GPU matches the CPU reference" : "GPU differs from the CPU reference");
    return ok ? 0 : 1;
  } catch (const Error& e) {
    // Every fusekit failure is a fusekit::Error; a GPU the kernels were not built for is
    // ErrorKind::unsupported (the CPU part above has run by then).
    std::printf("%s: %s\n", e.kind() == ErrorKind::unsupported ? "unsupported" : "error", e.what());
    return e.kind() == ErrorKind::unsupported ? 0 : 1;
  }
}
