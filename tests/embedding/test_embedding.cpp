// Embeddings: the CPU reference against closed forms, the CUDA kernels against the CPU reference
// (every dtype, both token types, with and without positions, accumulate on and off, many repeated
// tokens and a large vocabulary, padded and misaligned rows), against a float32 model of the
// kernels' fixed summation order (bit for bit), bitwise determinism, out-of-range tokens on the
// GPU, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/convert.h"
#include "fusekit/embedding.h"
#include "fusekit/error.h"
#include "tests/harness/error_testing.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

using testing::Buffer;
using testing::close_to_reference;
using testing::error_of;

struct Case {
  DType dtype = DType::bf16;  // weight, position_weight, out, dout
  DType token_dtype = DType::i64;
  DType dweight_dtype = DType::f32;
  DType dposition_dtype = DType::f32;
  std::vector<std::int64_t> token_shape = {4, 1024};
  std::int64_t vocab = 50, dim = 64;
  std::int64_t extra_positions = 3;  // P = T + extra_positions
  bool positions = true;
  bool accumulate = false;
  std::int64_t pad = 0;   // extra elements at the end of every row of every (rows, C) tensor
  std::int64_t lead = 0;  // elements before every float tensor's first (misaligned pointers)
  double hot = 0.3;       // fraction of tokens that are token 7 % V (a run longer than a warp)

  std::int64_t tokens() const {
    std::int64_t n = 1;
    for (std::int64_t s : token_shape) n *= s;
    return n;
  }
  std::int64_t seq() const { return token_shape.back(); }
  std::int64_t position_rows() const { return seq() + extra_positions; }
  std::string str() const {
    std::string shape;
    for (std::int64_t s : token_shape) shape += (shape.empty() ? "" : "x") + std::to_string(s);
    return std::string(dtype_name(dtype)) + "/" + dtype_name(token_dtype) + " dw " +
           dtype_name(dweight_dtype) + " dp " + dtype_name(dposition_dtype) + " tokens " + shape +
           " V " + std::to_string(vocab) + " C " + std::to_string(dim) +
           (positions ? " +pos" : "") + (accumulate ? " accumulate" : "") +
           (pad ? " pad " + std::to_string(pad) : "") + (lead ? " lead " + std::to_string(lead) : "");
  }
};

// Strides of `shape` whose last dimension is contiguous and whose rows are `pad` elements apart
// beyond their length.
std::vector<std::int64_t> padded_strides(const std::vector<std::int64_t>& shape, std::int64_t pad) {
  const std::size_t n = shape.size();
  std::vector<std::int64_t> strides(n, 1);
  if (n >= 2) strides[n - 2] = shape[n - 1] + pad;
  for (std::size_t d = n - 2; n >= 3 && d-- > 0;) strides[d] = strides[d + 1] * shape[d + 1];
  return strides;
}

std::vector<std::int64_t> with_dim(std::vector<std::int64_t> shape, std::int64_t dim) {
  shape.push_back(dim);
  return shape;
}

struct Inputs {
  std::vector<double> tokens, weight, position_weight, dout, dweight_old, dposition_old;
};

Inputs random_inputs(const Case& c, std::mt19937_64& rng) {
  Inputs in;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  in.tokens.resize(c.tokens());
  for (auto& t : in.tokens)
    t = static_cast<double>(u(rng) < c.hot ? 7 % c.vocab : static_cast<std::int64_t>(rng() % c.vocab));
  auto normal = [&](DType dtype, std::vector<std::int64_t> shape) {
    Buffer b(dtype, Device::cpu(), std::move(shape));
    b.fill_normal(rng);
    return b.values();
  };
  in.weight = normal(c.dtype, {c.vocab, c.dim});
  in.position_weight = normal(c.dtype, {c.position_rows(), c.dim});
  in.dout = normal(c.dtype, with_dim(c.token_shape, c.dim));
  in.dweight_old = normal(c.dweight_dtype, {c.vocab, c.dim});
  in.dposition_old = normal(c.dposition_dtype, {c.position_rows(), c.dim});
  return in;
}

// All tensors of one problem on one device.
struct Problem {
  Case c;
  Buffer tokens, weight, position_weight, out, dout, dweight, dposition_weight;
  std::optional<Buffer> workspace;

