// Gated activations: the CPU reference against its definition and against finite differences, the
// three input forms against each other, in-place and optional gradients, the CUDA kernels against
// the CPU reference (every activation, form and dtype; odd F, padded and misaligned rows, leading
// dimensions, every compiled rows-per-thread variant, grids that walk, empty batches), with
// outputs poisoned and row padding checked, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/activation.h"
#include "core/overrides.h"
#include "fusekit/error.h"
#include "fusekit/gated_act.h"
#include "tests/gated_act/gated_act_testing.h"
#include "tests/harness/error_testing.h"
#include "tests/harness/gtest_helpers.h"

namespace fusekit {
namespace {

using testing::close_to_reference;
using testing::error_of;
using testing::expect_error;
using testing::GatedCase;
using testing::GatedForm;
using testing::GatedInputs;
using testing::GatedTensors;
using testing::Strided;
using MathD = detail::ActivationMath<double>;

constexpr Activation kGates[] = {Activation::silu, Activation::gelu_tanh, Activation::gelu_erf, Activation::relu};
constexpr GatedForm kForms[] = {GatedForm::halves, GatedForm::interleaved, GatedForm::separate};
constexpr DType kDtypes[] = {DType::f32, DType::f16, DType::bf16};

double norm_of_products(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * a[i] * b[i] * b[i];
  return std::sqrt(s);
}

// Runs one case on the GPU and on the CPU reference and compares every output; the GPU's outputs
// start poisoned, and nothing outside the views may change.
void check_gpu_against_cpu(const GatedCase& c, std::uint64_t salt) {
  SCOPED_TRACE(c.str());
  auto rng = testing::make_rng(salt);
  const GatedInputs in = testing::random_gated_inputs(c, rng);
  GatedTensors cpu(c, Device::cpu()), gpu(c, Device::cuda(0));
  cpu.set_inputs(in);
  gpu.set_inputs(in);
  cpu.forward();
  cpu.backward();
  gpu.poison_outputs();
  std::vector<std::vector<unsigned char>> before;
  for (Strided* t : gpu.written()) before.push_back(t->raw_bytes());
  gpu.forward();
  gpu.backward();
  EXPECT_TRUE(close_to_reference(gpu.y(), cpu.y(), c.dtype, "y"));
  // dgate = dy * up * act'(gate): where act' nears its zero (gelu near -0.75, silu near -1.28) the
  // value is far below its factors; measure against ||dy * up||.
  EXPECT_TRUE(close_to_reference(gpu.dgate(), cpu.dgate(), c.dtype, "dgate", norm_of_products(in.dy, in.up)));
  EXPECT_TRUE(close_to_reference(gpu.dup(), cpu.dup(), c.dtype, "dup"));
  const std::vector<Strided*> written = gpu.written();
  for (std::size_t i = 0; i < written.size(); ++i)
    EXPECT_TRUE(written[i]->padding_unchanged(before[i])) << "output " << i << " wrote outside its view";
}

// Clears the override keys a test set, whatever way it ends.
struct OverrideScope {
  ~OverrideScope() { detail::clear_overrides(); }
};

// ---- CPU reference ---------------------------------------------------------------------------

// y, dgate and dup element by element from ActivationMath<double>, rounded once to f32, in every
// form, through padded and shifted views (row stride and element offsets told apart).
TEST(GatedActCpu, FollowsTheDefinition) {
  auto rng = testing::make_rng(1);
  for (Activation act : kGates)
    for (GatedForm form : kForms) {
      GatedCase c;
      c.dtype = DType::f32;
      c.activation = act;
      c.form = form;
      c.rows = 6;
      c.cols = 13;
      c.pad = 3;
      c.shift = 1;
      SCOPED_TRACE(c.str());
      const GatedInputs in = testing::random_gated_inputs(c, rng);
      GatedTensors t(c, Device::cpu());
      t.set_inputs(in);
      t.poison_outputs();
      t.forward();
      t.backward();
      const auto y = t.y(), dgate = t.dgate(), dup = t.dup();
      for (std::size_t i = 0; i < y.size(); ++i) {
        const double g = static_cast<float>(in.gate[i]), u = static_cast<float>(in.up[i]),
                     dy = static_cast<float>(in.dy[i]);
        ASSERT_EQ(y[i], static_cast<float>(MathD::forward(act, g, 0.0) * u)) << i;
        ASSERT_EQ(dgate[i], static_cast<float>(dy * u * MathD::derivative(act, g, 0.0))) << i;
        ASSERT_EQ(dup[i], static_cast<float>(dy * MathD::forward(act, g, 0.0))) << i;
      }
    }
}

// Central differences of L = sum(y * dy) with respect to gate and up.
TEST(GatedActCpu, GradientsMatchFiniteDifferences) {
  auto rng = testing::make_rng(2);
  for (Activation act : kGates) {
    GatedCase c;
    c.dtype = DType::f32;
    c.activation = act;
    c.form = GatedForm::separate;
    c.rows = 3;
    c.cols = 7;
    SCOPED_TRACE(c.str());
    GatedInputs in = testing::random_gated_inputs(c, rng);
    for (double& g : in.gate)  // away from relu's kink, so that a step of 1e-2 never crosses it
      if (std::abs(g) < 0.2) g += g >= 0 ? 0.3 : -0.3;
    const GatedActConfig config{act, GatedLayout::halves, false};
    testing::Buffer gate(DType::f32, Device::cpu(), {c.rows, c.cols}), up(DType::f32, Device::cpu(), {c.rows, c.cols}),
        dy(DType::f32, Device::cpu(), {c.rows, c.cols}), y(DType::f32, Device::cpu(), {c.rows, c.cols}),
        dgate(DType::f32, Device::cpu(), {c.rows, c.cols}), dup(DType::f32, Device::cpu(), {c.rows, c.cols});
    gate.set_values(in.gate);
    up.set_values(in.up);
    dy.set_values(in.dy);
    gated_act_backward_separate(dy.view(), gate.view(), up.view(), config, dgate.view(), dup.view());
    const auto dyv = dy.values();
    auto loss = [&] {
      gated_act_forward_separate(gate.view(), up.view(), config, y.view());
      const auto yv = y.values();
      double l = 0;
      for (std::size_t i = 0; i < yv.size(); ++i) l += yv[i] * dyv[i];
      return l;
    };
    const auto dg = dgate.values(), du = dup.values();
    for (std::int64_t i = 0; i < c.rows * c.cols; ++i) {
      const double fg = testing::central_difference(gate, i, 1e-2, loss);
      EXPECT_NEAR(fg, dg[i], 2e-3 * std::max(1.0, std::abs(fg))) << "dgate " << i;
      const double fu = testing::central_difference(up, i, 1e-2, loss);
      EXPECT_NEAR(fu, du[i], 2e-3 * std::max(1.0, std::abs(fu))) << "dup " << i;
    }
  }
}

// The same gate and up values in the three forms (and in place or not) give the same bits.
TEST(GatedActCpu, FormsAndInPlaceAgree) {
  auto rng = testing::make_rng(3);
  for (Activation act : kGates) {
    GatedCase base;
    base.dtype = DType::bf16;
    base.activation = act;
    base.rows = 12;
    base.cols = 21;
    base.lead0 = 3;
    const GatedInputs in = testing::random_gated_inputs(base, rng);
    GatedTensors reference(base, Device::cpu());
    reference.set_inputs(in);
    reference.forward();
    reference.backward();
    for (GatedForm form : kForms)
      for (bool in_place : {false, true}) {
        GatedCase c = base;
        c.form = form;
        c.in_place = in_place;
        c.pad = 5;
        SCOPED_TRACE(c.str());
        GatedTensors t(c, Device::cpu());
        t.set_inputs(in);
        t.poison_outputs();
        t.forward();
        t.backward();
        EXPECT_EQ(t.y(), reference.y());
        EXPECT_EQ(t.dgate(), reference.dgate());
        EXPECT_EQ(t.dup(), reference.dup());
      }
  }
}

// The separate form's gradients one at a time: the same values, and the other output untouched.
TEST(GatedActCpu, OptionalGradientsAreIndependent) {
  auto rng = testing::make_rng(4);
  GatedCase c;
  c.activation = Activation::gelu_tanh;
  c.form = GatedForm::separate;
  c.rows = 9;
  c.cols = 40;
  const GatedInputs in = testing::random_gated_inputs(c, rng);
  GatedTensors both(c, Device::cpu()), only_dgate(c, Device::cpu()), only_dup(c, Device::cpu());
  for (GatedTensors* t : {&both, &only_dgate, &only_dup}) {
    t->set_inputs(in);
    t->poison_outputs();
  }
  both.backward();
  only_dgate.backward_with(true, false);
  only_dup.backward_with(false, true);
  EXPECT_EQ(only_dgate.dgate(), both.dgate());
  EXPECT_EQ(only_dup.dup(), both.dup());
  for (double v : only_dgate.dup()) ASSERT_TRUE(std::isnan(v)) << "dup written though not asked for";
  for (double v : only_dup.dgate()) ASSERT_TRUE(std::isnan(v)) << "dgate written though not asked for";
}

// ---- argument errors (CPU tensors: the checks run before either backend) -----------------------

TEST(GatedActErrors, EachBadArgumentIsNamed) {
  std::vector<float> a(64 * 16), b(64 * 16), c(64 * 16), d(64 * 16);
  const Device cpu = Device::cpu();
  const TensorView gate_up(a.data(), DType::f32, cpu, {4, 16}), y(b.data(), DType::f32, cpu, {4, 8}),
      dy(c.data(), DType::f32, cpu, {4, 8}), dgate_up(d.data(), DType::f32, cpu, {4, 16});
  const GatedActConfig ok;
  const std::string fwd = "fusekit.gated_act_forward: ", bwd = "fusekit.gated_act_backward: ";

  // Activations that are not gates, and values outside the enums.
  for (Activation act : {Activation::none, Activation::squared_relu, Activation::leaky_relu}) {
    GatedActConfig bad = ok;
    bad.activation = act;
    EXPECT_EQ(error_of([&] { gated_act_forward(gate_up, bad, y); }),
              fwd + "argument 'activation': expected silu (SwiGLU), gelu_tanh or gelu_erf (GeGLU), or relu "
                    "(ReGLU), got " + activation_name(act));
  }
  GatedActConfig bad_code = ok;
  bad_code.activation = static_cast<Activation>(42);
  expect_error([&] { gated_act_backward(dy, gate_up, bad_code, dgate_up); }, ErrorKind::invalid_argument,
               "activation", "got activation code 42");
  GatedActConfig bad_layout = ok;
  bad_layout.layout = static_cast<GatedLayout>(7);
  expect_error([&] { gated_act_forward(gate_up, bad_layout, y); }, ErrorKind::invalid_argument, "layout",
               "expected halves or interleaved, got layout code 7");

  // The one-tensor form: an odd last dimension; y and dy of F columns and gate_up's leading shape.
  const TensorView odd(a.data(), DType::f32, cpu, {4, 15});
  EXPECT_EQ(error_of([&] { gated_act_forward(odd, ok, y); }),
            fwd + "argument 'gate_up': expected an even last dimension 2F (F columns of gate, F of up), got "
                  "last dimension 15");
  const TensorView y_wide(b.data(), DType::f32, cpu, {4, 16});
  EXPECT_EQ(error_of([&] { gated_act_forward(gate_up, ok, y_wide); }),
            fwd + "argument 'y': expected shape (4, 8) (gate_up's leading dimensions, F = 8 columns), got (4, 16)");
  const TensorView dy_rows(c.data(), DType::f32, cpu, {2, 2, 8});
  expect_error([&] { gated_act_backward(dy_rows, gate_up, ok, dgate_up); }, ErrorKind::invalid_argument, "dy",
               "expected shape (4, 8)");
  const TensorView dgate_up_short(d.data(), DType::f32, cpu, {4, 8});
  expect_error([&] { gated_act_backward(dy, gate_up, ok, dgate_up_short); }, ErrorKind::invalid_argument,
               "dgate_up", "expected shape (4, 16) (as 'gate_up')");

  // Dtypes: one for all, f32 / f16 / bf16.
  const TensorView y16(b.data(), DType::f16, cpu, {4, 8});
  EXPECT_EQ(error_of([&] { gated_act_forward(gate_up, ok, y16); }),
            fwd + "argument 'y': expected dtype f32 (as 'gate_up'), got f16");
  const TensorView gate_up64(a.data(), DType::f64, cpu, {4, 8});
  EXPECT_EQ(error_of([&] { gated_act_forward(gate_up64, ok, y); }),
            fwd + "argument 'gate_up': expected dtype f32, f16 or bf16, got f64");

  // Devices (only the views' metadata is read: no GPU is needed).
  const TensorView y_gpu(b.data(), DType::f32, Device::cuda(0), {4, 8});
  EXPECT_EQ(error_of([&] { gated_act_forward(gate_up, ok, y_gpu); }),
            fwd + "argument 'y': expected a tensor on cpu (where 'gate_up' is), got a tensor on cuda:0");

  // Layout: a strided last dimension; leading dimensions that do not flatten into one row stride.
  const TensorView strided(a.data(), DType::f32, cpu, {4, 8}, {16, 2});
  expect_error([&] { gated_act_forward_separate(strided, strided, ok, y); }, ErrorKind::invalid_argument, "gate",
               "expected a contiguous last dimension");
  const TensorView unflattenable(a.data(), DType::f32, cpu, {2, 2, 8}, {64, 8, 1});
  expect_error([&] { gated_act_forward_separate(unflattenable, unflattenable, ok, TensorView(b.data(), DType::f32, cpu, {2, 2, 8})); },
               ErrorKind::invalid_argument, "gate", "leading dimensions that flatten into one row stride");

  // Overlaps: y over its input; a gradient over the input without in_place_backward.
  const TensorView y_over(a.data(), DType::f32, cpu, {4, 8}, {16, 1});
  EXPECT_EQ(error_of([&] { gated_act_forward(gate_up, ok, y_over); }),
            fwd + "argument 'y': expected memory that does not overlap 'gate_up', got a view sharing bytes with "
                  "'gate_up'");
  EXPECT_EQ(error_of([&] { gated_act_backward(dy, gate_up, ok, gate_up); }),
            bwd + "argument 'dgate_up': expected memory that does not overlap 'gate_up', got a view sharing bytes "
                  "with 'gate_up'");
  expect_error([&] { gated_act_backward(dy, gate_up, ok, TensorView(c.data(), DType::f32, cpu, {4, 16})); },
               ErrorKind::invalid_argument, "dgate_up", "does not overlap 'dy'");
}

// In place: exactly the input's view, nothing else.
TEST(GatedActErrors, InPlaceBackwardAllowsExactAliasingOnly) {
  std::vector<float> a(16 * 32, 0.5f), b(16 * 32, 0.25f), c(16 * 32, 1.0f);
  const Device cpu = Device::cpu();
  GatedActConfig in_place;
  in_place.in_place_backward = true;
  const TensorView gate_up(a.data(), DType::f32, cpu, {4, 16}), dy(c.data(), DType::f32, cpu, {4, 8});
  EXPECT_EQ(error_of([&] { gated_act_backward(dy, gate_up, in_place, gate_up); }), "no error");
  // With leading dimensions too.
  const TensorView as_3d(a.data(), DType::f32, cpu, {2, 2, 16});
  const TensorView dy_3d(c.data(), DType::f32, cpu, {2, 2, 8});
  EXPECT_EQ(error_of([&] { gated_act_backward(dy_3d, as_3d, in_place, as_3d); }), "no error");
  // One row off, or the same data with another row stride: refused.
  const TensorView shifted(a.data() + 16, DType::f32, cpu, {4, 16});
  expect_error([&] { gated_act_backward(dy, gate_up, in_place, shifted); }, ErrorKind::invalid_argument, "dgate_up",
               "expected memory that does not overlap 'gate_up'");
  const TensorView restrided(a.data(), DType::f32, cpu, {4, 16}, {20, 1});
  expect_error([&] { gated_act_backward(dy, gate_up, in_place, restrided); }, ErrorKind::invalid_argument,
               "dgate_up", "does not overlap 'gate_up'");

  // Two tensors: dgate over gate and dup over up are fine; crossed, or both over one, are not.
  const TensorView gate(a.data(), DType::f32, cpu, {4, 8}), up(b.data(), DType::f32, cpu, {4, 8});
  const std::string sep = "fusekit.gated_act_backward_separate: ";
  EXPECT_EQ(error_of([&] { gated_act_backward_separate(dy, gate, up, in_place, gate, up); }), "no error");
  EXPECT_EQ(error_of([&] { gated_act_backward_separate(dy, gate, up, in_place, gate, std::nullopt); }), "no error");
  EXPECT_EQ(error_of([&] { gated_act_backward_separate(dy, gate, up, in_place, up, gate); }),
            sep + "argument 'dgate': expected memory that does not overlap 'up', got a view sharing bytes with 'up'");
  EXPECT_EQ(error_of([&] { gated_act_backward_separate(dy, gate, up, in_place, gate, gate); }),
            sep + "argument 'dgate': expected memory that does not overlap 'dup', got a view sharing bytes with "
                  "'dup'");
  EXPECT_EQ(error_of([&] { gated_act_backward_separate(dy, gate, up, GatedActConfig{}, gate, std::nullopt); }),
            sep + "argument 'dgate': expected memory that does not overlap 'gate', got a view sharing bytes with "
                  "'gate'");
  EXPECT_EQ(error_of([&] { gated_act_backward_separate(dy, gate, up, in_place, dy, std::nullopt); }),
            sep + "argument 'dgate': expected memory that does not overlap 'dy', got a view sharing bytes with 'dy'");
  // The halves of one buffer as gate and up (what x.chunk(2, -1) gives), in place: fine.
  const TensorView left(a.data(), DType::f32, cpu, {4, 8}, {16, 1}), right(a.data() + 8, DType::f32, cpu, {4, 8}, {16, 1});
  EXPECT_EQ(error_of([&] { gated_act_backward_separate(dy, left, right, in_place, left, right); }), "no error");
}

TEST(GatedActErrors, SeparateFormShapesAndOutputs) {
  std::vector<float> a(64), b(64), c(64), d(64);
  const Device cpu = Device::cpu();
  const TensorView gate(a.data(), DType::f32, cpu, {4, 8}), up(b.data(), DType::f32, cpu, {4, 8}),
      y(c.data(), DType::f32, cpu, {4, 8});
  const std::string fwd = "fusekit.gated_act_forward_separate: ";
  EXPECT_EQ(error_of([&] { gated_act_forward_separate(gate, TensorView(b.data(), DType::f32, cpu, {4, 7}), {}, y); }),
            fwd + "argument 'up': expected shape (4, 8) (as 'gate'), got (4, 7)");
  EXPECT_EQ(error_of([&] { gated_act_forward_separate(gate, TensorView(b.data(), DType::bf16, cpu, {4, 8}), {}, y); }),
            fwd + "argument 'up': expected dtype f32 (as 'gate'), got bf16");
  EXPECT_EQ(error_of([&] { gated_act_forward_separate(gate, up, {}, up); }),
            fwd + "argument 'y': expected memory that does not overlap 'up', got a view sharing bytes with 'up'");
  // A y whose rows overlap each other (stride 0).
  const TensorView expanded(c.data(), DType::f32, cpu, {4, 8}, {0, 1});
  expect_error([&] { gated_act_forward_separate(gate, up, {}, expanded); }, ErrorKind::invalid_argument, "y");
  // dgate / dup shapes; nothing asked for is a valid call that writes nothing.
  expect_error([&] {
    gated_act_backward_separate(y, gate, up, {}, TensorView(d.data(), DType::f32, cpu, {8, 4}), std::nullopt);
  }, ErrorKind::invalid_argument, "dgate", "expected shape (4, 8) (as 'gate')");
  expect_error([&] {
    gated_act_backward_separate(y, gate, up, {}, std::nullopt, TensorView(d.data(), DType::f16, cpu, {4, 8}));
  }, ErrorKind::invalid_argument, "dup", "expected dtype f32 (as 'gate')");
  EXPECT_EQ(error_of([&] { gated_act_backward_separate(y, gate, up, {}, std::nullopt, std::nullopt); }), "no error");
  // Empty batches are valid and write nothing.
  const TensorView empty_gate(nullptr, DType::f32, cpu, {0, 8});
  EXPECT_EQ(error_of([&] { gated_act_forward_separate(empty_gate, empty_gate, {}, empty_gate); }), "no error");
  EXPECT_EQ(error_of([&] {
              gated_act_forward(TensorView(nullptr, DType::bf16, cpu, {0, 3, 16}), {},
                                TensorView(nullptr, DType::bf16, cpu, {0, 3, 8}));
            }),
            "no error");
  EXPECT_STREQ(gated_layout_name(GatedLayout::halves), "halves");
  EXPECT_STREQ(gated_layout_name(GatedLayout::interleaved), "interleaved");
}

// ---- GPU ---------------------------------------------------------------------------------------

// Every form, activation and dtype, each with: an F of whole vectors on aligned rows (the vector
// path); an F that is not (the scalar path); and an F of whole vectors on misaligned or oddly
// padded rows (the scalar path again). Rows, leading dimensions, padding and in-place drawn at random.
TEST(GatedActGpu, RandomizedGridMatchesCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(100);
  const std::int64_t vector_cols[] = {8, 64, 256, 1024, 2048, 5632};
  const std::int64_t odd_cols[] = {1, 3, 7, 13, 1001};
  const std::int64_t rows_choices[] = {1, 2, 5, 17, 64, 333};
  int cases = 0;
  for (GatedForm form : kForms)
    for (Activation act : kGates)
      for (DType dtype : kDtypes)
        for (int kind = 0; kind < 3; ++kind) {
          GatedCase c;
          c.dtype = dtype;
          c.activation = act;
          c.form = form;
          c.rows = rows_choices[rng() % 6];
          c.lead0 = c.rows % 3 == 0 && rng() % 2 ? 3 : 1;
          c.in_place = rng() % 2 == 0;
          if (kind == 0) {
            c.cols = vector_cols[rng() % 6];
            c.pad = 8 * static_cast<std::int64_t>(rng() % 3);
          } else if (kind == 1) {
            c.cols = odd_cols[rng() % 5];
            c.pad = static_cast<std::int64_t>(rng() % 9);
          } else {
            c.cols = vector_cols[rng() % 6];
            c.shift = 1 + static_cast<std::int64_t>(rng() % 3);
            c.pad = static_cast<std::int64_t>(rng() % 9);
          }
          check_gpu_against_cpu(c, 1000 + cases++);
        }
  EXPECT_EQ(cases, 3 * 4 * 3 * 3);
}

// The benchmark's F values (Llama-like MLPs) on fewer rows: the launch choices of those rows.
TEST(GatedActGpu, BenchmarkColumnsMatchCpuReference) {
  FUSEKIT_REQUIRE_GPU();
  int salt = 0;
  for (std::int64_t cols : {5632, 8192, 11008, 14336})
    for (auto [act, form] : {std::pair{Activation::silu, GatedForm::halves},
                             std::pair{Activation::gelu_tanh, GatedForm::interleaved},
                             std::pair{Activation::gelu_erf, GatedForm::separate}}) {
      GatedCase c;
      c.dtype = DType::bf16;
      c.activation = act;
      c.form = form;
      c.rows = 2048;
      c.cols = cols;
      check_gpu_against_cpu(c, 2000 + salt++);
    }
}

// Every compiled rows-per-thread variant of the vector path (override keys) gives the same bits,
// on a row count that leaves every variant's last rows ragged.
TEST(GatedActGpu, RowsPerThreadVariantsAgree) {
  FUSEKIT_REQUIRE_GPU();
  OverrideScope clear;
  auto rng = testing::make_rng(101);
  int salt = 0;
  for (GatedForm form : kForms)
    for (DType dtype : kDtypes) {
      GatedCase c;
      c.dtype = dtype;
      c.activation = kGates[salt % 4];
      c.form = form;
      c.rows = 67;
      c.cols = 1024;
      SCOPED_TRACE(c.str());
      const GatedInputs in = testing::random_gated_inputs(c, rng);
      std::vector<std::vector<double>> results[3];
      for (int variant = 0; variant < 3; ++variant) {
        const std::string rows = std::to_string(1 << variant);
        detail::set_override("gated_act.forward.rows", rows);
        detail::set_override("gated_act.backward.rows", rows);
        GatedTensors t(c, Device::cuda(0));
        t.set_inputs(in);
        t.poison_outputs();
        t.forward();
        t.backward();
        results[variant] = {t.y(), t.dgate(), t.dup()};
      }
      detail::clear_overrides();
      EXPECT_EQ(results[1], results[0]) << "2 rows per thread against 1";
      EXPECT_EQ(results[2], results[0]) << "4 rows per thread against 1";
      check_gpu_against_cpu(c, 3000 + salt++);
    }
}

// More row groups than a grid's 65535 rows of blocks: the blocks walk on (vector path forced to one
// row per thread, and the scalar path).
TEST(GatedActGpu, GridsThatWalkCoverEveryRow) {
  FUSEKIT_REQUIRE_GPU();
  OverrideScope clear;
  detail::set_override("gated_act.forward.rows", "1");
  detail::set_override("gated_act.backward.rows", "1");
  GatedCase vector_case;
  vector_case.dtype = DType::bf16;
  vector_case.form = GatedForm::interleaved;
  vector_case.rows = 600000;  // 8 rows per block: 75000 row groups
  vector_case.cols = 8;
  check_gpu_against_cpu(vector_case, 4000);
  GatedCase scalar_case;
  scalar_case.dtype = DType::f16;
  scalar_case.activation = Activation::gelu_tanh;
  scalar_case.form = GatedForm::separate;
  scalar_case.rows = 2200000;  // 32 rows per block: 68750 row groups
  scalar_case.cols = 3;
  check_gpu_against_cpu(scalar_case, 4001);
}

// In place and out of place give the same bits on the GPU too, on both paths.
TEST(GatedActGpu, InPlaceBackwardMatchesOutOfPlace) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(102);
  for (GatedForm form : kForms)
    for (std::int64_t cols : {4096, 1003}) {
      GatedCase c;
      c.dtype = DType::bf16;
      c.activation = Activation::silu;
      c.form = form;
      c.rows = 129;
      c.cols = cols;
      SCOPED_TRACE(c.str());
      const GatedInputs in = testing::random_gated_inputs(c, rng);
      GatedCase in_place_case = c;
      in_place_case.in_place = true;
      GatedTensors apart(c, Device::cuda(0)), over(in_place_case, Device::cuda(0));
      for (GatedTensors* t : {&apart, &over}) {
        t->set_inputs(in);
        t->poison_outputs();
        t->backward();
      }
      EXPECT_EQ(over.dgate(), apart.dgate());
      EXPECT_EQ(over.dup(), apart.dup());
    }
}

// The separate form's gradients one at a time on the GPU: the output not asked for keeps its poison.
TEST(GatedActGpu, OptionalGradientsAreIndependent) {
  FUSEKIT_REQUIRE_GPU();
  auto rng = testing::make_rng(103);
  for (std::int64_t cols : {2048, 999}) {
    GatedCase c;
    c.activation = Activation::gelu_erf;
    c.form = GatedForm::separate;
    c.rows = 40;
    c.cols = cols;
    SCOPED_TRACE(c.str());
    const GatedInputs in = testing::random_gated_inputs(c, rng);
    GatedTensors both(c, Device::cuda(0)), only_dgate(c, Device::cuda(0)), only_dup(c, Device::cuda(0));
    for (GatedTensors* t : {&both, &only_dgate, &only_dup}) {
      t->set_inputs(in);
      t->poison_outputs();
    }
    both.backward();
    only_dgate.backward_with(true, false);
    only_dup.backward_with(false, true);
    EXPECT_EQ(only_dgate.dgate(), both.dgate());
    EXPECT_EQ(only_dup.dup(), both.dup());
    for (double v : only_dgate.dup()) ASSERT_TRUE(std::isnan(v));
    for (double v : only_dup.dgate()) ASSERT_TRUE(std::isnan(v));
  }
}

TEST(GatedActGpu, EmptyBatchIsANoOp) {
  FUSEKIT_REQUIRE_GPU();
  for (GatedForm form : kForms) {
    GatedCase c;
    c.form = form;
    c.rows = 0;
    c.cols = 64;
    GatedTensors t(c, Device::cuda(0));
    EXPECT_EQ(error_of([&] {
                t.forward();
                t.backward();
              }),
              "no error")
        << testing::form_name(form);
  }
}

}  // namespace
}  // namespace fusekit
