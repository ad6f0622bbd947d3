// Linear cross-entropy bindings (fusekit/linear_cross_entropy.h). The CrossEntropyConfig is
// flattened as in the cross-entropy bindings: `reduction` in the config's argument position, the
// other options after the outputs with the C++ defaults. dh, dweight, dbias are optional outputs
// (none given: the loss alone); workspace='auto' allocates through the framework of CUDA arrays.
#include <cstdint>

#include "bindings.h"
#include "fusekit/linear_cross_entropy.h"

namespace fusekit::python {

void bind_linear_cross_entropy(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();

  m.def(
      "linear_cross_entropy_workspace_size",
      [](nb::handle tokens, nb::handle vocab, nb::handle hidden, nb::handle dtype, nb::handle dweight_dtype,
         nb::handle has_bias, nb::handle reduction, nb::handle device, nb::handle ignore_index,
         nb::handle label_smoothing, nb::handle z_loss) {
        const ScalarArgs c("linear_cross_entropy_workspace_size");
        const std::int64_t t = c.i64(tokens, "tokens"), v = c.i64(vocab, "vocab"), h = c.i64(hidden, "hidden");
        const DType dt = c.dtype(dtype, "dtype"), dwt = c.dtype(dweight_dtype, "dweight_dtype");
        const bool bias = c.flag(has_bias, "has_bias");
        const CrossEntropyConfig config = cross_entropy_config(c, reduction, ignore_index, label_smoothing, z_loss);
        return linear_cross_entropy_workspace_size(t, v, h, dt, dwt, bias, config, c.device(device, "device"));
      },
      arg("tokens").none(), arg("vocab").none(), arg("hidden").none(), arg("dtype").none(),
      arg("dweight_dtype").none(), arg("has_bias").none(), arg("reduction").none(), arg("device").none(),
      arg("ignore_index").none() = -100, arg("label_smoothing").none() = 0.0f, arg("z_loss").none() = 0.0f,
      "Bytes of u8 scratch memory linear_cross_entropy needs on `device` (0 on the CPU): one chunk of "
      "logits, plus float32 accumulators for a 16-bit dweight and for dbias (see the C++ header).");

  m.def(
      "linear_cross_entropy",
      [](nb::handle h, nb::handle weight, nb::handle bias, nb::handle targets, nb::handle reduction,
         nb::handle loss, nb::handle dh, nb::handle dweight, nb::handle dbias, nb::handle workspace,
         nb::handle ignore_index, nb::handle label_smoothing, nb::handle z_loss, nb::handle stream) {
        OpCall c("linear_cross_entropy");
        const CrossEntropyConfig config = cross_entropy_config(c, reduction, ignore_index, label_smoothing, z_loss);
        const TensorView hv = c.tensor(h, "h", Access::read);
        const TensorView wv = c.tensor(weight, "weight", Access::read);
        const OptionalTensor bv = c.optional(bias, "bias", Access::read);
        const TensorView tv = c.tensor(targets, "targets", Access::read);
        const TensorView loss_v = c.tensor(loss, "loss", Access::write);
        const OptionalTensor dh_v = c.optional(dh, "dh", Access::write);
        const OptionalTensor dw_v = c.optional(dweight, "dweight", Access::write);
        const OptionalTensor db_v = c.optional(dbias, "dbias", Access::write);
        const OptionalTensor ws = c.workspace(workspace, [&]() -> std::size_t {
          const auto [rows, cols] = rows_cols(hv);
          return linear_cross_entropy_workspace_size(rows, wv.ndim > 0 ? wv.shape[0] : 0, cols, hv.dtype,
                                                     dw_v ? dw_v->dtype : hv.dtype, bv.has_value(), config,
                                                     hv.device);
        });
        c.run(stream, [&](Stream s) { linear_cross_entropy(hv, wv, bv, tv, config, loss_v, dh_v, dw_v, db_v, ws, s); });
      },
      arg("h").none(), arg("weight").none(), arg("bias").none(), arg("targets").none(), arg("reduction").none(),
      arg("loss").none(), arg("dh").none() = none, arg("dweight").none() = none, arg("dbias").none() = none,
      arg("workspace").none() = none, arg("ignore_index").none() = -100, arg("label_smoothing").none() = 0.0f,
      arg("z_loss").none() = 0.0f, arg("stream").none() = none,
      "Softmax cross-entropy of the logits h (..., H) weight (V, H)^T + bias (V) against class indices "
      "`targets`, without the (T, V) logits: loss (float32; T values for 'none', one otherwise) and, "
      "where given, dh, dweight, dbias of that loss (overwritten; dweight and dbias float32 or h's "
      "dtype).");
}

}  // namespace fusekit::python