  Problem(const Case& c_, Device d)
      : c(c_),
        tokens(c.token_dtype, d, c.token_shape),
        weight(c.dtype, d, {c.vocab, c.dim}, padded_strides({c.vocab, c.dim}, c.pad), c.lead),
        position_weight(c.dtype, d, {c.position_rows(), c.dim},
                        padded_strides({c.position_rows(), c.dim}, c.pad), c.lead),
        out(c.dtype, d, with_dim(c.token_shape, c.dim), padded_strides(with_dim(c.token_shape, c.dim), c.pad),
            c.lead),
        dout(c.dtype, d, with_dim(c.token_shape, c.dim),
             padded_strides(with_dim(c.token_shape, c.dim), c.pad), c.lead),
        dweight(c.dweight_dtype, d, {c.vocab, c.dim}, padded_strides({c.vocab, c.dim}, c.pad), c.lead),
        dposition_weight(c.dposition_dtype, d, {c.position_rows(), c.dim},
                         padded_strides({c.position_rows(), c.dim}, c.pad), c.lead) {
    const std::size_t ws = embedding_backward_workspace_size(c.tokens(), c.vocab, c.dim, d);
    if (ws > 0) workspace.emplace(DType::u8, d, std::vector<std::int64_t>{static_cast<std::int64_t>(ws)});
  }

  OptionalTensor ws() const { return workspace ? OptionalTensor(workspace->view()) : std::nullopt; }
  OptionalTensor pos() const { return c.positions ? OptionalTensor(position_weight.view()) : std::nullopt; }
  OptionalTensor dpos() const { return c.positions ? OptionalTensor(dposition_weight.view()) : std::nullopt; }

  void set_inputs(const Inputs& in) {
    tokens.set_values(in.tokens);
    weight.set_values(in.weight);
    position_weight.set_values(in.position_weight);
    dout.set_values(in.dout);
  }
  void forward() {
    out.poison();
    embedding_forward(tokens.view(), weight.view(), pos(), out.view());
  }
  // Accumulating: the gradients start from `in`'s old values; otherwise they are poisoned.
  void backward(const Inputs& in) {
    if (c.accumulate) {
      dweight.set_values(in.dweight_old);
      dposition_weight.set_values(in.dposition_old);
    } else {
      dweight.poison();
      dposition_weight.poison();
    }
    embedding_backward(dout.view(), tokens.view(), dweight.view(), dpos(), c.accumulate, ws());
  }
};

// The kernels' arithmetic on the host: float32 sums in their fixed order, then the old value, then
// one rounding. The GPU must match it bit for bit.
struct Float32Model {
  std::vector<double> out, dweight, dposition_weight;
};

Float32Model float32_model(const Case& c, const Inputs& in) {
  Float32Model m;
  const std::int64_t n = c.tokens(), T = c.seq(), C = c.dim;
  m.out.resize(n * C);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto v = static_cast<std::int64_t>(in.tokens[i]);
    for (std::int64_t k = 0; k < C; ++k) {
      float s = static_cast<float>(in.weight[v * C + k]);
      if (c.positions) s += static_cast<float>(in.position_weight[(i % T) * C + k]);
      m.out[i * C + k] = detail::round_to(c.dtype, s);
    }
  }
  std::vector<float> dw(c.vocab * C, 0.0f), dp(c.position_rows() * C, 0.0f);
  // dweight: the tokens sorted stably (out-of-range ones last); a token's run of sorted positions
  // is summed per window of 64 sorted positions, in increasing position, and the window sums are
  // added in window order (embedding_kernels.cuh, kSegment).
  constexpr std::int64_t kSegment = 64;
  auto key = [&](std::int64_t i) {
    const auto v = static_cast<std::int64_t>(in.tokens[i]);
    return v >= 0 && v < c.vocab ? v : c.vocab;
  };
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), std::int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return key(a) < key(b); });
  std::vector<float> segment(static_cast<std::size_t>(C));
  for (std::int64_t g = 0; g < n; ++g) {
    const std::int64_t i = order[g], v = key(i);
    if (v == c.vocab) break;
    const bool run_head = g == 0 || key(order[g - 1]) != v;
    if (run_head || g % kSegment == 0) {
      if (!run_head)
        for (std::int64_t k = 0; k < C; ++k) dw[v * C + k] += segment[k];
      std::fill(segment.begin(), segment.end(), 0.0f);
    }
    for (std::int64_t k = 0; k < C; ++k) segment[k] += static_cast<float>(in.dout[i * C + k]);
    if (g + 1 == n || key(order[g + 1]) != v)
      for (std::int64_t k = 0; k < C; ++k) dw[v * C + k] += segment[k];
  }
  for (std::int64_t b = 0; b < n / T; ++b)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t k = 0; k < C; ++k) dp[t * C + k] += static_cast<float>(in.dout[(b * T + t) * C + k]);
  auto finish = [&](std::vector<float>& sum, const std::vector<double>& old, DType dtype,
                    std::vector<double>& result) {
    result.resize(sum.size());
    for (std::size_t j = 0; j < sum.size(); ++j) {
      float s = sum[j];
      if (c.accumulate) s += static_cast<float>(old[j]);
      result[j] = detail::round_to(dtype, s);
    }
  };
  finish(dw, in.dweight_old, c.dweight_dtype, m.dweight);
  finish(dp, in.dposition_old, c.dposition_dtype, m.dposition_weight);
  return m;
}

