// Fused bias + activation + dropout bindings (fusekit/bias_act_dropout.h). BiasActDropoutConfig is
// flattened into its fields (activation, p, seed, offset, slope) in the C++ argument position;
// outputs and workspace are arrays the caller allocates.
#include <cstdint>
#include <string>

#include "bindings.h"
#include "fusekit/bias_act_dropout.h"

namespace fusekit::python {

namespace {

// The config from its flattened arguments; the bindings convert it before the arrays, so that a
// mistyped scalar is reported first, as PyTorch's argument parser checks every type first.
BiasActDropoutConfig make_config(const ScalarArgs& c, nb::handle activation, nb::handle p,
                                 nb::handle seed, nb::handle offset, nb::handle slope) {
  BiasActDropoutConfig config;
  config.activation = c.activation(activation);
  config.p = c.f32(p, "p");
  config.seed = c.u64(seed, "seed");
  config.offset = c.u64(offset, "offset");
  config.slope = c.f32(slope, "slope");
  return config;
}

}  // namespace

void bind_bias_act_dropout(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();

  m.def(
      "bias_act_dropout_forward",
      [](nb::handle x, nb::handle bias, nb::handle activation, nb::handle p, nb::handle seed,
         nb::handle offset, nb::handle y, nb::handle pre_activation, nb::handle slope,
         nb::handle stream) {
        OpCall c("bias_act_dropout_forward");
        const BiasActDropoutConfig config = make_config(c, activation, p, seed, offset, slope);
        const TensorView xv = c.tensor(x, "x", Access::read);
        const OptionalTensor bv = c.optional(bias, "bias", Access::read);
        const TensorView yv = c.tensor(y, "y", Access::write);
        const OptionalTensor hv = c.optional(pre_activation, "pre_activation", Access::write);
        c.run(stream, [&](Stream s) { bias_act_dropout_forward(xv, bv, config, yv, hv, s); });
      },
      arg("x").none(), arg("bias").none(), arg("activation").none(), arg("p").none(),
      arg("seed").none(), arg("offset").none(), arg("y").none(),
      arg("pre_activation").none() = none, arg("slope").none() = 0.01f,
      arg("stream").none() = none,
      "y = dropout_p(act(x + bias)) with the mask regenerated from Philox (seed, offset); "
      "optionally also h = x + bias into pre_activation. activation: fusekit.Activation or its "
      "name; slope: leaky_relu's negative slope.");

  m.def(
      "bias_act_dropout_backward_workspace_size",
      [](nb::handle rows, nb::handle cols, nb::handle dtype, nb::handle device) {
        const ScalarArgs c("bias_act_dropout_backward_workspace_size");
        const std::int64_t r = c.i64(rows, "rows"), n = c.i64(cols, "cols");
        const DType t = c.dtype(dtype, "dtype");
        return bias_act_dropout_backward_workspace_size(r, n, t, c.device(device, "device"));
      },
      arg("rows").none(), arg("cols").none(), arg("dtype").none(), arg("device").none(),
      "Bytes of u8 scratch memory the backward needs for dbias (0 on the CPU). device: 'cpu', "
      "'cuda', 'cuda:N'.");

  m.def(
      "bias_act_dropout_backward",
      [](nb::handle dy, nb::handle x, nb::handle bias, nb::handle activation, nb::handle p,
         nb::handle seed, nb::handle offset, nb::handle dx, nb::handle dbias,
         nb::handle workspace, nb::handle slope, nb::handle stream) {
        OpCall c("bias_act_dropout_backward");
        const BiasActDropoutConfig config = make_config(c, activation, p, seed, offset, slope);
        const TensorView dyv = c.tensor(dy, "dy", Access::read);
        const TensorView xv = c.tensor(x, "x", Access::read);
        const OptionalTensor bv = c.optional(bias, "bias", Access::read);
        const OptionalTensor dxv = c.optional(dx, "dx", Access::write);
        const OptionalTensor dbv = c.optional(dbias, "dbias", Access::write);
        const OptionalTensor wsv = c.workspace(workspace, [&]() -> std::size_t {
          if (!dbv) return 0;  // only dbias's reduction needs scratch memory
          const auto [rows, cols] = rows_cols(xv);
          return bias_act_dropout_backward_workspace_size(rows, cols, xv.dtype, xv.device);
        });
        c.run(stream, [&](Stream s) {
          bias_act_dropout_backward(dyv, xv, bv, config, dxv, dbv, wsv, s);
        });
      },
      arg("dy").none(), arg("x").none(), arg("bias").none(), arg("activation").none(),
      arg("p").none(), arg("seed").none(), arg("offset").none(), arg("dx").none() = none,
      arg("dbias").none() = none, arg("workspace").none() = none, arg("slope").none() = 0.01f,
      arg("stream").none() = none,
      "dx = dy * keep / (1 - p) * act'(x + bias), dbias = sum over rows of dx (each optional); "
      "the same activation, p, seed, offset and slope as the forward.");

  // The documented mask, for tests and for callers that want to inspect it.
  m.def(
      "dropout_keep_mask",
      [](nb::handle seed_arg, nb::handle offset_arg, nb::handle p_arg, nb::handle mask) {
        OpCall c("dropout_keep_mask");
        const auto [seed, offset, p] = keep_mask_args(c, seed_arg, offset_arg, p_arg);
        const TensorView mv = c.tensor(mask, "mask", Access::write);
        if (mv.dtype != DType::u8 || mv.device.is_cuda() || !mv.is_contiguous())
          c.fail("mask", "a contiguous u8 array in CPU memory",
                 std::string(dtype_name(mv.dtype)) + " on " + to_string(mv.device) +
                     (mv.is_contiguous() ? "" : ", not contiguous"));
        const std::uint32_t threshold = dropout_keep_threshold(p);
        auto* out = static_cast<std::uint8_t*>(mv.data);
        const std::int64_t n = mv.numel();
        c.run(nb::none(), [&](Stream) {
          for (std::int64_t i = 0; i < n; ++i)
            out[i] = dropout_keeps(seed, offset, static_cast<std::uint64_t>(i), threshold) ? 1 : 0;
        });
      },
      arg("seed").none(), arg("offset").none(), arg("p").none(), arg("mask").none(),
      "Fills the contiguous u8 CPU array `mask` with 1 where element i (its flat index = row * N "
      "+ col of the op's logical (M, N) tensor) is kept under (seed, offset, p), 0 where dropped.");
}

}  // namespace fusekit::python
