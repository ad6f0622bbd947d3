// CLI entry for the embedding family: `fusekit check` compares representative problems (each
// dtype, a float32 or same-dtype gradient, many repeated tokens and GPT-2's vocabulary) against the
// CPU reference with the test suite's tolerance rule; on the CPU it checks the reference's
// gradients against central differences. bench runs bench/embedding.
#include <fmt/format.h>

#include <optional>
#include <random>

#include "bench/embedding/bench_embedding.h"
#include "fusekit/embedding.h"
#include "tests/harness/harness.h"
#include "tools/cli/ops.h"

namespace fusekit::cli {
namespace {

using testing::Buffer;
constexpr const char* kOp = "embedding";

std::vector<double> random_tokens(std::int64_t n, std::int64_t vocab, std::mt19937_64& rng) {
  std::vector<double> t(n);
  for (auto& v : t) v = static_cast<double>(rng() % vocab);
  return t;
}

// The CPU reference's dweight and dposition_weight, the gradients of sum(dout * out), against
// central differences of the forward.
std::vector<CheckLine> check_cpu() {
  auto rng = testing::make_rng(70);
  const Device cpu = Device::cpu();
  const std::int64_t batch = 2, seq = 5, vocab = 7, dim = 4, positions = 6;
  Buffer tokens(DType::i64, cpu, {batch, seq}), w(DType::f32, cpu, {vocab, dim}), p(DType::f32, cpu, {positions, dim}),
      out(DType::f32, cpu, {batch, seq, dim}), dout(DType::f32, cpu, {batch, seq, dim}),
      dw(DType::f32, cpu, {vocab, dim}), dp(DType::f32, cpu, {positions, dim});
  tokens.set_values(random_tokens(batch * seq, vocab, rng));
  w.fill_normal(rng);
  p.fill_normal(rng);
  dout.fill_normal(rng);
  embedding_backward(dout.view(), tokens.view(), dw.view(), dp.view(), false, std::nullopt);
  auto forward = [&] { embedding_forward(tokens.view(), w.view(), p.view(), out.view()); };
  const testing::ErrorStats sw = testing::compare(dw.values(), finite_difference_gradient(w, out, dout, 1e-2, forward));
  const testing::ErrorStats sp = testing::compare(dp.values(), finite_difference_gradient(p, out, dout, 1e-2, forward));
  return {{kOp, "cpu", "dweight vs finite differences", sw.rel_l2, 1e-3, sw.rel_l2 <= 1e-3},
          {kOp, "cpu", "dposition_weight vs finite differences", sp.rel_l2, 1e-3, sp.rel_l2 <= 1e-3}};
}

std::vector<CheckLine> check_gpu(Device device) {
  std::vector<CheckLine> lines;
  auto rng = testing::make_rng(71);
  struct Shape {
    std::int64_t batch, seq, vocab, dim;
  };
  for (DType dt : {DType::bf16, DType::f32})
    for (DType grad : {DType::f32, dt})
      for (const Shape& s : {Shape{4, 1024, 50, 64}, Shape{2, 1024, 50257, 768}}) {
        const std::int64_t n = s.batch * s.seq;
        const std::vector<double> ids = random_tokens(n, s.vocab, rng);
        Buffer scratch_w(dt, Device::cpu(), {s.vocab, s.dim}), scratch_p(dt, Device::cpu(), {s.seq, s.dim}),
            scratch_d(dt, Device::cpu(), {s.batch, s.seq, s.dim});
        scratch_w.fill_normal(rng);
        scratch_p.fill_normal(rng);
        scratch_d.fill_normal(rng);
        struct Outputs {
          std::vector<double> out, dweight, dposition;
        };
        auto run = [&](Device d) {
          Buffer tokens(DType::i64, d, {s.batch, s.seq}), w(dt, d, {s.vocab, s.dim}), p(dt, d, {s.seq, s.dim}),
              out(dt, d, {s.batch, s.seq, s.dim}), dout(dt, d, {s.batch, s.seq, s.dim}), dw(grad, d, {s.vocab, s.dim}),
              dp(grad, d, {s.seq, s.dim});
          tokens.set_values(ids);
          w.set_values(scratch_w.values());
          p.set_values(scratch_p.values());
          dout.set_values(scratch_d.values());
          out.poison();
          dw.poison();
          dp.poison();
          const std::size_t ws_bytes = embedding_backward_workspace_size(n, s.vocab, s.dim, d);
          std::optional<Buffer> ws;
          if (ws_bytes > 0) ws.emplace(DType::u8, d, std::vector<std::int64_t>{static_cast<std::int64_t>(ws_bytes)});
          embedding_forward(tokens.view(), w.view(), p.view(), out.view());
          embedding_backward(dout.view(), tokens.view(), dw.view(), dp.view(), false,
                             ws ? OptionalTensor(ws->view()) : std::nullopt);
          return Outputs{out.values(), dw.values(), dp.values()};
        };
        const Outputs ref = run(Device::cpu()), got = run(device);
        const std::string tag = fmt::format("{} grad {} ({}, {}, {}) V={}", dtype_name(dt), dtype_name(grad), s.batch,
                                            s.seq, s.dim, s.vocab);
        lines.push_back(compared_line(kOp, device, "out " + tag, got.out, ref.out, dt));
        lines.push_back(compared_line(kOp, device, "dweight " + tag, got.dweight, ref.dweight, grad));
        lines.push_back(compared_line(kOp, device, "dposition_weight " + tag, got.dposition, ref.dposition, grad));
      }
  return lines;
}

}  // namespace

void add_embedding_ops(std::vector<OpEntry>& ops) {
  ops.push_back({kOp,
                 "token + learned position embeddings: forward gather (16-byte rows), backward into dweight and "
                 "dposition_weight (overwrite or accumulate) by a stable radix sort of the tokens; deterministic",
                 "tables f32, f16, bf16 (gradients f32 or the same dtype); tokens i32, i64", {"cpu", "cuda"},
                 [](Device d) { return d.is_cuda() ? check_gpu(d) : check_cpu(); },
                 [](bench::Report& r, const std::string&) { bench::bench_embedding(r); }});
}

}  // namespace fusekit::cli