// The relative L2 error of the float32 model's sums (before rounding to the output dtype) against
// the float64 reference: the error a float32 reduction of these terms makes.
double model_error(const std::vector<double>& model, const std::vector<double>& ref) {
  return testing::compare(model, ref).rel_l2;
}

void check_gpu_against_cpu(const Case& c, std::uint64_t salt) {
  SCOPED_TRACE(c.str());
  auto rng = testing::make_rng(salt);
  const Inputs in = random_inputs(c, rng);
  Problem cpu(c, Device::cpu()), gpu(c, Device::cuda(0));
  cpu.set_inputs(in);
  gpu.set_inputs(in);
  const Float32Model model = float32_model(c, in);

  cpu.forward();
  gpu.forward();
  const auto out = gpu.out.values(), out_ref = cpu.out.values();
  EXPECT_TRUE(close_to_reference(out, out_ref, c.dtype, "out"));
  EXPECT_TRUE(out == model.out) << "out differs from float32 model";
  if (c.pad > 0) {
    const std::int64_t rows = c.tokens();
    EXPECT_EQ(testing::poisoned_padding(gpu.out, rows, c.dim, c.pad), (rows - 1) * c.pad);
  }
  EXPECT_TRUE(gpu.out.lead_untouched());

  cpu.backward(in);
  gpu.backward(in);
  const auto dw = gpu.dweight.values(), dw_ref = cpu.dweight.values();
  EXPECT_TRUE(testing::reduction_close(dw, dw_ref, c.dweight_dtype, model_error(model.dweight, dw_ref), "dweight"));
  EXPECT_TRUE(dw == model.dweight) << "dweight differs from the float32 model of its summation order";
  EXPECT_TRUE(gpu.dweight.lead_untouched());
  if (c.positions) {
    const auto dp = gpu.dposition_weight.values(), dp_ref = cpu.dposition_weight.values();
    EXPECT_TRUE(testing::reduction_close(dp, dp_ref, c.dposition_dtype, model_error(model.dposition_weight, dp_ref),
                                         "dposition_weight"));
    EXPECT_TRUE(dp == model.dposition_weight) << "dposition_weight differs from the float32 model";
  }
}

// ---- CPU reference ------------------------------------------------------------------------------

TEST(EmbeddingCpu, ForwardIsTheRowPlusThePosition) {
  for (bool positions : {false, true}) {
    Case c;
    c.dtype = DType::f64;
    c.token_shape = {3, 5};
    c.vocab = 11;
    c.dim = 6;
    c.positions = positions;
    auto rng = testing::make_rng(1);
    const Inputs in = random_inputs(c, rng);
    Problem p(c, Device::cpu());
    p.set_inputs(in);
    p.forward();
    const auto out = p.out.values();
    for (std::int64_t i = 0; i < c.tokens(); ++i)
      for (std::int64_t k = 0; k < c.dim; ++k) {
        const auto v = static_cast<std::int64_t>(in.tokens[i]);
        const double want = in.weight[v * c.dim + k] +
                            (positions ? in.position_weight[(i % c.seq()) * c.dim + k] : 0.0);
        ASSERT_EQ(out[i * c.dim + k], want) << i << " " << k;
      }
  }
}

// Without positions a 16-bit output is the weight row, exactly.
TEST(EmbeddingCpu, ForwardWithoutPositionsCopiesTheRows) {
  Case c;
  c.dtype = DType::bf16;
  c.token_shape = {40};
  c.vocab = 9;
  c.dim = 12;
  c.positions = false;
  auto rng = testing::make_rng(2);
  const Inputs in = random_inputs(c, rng);
  Problem p(c, Device::cpu());
  p.set_inputs(in);
  p.forward();
  const auto out = p.out.values();
  for (std::int64_t i = 0; i < c.tokens(); ++i)
    for (std::int64_t k = 0; k < c.dim; ++k)
      ASSERT_EQ(out[i * c.dim + k], in.weight[static_cast<std::int64_t>(in.tokens[i]) * c.dim + k]);
}

