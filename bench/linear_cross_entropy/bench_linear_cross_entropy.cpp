// linear_cross_entropy benchmarks: bf16 h and W, int64 targets, reduction mean, no bias, dW in
// float32. The bar is the plain GEMMs the op cannot avoid, cublasGemmEx on the whole (T, V)
// problem, timed interleaved with it:
//   fwd+bwd  cublas_plain = logits = h W^T (bf16), dh = dx W (bf16), dW = dx^T h (float32)
//   fwd      cublas_plain = logits = h W^T alone (the loss-only call's one GEMM)
// The target: fusekit's fwd+bwd within 1.15x of cublas_plain. flops: 2 T V H per GEMM;
// bytes: h, W, the targets and the outputs once each (the logits never reach memory in fusekit).
// Each shape also prints its workspace (one chunk of logits) beside the bf16 (T, V) logits and
// dlogits an unfused layer keeps.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <random>
#include <string>
#include <vector>

#include "bench/harness/bench.h"
#include "bench/linear_cross_entropy/bench_linear_cross_entropy.h"
#include "fusekit/linear_cross_entropy.h"

namespace fusekit::bench {

namespace {

void cublas_ok(cublasStatus_t s, const char* what) {
  check(s == CUBLAS_STATUS_SUCCESS, std::string(what) + " failed (cuBLAS status " + std::to_string(int(s)) + ")");
}

double mib(std::size_t bytes) { return double(bytes) / double(1 << 20); }

}  // namespace

const std::vector<LinearCrossEntropyBenchShape>& linear_cross_entropy_bench_shapes() {
  static const std::vector<LinearCrossEntropyBenchShape> shapes = {
      {8192, 32000, 4096},  {8192, 128256, 4096},  {16384, 50257, 2048},
      {16384, 262144, 2048}, {32768, 32000, 8192}, {16384, 151936, 8192}};
  return shapes;
}

void bench_linear_cross_entropy(Report& report) {
  const Device gpu = Device::cuda(0);
  cublasHandle_t handle;
  cublas_ok(cublasCreate(&handle), "cublasCreate");
  const float alpha = 1.0f, beta = 0.0f;
  const CrossEntropyConfig config;  // mean, ignore_index -100
  for (const auto& s : linear_cross_entropy_bench_shapes()) {
    const std::int64_t T = s.tokens, V = s.vocab, H = s.hidden;
    const std::size_t h_bytes = std::size_t(T) * H * 2, w_bytes = std::size_t(V) * H * 2,
                      dw_bytes = std::size_t(V) * H * 4, logits_bytes = std::size_t(T) * V * 2;
    DeviceBuffer h(h_bytes), w(w_bytes), dh(h_bytes), dw(dw_bytes), logits(logits_bytes),
        targets(std::size_t(T) * sizeof(std::int64_t)), loss(sizeof(float));
    h.fill_random_bf16(900, 0.0f, 1.0f);
    w.fill_random_bf16(901, 0.0f, 0.02f);
    logits.fill_random_bf16(902, 0.0f, 1e-4f);
    std::vector<std::int64_t> host_targets(T);
    std::mt19937_64 rng(4321);
    for (auto& t : host_targets) t = static_cast<std::int64_t>(rng() % V);
    cuda_check(cudaMemcpy(targets.get(), host_targets.data(), targets.bytes(), cudaMemcpyHostToDevice), "targets");
    const std::size_t ws_bytes =
        linear_cross_entropy_workspace_size(T, V, H, DType::bf16, DType::f32, false, config, gpu);
    DeviceBuffer ws(ws_bytes);
    const std::int64_t chunk = linear_cross_entropy_chunk_tokens(T, V, H, DType::bf16, gpu);
    fmt::print("linear_cross_entropy ({}, {}, {}): workspace {:.0f} MiB (chunks of {} rows; dW float32, no "
               "accumulator), against {:.0f} MiB of bf16 logits + dlogits unfused\n",
               T, V, H, mib(ws_bytes), chunk, 2 * mib(logits_bytes));

    const TensorView hv(h.get(), DType::bf16, gpu, {T, H}), wv(w.get(), DType::bf16, gpu, {V, H}),
        tv(targets.get(), DType::i64, gpu, {T}), lv(loss.get(), DType::f32, gpu, {}),
        dhv(dh.get(), DType::bf16, gpu, {T, H}), dwv(dw.get(), DType::f32, gpu, {V, H}),
        wsv(ws.get(), DType::u8, gpu, {static_cast<std::int64_t>(ws_bytes)});
    auto fused = [&](int) { linear_cross_entropy(hv, wv, std::nullopt, tv, config, lv, dhv, dwv, std::nullopt, wsv); };
    auto loss_only = [&](int) { linear_cross_entropy(hv, wv, std::nullopt, tv, config, lv, std::nullopt, std::nullopt, std::nullopt, wsv); };
    auto plain_logits = [&] {
      cublas_ok(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, int(V), int(T), int(H), &alpha, w.get(), CUDA_R_16BF,
                             int(H), h.get(), CUDA_R_16BF, int(H), &beta, logits.get(), CUDA_R_16BF, int(V),
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "cublasGemmEx (logits)");
    };
    auto plain_three = [&](int) {
      plain_logits();
      cublas_ok(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, int(H), int(T), int(V), &alpha, w.get(), CUDA_R_16BF,
                             int(H), logits.get(), CUDA_R_16BF, int(V), &beta, dh.get(), CUDA_R_16BF, int(H),
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "cublasGemmEx (dh)");
      cublas_ok(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, int(H), int(V), int(T), &alpha, h.get(), CUDA_R_16BF,
                             int(H), logits.get(), CUDA_R_16BF, int(V), &beta, dw.get(), CUDA_R_32F, int(H),
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "cublasGemmEx (dW)");
    };
    const double gemm_flops = 2.0 * double(T) * double(V) * double(H);
    const double io_bytes = double(h_bytes + w_bytes + T * 8 + 4);
    const std::string shape = fmt::format("({}, {}, {})", T, V, H);
    const auto [tp, tf] = time_interleaved(plain_three, fused, 1, 2, 10);
    report.add({"linear_cross_entropy", "fwd+bwd", shape, "cublas_plain", tp.median_us,
                double(h_bytes + w_bytes) + double(logits_bytes) * 3 + double(h_bytes + dw_bytes), 3 * gemm_flops});
    report.add({"linear_cross_entropy", "fwd+bwd", shape, "fusekit", tf.median_us,
                io_bytes + double(h_bytes + dw_bytes), 3 * gemm_flops});
    const auto [tpl, tl] = time_interleaved([&](int) { plain_logits(); }, loss_only, 1, 2, 10);
    report.add({"linear_cross_entropy", "fwd", shape, "cublas_plain", tpl.median_us,
                double(h_bytes + w_bytes + logits_bytes), gemm_flops});
    report.add({"linear_cross_entropy", "fwd", shape, "fusekit", tl.median_us, io_bytes, gemm_flops});
    fmt::print("linear_cross_entropy {}: fwd+bwd {:.3f}x the three plain GEMMs, loss only {:.3f}x the logits GEMM\n",
               shape, tf.median_us / tp.median_us, tl.median_us / tpl.median_us);
  }
  cublasDestroy(handle);
}

}  // namespace fusekit::bench
