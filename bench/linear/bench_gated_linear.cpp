// Gated linear benchmarks (the gate and up projections of a gated MLP): bf16, SwiGLU, the MLP
// shapes of Llama-style models, x (M, K), W (2F, K) with gate and up rows interleaved, y (M, F).
//
// Forward rows (shape "(M, K, F) silu"):
//   fusekit           y and the saved pre-activation (training);
//   fusekit_nopre     y alone (inference);
//   fusekit_separate  the GEMM into pre, then the gated_act pass (what the epilogue saves);
//   cublas_plain      cublasGemmEx of the same total shape, (M, 2F) = x W^T (default algorithm);
//   cublaslt_tuned    the same GEMM as fusekit's linear op runs it: cuBLASLt, its algorithms timed
//                     on the first call (what PyTorch's torch.mm reaches too): the bar (within 3%).
// Backward rows: fusekit (dx, dW from dy and the saved pre; no bias, as these models have none)
//   against the two plain GEMMs dx = dpre W and dW = dpre^T x, as cublas_plain and as
//   cublaslt_tuned (fusekit's linear backward without activation): the bar (within 5%).
// Forward and backward implementations are timed in turns (time_in_turns).
// flops: 2 M (2F) K per GEMM; bytes: every tensor read or written once.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "bench/harness/bench.h"
#include "bench/linear/bench_linear.h"
#include "fusekit/linear.h"
#include "linear/linear_paths.h"