// The backward's sums in float64, unused rows 0 (overwrite) or untouched (accumulate), rows of
// dposition_weight past T likewise.
TEST(EmbeddingCpu, BackwardIsTheSumOfTheRowsOfEachToken) {
  for (bool accumulate : {false, true}) {
    Case c;
    c.dtype = DType::f64;
    c.dweight_dtype = c.dposition_dtype = DType::f64;
    c.token_shape = {2, 3, 4};
    c.vocab = 13;  // some tokens never occur
    c.dim = 5;
    c.accumulate = accumulate;
    SCOPED_TRACE(c.str());
    auto rng = testing::make_rng(3);
    const Inputs in = random_inputs(c, rng);
    Problem p(c, Device::cpu());
    p.set_inputs(in);
    p.backward(in);
    const auto dw = p.dweight.values(), dp = p.dposition_weight.values();
    const std::int64_t C = c.dim, T = c.seq(), n = c.tokens();
    for (std::int64_t v = 0; v < c.vocab; ++v)
      for (std::int64_t k = 0; k < C; ++k) {
        double want = 0.0;
        for (std::int64_t i = 0; i < n; ++i)
          if (static_cast<std::int64_t>(in.tokens[i]) == v) want += in.dout[i * C + k];
        if (accumulate) want += in.dweight_old[v * C + k];
        ASSERT_NEAR(dw[v * C + k], want, 1e-12) << v << " " << k;
      }
    for (std::int64_t t = 0; t < c.position_rows(); ++t)
      for (std::int64_t k = 0; k < C; ++k) {
        double want = 0.0;
        for (std::int64_t b = 0; t < T && b < n / T; ++b) want += in.dout[(b * T + t) * C + k];
        if (accumulate) want += in.dposition_old[t * C + k];
        ASSERT_NEAR(dp[t * C + k], want, 1e-12) << t << " " << k;
      }
  }
}

// The backward is the forward's adjoint: <dout, forward(w, p)> = <backward(dout), (w, p)>.
TEST(EmbeddingCpu, BackwardIsTheAdjointOfTheForward) {
  Case c;
  c.dtype = DType::f64;
  c.dweight_dtype = c.dposition_dtype = DType::f64;
  c.token_shape = {3, 17};
  c.vocab = 23;
  c.dim = 9;
  auto rng = testing::make_rng(4);
  const Inputs in = random_inputs(c, rng);
  Problem p(c, Device::cpu());
  p.set_inputs(in);
  p.forward();
  p.backward(in);
  const auto out = p.out.values(), dw = p.dweight.values(), dp = p.dposition_weight.values();
  double lhs = 0.0, rhs = 0.0;
  for (std::size_t j = 0; j < out.size(); ++j) lhs += in.dout[j] * out[j];
  for (std::size_t j = 0; j < dw.size(); ++j) rhs += dw[j] * in.weight[j];
  for (std::size_t j = 0; j < dp.size(); ++j) rhs += dp[j] * in.position_weight[j];
  EXPECT_NEAR(lhs, rhs, 1e-9 * std::abs(lhs) + 1e-9);
}

TEST(EmbeddingCpu, EmptyBatchZeroesOrKeepsTheGradients) {
  for (bool accumulate : {false, true}) {
    Case c;
    c.dtype = DType::f32;
    c.token_shape = {0, 8};
    c.vocab = 5;
    c.dim = 4;
    c.accumulate = accumulate;
    auto rng = testing::make_rng(5);
    const Inputs in = random_inputs(c, rng);
    Problem p(c, Device::cpu());
    p.forward();
    p.backward(in);
    EXPECT_EQ(p.dweight.values(), accumulate ? in.dweight_old : std::vector<double>(c.vocab * c.dim, 0.0));
    EXPECT_EQ(p.dposition_weight.values(),
              accumulate ? in.dposition_old : std::vector<double>(c.position_rows() * c.dim, 0.0));
  }
}

// ---- argument errors ----------------------------------------------------------------------------

