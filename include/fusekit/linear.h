// Linear layer with fused bias and activation, forward and backward:
//
//   forward:   pre = x W^T + b          y = act(pre)
//   backward:  dz = dout * act'(pre)    dx = dz W     dW = dz^T x     dbias = sum over rows of dz
//
// Shapes (all row-major; the last dimension of every matrix contiguous, rows any stride >= its
// length, 16-byte multiples preferred, see "Fast paths" below):
//   x     (..., K)   leading dimensions flattened into M rows with one row stride
//   W     (N, K)     the nn.Linear weight layout; or column-major, strides (1, ld) with ld >= N: the
//                    transpose of a row-major (K, N) matrix, as GPT-2's Conv1D stores its weight,
//                    which the GEMMs read transposed (no copy)
//   bias  (N)        optional, contiguous
//   y     (..., N)   M rows, same leading shape as x
//   pre_activation (..., N), M rows: optional forward output (x W^T + b, rounded to the dtype),
//                    the input of backward for every activation other than none
//   dout  like y;  dx like x;  dW (N, K) in either of W's layouts (not necessarily W's own);
//   dbias like bias.
// M, N, K: 0 .. 2^31 - 1.
//
// Dtypes: x, W, bias, y, pre_activation, dout, dx, dW, dbias all share one dtype:
//   f16 or bf16: tensor-core GEMMs accumulating in float32; the activation is computed in float32
//                on the float32 accumulator (fused paths) and rounded once.
//   f32:         supported on a slower path: plain float32 GEMMs (TF32 is never used) followed,
//                for activations other than none and relu, by a separate elementwise kernel.
//   f64:         CPU only (the float64 reference the GPU paths are tested against).
//
// Activations: none, relu, gelu_erf, gelu_tanh, squared_relu, silu (fusekit/activation.h).
//   leaky_relu is refused: its slope is not a parameter of this API.
//
// Backward computes any subset of dx, dW, dbias. With an activation other than none it needs
// pre_activation (as saved by linear_forward); with none, pre_activation may be omitted.
//
// Workspace: on a CUDA device both directions take caller-owned scratch memory (a u8 tensor of at
// least linear_*_workspace_size() bytes, 256-byte aligned, on the same device); nothing is
// allocated on the call path. The CPU backend needs none.
//
// How each case runs on the GPU (src/linear/linear_cuda.cu has the reasoning in detail):
//   forward, none / relu without pre_activation: one cuBLASLt GEMM with the BIAS / RELU_BIAS
//     epilogue.
//   forward, everything else (gelu_tanh, squared_relu, silu, gelu_erf, or relu / none with
//     pre_activation): a CUTLASS Hopper GEMM (TMA, warp-specialized ping-pong) whose epilogue adds
//     the bias, applies the activation and stores both outputs. Where its alignment rules are not
//     met, gelu_tanh takes cuBLASLt's GELU_BIAS / GELU_AUX_BIAS epilogue (tanh form; the aux is
//     pre_activation), measured 3-11% slower than the plain GEMM at the benchmark shapes.
//   forward, when the fused path's alignment rules are not met (or for f32): cuBLASLt GEMM with the
//     bias epilogue, then one elementwise kernel for the activation (the activation is then not
//     free: one extra read and write of the (M, N) output).
//   backward: dz = dout * act'(pre) is one elementwise pass into the workspace that also sums
//     dbias (deterministic: per-block partial rows in a fixed order); then dx and dW are two
//     cuBLASLt GEMMs. Without an activation dz is dout and the same kernel only sums dbias.
//
// Fast paths (otherwise the slower, still correct paths above are taken; nothing is refused for
// alignment except a data pointer not aligned to its element size):
//   the fused CUTLASS forward: f16/bf16, a row-major W, K and N multiples of 8, every row stride a
//     multiple of 8 elements, every pointer 16-byte aligned. With a column-major W the forward
//     takes the cuBLASLt paths, and the backward forms dz in the separate elementwise pass.
//   cuBLASLt GELU_AUX_BIAS: the pre_activation row stride a multiple of 8 elements and its pointer
//     16-byte aligned.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusekit/activation.h"
#include "fusekit/gated_act.h"
#include "fusekit/tensor.h"

