// Launch choice of the rotary-embedding kernel: the access width, how a head's elements spread
// over the lanes of a row group, how many rows each lane keeps in flight, and how many tokens a
// block takes. A pure function of the problem, the device and the forced choices (no CUDA calls),
// tested on the CPU (tests/rope/test_rope_config.cpp); rope_cuda.cu launches what it returns.
//
// The kernel (rope_kernels.cuh): each block takes `tokens_per_block` consecutive tokens. It first
// computes the tokens' m cos a_i and m sin a_i into shared memory (one sincosf per token and pair,
// shared by every head), then streams the tokens' head rows of q and k: a row is one head of one
// token, handled by `lanes_per_row` lanes that each own a unit of `access_elements` elements (and,
// for rotate_half, its partner r / 2 further on), `rows_in_flight` rows per lane loaded before
// any is rotated and stored (the first batch before the angles are computed).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/device_info.h"
#include "fusekit/rope.h"
#include "fusekit/tensor.h"

namespace fusekit::rope {

inline constexpr int kThreads = 256;
inline constexpr int kMaxTokensPerBlock = 16;
// Rows each lane loads before rotating any: 4 for rotate_half (two accesses a row: the unit and
// its partner), 8 for interleaved (one). At 16-byte accesses 128 bytes in flight per thread.
constexpr int rows_in_flight(RopeStyle style) { return style == RopeStyle::rotate_half ? 4 : 8; }

struct Problem {
  DType dtype = DType::bf16;
  RopeStyle style = RopeStyle::rotate_half;
  std::int64_t tokens = 0;  // >= 1
  std::int64_t heads_q = 0, heads_k = 0;  // heads_q + heads_k >= 1
  std::int64_t head_dim = 0, rotary_dim = 0;
  // The passed-through dims r .. D - 1 are copied (the output is not the input).
  bool q_copies = false, k_copies = false;
  // The largest power of two number of elements, at most 16 bytes' worth, that every pointer (in
  // bytes, over the element size) and every stride of a dimension longer than 1 is a multiple of.
  int aligned_elements = 1;
};

// Forced by override keys (tests, benchmark sweeps); 0: the table's choice.
struct ForcedChoices {
  int max_access_bytes = 0;    // rope.max_access_bytes: 16, 8, 4, or 1 (element accesses)
  int tokens_per_block = 0;    // rope.tokens_per_block: 1..kMaxTokensPerBlock
};

struct Launch {
  // Elements per unit access: one access of access_elements * element size bytes (16, 8 or 4),
  // or, with `elementwise`, that many element accesses (1 for rotate_half, 2 for interleaved).
  int access_elements = 1;
  bool elementwise = true;
  int rotation_units = 0;  // units per head row of the rotated dims
  // A pass unit is pass_accesses accesses of access_elements elements: 2 for rotate_half where the
  // passed-through dims allow, so that every lane of a row group makes two accesses a row, as
  // the rotation units do.
  int pass_accesses = 1;
  int pass_units = 0;      // units per head row of the passed-through dims (copied rows only)
  int lanes_per_row = 1;   // a power of two <= 32
  int rows_in_flight = 4;  // rows_in_flight(style)
  int tokens_per_block = 1;
  int threads = kThreads;
  std::int64_t blocks = 0;
  int cos_sin_stride = 0;  // float2 entries per token in shared memory (r / 2 rounded up to even)
  std::size_t smem_bytes = 0;
};

// Units of a row of q (k) that the kernel visits: the rotation units and, where copied, the pass
// units.
constexpr int row_units(const Launch& l, bool copies) { return l.rotation_units + (copies ? l.pass_units : 0); }

Launch choose_launch(const Problem& p, const detail::DeviceInfo& device, const ForcedChoices& forced = {});

}  // namespace fusekit::rope