TEST(EmbeddingErrors, EachBadArgumentIsNamed) {
  const Device cpu = Device::cpu();
  std::vector<float> wb(10 * 4, 0.5f), pb(8 * 4, 0.25f), ob(2 * 3 * 4), db(2 * 3 * 4, 1.0f),
      dwb(10 * 4), dpb(8 * 4);
  std::vector<std::int64_t> tb = {1, 2, 3, 9, 0, 0};
  TensorView tokens(tb.data(), DType::i64, cpu, {2, 3});
  TensorView weight(wb.data(), DType::f32, cpu, {10, 4}), pos(pb.data(), DType::f32, cpu, {8, 4});
  TensorView out(ob.data(), DType::f32, cpu, {2, 3, 4}), dout(db.data(), DType::f32, cpu, {2, 3, 4});
  TensorView dweight(dwb.data(), DType::f32, cpu, {10, 4}), dpos(dpb.data(), DType::f32, cpu, {8, 4});
  const std::string fwd = "fusekit.embedding_forward: ", bwd = "fusekit.embedding_backward: ";

  EXPECT_EQ(error_of([&] { embedding_forward(tokens, weight, pos, out); }), "no error");
  EXPECT_EQ(error_of([&] { embedding_forward(tokens, weight, std::nullopt, out); }), "no error");
  EXPECT_EQ(error_of([&] { embedding_backward(dout, tokens, dweight, dpos, false, std::nullopt); }), "no error");
  EXPECT_EQ(error_of([&] { embedding_backward(dout, tokens, dweight, std::nullopt, true, std::nullopt); }),
            "no error");

  // tokens: dtype, values (the CPU names the position), at least one dimension.
  EXPECT_EQ(error_of([&] { embedding_forward(TensorView(wb.data(), DType::f32, cpu, {2, 3}), weight, pos, out); }),
            fwd + "argument 'tokens': expected dtype i32 or i64, got f32");
  std::vector<std::int64_t> too_big = {1, 2, 3, 10, 0, 0};
  EXPECT_EQ(error_of([&] { embedding_forward(TensorView(too_big.data(), DType::i64, cpu, {2, 3}), weight, pos, out); }),
            fwd + "argument 'tokens': expected token ids in [0, 10), got token 10 at position 3");
  std::vector<std::int32_t> negative = {1, 2, 3, 4, -1, 0};
  EXPECT_EQ(error_of([&] {
              embedding_backward(dout, TensorView(negative.data(), DType::i32, cpu, {2, 3}), dweight, dpos, false,
                                 std::nullopt);
            }),
            bwd + "argument 'tokens': expected token ids in [0, 10), got token -1 at position 4");
  EXPECT_NE(error_of([&] { embedding_forward(TensorView(tb.data(), DType::i64, cpu, {}), weight, pos, out); })
                .find(fwd + "argument 'tokens': expected 1..5 dimensions (..., T), got 0 dimensions"),
            std::string::npos);

  // weight: dtype, rank, C past the limit.
  EXPECT_EQ(error_of([&] { embedding_forward(tokens, TensorView(tb.data(), DType::i64, cpu, {3, 2}), pos, out); }),
            fwd + "argument 'weight': expected dtype f32, f16, bf16 or f64, got i64");
  EXPECT_EQ(error_of([&] { embedding_forward(tokens, TensorView(wb.data(), DType::f32, cpu, {40}), pos, out); }),
            fwd + "argument 'weight': expected a 2-dimensional tensor (rows, C), got shape (40)");
  std::vector<float> wide(kEmbeddingMaxDim + 1);
  EXPECT_EQ(error_of([&] {
              embedding_forward(TensorView(tb.data(), DType::i64, cpu, {1}),
                                TensorView(wide.data(), DType::f32, cpu, {1, kEmbeddingMaxDim + 1}), std::nullopt,
                                TensorView(wide.data(), DType::f32, cpu, {1, kEmbeddingMaxDim + 1}));
            }),
            fwd + "argument 'weight': expected an embedding dimension C in 1..65536, got C = 65537");

  // position_weight: weight's dtype and C, at least T rows.
  std::vector<double> p64(8 * 4);
  EXPECT_EQ(error_of([&] { embedding_forward(tokens, weight, TensorView(p64.data(), DType::f64, cpu, {8, 4}), out); }),
            fwd + "argument 'position_weight': expected dtype f32 (as 'weight'), got f64");
  EXPECT_EQ(error_of([&] { embedding_forward(tokens, weight, TensorView(pb.data(), DType::f32, cpu, {4, 8}), out); }),
            fwd + "argument 'position_weight': expected shape (rows, 4), got shape (4, 8)");
  EXPECT_EQ(error_of([&] { embedding_forward(tokens, weight, TensorView(pb.data(), DType::f32, cpu, {2, 4}), out); }),
            fwd + "argument 'position_weight': expected at least T = 3 rows (P >= T), got shape (2, 4)");

  // out: tokens' shape then C, weight's dtype, no overlap with an input.
  EXPECT_EQ(error_of([&] { embedding_forward(tokens, weight, pos, TensorView(ob.data(), DType::f32, cpu, {6, 4})); }),
            fwd + "argument 'out': expected shape (2, 3, 4) (tokens' shape, then C), got shape (6, 4)");
  EXPECT_EQ(error_of([&] { embedding_forward(tokens, weight, pos, TensorView(ob.data(), DType::bf16, cpu, {2, 3, 4})); }),
            fwd + "argument 'out': expected dtype f32 (as 'weight'), got bf16");
  EXPECT_EQ(error_of([&] { embedding_forward(tokens, weight, pos, TensorView(wb.data(), DType::f32, cpu, {2, 3, 4})); }),
            fwd + "argument 'out': expected memory that does not overlap 'weight', got a view sharing bytes with "
                  "'weight'");

  // dout: tokens' shape then C.
  EXPECT_EQ(error_of([&] {
              embedding_backward(TensorView(db.data(), DType::f32, cpu, {3, 2, 4}), tokens, dweight, dpos, false,
                                 std::nullopt);
            }),
            bwd + "argument 'dout': expected shape (2, 3, 4) (tokens' shape, then C), got shape (3, 2, 4)");
  // dweight, dposition_weight: dout's dtype or f32, dout's C, P >= T.
  std::vector<std::uint16_t> half_buf(10 * 4);
  EXPECT_EQ(error_of([&] {
              embedding_backward(dout, tokens, TensorView(half_buf.data(), DType::bf16, cpu, {10, 4}), dpos, false,
                                 std::nullopt);
            }),
            bwd + "argument 'dweight': expected dtype f32 (as 'dout'), got bf16");
  EXPECT_EQ(error_of([&] {
              embedding_backward(dout, tokens, TensorView(dwb.data(), DType::f32, cpu, {8, 5}), dpos, false,
                                 std::nullopt);
            }),
            bwd + "argument 'dweight': expected shape (rows, 4), got shape (8, 5)");
  EXPECT_EQ(error_of([&] {
              embedding_backward(dout, tokens, dweight, TensorView(dpb.data(), DType::f32, cpu, {2, 4}), false,
                                 std::nullopt);
            }),
            bwd + "argument 'dposition_weight': expected at least T = 3 rows (P >= T), got shape (2, 4)");
  // Overlaps: dposition_weight over dweight, dweight over dout.
  EXPECT_EQ(error_of([&] {
              embedding_backward(dout, tokens, dweight, TensorView(dwb.data(), DType::f32, cpu, {4, 4}), false,
                                 std::nullopt);
            }),
            bwd + "argument 'dweight': expected memory that does not overlap 'dposition_weight', got a view sharing "
                  "bytes with 'dposition_weight'");
  EXPECT_EQ(error_of([&] {
              embedding_backward(dout, tokens, TensorView(db.data(), DType::f32, cpu, {6, 4}), std::nullopt, false,
                                 std::nullopt);
            }),
            bwd + "argument 'dweight': expected memory that does not overlap 'dout', got a view sharing bytes with "
                  "'dout'");
  // Devices: dweight claims a GPU while dout is on the CPU (only metadata is read).
  EXPECT_EQ(error_of([&] {
              embedding_backward(dout, tokens, TensorView(dwb.data(), DType::f32, Device::cuda(0), {10, 4}), dpos,
                                 false, std::nullopt);
            }),
            bwd + "argument 'dweight': expected a tensor on cpu (where 'dout' is), got a tensor on cuda:0");
}

