// Which implementation a CUDA linear forward runs, and a hook for tests and benchmarks to force
// one. Not part of the public API: the public entry points always choose automatically unless a
// test or benchmark has set an override.
#pragma once

namespace fusekit::linear {

enum class ForwardPath : int {
  automatic = 0,      // (override value) let the library choose
  cublaslt_epilogue,  // one cuBLASLt GEMM, bias/relu/gelu(+aux) epilogue
  cutlass_fused,      // one CUTLASS sm90 GEMM, bias + any activation (+ pre-activation) epilogue
  unfused,            // cuBLASLt GEMM with bias epilogue, then an elementwise activation kernel
  trivial,            // M, N or K is 0: no GEMM (bias broadcast or nothing)
};

const char* forward_path_name(ForwardPath path);

// Process-wide; `automatic` restores the normal choice. A forced path that cannot serve a call
// (cublaslt_epilogue for silu, cutlass_fused for misaligned rows, ...) leaves that call to the
// automatic choice; last_forward_path() tells what ran.
void set_forward_path_override(ForwardPath path);
ForwardPath forward_path_override();

// The path the calling thread's most recent CUDA linear_forward took.
ForwardPath last_forward_path();
void record_forward_path(ForwardPath path);

// How a CUDA linear_backward with an activation forms dz = dout * act'(pre).
enum class BackwardPath : int {
  automatic = 0,  // (override value) let the library choose
  separate_dz,    // one elementwise pass writes dz, then the dx and dW GEMMs (cuBLASLt) read it
  dz_in_dgrad,    // the dx GEMM (CUTLASS, sm90, 16-bit) forms dz in its idle producer warps
  no_dz,          // activation none, or neither dx nor dW asked for: dz is not formed
};
const char* backward_path_name(BackwardPath path);
// Process-wide, like the forward's override; a forced path that cannot serve a call (misaligned
// rows, f32) leaves that call to the automatic choice; last_backward_path() tells what ran.
void set_backward_path_override(BackwardPath path);
BackwardPath last_backward_path();
// The override key "linear.backward.dz" (separate | in_dgrad) forces the route the same way for
// benchmark sweeps, and "linear.backward.dz_first_rows" the rows the dz_in_dgrad path forms with
// the elementwise pass before its kernel (rounded down to a multiple of 128; tests set it to reach
// both parts).

// Autotuning of cuBLASLt's GEMM algorithms (linear_cublaslt.cpp) and of the forward path
// (linear_cuda.cu): the first call of a problem times the candidates and keeps the fastest. On
// unless the override "linear.autotune" is off (tests turn it off to check the untimed routing
// rules in linear_config.h). Problems already tuned keep their choice; problems of fewer than
// lt::kMinTimedFlops (2^30) are never timed and keep the heuristic's / the rules' first choice, so
// that their numerics do not depend on timer noise.
bool autotune_enabled();

// How a CUDA gated_linear_forward runs.
enum class GatedForwardPath : int {
  automatic = 0,    // (override value) let the library choose
  epilogue,         // one CUTLASS sm90 GEMM whose epilogue writes act(gate) * up (interleaved W)
  gemm_then_gated,  // the GEMM into pre (or the workspace), then a gated_act_forward pass
  trivial,          // M or F is 0: nothing to do
};
const char* gated_forward_path_name(GatedForwardPath path);
// Process-wide, like the others; the override key "linear.gated.forward" (epilogue | separate)
// forces it for benchmark sweeps. A forced epilogue that cannot serve a call is not taken.
void set_gated_forward_path_override(GatedForwardPath path);
GatedForwardPath last_gated_forward_path();

}  // namespace fusekit::linear
