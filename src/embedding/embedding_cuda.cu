// CUDA launchers for the embeddings, dispatching on the storage and index types. The forward is
// one gather kernel. The backward: zero the gradients (accumulate = false), write the sort keys,
// sort (token, position) pairs with CUB's stable radix sort in the caller's workspace, then one
// warp per run of equal tokens and column chunk sums dout's rows into dweight, and one thread per
// position and column group sums over the sequences into dposition_weight. All on the caller's
// stream, without a host synchronization.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <cub/device/device_radix_sort.cuh>

#include "core/cuda_check.h"
#include "core/device_info.h"
#include "embedding/embedding_kernels.cuh"
#include "embedding/embedding_params.h"

namespace fusekit::embedding {
namespace {

using namespace kernels;

constexpr std::size_t kRegionAlignment = 256;

std::size_t round_up(std::size_t bytes) {
  return (bytes + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
}

// Bits of the sort keys: enough for V (the out-of-range sentinel).
int key_bits(std::int64_t vocab) {
  int bits = 1;
  while (bits < 32 && (std::int64_t{1} << bits) <= vocab) ++bits;
  return bits;
}

// CUB's temporary storage for sorting N pairs of key_bits(V)-bit keys on the current device.
std::size_t sort_temp_bytes(const char* op, std::int64_t tokens, std::int64_t vocab) {
  std::size_t bytes = 0;
  cub::DoubleBuffer<std::uint32_t> keys(nullptr, nullptr), values(nullptr, nullptr);
  detail::check_cuda(cub::DeviceRadixSort::SortPairs(nullptr, bytes, keys, values,
                                                     static_cast<int>(tokens), 0, key_bits(vocab)),
                     op, "cub::DeviceRadixSort::SortPairs (temporary storage size)");
  return bytes;
}

// Float32 partial sums of the runs longer than a window: two rows of C per window of kSegment
// sorted positions.
std::size_t partials_bytes(std::int64_t tokens, std::int64_t dim) {
  const std::int64_t windows = (tokens + kSegment - 1) / kSegment;
  return round_up(static_cast<std::size_t>(2 * windows * dim) * sizeof(float));
}

// The workspace: slack to align its start, keys and positions twice (the sort's double buffers),
// the partial sums, then CUB's temporary storage.

std::size_t workspace_bytes(const char* op, std::int64_t tokens, std::int64_t vocab, std::int64_t dim) {
  if (tokens == 0) return 0;
  const std::size_t array = round_up(static_cast<std::size_t>(tokens) * sizeof(std::uint32_t));
  return kRegionAlignment + 4 * array + partials_bytes(tokens, dim) + round_up(sort_temp_bytes(op, tokens, vocab));
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// 16-byte groups of kGroup columns for a (rows, C) operand: the base and every row 16-byte
// aligned, and C a whole number of groups.
bool vector_ok(const void* base, std::int64_t row_stride, DType dtype, std::int64_t dim) {
  return dim % kGroup == 0 && aligned16(base) &&
         (row_stride * static_cast<std::int64_t>(dtype_size(dtype))) % 16 == 0;
}

// Calls f(T{}) with the storage type of a float dtype.
template <typename F>
void with_float_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f(float{}); return;
    case DType::f16: f(__half{}); return;
    case DType::bf16: f(__nv_bfloat16{}); return;
    default: return;  // refused by the argument checks
  }
}

template <typename F>
void with_index_type(DType dtype, F&& f) {
  if (dtype == DType::i32) f(std::int32_t{});
  else f(std::int64_t{});
}

template <typename F>
void with_vector(bool vector, F&& f) {
  if (vector) f(std::true_type{});
  else f(std::false_type{});
}

unsigned blocks_for(std::int64_t items, std::int64_t per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

// Zeroes a (rows, C) gradient (all-zero bytes are 0.0 in every float type).
void zero_rows(void* base, std::int64_t first_row, std::int64_t rows, std::int64_t row_stride,
               std::int64_t dim, DType dtype, cudaStream_t stream, const char* op) {
  if (rows <= 0) return;
  const std::size_t e = dtype_size(dtype);
  void* start = static_cast<char*>(base) + static_cast<std::size_t>(first_row * row_stride) * e;
  const std::size_t width = static_cast<std::size_t>(dim) * e;
  const std::size_t pitch = rows > 1 ? static_cast<std::size_t>(row_stride) * e : width;
  detail::check_cuda(cudaMemset2DAsync(start, pitch, 0, width, static_cast<std::size_t>(rows), stream),
                     op, "cudaMemset2DAsync (zeroing a gradient)");
}

}  // namespace

std::size_t backward_workspace_bytes_cuda(std::int64_t tokens, std::int64_t vocab, std::int64_t dim,
                                          int device_index) {
  const char* op = "embedding_backward_workspace_size";
  detail::DeviceGuard guard(op, device_index);
  return workspace_bytes(op, tokens, vocab, dim);
}

void forward_cuda(const ForwardParams& p, int device_index, Stream stream) {
  const char* op = "embedding_forward";
  if (p.tokens == 0) return;
  detail::DeviceGuard guard(op, device_index);
  auto s = static_cast<cudaStream_t>(stream);
  ForwardArgs a{p.token_ids, p.weight, p.position_weight, p.out,
                p.tokens, p.positions, p.vocab, p.dim,
                p.weight_row_stride, p.position_row_stride, p.out_row_stride};
  const bool vector = vector_ok(p.weight, p.weight_row_stride, p.dtype, p.dim) &&
                      vector_ok(p.out, p.out_row_stride, p.dtype, p.dim) &&
                      (!p.position_weight ||
                       vector_ok(p.position_weight, p.position_row_stride, p.dtype, p.dim));
  // One warp per row at a time; enough blocks to fill every SM several times over, the rest
  // strided.
  const int sms = detail::device_info(op, device_index).sm_count;
  const unsigned blocks = static_cast<unsigned>(
      std::min<std::int64_t>(blocks_for(p.tokens, kWarpsPerBlock), std::int64_t{sms} * 16));
  with_float_type(p.dtype, [&](auto t) {
    using T = decltype(t);
    with_index_type(p.token_dtype, [&](auto i) {
      using Index = decltype(i);
      with_vector(vector, [&](auto v) {
        forward_kernel<T, Index, decltype(v)::value><<<blocks, kThreads, 0, s>>>(a);
        detail::check_launch(op, "forward_kernel");
      });
    });
  });
}

void backward_cuda(const BackwardParams& p, int device_index, Stream stream) {
  const char* op = "embedding_backward";
  detail::DeviceGuard guard(op, device_index);
  auto s = static_cast<cudaStream_t>(stream);

  if (!p.accumulate) zero_rows(p.dweight, 0, p.vocab, p.dweight_row_stride, p.dim, p.dweight_dtype, s, op);
  // The position kernel below writes rows t < T (when there are tokens); the rest are zeroed.
  const std::int64_t written_positions = p.tokens > 0 ? p.positions : 0;
  if (p.dposition_weight && !p.accumulate)
    zero_rows(p.dposition_weight, written_positions, p.position_rows - written_positions,
              p.dposition_row_stride, p.dim, p.dposition_dtype, s, op);
  if (p.tokens == 0) return;

  // dposition_weight first: it needs no sort.
  if (p.dposition_weight) {
    PositionGradArgs a{p.dout, p.dposition_weight, p.tokens / p.positions, p.positions, p.dim,
                       p.dout_row_stride, p.dposition_row_stride, p.accumulate};
    const bool vector = vector_ok(p.dout, p.dout_row_stride, p.dtype, p.dim) &&
                        vector_ok(p.dposition_weight, p.dposition_row_stride, p.dposition_dtype, p.dim);
    const std::int64_t items = p.positions * ((p.dim + kGroup - 1) / kGroup);
    with_float_type(p.dtype, [&](auto in) {
      using In = decltype(in);
      with_vector(vector, [&](auto v) {
        if (p.dposition_dtype == DType::f32)
          position_grad_kernel<In, float, decltype(v)::value><<<blocks_for(items, kThreads), kThreads, 0, s>>>(a);
        else
          position_grad_kernel<In, In, decltype(v)::value><<<blocks_for(items, kThreads), kThreads, 0, s>>>(a);
        detail::check_launch(op, "position_grad_kernel");
      });
    });
  }

  // The workspace (checked by the entry point against workspace_bytes): aligned regions.
  const std::size_t need = workspace_bytes(op, p.tokens, p.vocab, p.dim);
  if (p.workspace == nullptr || p.workspace_bytes < need)
    throw Error(ErrorKind::invalid_argument, op, "workspace smaller than embedding_backward_workspace_size");
  const auto start = reinterpret_cast<std::uintptr_t>(p.workspace);
  char* base = reinterpret_cast<char*>((start + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment);
  const std::size_t array = round_up(static_cast<std::size_t>(p.tokens) * sizeof(std::uint32_t));
  auto* keys_a = reinterpret_cast<std::uint32_t*>(base);
  auto* keys_b = reinterpret_cast<std::uint32_t*>(base + array);
  auto* pos_a = reinterpret_cast<std::uint32_t*>(base + 2 * array);
  auto* pos_b = reinterpret_cast<std::uint32_t*>(base + 3 * array);
  auto* partials = reinterpret_cast<float*>(base + 4 * array);
  void* temp = base + 4 * array + partials_bytes(p.tokens, p.dim);
  std::size_t temp_bytes = sort_temp_bytes(op, p.tokens, p.vocab);

  with_index_type(p.token_dtype, [&](auto i) {
    using Index = decltype(i);
    sort_keys_kernel<Index><<<blocks_for(p.tokens, kThreads), kThreads, 0, s>>>(
        static_cast<const Index*>(p.token_ids), p.tokens, p.vocab, keys_a, pos_a);
    detail::check_launch(op, "sort_keys_kernel");
  });
  cub::DoubleBuffer<std::uint32_t> keys(keys_a, keys_b), positions(pos_a, pos_b);
  detail::check_cuda(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, positions,
                                                     static_cast<int>(p.tokens), 0,
                                                     key_bits(p.vocab), s),
                     op, "cub::DeviceRadixSort::SortPairs");

  WeightGradArgs a{p.dout, p.dweight, keys.Current(), positions.Current(), partials, p.tokens, p.vocab, p.dim,
                   p.dout_row_stride, p.dweight_row_stride, p.accumulate};
  const bool vector = vector_ok(p.dout, p.dout_row_stride, p.dtype, p.dim) &&
                      vector_ok(p.dweight, p.dweight_row_stride, p.dweight_dtype, p.dim);
  const dim3 grid(blocks_for(p.tokens, kWarpsPerBlock), blocks_for(p.dim, kChunk));
  with_float_type(p.dtype, [&](auto in) {
    using In = decltype(in);
    with_vector(vector, [&](auto v) {
      if (p.dweight_dtype == DType::f32)
        weight_grad_kernel<In, float, decltype(v)::value><<<grid, kThreads, 0, s>>>(a);
      else
        weight_grad_kernel<In, In, decltype(v)::value><<<grid, kThreads, 0, s>>>(a);
      detail::check_launch(op, "weight_grad_kernel");
      // Runs longer than their window (rare in a large vocabulary; most of a byte-level batch).
      if (p.tokens > kSegment) {
        if (p.dweight_dtype == DType::f32)
          combine_segments_kernel<float, decltype(v)::value><<<grid, kThreads, 0, s>>>(a);
        else
          combine_segments_kernel<In, decltype(v)::value><<<grid, kThreads, 0, s>>>(a);
        detail::check_launch(op, "combine_segments_kernel");
      }
    });
  });
}

}  // namespace fusekit::embedding