TEST(EmbeddingErrors, WorkspaceQueryChecksItsArguments) {
  EXPECT_EQ(embedding_backward_workspace_size(8192, 50257, 768, Device::cpu()), 0u);
  for (Device device : {Device::cpu(), Device::cuda(0)}) {  // refused before any CUDA call
    testing::expect_error([&] { embedding_backward_workspace_size(-1, 50257, 768, device); },
                          ErrorKind::invalid_argument, "tokens", "got -1");
    testing::expect_error([&] { embedding_backward_workspace_size(std::int64_t{1} << 31, 50257, 768, device); },
                          ErrorKind::invalid_argument, "tokens", "got 2147483648");
    testing::expect_error([&] { embedding_backward_workspace_size(INT64_MAX, 50257, 768, device); },
                          ErrorKind::invalid_argument, "tokens");
    testing::expect_error([&] { embedding_backward_workspace_size(64, 0, 768, device); },
                          ErrorKind::invalid_argument, "vocab", "got 0");
    testing::expect_error([&] { embedding_backward_workspace_size(64, kEmbeddingMaxVocab + 1, 768, device); },
                          ErrorKind::invalid_argument, "vocab");
    testing::expect_error([&] { embedding_backward_workspace_size(64, 50257, 0, device); },
                          ErrorKind::invalid_argument, "dim", "got 0");
    testing::expect_error([&] { embedding_backward_workspace_size(64, 50257, kEmbeddingMaxDim + 1, device); },
                          ErrorKind::invalid_argument, "dim");
  }
}

