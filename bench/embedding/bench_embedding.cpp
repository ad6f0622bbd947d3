// Embedding benchmarks: bf16 weight and position_weight (GPT-2's vocabulary, 1024 positions),
// int64 tokens uniform over the vocabulary, a float32 dweight and dposition_weight overwritten
// (accumulate = false). Bytes counted as each tensor that must move once: the forward reads the
// tokens, one weight row per token and the position table, and writes out; the backward reads
// the tokens and dout and writes the whole of dweight (unused rows become 0) and dposition_weight.
// The "copy" row moves out's bytes with cudaMemcpy (read once, written once).
#include <cuda_runtime.h>

#include <random>
#include <string>
#include <vector>

#include "bench/embedding/bench_embedding.h"
#include "bench/harness/bench.h"
#include "fusekit/embedding.h"

namespace fusekit::bench {

namespace {

constexpr std::int64_t kVocab = 50257;
constexpr std::int64_t kPositions = 1024;

struct Set {
  DeviceBuffer out, dout;
};

}  // namespace

const std::vector<std::pair<std::int64_t, std::int64_t>>& embedding_bench_shapes() {
  static const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {
      {8192, 768}, {16384, 768}, {8192, 1024}, {8192, 1600}, {16384, 4096}};
  return shapes;
}

void bench_embedding(Report& report) {
  const Device gpu = Device::cuda(0);
  for (auto [tokens, dim] : selected_shapes(embedding_bench_shapes())) {
    const std::int64_t seqs = (tokens + kPositions - 1) / kPositions;
    const std::int64_t n = seqs * kPositions;  // whole sequences
    const std::size_t row_bytes = static_cast<std::size_t>(n) * dim * 2;
    const int rotations = rotations_for(2 * row_bytes);
    std::vector<Set> sets(rotations);
    for (int r = 0; r < rotations; ++r) {
      sets[r] = {DeviceBuffer(row_bytes), DeviceBuffer(row_bytes)};
      sets[r].dout.fill_random_bf16(900 + r);
    }
    DeviceBuffer weight(static_cast<std::size_t>(kVocab) * dim * 2), position(kPositions * dim * 2),
        dweight(static_cast<std::size_t>(kVocab) * dim * 4), dposition(kPositions * dim * 4);
    weight.fill_random_bf16(31, 0.0f, 0.02f);
    position.fill_random_bf16(32, 0.0f, 0.01f);
    std::vector<std::int64_t> host_tokens(n);
    std::mt19937_64 rng(4321);
    for (auto& t : host_tokens) t = static_cast<std::int64_t>(rng() % kVocab);
    DeviceBuffer ids(n * sizeof(std::int64_t));
    cuda_check(cudaMemcpy(ids.get(), host_tokens.data(), ids.bytes(), cudaMemcpyHostToDevice), "tokens");
    const std::size_t ws_bytes = embedding_backward_workspace_size(n, kVocab, dim, gpu);
    DeviceBuffer ws(ws_bytes);

    const TensorView t(ids.get(), DType::i64, gpu, {seqs, kPositions}),
        w(weight.get(), DType::bf16, gpu, {kVocab, dim}), p(position.get(), DType::bf16, gpu, {kPositions, dim}),
        dw(dweight.get(), DType::f32, gpu, {kVocab, dim}), dp(dposition.get(), DType::f32, gpu, {kPositions, dim}),
        wsv(ws.get(), DType::u8, gpu, {static_cast<std::int64_t>(ws_bytes)});
    auto rows = [&](const DeviceBuffer& b) { return TensorView(b.get(), DType::bf16, gpu, {seqs, kPositions, dim}); };
    const std::string shape = "(" + std::to_string(n) + ", " + std::to_string(dim) + ")";
    const double ids_bytes = 8.0 * static_cast<double>(n);
    const double table_bytes = static_cast<double>(kPositions) * dim;  // elements of position_weight

    const Timing tc = time_same_size_copy(
        row_bytes, rotations, [&](int r) { return sets[r].out.get(); }, [&](int r) { return sets[r].dout.get(); });
    report.add({"embedding", "fwd", shape, "copy", tc.median_us, 2.0 * row_bytes});
    const Timing tf = time_kernel([&](int r) { embedding_forward(t, w, p, rows(sets[r].out)); }, rotations);
    report.add({"embedding", "fwd", shape, "fusekit", tf.median_us, ids_bytes + 2.0 * row_bytes + 2.0 * table_bytes});
    const Timing tb = time_kernel(
        [&](int r) { embedding_backward(rows(sets[r].dout), t, dw, dp, false, wsv); }, rotations);
    report.add({"embedding", "bwd", shape, "fusekit", tb.median_us,
                ids_bytes + row_bytes + 4.0 * static_cast<double>(kVocab) * dim + 4.0 * table_bytes});
  }
}

}  // namespace fusekit::bench
