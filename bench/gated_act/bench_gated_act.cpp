// Gated-activation benchmarks, bf16. Bytes counted as each tensor that must move once: the forward
// reads gate and up (2F per row) and writes y (F); the backward reads dy, gate and up and writes
// dgate and dup (5F per row). The same-size copy (impl "copy") moves the forward's bytes.
#include <string>
#include <utility>
#include <vector>

#include "bench/gated_act/bench_gated_act.h"
#include "bench/harness/bench.h"
#include "fusekit/gated_act.h"

namespace fusekit::bench {

namespace {

// One rotation's buffers: gate_up and dgate_up hold (M, 2F) (the separate form: gate and up, dgate
// and dup, as two contiguous (M, F) halves of the same allocations), y and dy (M, F).
struct Set {
  DeviceBuffer gate_up, y, dy, dgate_up;
};

enum class Form { halves, interleaved, separate };

const char* form_name(Form f) {
  return f == Form::halves ? "halves" : f == Form::interleaved ? "interleaved" : "separate";
}

}  // namespace

const std::vector<std::pair<std::int64_t, std::int64_t>>& gated_act_bench_shapes() {
  static const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {
      {16384, 5632}, {16384, 8192}, {16384, 11008}, {16384, 14336}, {2048, 5632}, {4096, 2816}, {16384, 1024}};
  return shapes;
}

void bench_gated_act(Report& report) {
  const Device gpu = Device::cuda(0);
  const std::pair<Activation, Form> cases[] = {
      {Activation::silu, Form::halves},      {Activation::silu, Form::interleaved},
      {Activation::silu, Form::separate},    {Activation::gelu_tanh, Form::halves},
      {Activation::gelu_erf, Form::halves},
  };
  for (auto [rows, cols] : selected_shapes(gated_act_bench_shapes())) {
    const RowTensors both = bf16_row_tensors(rows, 2 * cols), half = bf16_row_tensors(rows, cols);
    const std::size_t per_set = 2 * both.alloc + 2 * half.alloc;
    const int rotations = rotations_for(per_set);
    std::vector<Set> sets(rotations);
    for (int r = 0; r < rotations; ++r) {
      sets[r] = {DeviceBuffer(both.alloc), DeviceBuffer(half.alloc), DeviceBuffer(half.alloc),
                 DeviceBuffer(both.alloc)};
      sets[r].gate_up.fill_random_bf16(500 + r);
      sets[r].dy.fill_random_bf16(600 + r);
    }
    auto view = [&](const DeviceBuffer& buf, const RowTensors& t, std::int64_t cols_of) {
      return TensorView(buf.get(), DType::bf16, gpu, {rows, cols_of}, {t.ld, 1});
    };
    // The separate form's two contiguous (M, F) tensors in one (M, 2F) allocation.
    auto first_half = [&](const DeviceBuffer& buf) { return TensorView(buf.get(), DType::bf16, gpu, {rows, cols}); };
    auto second_half = [&](const DeviceBuffer& buf) {
      return TensorView(static_cast<char*>(buf.get()) + std::size_t(rows) * cols * 2, DType::bf16, gpu, {rows, cols});
    };
    const double elems = double(rows) * cols;
    const std::string label = padded_shape_label(rows, cols);

    // The forward's bytes as one memcpy (impl "copy"): reads and writes 3 M F bf16 values between them.
    const std::size_t copy_bytes = std::size_t(rows) * cols * 3;
    const Timing tc = time_same_size_copy(
        copy_bytes, rotations, [&](int r) { return sets[r].dgate_up.get(); }, [&](int r) { return sets[r].gate_up.get(); });
    report.add({"gated_act", "fwd", label, "copy", tc.median_us, 2.0 * copy_bytes});

    for (auto [act, form] : cases) {
      GatedActConfig config;
      config.activation = act;
      config.layout = form == Form::interleaved ? GatedLayout::interleaved : GatedLayout::halves;
      const std::string shape = label + " " + activation_name(act) + " " + form_name(form);
      const Timing tf = time_kernel(
          [&](int r) {
            const Set& s = sets[r];
            if (form == Form::separate)
              gated_act_forward_separate(first_half(s.gate_up), second_half(s.gate_up), config, view(s.y, half, cols));
            else
              gated_act_forward(view(s.gate_up, both, 2 * cols), config, view(s.y, half, cols));
          },
          rotations);
      report.add({"gated_act", "fwd", shape, "fusekit", tf.median_us, 2.0 * 3.0 * elems});
      const Timing tb = time_kernel(
          [&](int r) {
            const Set& s = sets[r];
            if (form == Form::separate)
              gated_act_backward_separate(view(s.dy, half, cols), first_half(s.gate_up), second_half(s.gate_up), config,
                                          first_half(s.dgate_up), second_half(s.dgate_up));
            else
              gated_act_backward(view(s.dy, half, cols), view(s.gate_up, both, 2 * cols), config,
                                 view(s.dgate_up, both, 2 * cols));
          },
          rotations);
      report.add({"gated_act", "bwd", shape, "fusekit", tb.median_us, 2.0 * 5.0 * elems});
    }
  }
}

}  // namespace fusekit::bench