// ---- GPU against the reference ------------------------------------------------------------------

// Every dtype pairing and token type, with and without positions, overwriting and accumulating,
// many repeats of few tokens (V = 50, 4096 tokens).
TEST(EmbeddingGpu, RepeatedTokensMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (DType dtype : {DType::f32, DType::f16, DType::bf16})
    for (DType grad : {dtype, DType::f32})
      for (bool accumulate : {false, true})
        for (bool positions : {true, false}) {
          Case c;
          c.dtype = dtype;
          c.dweight_dtype = grad;
          c.dposition_dtype = salt % 3 == 0 ? dtype : DType::f32;
          c.token_dtype = salt % 2 ? DType::i32 : DType::i64;
          c.accumulate = accumulate;
          c.positions = positions;
          c.dim = 64;
          check_gpu_against_cpu(c, 100 + salt++);
        }
}

// A GPT-2-like shape: a large vocabulary, C = 768, 8 x 1024 tokens.
TEST(EmbeddingGpu, LargeVocabularyMatchesCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (bool accumulate : {false, true}) {
    Case c;
    c.dtype = DType::bf16;
    c.dweight_dtype = DType::f32;
    c.token_shape = {8, 1024};
    c.vocab = 50257;
    c.dim = 768;
    c.hot = 0.05;
    c.accumulate = accumulate;
    check_gpu_against_cpu(c, 200 + salt++);
  }
}

// C that is not a multiple of 8, padded rows, and pointers off a 16-byte boundary: the scalar
// path; and C a multiple of 8 with 16-byte rows: the vector path with padding.
TEST(EmbeddingGpu, ScalarAndPaddedLayoutsMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  struct Layout {
    std::int64_t dim, pad, lead;
  };
  int salt = 0;
  for (DType dtype : {DType::bf16, DType::f32})
    for (const Layout& l : {Layout{100, 0, 0}, Layout{3, 5, 1}, Layout{64, 8, 0}, Layout{64, 0, 1},
                            Layout{264, 3, 0}, Layout{1, 0, 0}})
      for (bool accumulate : {false, true}) {
        Case c;
        c.dtype = dtype;
        c.dweight_dtype = dtype;
        c.dposition_dtype = DType::f32;
        c.token_shape = {3, 2, 77};
        c.vocab = 1000;
        c.dim = l.dim;
        c.pad = l.pad;
        c.lead = l.lead;
        c.accumulate = accumulate;
        check_gpu_against_cpu(c, 300 + salt++);
      }
}

// One token for the whole batch: a single run of every position.
TEST(EmbeddingGpu, OneTokenEverywhereMatchesCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  Case c;
  c.token_shape = {2, 3000};
  c.vocab = 3;
  c.dim = 520;
  c.hot = 1.0;
  check_gpu_against_cpu(c, 400);
}

// Small vocabularies: runs of every length around the kernels' 64-position segment windows (a
// byte-level batch's spaces and letters), a dim that is not a whole number of column chunks.
TEST(EmbeddingGpu, RunsAcrossSegmentWindowsMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (std::int64_t vocab : {2, 7, 40, 130, 300})
    for (bool accumulate : {false, true}) {
      Case c;
      c.dtype = DType::bf16;
      c.dweight_dtype = salt % 2 ? DType::f32 : DType::bf16;
      c.token_shape = {3, 1001};
      c.vocab = vocab;
      c.dim = 264;
      c.hot = vocab == 40 ? 0.3 : 0.0;
      c.accumulate = accumulate;
      check_gpu_against_cpu(c, 450 + salt++);
    }
}

