// The chunk size of linear_cross_entropy: a pure host function of the problem and the device, so
// that the CPU tests check it; the workspace query and the launcher both ask it.
//
// Each chunk runs three GEMMs of its Tc rows (logits, dh, dW) and the cross-entropy kernel on its
// (Tc, V) logits. Two costs set Tc:
//  * memory: the chunk's logits are the workspace's largest part, so Tc Vp e is kept near
//    kTargetChunkBytes and never above kMaxChunkBytes;
//  * the dW accumulation: every chunk but the first reads and writes the float32 (V, H) dW once
//    more (beta = 1), 8 V H bytes against 2 Tc V H flops: Tc / 4 flops per byte. At Tc = 4096 that
//    is ~1000 flops per byte, well above an H100's ~300 (990 TFLOP/s over 3.35 TB/s), so the GEMM
//    stays compute bound; kMinChunkTokens keeps Tc there even where it takes more than the target.
// The rows are then split into equal chunks (a multiple of kChunkRowMultiple, a GEMM tile) rather
// than full chunks and a short tail: one GEMM shape per call, none inefficiently small.
// The device does not enter yet: the chunk lives in DRAM, whose size DeviceInfo does not carry, and
// the bounds above hold for every Hopper part.
#pragma once

#include <cstdint>

#include "core/device_info.h"

namespace fusekit::lxent {

inline constexpr std::int64_t kTargetChunkBytes = std::int64_t(512) << 20;
inline constexpr std::int64_t kMaxChunkBytes = std::int64_t(4) << 30;
inline constexpr std::int64_t kMinChunkTokens = 4096;
inline constexpr std::int64_t kChunkRowMultiple = 128;

struct Problem {
  std::int64_t tokens = 0, vocab = 1, hidden = 1;
  int element_bytes = 2;  // h's dtype: 2 (bf16, f16) or 4 (f32)
};

// Rows per chunk: T where one chunk holds every row (0 for T = 0), else a multiple of
// kChunkRowMultiple with ceil(T / Tc) chunks covering T.
std::int64_t choose_chunk(const Problem& problem, const detail::DeviceInfo& device);

// choose_chunk, or the override linear_cross_entropy.chunk_tokens (capped at T) where set.
std::int64_t chunk_with_overrides(const Problem& problem, const detail::DeviceInfo& device);

}  // namespace fusekit::lxent
