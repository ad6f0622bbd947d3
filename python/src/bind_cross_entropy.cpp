// Cross-entropy bindings (fusekit/cross_entropy.h). CrossEntropyConfig is flattened into its
// fields: `reduction` in the config's argument position (it decides the loss's shape), the others
// (ignore_index, label_smoothing, z_loss) after the outputs with the C++ defaults. `reduction` is
// a fusekit.LossReduction or its name; outputs and workspace are arrays the caller allocates
// (workspace='auto': through the framework of CUDA arrays).
#include <cstdint>

#include "bindings.h"
#include "fusekit/cross_entropy.h"

namespace fusekit::python {

namespace {

constexpr LossReduction kReductions[] = {LossReduction::none, LossReduction::mean, LossReduction::sum};

}  // namespace

LossReduction loss_reduction_arg(const ScalarArgs& c, nb::handle value) {
  return c.option(value, "reduction", "fusekit.LossReduction", kReductions, loss_reduction_name);
}

CrossEntropyConfig cross_entropy_config(const ScalarArgs& c, nb::handle reduction, nb::handle ignore_index,
                                        nb::handle label_smoothing, nb::handle z_loss) {
  CrossEntropyConfig config;
  config.reduction = loss_reduction_arg(c, reduction);
  config.ignore_index = c.i64(ignore_index, "ignore_index");
  config.label_smoothing = c.f32(label_smoothing, "label_smoothing");
  config.z_loss = c.f32(z_loss, "z_loss");
  return config;
}

namespace {

// workspace: an array, None or 'auto' (sized by cross_entropy_workspace_size from the logits).
OptionalTensor workspace_of(OpCall& c, nb::handle workspace, const TensorView& logits, LossReduction reduction) {
  return c.workspace(workspace, [&]() -> std::size_t {
    const auto [rows, cols] = rows_cols(logits);
    return cross_entropy_workspace_size(rows, cols, reduction, logits.device);
  });
}

}  // namespace

void bind_cross_entropy(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();

  auto e = nb::enum_<LossReduction>(m, "LossReduction",
                                    "How cross-entropy reduces its row losses (ops also accept the names)");
  for (LossReduction r : kReductions) e.value(loss_reduction_name(r), r);

  m.def(
      "cross_entropy_workspace_size",
      [](nb::handle rows, nb::handle classes, nb::handle reduction, nb::handle device) {
        const ScalarArgs c("cross_entropy_workspace_size");
        const std::int64_t r = c.i64(rows, "rows"), n = c.i64(classes, "classes");
        const LossReduction red = loss_reduction_arg(c, reduction);
        return cross_entropy_workspace_size(r, n, red, c.device(device, "device"));
      },
      arg("rows").none(), arg("classes").none(), arg("reduction").none(), arg("device").none(),
      "Bytes of u8 scratch memory any cross-entropy call needs (0 on the CPU and for reduction "
      "'none'). device: 'cpu', 'cuda', 'cuda:N'.");

  m.def(
      "cross_entropy_forward",
      [](nb::handle logits, nb::handle targets, nb::handle reduction, nb::handle loss, nb::handle lse,
         nb::handle workspace, nb::handle ignore_index, nb::handle label_smoothing, nb::handle z_loss,
         nb::handle stream) {
        OpCall c("cross_entropy_forward");
        const CrossEntropyConfig config = cross_entropy_config(c, reduction, ignore_index, label_smoothing, z_loss);
        const TensorView lv = c.tensor(logits, "logits", Access::read);
        const TensorView tv = c.tensor(targets, "targets", Access::read);
        const TensorView loss_v = c.tensor(loss, "loss", Access::write);
        const OptionalTensor lse_v = c.optional(lse, "lse", Access::write);
        const OptionalTensor ws = workspace_of(c, workspace, lv, config.reduction);
        c.run(stream, [&](Stream s) { cross_entropy_forward(lv, tv, config, loss_v, lse_v, ws, s); });
      },
      arg("logits").none(), arg("targets").none(), arg("reduction").none(), arg("loss").none(),
      arg("lse").none() = none, arg("workspace").none() = none, arg("ignore_index").none() = -100,
      arg("label_smoothing").none() = 0.0f, arg("z_loss").none() = 0.0f, arg("stream").none() = none,
      "Softmax cross-entropy of logits (..., V) against class indices `targets` (int32 or int64): "
      "loss (float32; T values for 'none', one for 'mean' and 'sum') and optionally the float32 "
      "row logsumexp lse that the backward needs.");

  m.def(
      "cross_entropy_backward",
      [](nb::handle dloss, nb::handle logits, nb::handle targets, nb::handle lse, nb::handle reduction,
         nb::handle dlogits, nb::handle workspace, nb::handle ignore_index, nb::handle label_smoothing,
         nb::handle z_loss, nb::handle stream) {
        OpCall c("cross_entropy_backward");
        const CrossEntropyConfig config = cross_entropy_config(c, reduction, ignore_index, label_smoothing, z_loss);
        const TensorView gv = c.tensor(dloss, "dloss", Access::read);
        const TensorView lv = c.tensor(logits, "logits", Access::read);
        const TensorView tv = c.tensor(targets, "targets", Access::read);
        const TensorView sv = c.tensor(lse, "lse", Access::read);
        const TensorView dv = c.tensor(dlogits, "dlogits", Access::write);
        const OptionalTensor ws = workspace_of(c, workspace, lv, config.reduction);
        c.run(stream, [&](Stream s) { cross_entropy_backward(gv, lv, tv, sv, config, dv, ws, s); });
      },
      arg("dloss").none(), arg("logits").none(), arg("targets").none(), arg("lse").none(),
      arg("reduction").none(), arg("dlogits").none(), arg("workspace").none() = none, arg("ignore_index").none() = -100,
      arg("label_smoothing").none() = 0.0f, arg("z_loss").none() = 0.0f, arg("stream").none() = none,
      "dlogits = dloss * d loss / d logits from the forward's lse (dloss: float32, T values for "
      "'none', one otherwise). dlogits may be the logits array itself (in place).");

  m.def(
      "cross_entropy_forward_backward",
      [](nb::handle logits, nb::handle targets, nb::handle reduction, nb::handle loss, nb::handle dlogits,
         nb::handle lse, nb::handle workspace, nb::handle ignore_index, nb::handle label_smoothing, nb::handle z_loss,
         nb::handle stream) {
        OpCall c("cross_entropy_forward_backward");
        const CrossEntropyConfig config = cross_entropy_config(c, reduction, ignore_index, label_smoothing, z_loss);
        const TensorView lv = c.tensor(logits, "logits", Access::read);
        const TensorView tv = c.tensor(targets, "targets", Access::read);
        const TensorView loss_v = c.tensor(loss, "loss", Access::write);
        const TensorView dv = c.tensor(dlogits, "dlogits", Access::write);
        const OptionalTensor lse_v = c.optional(lse, "lse", Access::write);
        const OptionalTensor ws = workspace_of(c, workspace, lv, config.reduction);
        c.run(stream, [&](Stream s) { cross_entropy_forward_backward(lv, tv, config, loss_v, dv, lse_v, ws, s); });
      },
      arg("logits").none(), arg("targets").none(), arg("reduction").none(), arg("loss").none(),
      arg("dlogits").none(), arg("lse").none() = none, arg("workspace").none() = none, arg("ignore_index").none() = -100,
      arg("label_smoothing").none() = 0.0f, arg("z_loss").none() = 0.0f, arg("stream").none() = none,
      "The loss and its gradient d loss / d logits in one call (1 for 'sum' and each row of "
      "'none', 1 / N for 'mean', N the rows not ignored). dlogits may be the logits array itself "
      "(in place).");
}

}  // namespace fusekit::python