TEST(EmbeddingGpu, BackwardIsBitwiseDeterministic) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (DType grad : {DType::f32, DType::bf16})
    for (std::int64_t vocab : {50, 50257}) {
      Case c;
      c.dtype = DType::bf16;
      c.dweight_dtype = c.dposition_dtype = grad;
      c.token_shape = vocab == 50 ? std::vector<std::int64_t>{4, 1024} : std::vector<std::int64_t>{8, 1024};
      c.vocab = vocab;
      c.dim = 768;
      SCOPED_TRACE(c.str());
      auto rng = testing::make_rng(500 + salt++);
      const Inputs in = random_inputs(c, rng);
      Problem p(c, Device::cuda(0));
      p.set_inputs(in);
      EXPECT_TRUE(testing::same_bytes_every_run([&] { p.backward(in); }, {&p.dweight, &p.dposition_weight}));
    }
}

// Out-of-range tokens on the GPU: NaN rows in the forward, left out of dweight in the backward
// (their dposition_weight contribution counts).
TEST(EmbeddingGpu, OutOfRangeTokensGiveNaNRowsAndNoGradient) {
  FUSEKIT_REQUIRE_GPU();
  Case c;
  c.token_shape = {2, 40};
  c.vocab = 30;
  c.dim = 48;
  auto rng = testing::make_rng(600);
  Inputs in = random_inputs(c, rng);
  const std::vector<std::int64_t> bad_at = {3, 41, 79};
  Inputs gpu_in = in;
  gpu_in.tokens[3] = 30;
  gpu_in.tokens[41] = -1;
  gpu_in.tokens[79] = 1e9;
  Problem gpu(c, Device::cuda(0));
  gpu.set_inputs(gpu_in);
  gpu.forward();
  const auto out = gpu.out.values();
  for (std::int64_t i = 0; i < c.tokens(); ++i) {
    const bool bad = i == 3 || i == 41 || i == 79;
    for (std::int64_t k = 0; k < c.dim; ++k) ASSERT_EQ(std::isnan(out[i * c.dim + k]), bad) << i << " " << k;
  }
  gpu.backward(gpu_in);
  // The reference: the same tokens with the bad ones' dout rows zeroed for dweight (x + 0 = x: the
  // float32 model is unchanged), and the full dout for dposition_weight.
  Inputs ref_in = in;
  for (std::int64_t i : bad_at)
    for (std::int64_t k = 0; k < c.dim; ++k) ref_in.dout[i * c.dim + k] = 0.0;
  Float32Model zeroed = float32_model(c, ref_in), full = float32_model(c, in);
  EXPECT_TRUE(gpu.dweight.values() == zeroed.dweight);
  EXPECT_TRUE(gpu.dposition_weight.values() == full.dposition_weight);
}

TEST(EmbeddingGpu, EmptyBatchZeroesOrKeepsTheGradients) {
  FUSEKIT_REQUIRE_GPU();
  for (bool accumulate : {false, true}) {
    Case c;
    c.token_shape = {0, 8};
    c.vocab = 5;
    c.dim = 16;
    c.accumulate = accumulate;
    auto rng = testing::make_rng(700);
    const Inputs in = random_inputs(c, rng);
    Problem p(c, Device::cuda(0));
    p.forward();
    p.backward(in);
    EXPECT_EQ(p.dweight.values(), accumulate ? in.dweight_old : std::vector<double>(c.vocab * c.dim, 0.0));
    EXPECT_EQ(p.dposition_weight.values(),
              accumulate ? in.dposition_old : std::vector<double>(c.position_rows() * c.dim, 0.0));
  }
}

TEST(EmbeddingGpu, WorkspaceMissingOrTooSmallIsAnError) {
  FUSEKIT_REQUIRE_GPU();
  Case c;
  Problem p(c, Device::cuda(0));
  Buffer tiny(DType::u8, Device::cuda(0), {16});
  for (const OptionalTensor& ws : {OptionalTensor(tiny.view()), OptionalTensor()}) {
    const std::string e = error_of([&] {
      embedding_backward(p.dout.view(), p.tokens.view(), p.dweight.view(), p.dpos(), false, ws);
    });
    EXPECT_NE(e.find("argument 'workspace': expected a contiguous u8 tensor of at least"), std::string::npos) << e;
    EXPECT_NE(e.find("embedding_backward_workspace_size"), std::string::npos) << e;
  }
  // f64 runs on the CPU only.
  Buffer w64(DType::f64, Device::cuda(0), {c.vocab, c.dim});
  Buffer o64(DType::f64, Device::cuda(0), with_dim(c.token_shape, c.dim));
  EXPECT_NE(error_of([&] { embedding_forward(p.tokens.view(), w64.view(), std::nullopt, o64.view()); })
                .find("argument 'weight': expected dtype f32, f16 or bf16 on a CUDA device"),
            std::string::npos);
}

}  // namespace
}  // namespace fusekit
