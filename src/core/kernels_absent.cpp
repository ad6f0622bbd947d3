// A build without CUDA kernels (CMake -DFUSEKIT_CUDA_KERNELS=OFF): the CPU backend alone, for a
// machine without a GPU that should not spend most of an hour compiling kernels it cannot run
// (`make run` there). The families' CUDA entry points are defined here instead of in their .cu
// files, and each refuses the call with the same unsupported error. Compiled empty otherwise.
#if defined(FUSEKIT_NO_CUDA_KERNELS)

#include <cstddef>
#include <cstdint>

#include "attention/attention_params.h"
#include "bias_act_dropout/bias_act_dropout_params.h"
#include "cross_entropy/cross_entropy_params.h"
#include "embedding/embedding_params.h"
#include "fp8_norm/fp8_norm_params.h"
#include "fusekit/error.h"
#include "gated_act/gated_act_params.h"
#include "linear/linear_params.h"
#include "linear_cross_entropy/linear_cross_entropy_params.h"
#include "norm/norm_params.h"
#include "optim/optim_params.h"
#include "rope/rope_params.h"

namespace fusekit {
namespace {

[[noreturn]] void no_kernels(const char* op) {
  throw Error(ErrorKind::unsupported, op,
              "this build of fusekit has no CUDA kernels (configured with -DFUSEKIT_CUDA_KERNELS=OFF); "
              "the CPU backend runs, a GPU needs the default build");
}

}  // namespace

using I64 = std::int64_t;

void attention::forward_cuda(const Problem&, int, Stream) { no_kernels("attention_forward"); }
void attention::backward_cuda(const BackwardProblem&, int, Stream) { no_kernels("attention_backward"); }
std::size_t attention::forward_workspace_cuda(I64, I64, I64, I64) { no_kernels("attention_forward_workspace_size"); }
std::size_t attention::backward_workspace_cuda(I64, I64, I64, I64, bool) {
  no_kernels("attention_backward_workspace_size");
}

void bias_act_dropout::forward_cuda(const ForwardParams&, int, Stream) { no_kernels("bias_act_dropout_forward"); }
void bias_act_dropout::backward_cuda(const BackwardParams&, int, Stream) { no_kernels("bias_act_dropout_backward"); }
std::size_t bias_act_dropout::backward_workspace_cuda(I64, I64, DType, int) {
  no_kernels("bias_act_dropout_backward_workspace_size");
}

void cross_entropy::run_cuda(const Params&, int, Stream) { no_kernels("cross_entropy"); }

void embedding::forward_cuda(const ForwardParams&, int, Stream) { no_kernels("embedding_forward"); }
void embedding::backward_cuda(const BackwardParams&, int, Stream) { no_kernels("embedding_backward"); }
std::size_t embedding::backward_workspace_bytes_cuda(I64, I64, I64, int) {
  no_kernels("embedding_backward_workspace_size");
}

void fp8_norm::forward_cuda(const ForwardParams&, int, Stream) { no_kernels("fp8_rms_norm_forward"); }
void fp8_norm::backward_cuda(const BackwardParams&, int, Stream) { no_kernels("fp8_rms_norm_backward"); }
std::size_t fp8_norm::forward_workspace_cuda(I64, I64, int) { no_kernels("fp8_rms_norm_forward_workspace_size"); }
std::size_t fp8_norm::backward_workspace_cuda(I64, I64, int) { no_kernels("fp8_rms_norm_backward_workspace_size"); }

void gated_act::forward_cuda(const char* op, const ForwardParams&, int, Stream) { no_kernels(op); }
void gated_act::backward_cuda(const char* op, const BackwardParams&, int, Stream) { no_kernels(op); }

void linear::forward_cuda(const ForwardParams&, int, Stream) { no_kernels("linear_forward"); }
void linear::backward_cuda(const BackwardParams&, int, Stream) { no_kernels("linear_backward"); }
std::size_t linear::forward_workspace_cuda(I64, I64, I64, DType, Activation) {
  no_kernels("linear_forward_workspace_size");
}
std::size_t linear::backward_workspace_cuda(I64, I64, I64, DType, Activation) {
  no_kernels("linear_backward_workspace_size");
}
std::size_t linear::backward_through_input_activation_workspace_cuda(I64, I64, I64, DType, Activation) {
  no_kernels("linear_backward_through_input_activation_workspace_size");
}
void linear::gated_forward_cuda(const GatedForwardParams&, int, Stream) { no_kernels("gated_linear_forward"); }
std::size_t linear::gated_forward_workspace_cuda(I64, I64, I64, DType, GatedLayout, bool) {
  no_kernels("gated_linear_forward_workspace_size");
}

void lxent::run_cuda(const Params&, I64, int, Stream) { no_kernels("linear_cross_entropy"); }

void norm::forward_cuda(const ForwardParams&, int, Stream) { no_kernels("norm_forward"); }
void norm::backward_cuda(const BackwardParams&, int, Stream) { no_kernels("norm_backward"); }
std::size_t norm::backward_workspace_cuda(I64, I64, DType, int) { no_kernels("norm_backward_workspace_size"); }

void optim::adamw_step_cuda(const AdamWParams&, int, Stream) { no_kernels("adamw_step"); }
void optim::global_norm_cuda(const NormParams&, int, Stream) { no_kernels("global_norm"); }

void rope::rotate_cuda(const Params&, int, Stream) { no_kernels("rope"); }

}  // namespace fusekit

#endif  // FUSEKIT_NO_CUDA_KERNELS
