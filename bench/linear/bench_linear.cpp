// Linear + bias + activation benchmarks: bf16, the (M, K, N) shapes plus one odd one.
//
// Forward rows per activation (shape "(M, K, N) act"):
//   fusekit          bias + activation, saving the pre-activation for backward (training), except
//                    for none, which has nothing to save;
//   fusekit_nopre    the same without saving the pre-activation (inference);
//   fusekit_cutlass  the fused CUTLASS path forced, where the automatic choice is another path;
//   fusekit_unfused  cuBLASLt GEMM + separate activation kernel forced (what fusion saves);
//   cublas_plain     cublasGemmEx y = x W^T, no bias, no activation: the bar ("free" = within 3%).
// Backward rows: fusekit (dx, dW, dbias from dout and the saved pre-activation) against
//   cublas_plain = the two plain GEMMs dx = dout W and dW = dout^T x.
// flops: 2 M N K per GEMM (the activation, bias and bias-gradient work is not counted).
// bytes: every tensor read or written once, as in the other families' rows.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <optional>
#include <vector>

#include "bench/harness/bench.h"
#include "bench/linear/bench_linear.h"
#include "fusekit/linear.h"
#include "linear/linear_paths.h"

namespace fusekit::bench {

namespace {

constexpr Activation kActivations[] = {Activation::none,      Activation::relu,
                                       Activation::gelu_erf,  Activation::gelu_tanh,
                                       Activation::squared_relu, Activation::silu};

struct Set {
  DeviceBuffer x, w, b, y, pre, dout, dx, dw, db;
};

void cublas_ok(cublasStatus_t s, const char* what) {
  check(s == CUBLAS_STATUS_SUCCESS, std::string(what) + " failed (cuBLAS status " + std::to_string(int(s)) + ")");
}

// Restores automatic path selection when it goes out of scope.
struct ForcedPath {
  explicit ForcedPath(linear::ForwardPath p) { linear::set_forward_path_override(p); }
  ~ForcedPath() { linear::set_forward_path_override(linear::ForwardPath::automatic); }
};

}  // namespace

const std::vector<LinearBenchShape>& linear_bench_shapes() {
  // The odd shape: M odd and N not a multiple of the 128-wide tiles, but rows 16-byte aligned
  // (N a multiple of 8), so the fused paths apply. The last two: the MLP up projections of GPT-2
  // 124M (apps/train_gpt, 16 x 1024 tokens) and of a 1B Llama-style model, where dx is narrow.
  static const std::vector<LinearBenchShape> shapes = {{8192, 4096, 16384}, {16384, 8192, 8192},
                                                       {8192, 16384, 4096}, {8191, 4096, 12296},
                                                       {16384, 768, 3072},  {16384, 2048, 8192}};
  return shapes;
}

void bench_linear(Report& report, const std::string&) {
  const Device gpu = Device::cuda(0);
  cublasHandle_t handle;
  cublas_ok(cublasCreate(&handle), "cublasCreate");
  const float alpha = 1.0f, beta = 0.0f;
  const DType bf16 = DType::bf16;

  // For tuning runs: --shapes 8192x4096x16384 (M x K x N) narrows the shapes, --activations
  // silu,gelu_tanh the activations.
  const char* shape_filter = options().shapes.empty() ? nullptr : options().shapes.c_str();
  const char* act_filter = options().activations.empty() ? nullptr : options().activations.c_str();
  for (const LinearBenchShape& s : linear_bench_shapes()) {
    const std::int64_t m = s.m, k = s.k, n = s.n;
    if (shape_filter && std::string(shape_filter).find(fmt::format("{}x{}x{}", m, k, n)) == std::string::npos)
      continue;
    const std::size_t x_bytes = std::size_t(m) * k * 2, w_bytes = std::size_t(n) * k * 2,
                      y_bytes = std::size_t(m) * n * 2, b_bytes = std::size_t(n) * 2;
    const int rotations = rotations_for(x_bytes + w_bytes + 2 * y_bytes);
    std::vector<Set> sets(rotations);
    for (int r = 0; r < rotations; ++r) {
      Set& t = sets[r];
      t = {DeviceBuffer(x_bytes), DeviceBuffer(w_bytes), DeviceBuffer(b_bytes), DeviceBuffer(y_bytes),
           DeviceBuffer(y_bytes), DeviceBuffer(y_bytes), DeviceBuffer(x_bytes), DeviceBuffer(w_bytes),
           DeviceBuffer(b_bytes)};
      t.x.fill_random_bf16(300 + r);
      t.w.fill_random_bf16(400 + r, 0.0f, 1.0f / std::sqrt(float(k)));
      t.b.fill_random_bf16(500 + r, 0.0f, 0.5f);
      t.dout.fill_random_bf16(600 + r);
    }
    std::size_t ws_bytes = 0;
    for (Activation a : kActivations)
      ws_bytes = std::max({ws_bytes, linear_forward_workspace_size(m, n, k, bf16, a, gpu),
                           linear_backward_workspace_size(m, n, k, bf16, a, gpu)});
    DeviceBuffer ws(ws_bytes);
    const TensorView workspace(ws.get(), DType::u8, gpu, {static_cast<std::int64_t>(ws_bytes)});
    auto mat = [&](const DeviceBuffer& buf, std::int64_t rows, std::int64_t cols) {
      return TensorView(buf.get(), bf16, gpu, {rows, cols});
    };
    auto vec = [&](const DeviceBuffer& buf) { return TensorView(buf.get(), bf16, gpu, {n}); };

    const double gemm_flops = 2.0 * double(m) * double(n) * double(k);
    const std::string plain_shape = fmt::format("({}, {}, {})", m, k, n);
    for (Activation act : kActivations) {
      if (act_filter && ("," + std::string(act_filter) + ",").find("," + std::string(activation_name(act)) + ",") ==
                            std::string::npos)
        continue;
      const std::string shape = plain_shape + " " + activation_name(act);
      const bool keeps_pre = act != Activation::none;
      auto forward = [&](bool save_pre) {
        return [&, save_pre](int r) {
          Set& t = sets[r];
          linear_forward(mat(t.x, m, k), mat(t.w, n, k), vec(t.b), act, mat(t.y, m, n),
                         save_pre ? OptionalTensor(mat(t.pre, m, n)) : std::nullopt, workspace);
        };
      };
      auto plain_forward = [&](int r) {
        Set& t = sets[r];
        cublas_ok(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &alpha,
                               t.w.get(), CUDA_R_16BF, int(k), t.x.get(), CUDA_R_16BF, int(k), &beta,
                               t.y.get(), CUDA_R_16BF, int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                  "cublasGemmEx (forward)");
      };
      const double fwd_bytes = double(x_bytes + w_bytes + b_bytes + y_bytes * (keeps_pre ? 2 : 1));
      const double plain_fwd_bytes = double(x_bytes + w_bytes + y_bytes);

      // Which path the automatic choice takes, for the record.
      forward(keeps_pre)(0);
      cuda_check(cudaDeviceSynchronize(), "linear forward");
      const linear::ForwardPath auto_path = linear::last_forward_path();
      forward(false)(0);
      const linear::ForwardPath auto_path_nopre = linear::last_forward_path();
      fmt::print("linear {}: forward path {} (without pre-activation: {})\n", shape,
                 linear::forward_path_name(auto_path), linear::forward_path_name(auto_path_nopre));

      // fusekit and the plain GEMM alternate call by call (time_interleaved): the ratio the
      // issue bounds is a few percent, less than the clock drift between two measurement blocks.
      const auto [tp, tf] = time_interleaved(plain_forward, forward(keeps_pre), rotations, 5, 40);
      report.add({"linear", "fwd", shape, "cublas_plain", tp.median_us, plain_fwd_bytes, gemm_flops});
      report.add({"linear", "fwd", shape, "fusekit", tf.median_us, fwd_bytes, gemm_flops});
      if (keeps_pre) {
        const Timing tn = time_kernel(forward(false), rotations, 5, 30);
        report.add({"linear", "fwd", shape, "fusekit_nopre", tn.median_us, fwd_bytes - y_bytes, gemm_flops});
      }
      for (linear::ForwardPath forced : {linear::ForwardPath::cutlass_fused, linear::ForwardPath::unfused}) {
        if (forced == auto_path) continue;
        ForcedPath force(forced);
        forward(keeps_pre)(0);
        if (linear::last_forward_path() != forced) continue;  // not applicable to this case
        const Timing t = time_kernel(forward(keeps_pre), rotations, 5, 30);
        const char* impl = forced == linear::ForwardPath::cutlass_fused ? "fusekit_cutlass" : "fusekit_unfused";
        report.add({"linear", "fwd", shape, impl, t.median_us, fwd_bytes, gemm_flops});
      }

      // Backward from the saved pre-activation of every rotation.
      for (int r = 0; r < rotations; ++r) forward(keeps_pre)(r);
      auto backward = [&](int r) {
        Set& t = sets[r];
        linear_backward(mat(t.dout, m, n), mat(t.x, m, k), mat(t.w, n, k),
                        keeps_pre ? OptionalTensor(mat(t.pre, m, n)) : std::nullopt, act,
                        mat(t.dx, m, k), mat(t.dw, n, k), vec(t.db), workspace);
      };
      auto plain_backward = [&](int r) {
        Set& t = sets[r];
        cublas_ok(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, int(k), int(m), int(n), &alpha,
                               t.w.get(), CUDA_R_16BF, int(k), t.dout.get(), CUDA_R_16BF, int(n), &beta,
                               t.dx.get(), CUDA_R_16BF, int(k), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                  "cublasGemmEx (dx)");
        cublas_ok(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, int(k), int(n), int(m), &alpha,
                               t.x.get(), CUDA_R_16BF, int(k), t.dout.get(), CUDA_R_16BF, int(n), &beta,
                               t.dw.get(), CUDA_R_16BF, int(k), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                  "cublasGemmEx (dW)");
      };
      const double bwd_bytes = double(y_bytes * (keeps_pre ? 2 : 1) + 2 * x_bytes + 2 * w_bytes + b_bytes);
      const double plain_bwd_bytes = double(y_bytes + 2 * x_bytes + 2 * w_bytes);
      const auto [tpb, tb] = time_interleaved(plain_backward, backward, rotations, 5, 40);
      report.add({"linear", "bwd", shape, "cublas_plain", tpb.median_us, plain_bwd_bytes, 2 * gemm_flops});
      report.add({"linear", "bwd", shape, "fusekit", tb.median_us, bwd_bytes, 2 * gemm_flops});
    }
  }
  cublasDestroy(handle);
}

}  // namespace fusekit::bench