namespace fusekit::bench {

namespace {

struct GatedSet {
  DeviceBuffer x, w, y, pre, dy, dx, dw;
};

void cublas_status(cublasStatus_t s, const char* what) {
  check(s == CUBLAS_STATUS_SUCCESS, std::string(what) + " failed (cuBLAS status " + std::to_string(int(s)) + ")");
}

struct ForcedGatedPath {
  explicit ForcedGatedPath(linear::GatedForwardPath p) { linear::set_gated_forward_path_override(p); }
  ~ForcedGatedPath() { linear::set_gated_forward_path_override(linear::GatedForwardPath::automatic); }
};

}  // namespace

const std::vector<LinearBenchShape>& gated_linear_bench_shapes() {
  // (M, K, F): Llama-3 8B, Llama-3.2 1B, Qwen2 7B with an odd token count.
  static const std::vector<LinearBenchShape> shapes = {{8192, 4096, 14336}, {8192, 2048, 8192}, {8191, 3584, 18944}};
  return shapes;
}

void bench_gated_linear(Report& report, const std::string&) {
  const Device gpu = Device::cuda(0);
  cublasHandle_t handle;
  cublas_status(cublasCreate(&handle), "cublasCreate");
  const float alpha = 1.0f, beta = 0.0f;
  const DType bf16 = DType::bf16;
  const GatedLinearConfig config{Activation::silu, GatedLayout::interleaved};
  const char* shape_filter = options().shapes.empty() ? nullptr : options().shapes.c_str();
  for (const LinearBenchShape& s : gated_linear_bench_shapes()) {
    const std::int64_t m = s.m, k = s.k, f = s.n, n = 2 * s.n;
    if (shape_filter && std::string(shape_filter).find(fmt::format("{}x{}x{}", m, k, f)) == std::string::npos)
      continue;
    const std::size_t x_bytes = std::size_t(m) * k * 2, w_bytes = std::size_t(n) * k * 2,
                      pre_bytes = std::size_t(m) * n * 2, y_bytes = std::size_t(m) * f * 2;
    const int rotations = rotations_for(x_bytes + w_bytes + pre_bytes + y_bytes);
    std::vector<GatedSet> sets(rotations);
    for (int r = 0; r < rotations; ++r) {
      GatedSet& t = sets[r];
      t = {DeviceBuffer(x_bytes), DeviceBuffer(w_bytes), DeviceBuffer(pre_bytes), DeviceBuffer(pre_bytes),
           DeviceBuffer(pre_bytes), DeviceBuffer(x_bytes), DeviceBuffer(w_bytes)};
      t.x.fill_random_bf16(300 + r);
      t.w.fill_random_bf16(400 + r, 0.0f, 1.0f / std::sqrt(float(k)));
      t.dy.fill_random_bf16(600 + r);
    }
    const std::size_t ws_bytes =
        std::max(gated_linear_forward_workspace_size(m, f, k, bf16, config, false, gpu),
                 gated_linear_backward_workspace_size(m, f, k, bf16, config, gpu));
    DeviceBuffer ws(ws_bytes);
    const TensorView workspace(ws.get(), DType::u8, gpu, {static_cast<std::int64_t>(ws_bytes)});
    auto mat = [&](const DeviceBuffer& buf, std::int64_t rows, std::int64_t cols) {
      return TensorView(buf.get(), bf16, gpu, {rows, cols});
    };
    const double gemm_flops = 2.0 * double(m) * double(n) * double(k);
    const std::string shape = fmt::format("({}, {}, {}) silu", m, k, f);

    auto forward = [&](bool save_pre) {
      return [&, save_pre](int r) {
        GatedSet& t = sets[r];
        gated_linear_forward(mat(t.x, m, k), mat(t.w, n, k), std::nullopt, config, mat(t.y, m, f),
                             save_pre ? OptionalTensor(mat(t.pre, m, n)) : std::nullopt, workspace);
      };
    };
    auto plain_forward = [&](int r) {
      GatedSet& t = sets[r];
      cublas_status(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &alpha, t.w.get(),
                                 CUDA_R_16BF, int(k), t.x.get(), CUDA_R_16BF, int(k), &beta, t.pre.get(),
                                 CUDA_R_16BF, int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                    "cublasGemmEx (forward)");
    };
    forward(true)(0);
    cuda_check(cudaDeviceSynchronize(), "gated linear forward");
    fmt::print("gated_linear {}: forward path {}\n", shape,
               linear::gated_forward_path_name(linear::last_gated_forward_path()));
    auto tuned_forward = [&](int r) {
      GatedSet& t = sets[r];
      linear_forward(mat(t.x, m, k), mat(t.w, n, k), std::nullopt, Activation::none, mat(t.pre, m, n), std::nullopt,
                     workspace);
    };
    auto separate_forward = [&](int r) {
      ForcedGatedPath force(linear::GatedForwardPath::gemm_then_gated);
      forward(true)(r);
    };
    const double fwd_bytes = double(x_bytes + w_bytes + pre_bytes + y_bytes);
    const double plain_fwd_bytes = double(x_bytes + w_bytes + pre_bytes);
    const std::vector<Timing> tf =
        time_in_turns({plain_forward, tuned_forward, forward(true), forward(false), separate_forward}, rotations, 5, 40);
    report.add({"gated_linear", "fwd", shape, "cublas_plain", tf[0].median_us, plain_fwd_bytes, gemm_flops});
    report.add({"gated_linear", "fwd", shape, "cublaslt_tuned", tf[1].median_us, plain_fwd_bytes, gemm_flops});
    report.add({"gated_linear", "fwd", shape, "fusekit", tf[2].median_us, fwd_bytes, gemm_flops});
    report.add({"gated_linear", "fwd", shape, "fusekit_nopre", tf[3].median_us, double(x_bytes + w_bytes + y_bytes),
                gemm_flops});
    report.add({"gated_linear", "fwd", shape, "fusekit_separate", tf[4].median_us, fwd_bytes, gemm_flops});

    for (int r = 0; r < rotations; ++r) forward(true)(r);
    auto backward = [&](int r) {
      GatedSet& t = sets[r];
      gated_linear_backward(mat(t.dy, m, f), mat(t.x, m, k), mat(t.w, n, k), mat(t.pre, m, n), config,
                            mat(t.dx, m, k), mat(t.dw, n, k), std::nullopt, workspace);
    };
    auto plain_backward = [&](int r) {  // dpre (M, 2F) stands in the dy buffer
      GatedSet& t = sets[r];
      cublas_status(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, int(k), int(m), int(n), &alpha, t.w.get(),
                                 CUDA_R_16BF, int(k), t.dy.get(), CUDA_R_16BF, int(n), &beta, t.dx.get(),
                                 CUDA_R_16BF, int(k), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                    "cublasGemmEx (dx)");
      cublas_status(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, int(k), int(n), int(m), &alpha, t.x.get(),
                                 CUDA_R_16BF, int(k), t.dy.get(), CUDA_R_16BF, int(n), &beta, t.dw.get(),
                                 CUDA_R_16BF, int(k), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                    "cublasGemmEx (dW)");
    };
    auto tuned_backward = [&](int r) {  // dpre (M, 2F) stands in the dy buffer
      GatedSet& t = sets[r];
      linear_backward(mat(t.dy, m, n), mat(t.x, m, k), mat(t.w, n, k), std::nullopt, Activation::none,
                      mat(t.dx, m, k), mat(t.dw, n, k), std::nullopt, workspace);
    };
    backward(0);
    cuda_check(cudaDeviceSynchronize(), "gated linear backward");
    fmt::print("gated_linear {}: backward dpre {}\n", shape, linear::backward_path_name(linear::last_backward_path()));
    const std::vector<Timing> tb = time_in_turns({plain_backward, tuned_backward, backward}, rotations, 5, 40);
    const double plain_bwd_bytes = double(pre_bytes + 2 * x_bytes + 2 * w_bytes);
    report.add({"gated_linear", "bwd", shape, "cublas_plain", tb[0].median_us, plain_bwd_bytes, 2 * gemm_flops});
    report.add({"gated_linear", "bwd", shape, "cublaslt_tuned", tb[1].median_us, plain_bwd_bytes, 2 * gemm_flops});
    report.add({"gated_linear", "bwd", shape, "fusekit", tb[2].median_us,
                double(y_bytes + pre_bytes + 2 * x_bytes + 2 * w_bytes), 2 * gemm_flops});
  }
  cublasDestroy(handle);
}

}  // namespace fusekit::bench
