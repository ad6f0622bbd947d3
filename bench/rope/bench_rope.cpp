// Rotary-embedding benchmarks: bf16 q and k of Llama's attention, B * S = 16384 tokens (B = 4,
// S = 4096), Hq = 32, Hk = 8, theta 500000, positions the sequence index, (B, S, H, D) tensors:
//   D = 128 (Llama), D = 64, partial rotary r = 32 of D = 128 (GPT-NeoX / Pythia), interleaved
//   pairs at D = 128 (GPT-J).
// Bytes counted as each tensor that must move once: q and k read, q_out and k_out written (the
// passed-through dims included: they are copied). In place ("fwd-inplace") only the rotated dims
// move. Beside each shape, impl "copy": a device-to-device copy of the same q + k bytes.
// `fusekit bench rope --shapes D=64,r=32` keeps the shapes whose name contains every
// comma-separated piece; --diagnostics adds the forward with int64 position ids ("fwd-ids") and
// with (B, H, S, D) storage read through the permuted view ("fwd-bhsd").
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "bench/harness/bench.h"
#include "bench/rope/bench_rope.h"
#include "fusekit/rope.h"

namespace fusekit::bench {

namespace {

struct Case {
  std::int64_t d = 128, r = 0;  // r = 0: the whole head dim
  RopeStyle style = RopeStyle::rotate_half;
};

constexpr std::int64_t kBatch = 4, kSeq = 4096, kHeadsQ = 32, kHeadsK = 8;

std::string case_name(const Case& c) {
  std::string name = fmt::format("(B={}, S={}, Hq={}, Hk={}, D={})", kBatch, kSeq, kHeadsQ, kHeadsK, c.d);
  if (c.r != 0) name += fmt::format(" r={}", c.r);
  if (c.style == RopeStyle::interleaved) name += " interleaved";
  return name;
}

// Every comma-separated piece of --shapes occurs in `name` (no --shapes: everything runs).
bool selected(const std::string& name) {
  std::stringstream pieces(options().shapes);
  std::string piece;
  while (std::getline(pieces, piece, ','))
    if (!piece.empty() && name.find(piece) == std::string::npos) return false;
  return true;
}

// q and k of one rotation, each in and out: q then k in one allocation, so that the copy ceiling
// moves the same bytes in one memcpy.
struct Set {
  DeviceBuffer in, out;
};

void run_case(Report& report, const Case& c) {
  const Device gpu = Device::cuda(0);
  const DType bf16 = DType::bf16;
  const std::int64_t D = c.d, tokens = kBatch * kSeq;
  const std::size_t q_bytes = static_cast<std::size_t>(tokens * kHeadsQ * D) * 2;
  const std::size_t bytes = static_cast<std::size_t>(tokens * (kHeadsQ + kHeadsK) * D) * 2;
  const int rotations = rotations_for(2 * bytes);
  std::vector<Set> sets(rotations);
  for (int r = 0; r < rotations; ++r) {
    sets[r] = {DeviceBuffer(bytes), DeviceBuffer(bytes)};
    sets[r].in.fill_random_bf16(1000 + r);
  }
  RopeConfig config;
  config.style = c.style;
  config.rotary_dim = c.r;
  config.theta = 500000.0f;
  auto q = [&](const DeviceBuffer& b) { return TensorView(b.get(), bf16, gpu, {kBatch, kSeq, kHeadsQ, D}); };
  auto k = [&](const DeviceBuffer& b) {
    return TensorView(static_cast<unsigned char*>(b.get()) + q_bytes, bf16, gpu, {kBatch, kSeq, kHeadsK, D});
  };
  const std::string shape = case_name(c);
  const double moved = 2.0 * bytes;  // read once, written once
  const double rotated_fraction = c.r == 0 ? 1.0 : static_cast<double>(c.r) / static_cast<double>(D);

  const Timing tc = time_same_size_copy(
      bytes, rotations, [&](int r) { return sets[r].out.get(); }, [&](int r) { return sets[r].in.get(); });
  report.add({"rope", "fwd", shape, "copy", tc.median_us, moved});
  const Timing tf = time_kernel(
      [&](int r) { rope_forward(q(sets[r].in), k(sets[r].in), std::nullopt, config, q(sets[r].out), k(sets[r].out)); },
      rotations);
  report.add({"rope", "fwd", shape, "fusekit", tf.median_us, moved});
  const Timing tb = time_kernel(
      [&](int r) { rope_backward(q(sets[r].in), k(sets[r].in), std::nullopt, config, q(sets[r].out), k(sets[r].out)); },
      rotations);
  report.add({"rope", "bwd", shape, "fusekit", tb.median_us, moved});
  // In place the passed-through dims are not touched.
  const Timing ti = time_kernel(
      [&](int r) { rope_forward(q(sets[r].out), k(sets[r].out), std::nullopt, config, q(sets[r].out), k(sets[r].out)); },
      rotations);
  report.add({"rope", "fwd-inplace", shape, "fusekit", ti.median_us, moved * rotated_fraction});

  if (options().diagnostics) {
    // int64 position ids (B, S): the sequence index, as the implicit positions.
    std::vector<std::int64_t> host_ids(static_cast<std::size_t>(tokens));
    for (std::int64_t t = 0; t < tokens; ++t) host_ids[t] = t % kSeq;
    DeviceBuffer ids(host_ids.size() * sizeof(std::int64_t));
    cuda_check(cudaMemcpy(ids.get(), host_ids.data(), host_ids.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice),
               "position ids upload");
    const TensorView ids_view(ids.get(), DType::i64, gpu, {kBatch, kSeq});
    const Timing tp = time_kernel(
        [&](int r) { rope_forward(q(sets[r].in), k(sets[r].in), ids_view, config, q(sets[r].out), k(sets[r].out)); },
        rotations);
    report.add({"rope", "fwd-ids", shape, "fusekit", tp.median_us, moved});
    // (B, H, S, D) storage: the (B, S, H, D) view with permuted strides.
    auto bhsd = [&](void* data, std::int64_t heads) {
      return TensorView(data, bf16, gpu, {kBatch, kSeq, heads, D}, {heads * kSeq * D, D, kSeq * D, 1});
    };
    auto kb = [&](const DeviceBuffer& b) { return static_cast<unsigned char*>(b.get()) + q_bytes; };
    const Timing tl = time_kernel(
        [&](int r) {
          rope_forward(bhsd(sets[r].in.get(), kHeadsQ), bhsd(kb(sets[r].in), kHeadsK), std::nullopt, config,
                       bhsd(sets[r].out.get(), kHeadsQ), bhsd(kb(sets[r].out), kHeadsK));
        },
        rotations);
    report.add({"rope", "fwd-bhsd", shape, "fusekit", tl.median_us, moved});
  }
}

}  // namespace

void bench_rope(Report& report) {
  const Case cases[] = {{128, 0, RopeStyle::rotate_half},
                        {64, 0, RopeStyle::rotate_half},
                        {128, 32, RopeStyle::rotate_half},
                        {128, 0, RopeStyle::interleaved}};
  for (const Case& c : cases)
    if (selected(case_name(c))) run_case(report, c);
}

}  // namespace fusekit::bench
