// The list of op families the CLI knows. A new family adds its add_*_ops line here.
#include "tools/cli/ops.h"

namespace fusekit::cli {

const std::vector<OpEntry>& registry() {
  static const std::vector<OpEntry> ops = [] {
    std::vector<OpEntry> v;
    add_norm_ops(v);
    add_bias_act_dropout_ops(v);
    add_gated_act_ops(v);
    add_linear_ops(v);
    add_fp8_norm_ops(v);
    add_attention_ops(v);
    add_cross_entropy_ops(v);
    add_linear_cross_entropy_ops(v);
    add_rope_ops(v);
    add_embedding_ops(v);
    add_optim_ops(v);
    return v;
  }();
  return ops;
}

std::vector<double> finite_difference_gradient(testing::Buffer& param, const testing::Buffer& y,
                                               const testing::Buffer& dy, double h,
                                               const std::function<void()>& forward) {
  const std::vector<double> g = dy.values();
  auto loss = [&] {
    forward();
    const std::vector<double> yv = y.values();
    double l = 0;
    for (std::size_t k = 0; k < yv.size(); ++k) l += yv[k] * g[k];
    return l;
  };
  std::vector<double> fd(static_cast<std::size_t>(param.numel()));
  for (std::size_t i = 0; i < fd.size(); ++i)
    fd[i] = testing::central_difference(param, static_cast<std::int64_t>(i), h, loss);
  return fd;
}

CheckLine compared_line(const std::string& op, Device device, const std::string& what,
                        const std::vector<double>& got, const std::vector<double>& ref, DType dtype) {
  const testing::ErrorStats s = testing::compare(got, ref);
  const double tol = testing::tolerance(dtype, ref);
  return {op, device.is_cuda() ? "cuda" : "cpu", what, s.rel_l2, tol, s.non_finite == 0 && s.rel_l2 <= tol};
}

}  // namespace fusekit::cli
