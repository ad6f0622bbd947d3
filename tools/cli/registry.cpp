// The list of op families the CLI knows. A new family adds its add_*_ops line here.
#include "tools/cli/ops.h"

namespace fusekit::cli {

const std::vector<OpEntry>& registry() {
  static const std::vector<OpEntry> ops = [] {
    std::vector<OpEntry> v;
    add_norm_ops(v);
    add_bias_act_dropout_ops(v);
    add_linear_ops(v);
    add_fp8_norm_ops(v);
    add_attention_ops(v);
    return v;
  }();
  return ops;
}

}  // namespace fusekit::cli
