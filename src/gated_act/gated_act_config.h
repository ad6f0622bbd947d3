// Launch choice of the gated-activation kernels: a pure, table-driven function of the problem and
// the device (no CUDA calls), so that the CPU tests check it (tests/gated_act/test_gated_act_config.cpp);
// gated_act_cuda.cu launches what it returns.
//
// Both directions have one kernel shape. A thread owns one unit of a row, `unit_elems` consecutive
// outputs (16 bytes of y on the vector path, one element on the scalar path), in each of
// `rows_per_thread` rows, and issues all of those rows' loads before any math: the bytes in flight
// that keep HBM busy. Blocks are (tile_threads, row_threads) = kBlockThreads threads; blockIdx.x
// picks a tile of units along the row, blockIdx.y a group of row_threads x rows_per_thread rows.
// The grid covers every row once (blocks walk on by gridDim.y rows only where M needs more than
// kMaxRowBlocks row groups).
#pragma once

#include <cstdint>

#include "core/device_info.h"

namespace fusekit::gated_act {

inline constexpr int kBlockThreads = 256;
inline constexpr int kMaxRowBlocks = 65535;  // gridDim.y
// rows_per_thread on the vector path: the values the kernels are compiled for.
inline constexpr int kVectorRowsPerThread[] = {1, 2, 4};
// The scalar path (any F, any alignment) is compiled for one value only.
inline constexpr int kScalarRowsPerThread = 4;

// Elements of one 16-byte vector: the vector path's unit.
constexpr int vector_elems(int element_bytes) { return 16 / element_bytes; }

struct Problem {
  std::int64_t rows = 0, cols = 0;  // M >= 1, F >= 1
  int element_bytes = 2;            // 4 (f32) or 2 (f16, bf16)
  bool backward = false;
  // F and every row stride (elements) multiples of vector_elems, every pointer 16-byte aligned.
  bool vector_ok = false;
};

struct Launch {
  bool vector = false;
  int unit_elems = 1;              // outputs per thread and row
  std::int64_t units_per_row = 0;  // F / unit_elems
  int tile_threads = 32;           // blockDim.x: a multiple of 32
  int row_threads = 8;             // blockDim.y: tile_threads x row_threads = kBlockThreads
  int rows_per_thread = 1;         // vector path: one of kVectorRowsPerThread; scalar: kScalarRowsPerThread
  std::int64_t col_tiles = 0;      // gridDim.x: tiles of tile_threads units
  int row_blocks = 0;              // gridDim.y: groups of row_threads x rows_per_thread rows (capped)
};

// Choices forced by the override keys "gated_act.forward.rows" and "gated_act.backward.rows"
// (core/overrides.h), for benchmark sweeps; 0: the table's. The launcher's only non-pure input.
struct ForcedChoices {
  int forward_rows_per_thread = 0;
  int backward_rows_per_thread = 0;
};
ForcedChoices forced_choices();

Launch choose_launch(const Problem& p, const detail::DeviceInfo& device, const ForcedChoices& forced = {});

}  // namespace fusekit::gated_act