namespace fusekit {

// The size queries check their arguments on every device: m, n, k in 0..2^31 - 1, a dtype and an
// activation the ops take, and M x N small enough that the scratch size cannot wrap (an
// invalid_argument Error otherwise, never a wrapped size).
//
// Bytes of scratch memory linear_forward needs on `device` (0 on the CPU).
std::size_t linear_forward_workspace_size(std::int64_t m, std::int64_t n, std::int64_t k,
                                          DType dtype, Activation activation, Device device);

// Bytes of scratch memory linear_backward needs on `device` (0 on the CPU). It includes room for
// dz (m * n elements) when `activation` is not none.
std::size_t linear_backward_workspace_size(std::int64_t m, std::int64_t n, std::int64_t k,
                                           DType dtype, Activation activation, Device device);

void linear_forward(const TensorView& x, const TensorView& weight, const OptionalTensor& bias,
                    Activation activation, const TensorView& y,
                    const OptionalTensor& pre_activation, const OptionalTensor& workspace,
                    Stream stream = nullptr);

void linear_backward(const TensorView& dout, const TensorView& x, const TensorView& weight,
                     const OptionalTensor& pre_activation, Activation activation,
                     const OptionalTensor& dx, const OptionalTensor& dweight,
                     const OptionalTensor& dbias, const OptionalTensor& workspace,
                     Stream stream = nullptr);

// ---- Backward through the input's activation ---------------------------------------------------
//
// When x is itself an activation, x = x_activation(x_pre) with x_pre the pre_activation of the
// layer before (an MLP's down projection after its up projection), the backward can return the
// gradient at x_pre instead of dx:
//
//   dx_pre_activation = (dz W) * x_activation'(x_pre)     dx_pre_activation_sum = its column sums
//
// with dW and dbias as linear_backward computes them. The layer before then runs
// linear_backward with activation none on dx_pre_activation (its dz), without dbias (the sum is
// its dbias): its own elementwise dz pass and one read and write of an (M, K) matrix are saved.
// x_pre_activation and dx_pre_activation are (M, K) like x, dx_pre_activation_sum (K), all in x's
// dtype; x_activation is any activation other than none. On the GPU, gelu_tanh in f16 / bf16 with
// x_pre_activation's rows 16-byte aligned runs in the dx GEMM's epilogue (cuBLASLt DGELU; the
// sums in a column-sum pass over its output); otherwise dx goes to the workspace and one
// elementwise pass forms the product and the sums.
std::size_t linear_backward_through_input_activation_workspace_size(std::int64_t m, std::int64_t n, std::int64_t k,
                                                                    DType dtype, Activation activation,
                                                                    Device device);

void linear_backward_through_input_activation(const TensorView& dout, const TensorView& x, const TensorView& weight,
                                              const OptionalTensor& pre_activation, Activation activation,
                                              const TensorView& x_pre_activation, Activation x_activation,
                                              const TensorView& dx_pre_activation,
                                              const OptionalTensor& dx_pre_activation_sum,
                                              const OptionalTensor& dweight, const OptionalTensor& dbias,
                                              const OptionalTensor& workspace, Stream stream = nullptr);

// ---- Gated linear: the gate and up projections of a gated MLP in one GEMM ----------------------
//
//   forward:   pre = x W^T + b  (M, 2F: gate and up columns, config.layout)    y = act(gate) * up
//   backward:  dgate = dy * up * act'(gate),  dup = dy * act(gate)  form dpre (M, 2F) in pre's layout;
//              dx = dpre W,  dW = dpre^T x,  dbias = sum over rows of dpre
//
// Shapes: x (..., K) flattened into M rows; W (2F, K), row-major or column-major as linear_forward
// takes it, its rows ordered as config.layout orders pre's columns (halves: the F gate rows, then the
// F up rows, as a fused gate_up_proj stores them; interleaved: gate row j at 2j, up row j at 2j + 1);
// bias (2F) in the same order, optional; y and dy (..., F); pre_activation (..., 2F), optional in the
// forward (the saved input of the backward), required by the backward. dx like x, dW like W (either
// layout), dbias like bias; each optional. Dtypes as linear_forward: one of f16, bf16, f32 (f64 on
// the CPU); the math in float32 on the float32 accumulator, each output rounded once. Activation
// (config.activation): silu (SwiGLU), gelu_tanh or gelu_erf (GeGLU), relu (ReGLU).
//
// On the GPU:
//   forward, interleaved layout, f16/bf16, row-major W, K a multiple of 8 and F of 4, x, W and
//     pre rows 16-byte aligned (row strides multiples of 8 elements), y rows 8-byte aligned: one
//     CUTLASS Hopper GEMM over all 2F columns whose epilogue finds each gate beside its up in the
//     same thread's registers and writes y (F columns) and, when asked, pre.
//   forward, otherwise (halves, f32, misaligned views): the GEMM into pre (or the workspace), then a
//     gated_act_forward pass over it.
//   backward: one elementwise pass forms dpre in the workspace, then the linear family's GEMMs (and
//     its deterministic dbias sum) read it.
// Limits: M, K, 2F in 0 .. 2^31 - 1. Workspaces as linear_forward's (u8, 256-byte aligned).
struct GatedLinearConfig {
  Activation activation = Activation::silu;        // silu, gelu_tanh, gelu_erf or relu
  GatedLayout layout = GatedLayout::interleaved;  // the order of W's rows, bias and pre's columns
};

// Bytes of scratch memory gated_linear_forward needs on `device` (0 on the CPU). `keeps_pre`: the
// caller passes pre_activation (otherwise the halves path needs room for it).
std::size_t gated_linear_forward_workspace_size(std::int64_t m, std::int64_t f, std::int64_t k, DType dtype,
                                                const GatedLinearConfig& config, bool keeps_pre,
                                                Device device);
// Bytes of scratch memory gated_linear_backward needs on `device` (0 on the CPU): dpre (m x 2f
// elements) and the GEMMs' scratch.
std::size_t gated_linear_backward_workspace_size(std::int64_t m, std::int64_t f, std::int64_t k, DType dtype,
                                                 const GatedLinearConfig& config, Device device);

void gated_linear_forward(const TensorView& x, const TensorView& weight, const OptionalTensor& bias,
                          const GatedLinearConfig& config, const TensorView& y,
                          const OptionalTensor& pre_activation, const OptionalTensor& workspace,
                          Stream stream = nullptr);

void gated_linear_backward(const TensorView& dy, const TensorView& x, const TensorView& weight,
                           const TensorView& pre_activation, const GatedLinearConfig& config,
                           const OptionalTensor& dx, const OptionalTensor& dweight, const OptionalTensor& dbias,
                           const OptionalTensor& workspace, Stream stream = nullptr);

}  // namespace fusekit
