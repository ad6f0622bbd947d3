// Gated activations of the gated MLP (GLU variants), forward and backward:
//
//   forward:  y = act(gate) * up
//   backward: dgate = dy * up * act'(gate),  dup = dy * act(gate)
//
// act: silu (SwiGLU), gelu_tanh or gelu_erf (GeGLU), relu (ReGLU), as fusekit/activation.h
// defines them; the other activations are refused (none, squared_relu and leaky_relu are not
// gates of a GLU this API offers; leaky_relu's slope is not a parameter here).
//
// Inputs come in one of two forms:
//  * one tensor gate_up of shape (..., 2F), the output of a fused gate-up projection, in one of two
//    layouts (config.layout):
//      halves:      [gate | up] along the last dimension: gate j at column j, up j at column F + j
//      interleaved: gate and up alternate: gate j at column 2j, up j at column 2j + 1
//    Its gradient dgate_up has gate_up's shape and the same layout.
//  * two tensors gate and up of shape (..., F) (the *_separate functions), each with a row stride
//    of its own; their gradients dgate and dup have gate's shape, and each is optional.
// y and dy have the inputs' leading shape and F columns. Leading dimensions flatten into M rows
// with one row stride per tensor (any stride >= the row length; the last dimension contiguous).
//
// Dtypes: f32, f16 or bf16, one dtype for every tensor of a call. The math is float32: act and act'
// as fusekit's float kernels evaluate them (core/activation.h), each output rounded once.
//
// Outputs must not overlap the inputs or each other, with one exception: with
// config.in_place_backward, each gradient may be exactly the view of the input it belongs to
// (dgate_up = gate_up; dgate = gate, dup = up: same data pointer, shape and strides), so that the
// backward needs no memory of its own for them. Every element is read before its gradient is
// written over it. Any other overlap is refused, with or without the flag.
//
// What backward needs: dy and the forward's inputs; the forward saves nothing.
// Fast path (GPU): F, every row stride a multiple of 16 bytes' worth of elements (8 for f16 / bf16,
// 4 for f32) and every pointer 16-byte aligned; other views take an element-wise path, same results.
// Limits: F in 1 .. 2^30 - 1, M <= 2^31 - 1. M = 0 is a valid call that does nothing.
#pragma once

#include <cstdint>

#include "fusekit/activation.h"
#include "fusekit/tensor.h"

namespace fusekit {

// Where gate and up sit in the one-tensor form's last dimension of 2F columns.
enum class GatedLayout : std::uint8_t {
  halves,       // [gate | up]: gate j at column j, up j at column F + j
  interleaved,  // gate j at column 2j, up j at column 2j + 1
};

const char* gated_layout_name(GatedLayout layout);

// Everything that defines the op besides its tensors. Pass the same value to the forward and to
// the backward.
struct GatedActConfig {
  Activation activation = Activation::silu;  // silu, gelu_tanh, gelu_erf or relu
  GatedLayout layout = GatedLayout::halves;  // the one-tensor form's layout (*_separate: ignored)
  // Backward only: each gradient may be exactly the view of its input (see above).
  bool in_place_backward = false;
};

// y = act(gate) * up from one (..., 2F) tensor.
void gated_act_forward(const TensorView& gate_up, const GatedActConfig& config, const TensorView& y,
                       Stream stream = nullptr);

// dgate_up (gate_up's shape and layout) = [dy * up * act'(gate), dy * act(gate)].
void gated_act_backward(const TensorView& dy, const TensorView& gate_up, const GatedActConfig& config,
                        const TensorView& dgate_up, Stream stream = nullptr);

// y = act(gate) * up from two (..., F) tensors.
void gated_act_forward_separate(const TensorView& gate, const TensorView& up, const GatedActConfig& config,
                                const TensorView& y, Stream stream = nullptr);

// dgate = dy * up * act'(gate), dup = dy * act(gate); each optional.
void gated_act_backward_separate(const TensorView& dy, const TensorView& gate, const TensorView& up,
                                 const GatedActConfig& config, const OptionalTensor& dgate,
                                 const OptionalTensor& dup, Stream stream = nullptr);

}  // namespace fusekit
