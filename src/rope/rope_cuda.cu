// CUDA launcher for rotary embeddings: describe the problem (the alignment that every pointer and
// stride allows), launch what rope_config.h chooses, dispatching on dtype, style and access width.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "core/cuda_check.h"
#include "core/device_info.h"
#include "core/overrides.h"
#include "rope/rope_config.h"
#include "rope/rope_kernels.cuh"
#include "rope/rope_params.h"

namespace fusekit::rope {
namespace {

constexpr const char* kOp[2] = {"rope_forward", "rope_backward"};

// The largest power of two number of elements (at most 16 bytes of them) that every pointer of
// the call, and every stride of a dimension longer than 1, is a multiple of.
int aligned_elements(const Params& p) {
  const int size = static_cast<int>(dtype_size(p.dtype));
  int best = 16 / size;
  auto operand = [&](const Operand& op, std::int64_t heads) {
    const auto address = reinterpret_cast<std::uintptr_t>(op.data);
    while (best > 1 && address % static_cast<std::uintptr_t>(best * size) != 0) best /= 2;
    for (auto [stride, extent] : {std::pair{op.b_stride, p.batch}, std::pair{op.s_stride, p.seqlen},
                                  std::pair{op.h_stride, heads}})
      while (extent > 1 && best > 1 && stride % best != 0) best /= 2;
  };
  operand(p.q_in, p.heads_q);
  operand(p.q_out, p.heads_q);
  if (p.heads_k > 0) {
    operand(p.k_in, p.heads_k);
    operand(p.k_out, p.heads_k);
  }
  return best;
}

ForcedChoices forced_choices() {
  ForcedChoices f;
  if (const auto bytes = detail::override_choice<int>("rope.max_access_bytes",
                                                      {{"16", 16}, {"8", 8}, {"4", 4}, {"element", 1}}))
    f.max_access_bytes = *bytes;
  if (const auto tokens = detail::override_int("rope.tokens_per_block", 1, kMaxTokensPerBlock))
    f.tokens_per_block = static_cast<int>(*tokens);
  return f;
}

template <typename T, RopeStyle STYLE, int W, bool ELEMENTWISE>
void launch(const Params& p, const Launch& l, const kernels::Geometry& g, cudaStream_t stream) {
  kernels::rope_kernel<T, STYLE, W, ELEMENTWISE>
      <<<static_cast<unsigned>(l.blocks), l.threads, l.smem_bytes, stream>>>(p, g);
}

template <typename T, RopeStyle STYLE>
void launch_style(const Params& p, const Launch& l, const kernels::Geometry& g, cudaStream_t stream) {
  constexpr int kSize = static_cast<int>(sizeof(T));
  if (l.elementwise) {
    launch<T, STYLE, STYLE == RopeStyle::rotate_half ? 1 : 2, true>(p, l, g, stream);
    return;
  }
  switch (l.access_elements * kSize) {
    case 16: launch<T, STYLE, 16 / kSize, false>(p, l, g, stream); return;
    case 8: launch<T, STYLE, 8 / kSize, false>(p, l, g, stream); return;
    case 4:
      // One f32 element holds no whole interleaved pair: the config never asks for it.
      if constexpr (STYLE == RopeStyle::rotate_half || kSize == 2) launch<T, STYLE, 4 / kSize, false>(p, l, g, stream);
      return;
    default: return;
  }
}

template <typename T>
void launch_typed(const Params& p, const Launch& l, cudaStream_t stream) {
  kernels::Geometry g;
  int log2 = 0;
  while ((1 << log2) < l.lanes_per_row) ++log2;
  g.lanes_log2 = log2;
  g.tokens_per_block = l.tokens_per_block;
  g.rotation_units = l.rotation_units;
  g.units_q = row_units(l, !p.q_in_place);
  g.units_k = row_units(l, !p.k_in_place);
  g.cos_sin_stride = l.cos_sin_stride;
  const int slots = l.threads / l.lanes_per_row;
  const int heads = static_cast<int>(p.heads_q + p.heads_k);
  g.slots_t = slots / heads;
  g.slots_h = slots % heads;
  g.pass_accesses = l.pass_accesses;
  if (p.style == RopeStyle::rotate_half) launch_style<T, RopeStyle::rotate_half>(p, l, g, stream);
  else launch_style<T, RopeStyle::interleaved>(p, l, g, stream);
}

}  // namespace

void rotate_cuda(const Params& p, int device_index, Stream stream) {
  const char* op = kOp[p.transpose ? 1 : 0];
  detail::DeviceGuard guard(op, device_index);
  Problem problem;
  problem.dtype = p.dtype;
  problem.style = p.style;
  problem.tokens = p.tokens();
  problem.heads_q = p.heads_q;
  problem.heads_k = p.heads_k;
  problem.head_dim = p.head_dim;
  problem.rotary_dim = p.rotary_dim;
  problem.q_copies = !p.q_in_place;
  problem.k_copies = !p.k_in_place;
  problem.aligned_elements = aligned_elements(p);
  const Launch l = choose_launch(problem, detail::device_info(op, device_index), forced_choices());
  const auto s = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::f32: launch_typed<float>(p, l, s); break;
    case DType::f16: launch_typed<__half>(p, l, s); break;
    case DType::bf16: launch_typed<__nv_bfloat16>(p, l, s); break;
    default: return;  // refused by the argument checks
  }
  detail::check_launch(op, "rope kernel");
}

}  // namespace fusekit::rope
