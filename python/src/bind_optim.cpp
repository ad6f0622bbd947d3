// Optimizer bindings (fusekit/optim.h): the tensor lists are Python lists or tuples of arrays;
// AdamWConfig is flattened into keyword arguments with the C++ defaults, after the arrays.
#include <cstdint>
#include <vector>

#include "bindings.h"
#include "fusekit/optim.h"

namespace fusekit::python {

void bind_optim(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();

  m.def(
      "global_norm_workspace_size",
      [](nb::handle tensors, nb::handle device) {
        OpCall c("global_norm_workspace_size");
        const Device d = c.device(device, "device");
        const std::vector<TensorView> views = c.tensor_list(tensors, "tensors", Access::read);
        return global_norm_workspace_size(views, d);
      },
      arg("tensors").none(), arg("device").none(),
      "Bytes of u8 scratch memory global_norm needs for these tensors on `device` (0 on the CPU).");

  m.def(
      "global_norm",
      [](nb::handle tensors, nb::handle norm, nb::handle workspace, nb::handle stream) {
        OpCall c("global_norm");
        const std::vector<TensorView> views = c.tensor_list(tensors, "tensors", Access::read);
        const TensorView nv = c.tensor(norm, "norm", Access::write);
        const OptionalTensor ws = c.workspace(workspace, [&]() -> std::size_t {
          return global_norm_workspace_size(views, nv.device);
        });
        c.run(stream, [&](Stream s) { global_norm(views, nv, ws, s); });
      },
      arg("tensors").none(), arg("norm").none(), arg("workspace").none() = none, arg("stream").none() = none,
      "The L2 norm over every element of every array of `tensors`, written as one float32 to `norm`.");

  m.def(
      "adamw_step",
      [](nb::handle params, nb::handle grads, nb::handle exp_avg, nb::handle exp_avg_sq, nb::handle param_copies,
         nb::handle grad_norm, nb::handle lr, nb::handle beta1, nb::handle beta2, nb::handle eps,
         nb::handle weight_decay, nb::handle step, nb::handle max_grad_norm, nb::handle stream) {
        OpCall c("adamw_step");
        AdamWConfig config;
        config.lr = c.f32(lr, "lr");
        config.beta1 = c.f32(beta1, "beta1");
        config.beta2 = c.f32(beta2, "beta2");
        config.eps = c.f32(eps, "eps");
        config.weight_decay = c.f32(weight_decay, "weight_decay");
        config.step = c.i64(step, "step");
        config.max_grad_norm = c.f32(max_grad_norm, "max_grad_norm");
        const std::vector<TensorView> p = c.tensor_list(params, "params", Access::write);
        const std::vector<TensorView> g = c.tensor_list(grads, "grads", Access::read);
        const std::vector<TensorView> m1 = c.tensor_list(exp_avg, "exp_avg", Access::write);
        const std::vector<TensorView> m2 = c.tensor_list(exp_avg_sq, "exp_avg_sq", Access::write);
        const std::vector<TensorView> copies =
            param_copies.is_none() ? std::vector<TensorView>{}
                                   : c.tensor_list(param_copies, "param_copies", Access::write);
        const OptionalTensor gn = c.optional(grad_norm, "grad_norm", Access::read);
        c.run(stream, [&](Stream s) { adamw_step(p, g, m1, m2, copies, config, gn, s); });
      },
      arg("params").none(), arg("grads").none(), arg("exp_avg").none(), arg("exp_avg_sq").none(),
      arg("param_copies").none() = none, arg("grad_norm").none() = none, arg("lr").none() = 1e-3f,
      arg("beta1").none() = 0.9f, arg("beta2").none() = 0.999f, arg("eps").none() = 1e-8f,
      arg("weight_decay").none() = 0.0f, arg("step").none() = 1, arg("max_grad_norm").none() = 0.0f,
      arg("stream").none() = none,
      "One AdamW step (PyTorch's, decoupled weight decay) over lists of float32 params and moments, in "
      "place: grads float32 / float16 / bfloat16; param_copies (None or one per param) rewritten from "
      "the updated params; with max_grad_norm > 0 the gradients are scaled by "
      "min(1, max_grad_norm / (grad_norm + 1e-6)), grad_norm being global_norm's float32 output.");
}

}  // namespace fusekit::python
