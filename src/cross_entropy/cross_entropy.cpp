// Public entry points of the cross-entropy family: argument checks, then dispatch on where the
// tensors live (CPU reference or CUDA kernels).
#include <cmath>
#include <string>

#include "core/convert.h"
#include "core/format.h"
#include "core/validate.h"
#include "cross_entropy/cross_entropy_params.h"
#include "fusekit/cross_entropy.h"
#include "fusekit/runtime.h"

namespace fusekit {

using detail::arg;
using detail::ArgCheck;
using detail::kFloatDtypes;
using detail::RowLayout;
using cross_entropy::Params;
using cross_entropy::Pass;

const char* loss_reduction_name(LossReduction r) {
  switch (r) {
    case LossReduction::none: return "none";
    case LossReduction::mean: return "mean";
    case LossReduction::sum: return "sum";
  }
  return "unknown";
}

void cross_entropy::check_reduction(const ArgCheck& check, LossReduction r) {
  switch (r) {
    case LossReduction::none: case LossReduction::mean: case LossReduction::sum: return;
  }
  check.fail("reduction", "one of none, mean, sum", "value " + std::to_string(static_cast<int>(r)));
}

void cross_entropy::check_options(const ArgCheck& check, const CrossEntropyConfig& c) {
  if (!(c.label_smoothing >= 0.0f && c.label_smoothing < 1.0f))
    check.fail("label_smoothing", "a label smoothing in [0, 1)", detail::format_float(c.label_smoothing));
  if (!(std::isfinite(c.z_loss) && c.z_loss >= 0.0f))
    check.fail("z_loss", "a finite z-loss coefficient >= 0", detail::format_float(c.z_loss));
  check_reduction(check, c.reduction);
}

namespace {

// The options; fills the params' copies.
void check_config(const ArgCheck& check, const CrossEntropyConfig& c, Params& p) {
  cross_entropy::check_options(check, c);
  p.ignore_index = c.ignore_index;
  p.label_smoothing = c.label_smoothing;
  p.z_loss = c.z_loss;
  p.reduction = c.reduction;
}

// logits (T, V) and targets (T values, i32 or i64); fills the shared fields.
RowLayout check_logits_and_targets(const ArgCheck& check, const TensorView& logits,
                                   const TensorView& targets, Params& p) {
  const RowLayout l = check.leading_rows(logits, "logits", kFloatDtypes, kCrossEntropyMaxClasses);
  check.dtype_in(targets, "targets", {DType::i32, DType::i64});
  check.contiguous_numel(targets, "targets", l.rows);
  p.rows = l.rows;
  p.cols = l.cols;
  p.dtype = logits.dtype;
  p.target_dtype = targets.dtype;
  p.logits = logits.data;
  p.logits_row_stride = l.row_stride;
  p.targets = targets.data;
  return l;
}

// A float32 tensor of `n` contiguous values (loss, lse, dloss).
void check_f32_values(const ArgCheck& check, const TensorView& t, const char* name, std::int64_t n,
                      const char* what) {
  check.dtype_is(t, name, DType::f32, what);
  check.contiguous_numel(t, name, n);
}

// Values per loss / dloss: T for reduction none, one for mean and sum.
std::int64_t loss_values(const Params& p) { return p.reduction == LossReduction::none ? p.rows : 1; }

// dlogits: logits' shape and dtype; whether it is exactly the logits' memory (in place).
bool check_dlogits(const ArgCheck& check, const TensorView& dlogits, const TensorView& logits,
                   const RowLayout& ll, Params& p) {
  const RowLayout dl = check.rows_and_dtype_as(dlogits, "dlogits", logits, ll, "logits");
  p.dlogits = dlogits.data;
  p.dlogits_row_stride = dl.row_stride;
  return dlogits.data == logits.data && dl.row_stride == ll.row_stride;
}

// Outputs against inputs; dlogits that is exactly the logits is allowed (in place), any other
// overlap is not.
void check_overlaps(const ArgCheck& check, bool in_place, const TensorView& logits,
                    const OptionalTensor& dlogits, std::initializer_list<detail::NamedArg> other_outputs,
                    std::initializer_list<detail::NamedArg> other_inputs) {
  // The outputs besides dlogits, against every input and each other.
  for (const detail::NamedArg& out : other_outputs) {
    check.no_overlap({out}, other_inputs);
    check.no_overlap({out}, {arg("logits", logits)});
    if (dlogits) check.no_overlap({out}, {arg("dlogits", dlogits)});
  }
  for (auto a = other_outputs.begin(); a != other_outputs.end(); ++a)
    for (auto b = a + 1; b != other_outputs.end(); ++b) check.no_overlap({*a}, {*b});
  if (!dlogits) return;
  check.no_overlap({arg("dlogits", dlogits)}, other_inputs);
  if (!in_place) check.no_overlap({arg("dlogits", dlogits)}, {arg("logits", logits)});
}

// The CPU backend refuses a target that is neither ignore_index nor a class (the GPU marks it
// NaN instead: reading the targets back would cost a synchronization).
void check_target_values(const ArgCheck& check, const Params& p) {
  for (std::int64_t r = 0; r < p.rows; ++r) {
    const auto t = static_cast<std::int64_t>(detail::load_as_double(p.targets, p.target_dtype, r));
    if (t != p.ignore_index && (t < 0 || t >= p.cols))
      check.fail("targets",
                 "class indices in [0, " + std::to_string(p.cols) + ") or ignore_index (" +
                     std::to_string(p.ignore_index) + ")",
                 "target " + std::to_string(t) + " at row " + std::to_string(r));
  }
}

// Runs the call on the tensors' device: the workspace check on a GPU, the target check on the CPU.
void dispatch(const ArgCheck& check, Device device, const OptionalTensor& workspace, Params& p,
              Stream stream) {
  if (device.is_cuda()) {
    require_supported_gpu(check.op(), device.index);
    const std::size_t need = cross_entropy::workspace_bytes(p.rows, p.reduction, p.pass);
    if (need > 0) {
      const detail::Workspace ws = check.workspace(workspace, need, "cross_entropy_workspace_size", 16);
      p.workspace = ws.data;
      p.workspace_bytes = ws.bytes;
    }
    cross_entropy::run_cuda(p, device.index, stream);
  } else {
    check_target_values(check, p);
    cross_entropy::run_cpu(p);
  }
}

}  // namespace

std::size_t cross_entropy_workspace_size(std::int64_t rows, std::int64_t classes,
                                         LossReduction reduction, Device device) {
  const ArgCheck check("cross_entropy_workspace_size");
  check.size_in(rows, "rows", 0, INT32_MAX);
  check.size_in(classes, "classes", 1, kCrossEntropyMaxClasses);
  cross_entropy::check_reduction(check, reduction);
  if (!device.is_cuda()) return 0;
  return cross_entropy::workspace_bytes_any_pass(rows, reduction);
}

void cross_entropy_forward(const TensorView& logits, const TensorView& targets,
                           const CrossEntropyConfig& config, const TensorView& loss,
                           const OptionalTensor& lse, const OptionalTensor& workspace, Stream stream) {
  ArgCheck check("cross_entropy_forward");
  const Device device = check.same_device({arg("logits", logits), arg("targets", targets),
                                           arg("loss", loss), arg("lse", lse),
                                           arg("workspace", workspace)});
  Params p;
  p.pass = Pass::forward;
  check_config(check, config, p);
  check_logits_and_targets(check, logits, targets, p);
  check_f32_values(check, loss, "loss", loss_values(p), "float32 losses");
  p.loss = static_cast<float*>(loss.data);
  if (lse) {
    check_f32_values(check, *lse, "lse", p.rows, "float32 row statistics");
    p.lse = static_cast<float*>(lse->data);
  }
  check_overlaps(check, false, logits, std::nullopt,
                 {arg("loss", loss), arg("lse", lse), arg("workspace", workspace)},
                 {arg("targets", targets)});
  dispatch(check, device, workspace, p, stream);
}

void cross_entropy_backward(const TensorView& dloss, const TensorView& logits,
                            const TensorView& targets, const TensorView& lse,
                            const CrossEntropyConfig& config, const TensorView& dlogits,
                            const OptionalTensor& workspace, Stream stream) {
  ArgCheck check("cross_entropy_backward");
  const Device device = check.same_device({arg("dloss", dloss), arg("logits", logits),
                                           arg("targets", targets), arg("lse", lse),
                                           arg("dlogits", dlogits), arg("workspace", workspace)});
  Params p;
  p.pass = Pass::backward;
  check_config(check, config, p);
  const RowLayout ll = check_logits_and_targets(check, logits, targets, p);
  check_f32_values(check, dloss, "dloss", loss_values(p), "float32 loss gradients");
  p.dloss = static_cast<const float*>(dloss.data);
  check_f32_values(check, lse, "lse", p.rows, "float32 row statistics, as the forward wrote them");
  p.lse = static_cast<float*>(lse.data);
  const bool in_place = check_dlogits(check, dlogits, logits, ll, p);
  check_overlaps(check, in_place, logits, dlogits, {arg("workspace", workspace)},
                 {arg("dloss", dloss), arg("targets", targets), arg("lse", lse)});
  dispatch(check, device, workspace, p, stream);
}

void cross_entropy_forward_backward(const TensorView& logits, const TensorView& targets,
                                    const CrossEntropyConfig& config, const TensorView& loss,
                                    const TensorView& dlogits, const OptionalTensor& lse,
                                    const OptionalTensor& workspace, Stream stream) {
  ArgCheck check("cross_entropy_forward_backward");
  const Device device = check.same_device({arg("logits", logits), arg("targets", targets),
                                           arg("loss", loss), arg("dlogits", dlogits),
                                           arg("lse", lse), arg("workspace", workspace)});
  Params p;
  p.pass = Pass::forward_backward;
  check_config(check, config, p);
  const RowLayout ll = check_logits_and_targets(check, logits, targets, p);
  check_f32_values(check, loss, "loss", loss_values(p), "float32 losses");
  p.loss = static_cast<float*>(loss.data);
  if (lse) {
    check_f32_values(check, *lse, "lse", p.rows, "float32 row statistics");
    p.lse = static_cast<float*>(lse->data);
  }
  const bool in_place = check_dlogits(check, dlogits, logits, ll, p);
  check_overlaps(check, in_place, logits, dlogits,
                 {arg("loss", loss), arg("lse", lse), arg("workspace", workspace)},
                 {arg("targets", targets)});
  dispatch(check, device, workspace, p, stream);
}

}  // namespace fusekit
