// Embedding bindings (fusekit/embedding.h): embedding_forward, embedding_backward and the
// workspace query with the C++ names and argument order; outputs and workspace are arrays the
// caller allocates (workspace='auto': through the framework of CUDA arrays).
#include <cstdint>

#include "bindings.h"
#include "fusekit/embedding.h"

namespace fusekit::python {

void bind_embedding(nb::module_& m) {
  using nb::arg;
  const auto none = nb::none();

  m.def(
      "embedding_backward_workspace_size",
      [](nb::handle tokens, nb::handle vocab, nb::handle dim, nb::handle device) {
        const ScalarArgs c("embedding_backward_workspace_size");
        const std::int64_t n = c.i64(tokens, "tokens"), v = c.i64(vocab, "vocab"), d = c.i64(dim, "dim");
        return embedding_backward_workspace_size(n, v, d, c.device(device, "device"));
      },
      arg("tokens").none(), arg("vocab").none(), arg("dim").none(), arg("device").none(),
      "Bytes of u8 scratch memory embedding_backward needs for `tokens` tokens, a vocabulary of "
      "`vocab` rows and embedding dimension `dim` (0 on the CPU). device: 'cpu', 'cuda', 'cuda:N'.");

  m.def(
      "embedding_forward",
      [](nb::handle tokens, nb::handle weight, nb::handle position_weight, nb::handle out, nb::handle stream) {
        OpCall c("embedding_forward");
        const TensorView tv = c.tensor(tokens, "tokens", Access::read);
        const TensorView wv = c.tensor(weight, "weight", Access::read);
        const OptionalTensor pv = c.optional(position_weight, "position_weight", Access::read);
        const TensorView ov = c.tensor(out, "out", Access::write);
        c.run(stream, [&](Stream s) { embedding_forward(tv, wv, pv, ov, s); });
      },
      arg("tokens").none(), arg("weight").none(), arg("position_weight").none(), arg("out").none(),
      arg("stream").none() = none,
      "out[..., t, :] = weight[tokens[..., t], :] + position_weight[t, :] (tokens int32 or int64, "
      "(..., T); position_weight (P, C) with P >= T, or None).");

  m.def(
      "embedding_backward",
      [](nb::handle dout, nb::handle tokens, nb::handle dweight, nb::handle dposition_weight,
         nb::handle accumulate, nb::handle workspace, nb::handle stream) {
        OpCall c("embedding_backward");
        const bool acc = c.flag(accumulate, "accumulate");
        const TensorView dv = c.tensor(dout, "dout", Access::read);
        const TensorView tv = c.tensor(tokens, "tokens", Access::read);
        const TensorView wv = c.tensor(dweight, "dweight", Access::write);
        const OptionalTensor pv = c.optional(dposition_weight, "dposition_weight", Access::write);
        const OptionalTensor ws = c.workspace(workspace, [&]() -> std::size_t {
          return embedding_backward_workspace_size(tv.numel(), wv.ndim == 2 ? wv.shape[0] : 0,
                                                   dv.ndim > 0 ? dv.shape[dv.ndim - 1] : 0, dv.device);
        });
        c.run(stream, [&](Stream s) { embedding_backward(dv, tv, wv, pv, acc, ws, s); });
      },
      arg("dout").none(), arg("tokens").none(), arg("dweight").none(), arg("dposition_weight").none(),
      arg("accumulate").none(), arg("workspace").none() = none, arg("stream").none() = none,
      "dweight[v] (+)= the sum of dout's rows whose token is v; dposition_weight[t] (+)= the sum of "
      "dout[..., t, :] over the leading dims (None: not computed). accumulate=False overwrites "
      "(rows of absent tokens become 0), True adds. Deterministic.");
}

}  // namespace fusekit::python
