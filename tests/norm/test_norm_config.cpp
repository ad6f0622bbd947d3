// The LayerNorm / RMSNorm launch configuration (norm_config.h) on the CPU: the launches of the
// benchmark shapes on H100-like and H200-like devices, and properties over a grid of problems.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/overrides.h"
#include "fusekit/error.h"
#include "norm/norm_config.h"
#include "tests/harness/devices.h"

namespace fusekit::norm {
namespace {

detail::DeviceInfo h100() { return testing::h100_device(); }
detail::DeviceInfo h200() { return testing::h200_device(); }


// The occupancy calculator of a Hopper SM (65536 registers allocated per warp in units of 256,
// 2048 threads, 32 blocks, the opt-in shared memory plus 1 KB with 1 KB reserved per block) for
// kernels of the register counts and static shared memory of the sm_90a build, bf16 in and out.
// Clusters: whole clusters of two fit 128 of the 132 SMs.
class HopperOccupancy final : public KernelOccupancy {
 public:
  explicit HopperOccupancy(const detail::DeviceInfo& device) : device_(device) {}

  // Registers per thread of the sm_90a build, bf16 in and out (cuobjdump -res-usage).
  static int registers(const ForwardVariant& v) {
    static const int by_vectors_and_rows[5][3] = {{0, 0, 0}, {48, 56, 40}, {55, 63, 64}, {56, 64, 64}, {64, 64, 64}};
    return by_vectors_and_rows[v.vectors_per_thread][static_cast<int>(v.rows)];
  }
  static int registers(const BackwardVariant& variant) {
    // The residual backward's variants (dx += dsum) and the tail variants (a partial last
    // vector): a few registers more than the plain ones.
    BackwardVariant v = variant;
    v.dsum = false;
    v.tail = false;
    const int extra = (variant.dsum ? 8 : 0) + (variant.tail ? 4 : 0);
    return plain_registers(v) + std::min(extra, 128 - plain_registers(v));
  }
  static int plain_registers(const BackwardVariant& v) {
    struct Row {
      BackwardVariant v;
      int registers;
    };
    static const Row rows[] = {
        {{1, Source::x, false}, 64},  {{1, Source::x, true}, 72},
        {{1, Source::y, false}, 80},  {{1, Source::y, true}, 92},
        {{1, Source::y_uncached, false}, 80}, {{1, Source::y_uncached, true}, 84},
        {{2, Source::x, false}, 64},  {{2, Source::x, true}, 96},
        {{2, Source::y, false}, 96},  {{2, Source::y, true}, 107},
        {{2, Source::y_uncached, false}, 90}, {{2, Source::y_uncached, true}, 110},
        {{3, Source::x, false}, 88},  {{3, Source::x, true}, 117},
        {{3, Source::y, false}, 103}, {{3, Source::y, true}, 123},
        {{3, Source::y_uncached, false}, 109}, {{3, Source::y_uncached, true}, 128},
        {{4, Source::x, false}, 96},  {{4, Source::x, true}, 123},
        {{4, Source::y, false}, 114}, {{4, Source::y, true}, 128},
        {{4, Source::y_uncached, false}, 128}, {{4, Source::y_uncached, true}, 128},
        {{4, Source::x, false, true}, 122}, {{4, Source::y, false, true}, 126},
        {{4, Source::x, false, false, false, true}, 126}, {{3, Source::x, false, false, false, true}, 128},
        {{3, Source::x, true, false, false, true}, 128},
        {{4, Source::x, true, false, true}, 127}, {{4, Source::y, true, false, true}, 127},
        {{4, Source::y_uncached, true, false, true}, 128},
    };
    for (const Row& r : rows)
      if (r.v == v) return r.registers;
    ADD_FAILURE() << "no register count for a backward variant";
    return 255;
  }
  static constexpr std::size_t kBackwardStaticSmem = 2560;

  int forward_blocks_per_sm(const ForwardVariant& v, int block_threads) const override {
    return blocks(registers(v), block_threads, 1536);
  }
  int forward_generic_blocks_per_sm() const override { return blocks(32, kGenericThreads, 1152); }
  int backward_blocks_per_sm(const BackwardVariant& v, int block_threads, std::size_t smem) const override {
    return blocks(registers(v), block_threads, smem + kBackwardStaticSmem);
  }
  int backward_generic_blocks_per_sm() const override { return blocks(54, kGenericThreads, 1280); }
  std::size_t backward_static_smem(const BackwardVariant&) const override { return kBackwardStaticSmem; }
  int backward_max_clusters(const BackwardVariant& v, int block_threads, std::size_t smem, int cluster) const override {
    return (device_.sm_count - 4) * backward_blocks_per_sm(v, block_threads, smem) / cluster;
  }

 private:
  int blocks(int registers, int block_threads, std::size_t smem) const {
    const int warps = (block_threads + 31) / 32;
    const int by_threads = device_.max_threads_per_sm / (warps * 32);
    const int by_registers = 65536 / ((registers * 32 + 255) / 256 * 256 * warps);
    const int by_smem = static_cast<int>((device_.max_smem_per_block_optin + 1024) / (smem + 1024));
    return std::max(1, std::min({32, by_threads, by_registers, by_smem}));
  }
  detail::DeviceInfo device_;
};

ForwardProblem forward_problem(Kind kind, std::int64_t rows, std::int64_t cols, int element_bytes = 2) {
  ForwardProblem p;
  p.rows = rows;
  p.cols = cols;
  p.element_bytes = element_bytes;
  p.kind = kind;
  p.has_weight = true;
  p.has_bias = kind == Kind::layer_norm;
  return p;
}

// LayerNorm's backward asks for dbias, RMSNorm's only for dweight.
BackwardProblem backward_problem(Kind kind, std::int64_t rows, std::int64_t cols, bool from_output = false,
                                 int element_bytes = 2) {
  BackwardProblem p;
  p.rows = rows;
  p.cols = cols;
  p.element_bytes = element_bytes;
  p.from_output = from_output;
  p.bias_grad = kind == Kind::layer_norm;
  p.partials = true;
  return p;
}

bool same(const RowGeometry& a, const RowGeometry& b) {
  return a.threads_per_row == b.threads_per_row && a.rows_per_block == b.rows_per_block && a.stages == b.stages &&
         a.cached_columns == b.cached_columns && a.l2_prefetch_rows == b.l2_prefetch_rows &&
         a.ring_dsum == b.ring_dsum;
}

bool same(const ForwardLaunch& a, const ForwardLaunch& b) {
  return a.generic == b.generic && a.variant.vectors_per_thread == b.variant.vectors_per_thread &&
         a.variant.rows == b.variant.rows && same(a.geometry, b.geometry) && a.block_threads == b.block_threads &&
         a.grid == b.grid;
}

bool same(const BackwardLaunch& a, const BackwardLaunch& b) {
  return a.generic == b.generic && a.variant == b.variant && same(a.geometry, b.geometry) &&
         a.block_threads == b.block_threads && a.smem_bytes == b.smem_bytes && a.grid == b.grid &&
         a.cluster == b.cluster && a.partial_rows == b.partial_rows &&
         a.reduce_columns_per_thread == b.reduce_columns_per_thread && a.reduce_blocks == b.reduce_blocks;
}

ForwardLaunch forward_on(const detail::DeviceInfo& device, const ForwardProblem& p, const LaunchOverrides& o = {}) {
  return choose_forward_launch(p, device, HopperOccupancy(device), o);
}
BackwardLaunch backward_on(const detail::DeviceInfo& device, const BackwardProblem& p, const LaunchOverrides& o = {}) {
  return choose_backward_launch(p, device, HopperOccupancy(device), o);
}

// ---- the benchmark shapes ------------------------------------------------------------------------

TEST(NormConfig, ForwardOfOneWarpRowsIsACappedGrid) {
  for (const auto& device : {h100(), h200()}) {
    // N = 768: 96 vectors, 3 per lane, every lane full.
    const ForwardLaunch l = forward_on(device, forward_problem(Kind::layer_norm, 32768, 768));
    EXPECT_FALSE(l.generic);
    EXPECT_EQ(l.variant.vectors_per_thread, 3);
    EXPECT_EQ(l.variant.rows, ForwardRows::full_layer_norm);
    EXPECT_EQ(l.geometry.threads_per_row, 32);
    EXPECT_EQ(l.geometry.rows_per_block, 1);
    EXPECT_EQ(l.block_threads, 32);
    EXPECT_EQ(l.grid, 132 * 128);
    EXPECT_EQ(l.geometry.l2_prefetch_rows, 0);
  }
}

TEST(NormConfig, ForwardOfLongerRowsPrefetchesTheNextWave) {
  for (const auto& device : {h100(), h200()}) {
    // N = 1024 in bf16: 128 vectors on two warps at two per lane.
    ForwardLaunch l = forward_on(device, forward_problem(Kind::rms_norm, 16384, 1024));
    EXPECT_EQ(l.variant.vectors_per_thread, 2);
    EXPECT_EQ(l.variant.rows, ForwardRows::full_rms_norm);
    EXPECT_EQ(l.geometry.threads_per_row, 64);
    EXPECT_EQ(l.grid, 16384);
    EXPECT_EQ(l.geometry.l2_prefetch_rows, 16 * 132);  // 16 resident 64-thread blocks of 64 registers per SM
    // N = 16384: 2048 vectors, 4 per thread on 512 threads: one block per row, three per SM.
    l = forward_on(device, forward_problem(Kind::layer_norm, 4096, 16384));
    EXPECT_EQ(l.variant.vectors_per_thread, 4);
    EXPECT_EQ(l.variant.rows, ForwardRows::full_layer_norm);
    EXPECT_EQ(l.block_threads, 512);
    EXPECT_EQ(l.grid, 4096);
    EXPECT_EQ(l.geometry.l2_prefetch_rows, 2 * 132);
    // N = 12288: 384 threads.
    l = forward_on(device, forward_problem(Kind::layer_norm, 8192, 12288));
    EXPECT_EQ(l.block_threads, 384);
    EXPECT_EQ(l.variant.rows, ForwardRows::full_layer_norm);
  }
}

// Forwards the occupancy questions to a HopperOccupancy and records whether every forward question
// was about a residual kernel.
class RecordingOccupancy final : public KernelOccupancy {
 public:
  explicit RecordingOccupancy(const detail::DeviceInfo& device) : inner_(device) {}
  int forward_blocks_per_sm(const ForwardVariant& v, int block_threads) const override {
    asked_plain_ = asked_plain_ || !v.residual;
    return inner_.forward_blocks_per_sm(v, block_threads);
  }
  int forward_generic_blocks_per_sm() const override { return inner_.forward_generic_blocks_per_sm(); }
  int backward_blocks_per_sm(const BackwardVariant& v, int block_threads, std::size_t smem) const override {
    return inner_.backward_blocks_per_sm(v, block_threads, smem);
  }
  int backward_generic_blocks_per_sm() const override { return inner_.backward_generic_blocks_per_sm(); }
  std::size_t backward_static_smem(const BackwardVariant& v) const override { return inner_.backward_static_smem(v); }
  int backward_max_clusters(const BackwardVariant& v, int block_threads, std::size_t smem, int cluster) const override {
    return inner_.backward_max_clusters(v, block_threads, smem, cluster);
  }
  bool asked_plain() const { return asked_plain_; }

 private:
  HopperOccupancy inner_;
  mutable bool asked_plain_ = false;
};

// The residual forward holds one row (the sum) in registers as the plain one does: the same row
// shapes and grid, on the residual kernels, whose own occupancy sets the L2 request distance.
TEST(NormConfig, ResidualForwardTakesThePlainShapesOnResidualKernels) {
  for (const auto& device : {h100(), h200()}) {
    for (Kind kind : {Kind::layer_norm, Kind::rms_norm}) {
      for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{32768, 768}, {16384, 1024}, {4096, 16384},
                                {8192, 12288}, {100, 1000}, {100, 1001}, {100, 32768}}) {
        SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
        const ForwardProblem plain_problem = forward_problem(kind, rows, cols);
        ForwardProblem problem = plain_problem;
        problem.residual = true;
        const ForwardLaunch plain = forward_on(device, plain_problem);
        const RecordingOccupancy occupancy(device);
        const ForwardLaunch l = choose_forward_launch(problem, device, occupancy);
        EXPECT_TRUE(same(l, plain));
        EXPECT_FALSE(occupancy.asked_plain());
        if (!l.generic) EXPECT_TRUE(l.variant.residual);
        EXPECT_FALSE(plain.variant.residual);
      }
    }
  }
  // Misaligned residual or sum rows (the launcher's test): the generic kernel.
  ForwardProblem misaligned = forward_problem(Kind::layer_norm, 100, 1024);
  misaligned.residual = true;
  misaligned.aligned = false;
  EXPECT_TRUE(forward_on(h100(), misaligned).generic);
}

// The residual backward (dx += dsum) takes the dsum twin of the variant the plain backward from
// x takes, and the workspace query covers its grid.
TEST(NormConfig, ResidualBackwardTakesTheDsumTwinOfThePlainVariant) {
  for (const auto& device : {h100(), h200()}) {
    for (Kind kind : {Kind::layer_norm, Kind::rms_norm}) {
      for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{16384, 768}, {16384, 1024}, {32768, 2048},
                                {8192, 5120}, {4096, 16384}, {300, 8}, {100, 1000}, {100, 1001}}) {
        SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
        const BackwardProblem plain_problem = backward_problem(kind, rows, cols);
        BackwardProblem problem = plain_problem;
        problem.dsum = true;
        const BackwardLaunch plain = backward_on(device, plain_problem);
        const BackwardLaunch l = backward_on(device, problem);
        EXPECT_EQ(l.generic, plain.generic);
        if (!l.generic) {
          EXPECT_TRUE(l.variant.dsum);
          EXPECT_TRUE(is_compiled(l.variant));
          // The plain rows' shape, or the residual table's vectors per thread (g not kept).
          const std::int64_t vectors = (cols + 7) / 8;
          const int residual = backward_vectors_by_rule(true, problem.bias_grad, vectors, cols % 8 != 0);
          if (residual == 0) {
            BackwardVariant twin = l.variant;
            twin.dsum = false;
            EXPECT_TRUE(twin == plain.variant);
            EXPECT_EQ(l.geometry.threads_per_row, plain.geometry.threads_per_row);
          } else {
            EXPECT_EQ(l.variant.vectors_per_thread, residual);
            EXPECT_FALSE(l.variant.keep_g);
            EXPECT_EQ(l.geometry.threads_per_row, (vectors + 32 * residual - 1) / (32 * residual) * 32);
          }
          // dsum's rows ride in the ring where three rows a slot leave two stages (else, and when
          // the ring is turned off, they are read from memory). The shared memory covers the
          // columns and the ring.
          const std::int64_t pitch = (cols + 7) / 8 * 8;
          const std::size_t ring_row = std::size_t(l.geometry.rows_per_block) * pitch * 2;
          const int slot_rows = l.geometry.ring_dsum ? 3 : 2;
          EXPECT_EQ(l.smem_bytes, pitch * sizeof(float) + l.geometry.stages * slot_rows * ring_row);
          if (cols <= 8192) EXPECT_EQ(l.geometry.ring_dsum, 1);
          if (cols >= 16384) EXPECT_EQ(l.geometry.ring_dsum, 0);
          LaunchOverrides off;
          off.backward_ring_dsum = -1;
          const BackwardLaunch m = backward_on(device, problem, off);
          EXPECT_EQ(m.geometry.ring_dsum, 0);
          if (residual == 0) EXPECT_TRUE(same(m.geometry, plain.geometry));
          EXPECT_TRUE(m.variant == l.variant);
        }
        EXPECT_LE(l.partial_rows, backward_workspace_rows(rows, cols, 2, device, HopperOccupancy(device)));
      }
    }
  }
}

// kBackwardVectorsRules: by the residual backward, dbias, row length and a partial last vector;
// rows outside them take the table's shape. The residual forward's own rows.
TEST(NormConfig, BackwardVectorsRulesAndTheResidualForwardsRows) {
  EXPECT_EQ(backward_vectors_by_rule(true, false, 257, true), 3);    // rms (, 2049)
  EXPECT_EQ(backward_vectors_by_rule(true, false, 256, false), 0);   // rms (, 2048): the plain shape
  EXPECT_EQ(backward_vectors_by_rule(true, false, 1024, false), 4);  // rms (, 8192)
  EXPECT_EQ(backward_vectors_by_rule(true, false, 1280, false), 0);  // rms (, 10240)
  EXPECT_EQ(backward_vectors_by_rule(true, false, 1280, true), 3);   // rms (, 10239)
  EXPECT_EQ(backward_vectors_by_rule(true, false, 1537, true), 4);   // 3 would need 513 threads: RMSNorm's tail rule
  EXPECT_EQ(backward_vectors_by_rule(true, true, 256, false), 2);    // layer (, 2048)
  EXPECT_EQ(backward_vectors_by_rule(true, true, 626, true), 0);     // layer (, 5001)
  EXPECT_EQ(backward_vectors_by_rule(true, true, 1024, true), 2);    // layer (, 8191)
  EXPECT_EQ(backward_vectors_by_rule(true, true, 1024, false), 0);   // layer (, 8192)
  EXPECT_EQ(backward_vectors_by_rule(true, false, 128, true), 0);    // short rows: one warp
  // The plain backward: tail rows (LayerNorm's of 641..1024 vectors, RMSNorm's past 128).
  EXPECT_EQ(backward_vectors_by_rule(false, true, 1024, true), 2);
  EXPECT_EQ(backward_vectors_by_rule(false, true, 256, false), 0);
  EXPECT_EQ(backward_vectors_by_rule(false, false, 257, true), 4);  // RMSNorm's tail rows
  EXPECT_EQ(backward_vectors_by_rule(false, false, 128, true), 0);
  EXPECT_EQ(backward_vectors_by_rule(false, false, 1024, false), 0);
  EXPECT_EQ(residual_forward_vectors(1024, false), 2);   // (, 8192)
  EXPECT_EQ(residual_forward_vectors(375, false), 2);    // (, 3000)
  EXPECT_EQ(residual_forward_vectors(1280, false), 3);   // (, 10240)
  EXPECT_EQ(residual_forward_vectors(1536, false), 0);   // (, 12288)
  EXPECT_EQ(residual_forward_vectors(1024, true), 0);    // (, 8191)
  EXPECT_EQ(residual_forward_vectors(128, false), 0);    // (, 1024): two warps
  for (const auto& device : {h100(), h200()})
    for (auto [kind, cols, vectors] : {std::tuple{Kind::rms_norm, 2049, 3}, {Kind::rms_norm, 8192, 4},
                                       {Kind::layer_norm, 2048, 2}, {Kind::layer_norm, 8191, 2}}) {
      BackwardProblem problem = backward_problem(kind, 8192, cols);
      problem.dsum = true;
      const BackwardLaunch l = backward_on(device, problem);
      ASSERT_FALSE(l.generic);
      EXPECT_EQ(l.variant.vectors_per_thread, vectors) << cols;
      EXPECT_FALSE(l.variant.keep_g);
      EXPECT_TRUE(l.variant.dsum);
      EXPECT_TRUE(is_compiled(l.variant));
      // The override still wins.
      LaunchOverrides o;
      o.backward_vectors = vectors == 2 ? 3 : 2;
      EXPECT_EQ(backward_on(device, problem, o).variant.vectors_per_thread, o.backward_vectors);
    }
}

TEST(NormConfig, ForwardFallsBackToTheGenericKernel) {
  const auto device = h100();
  // Threads whose last vector lies past the row: the row kernel with bounds tests.
  ForwardLaunch l = forward_on(device, forward_problem(Kind::layer_norm, 100, 1000));
  EXPECT_FALSE(l.generic);
  EXPECT_EQ(l.variant.rows, ForwardRows::any);
  EXPECT_FALSE(l.variant.tail);
  // Misaligned rows (any N), rows over 512 threads of 4 vectors.
  ForwardProblem misaligned = forward_problem(Kind::layer_norm, 100, 1024);
  misaligned.aligned = false;
  ForwardProblem misaligned_odd = forward_problem(Kind::layer_norm, 100, 1001);
  misaligned_odd.aligned = false;
  for (const ForwardProblem& p : {misaligned, misaligned_odd, forward_problem(Kind::rms_norm, 100, 32768),
                                  forward_problem(Kind::rms_norm, 100, 16385)}) {
    l = forward_on(device, p);
    EXPECT_TRUE(l.generic);
    EXPECT_EQ(l.block_threads, kGenericThreads);
    EXPECT_EQ(l.grid, 100);
  }
  // Misaligned rows the element kernels hold; aligned rows too long for the row kernels, and
  // rows too long for the element kernels, the generic kernel itself.
  EXPECT_EQ(forward_on(device, misaligned).elements.elements_per_thread, 8);
  EXPECT_EQ(forward_on(device, misaligned_odd).elements.threads_per_row, 128);
  EXPECT_EQ(forward_on(device, forward_problem(Kind::rms_norm, 100, 32768)).elements.elements_per_thread, 0);
  // The persistent generic grid: every resident block once.
  l = forward_on(device, forward_problem(Kind::rms_norm, 1 << 20, 32768));
  EXPECT_EQ(l.grid, 132 * 4);  // four 512-thread blocks of 32 registers per SM
  // f32 rows of 4 values per vector: N = 8192 is 2048 vectors, N = 16384 too long.
  EXPECT_FALSE(forward_on(device, forward_problem(Kind::rms_norm, 64, 8192, 4)).generic);
  EXPECT_TRUE(forward_on(device, forward_problem(Kind::rms_norm, 64, 16384, 4)).generic);
}

TEST(NormConfig, BackwardShortRows) {
  for (const auto& device : {h100(), h200()}) {
    // RMSNorm (16384, 1024): one warp per row at 4 vectors per lane, full rows, 256-thread blocks.
    BackwardLaunch l = backward_on(device, backward_problem(Kind::rms_norm, 16384, 1024));
    EXPECT_EQ(l.variant, (BackwardVariant{4, Source::x, false, true}));
    EXPECT_EQ(l.geometry.threads_per_row, 32);
    EXPECT_EQ(l.geometry.rows_per_block, 8);
    EXPECT_EQ(l.block_threads, 256);
    // Two blocks per SM (122 registers): 3 rows of ring per row group beside the weight column.
    EXPECT_EQ(l.geometry.stages, 3);
    EXPECT_EQ(l.smem_bytes, 1024 * 4 + 3 * 8 * 2 * 1024 * 2);
    EXPECT_EQ(l.cluster, 1);
    // LayerNorm with dbias: two warps per row at 2 vectors per lane.
    l = backward_on(device, backward_problem(Kind::layer_norm, 16384, 1024));
    EXPECT_EQ(l.variant, (BackwardVariant{2, Source::x, true}));
    EXPECT_EQ(l.geometry.threads_per_row, 64);
    EXPECT_EQ(l.geometry.rows_per_block, 4);
    // Up to 32 vectors: 512-thread blocks of 16 one-warp rows.
    l = backward_on(device, backward_problem(Kind::layer_norm, 16384, 256));
    EXPECT_EQ(l.variant, (BackwardVariant{1, Source::x, true}));
    EXPECT_EQ(l.geometry.rows_per_block, 16);
    EXPECT_EQ(l.block_threads, 512);
  }
}

TEST(NormConfig, BackwardLongRows) {
  for (const auto& device : {h100(), h200()}) {
    // LayerNorm (32768, 2048): 256 vectors, 3 per thread with g kept, 96-thread rows in 384.
    BackwardLaunch l = backward_on(device, backward_problem(Kind::layer_norm, 32768, 2048));
    EXPECT_EQ(l.variant, (BackwardVariant{3, Source::x, true, false, false, true}));
    EXPECT_EQ(l.geometry.threads_per_row, 96);
    EXPECT_EQ(l.geometry.rows_per_block, 4);
    EXPECT_EQ(l.block_threads, 384);
    // RMSNorm (8192, 8192): 2 vectors per thread, 512-thread rows, two blocks per SM.
    l = backward_on(device, backward_problem(Kind::rms_norm, 8192, 8192));
    EXPECT_EQ(l.variant, (BackwardVariant{2, Source::x, false}));
    EXPECT_EQ(l.geometry.threads_per_row, 512);
    EXPECT_EQ(l.geometry.rows_per_block, 1);
    EXPECT_EQ(l.grid, 256);  // 264 slots, balanced: 32 rows per block on 256 blocks
    // LayerNorm (8192, 8192): 4 vectors, the grid capped at 27/32 of the SMs.
    l = backward_on(device, backward_problem(Kind::layer_norm, 8192, 8192));
    EXPECT_EQ(l.variant, (BackwardVariant{4, Source::x, true}));
    EXPECT_EQ(l.geometry.threads_per_row, 256);
    EXPECT_EQ(l.grid, 132 * 27 / 32);
    // LayerNorm (4096, 16384): clusters of two pre-sum dweight and dbias.
    l = backward_on(device, backward_problem(Kind::layer_norm, 4096, 16384));
    EXPECT_EQ(l.variant, (BackwardVariant{4, Source::x, true, false, true}));
    EXPECT_EQ(l.cluster, 2);
    EXPECT_EQ(l.grid, 128);
    EXPECT_EQ(l.partial_rows, 64);
    EXPECT_EQ(l.reduce_columns_per_thread, 4);
    EXPECT_EQ(l.reduce_blocks, 16384 / 128);
    // RMSNorm at N = 16384 has no clusters (dweight alone).
    l = backward_on(device, backward_problem(Kind::rms_norm, 4096, 16384));
    EXPECT_EQ(l.variant, (BackwardVariant{4, Source::x, false}));
    EXPECT_EQ(l.cluster, 1);
  }
}

TEST(NormConfig, BackwardFromOutputCachesColumnsWhereTheyFit) {
  for (const auto& device : {h100(), h200()}) {
    BackwardLaunch l = backward_on(device, backward_problem(Kind::layer_norm, 4096, 4096, true));
    EXPECT_EQ(l.variant.source, Source::y);
    EXPECT_EQ(l.geometry.cached_columns, 1);
    // N = 16384: three float columns (192 KB) leave no room for two rows of ring.
    l = backward_on(device, backward_problem(Kind::layer_norm, 4096, 16384, true));
    EXPECT_EQ(l.variant, (BackwardVariant{4, Source::y_uncached, true, false, true}));
    EXPECT_EQ(l.geometry.cached_columns, 0);
    EXPECT_EQ(l.geometry.stages, 2);
    EXPECT_EQ(l.smem_bytes, 16384 * 4 + 2 * 2 * 16384 * 2);
  }
}

TEST(NormConfig, BackwardFallsBackToTheGenericKernel) {
  const auto device = h100();
  BackwardProblem misaligned = backward_problem(Kind::layer_norm, 1000, 4096);
  misaligned.aligned = false;
  BackwardProblem misaligned_odd = backward_problem(Kind::layer_norm, 1000, 4100);
  misaligned_odd.aligned = false;
  for (const BackwardProblem& p : {misaligned_odd, misaligned, backward_problem(Kind::rms_norm, 1000, 65536),
                                   backward_problem(Kind::rms_norm, 1000, 16385)}) {
    const BackwardLaunch l = backward_on(device, p);
    EXPECT_TRUE(l.generic);
    EXPECT_EQ(l.block_threads, kGenericThreads);
    EXPECT_EQ(l.grid, 132 * 2);  // two 512-thread blocks of 54 registers per SM
    EXPECT_EQ(l.cluster, 1);
    EXPECT_EQ(l.partial_rows, l.grid);
  }
}

// N not a multiple of the vector, with aligned pointers and row strides: the row kernels' tail
// variants (a masked last vector), never the generic kernel; misaligned, the generic kernel still.
// The row shape is that of N rounded up to whole vectors, except for rows longer than 128 vectors:
// the forward takes 3 vectors per thread where 512 threads cover the row (the rounded row may
// fill 4 exactly), RMSNorm's backward from x 4, LayerNorm's from x by kBackwardVectorsRules.
TEST(NormConfig, PartialLastVectorTakesTheRowKernels) {
  for (const auto& device : {h100(), h200()})
    for (int bytes : {2, 4}) {
      const int vec = 16 / bytes;
      for (std::int64_t cols : {1, 3, 7, 9, 100, 1001, 1023, 1025, 2047, 4097, 5121, 8191, 12289, 16383, 16385}) {
        if (cols % vec == 0) continue;
        const std::int64_t rounded = (cols + vec - 1) / vec * vec;
        if (rounded / vec > 2048) continue;  // past 512 threads of 4 vectors: generic
        SCOPED_TRACE(std::to_string(cols) + ", " + std::to_string(bytes) + " bytes");
        for (Kind kind : {Kind::layer_norm, Kind::rms_norm}) {
          const ForwardLaunch f = forward_on(device, forward_problem(kind, 4096, cols, bytes));
          const ForwardLaunch f_rounded = forward_on(device, forward_problem(kind, 4096, rounded, bytes));
          EXPECT_FALSE(f.generic);
          EXPECT_TRUE(f.variant.tail);
          EXPECT_EQ(f.variant.rows, ForwardRows::any);
          const std::int64_t vectors = rounded / vec;
          if (vectors > 128) {
            const int vpt = (vectors + 95) / 96 * 32 <= 512 ? 3 : 4;
            EXPECT_EQ(f.variant.vectors_per_thread, vpt);
            EXPECT_EQ(f.geometry.threads_per_row, (vectors + 32 * vpt - 1) / (32 * vpt) * 32);
          } else {
            EXPECT_EQ(f.variant.vectors_per_thread, f_rounded.variant.vectors_per_thread);
            EXPECT_EQ(f.geometry.threads_per_row, f_rounded.geometry.threads_per_row);
          }
          ForwardProblem misaligned = forward_problem(kind, 4096, cols, bytes);
          misaligned.aligned = false;
          EXPECT_TRUE(forward_on(device, misaligned).generic);
          for (bool from_output : {false, true}) {
            const BackwardLaunch b = backward_on(device, backward_problem(kind, 4096, cols, from_output, bytes));
            const BackwardLaunch b_rounded =
                backward_on(device, backward_problem(kind, 4096, rounded, from_output, bytes));
            EXPECT_FALSE(b.generic);
            EXPECT_TRUE(b.variant.tail);
            EXPECT_TRUE(is_compiled(b.variant));
            EXPECT_FALSE(b.variant.full_rows);
            EXPECT_FALSE(b.variant.keep_g);
            const int by_rule = from_output ? 0 : backward_vectors_by_rule(false, kind == Kind::layer_norm, vectors, true);
            if (kind == Kind::rms_norm && !from_output && vectors > 128) {
              EXPECT_EQ(b.variant.vectors_per_thread, 4);
              EXPECT_EQ(b.geometry.threads_per_row, (vectors + 127) / 128 * 32);
            } else if (by_rule > 0) {  // LayerNorm's tail rows of 641..1024 vectors
              EXPECT_EQ(b.variant.vectors_per_thread, by_rule);
              EXPECT_EQ(b.geometry.threads_per_row, (vectors + 32 * by_rule - 1) / (32 * by_rule) * 32);
            } else {
              EXPECT_EQ(b.variant.vectors_per_thread, b_rounded.variant.vectors_per_thread);
              EXPECT_EQ(b.geometry.threads_per_row, b_rounded.geometry.threads_per_row);
            }
            BackwardProblem misaligned_b = backward_problem(kind, 4096, cols, from_output, bytes);
            misaligned_b.aligned = false;
            EXPECT_TRUE(backward_on(device, misaligned_b).generic);
          }
          // The residual backward: the dsum twin of the tail variant.
          BackwardProblem residual = backward_problem(kind, 4096, cols, false, bytes);
          residual.dsum = true;
          const BackwardLaunch r = backward_on(device, residual);
          EXPECT_FALSE(r.generic);
          EXPECT_TRUE(r.variant.tail && r.variant.dsum);
          EXPECT_TRUE(is_compiled(r.variant));
          // Without dbias 3 vectors a thread where 512 threads hold them (kBackwardVectorsRules), else 4.
          if (kind == Kind::rms_norm && vectors > 128)
            EXPECT_EQ(r.variant.vectors_per_thread, vectors <= 1536 ? 3 : 4);
        }
      }
    }
  // The tail variants exist for every listed variant but the full-row and kept-g refinements.
  for (const BackwardVariant& v : kBackwardVariants) {
    BackwardVariant tail = v;
    tail.tail = true;
    EXPECT_EQ(is_compiled(tail), !v.full_rows && !v.keep_g);
    EXPECT_TRUE(BackwardVariant::unpack(tail.pack()) == tail);
  }
  EXPECT_EQ(partial_pitch(1), 8);
  EXPECT_EQ(partial_pitch(1024), 1024);
  EXPECT_EQ(partial_pitch(1001), 1008);
}

// Batches of more than 8 rows per SM: every row group takes at least 4 rows, unless that would
// leave fewer blocks than SMs; so a few thousand rows write a few partial rows per SM, not one per
// resident block slot (LayerNorm (2048, 1024): 128 blocks of 4 two-warp groups, where two blocks
// per SM would give 256 blocks of 2 rows per group; (4096, 1024) already had 4 rows per group).
TEST(NormConfig, FewRowsPerSmShareBlocks) {
  for (const auto& device : {h100(), h200()}) {
    BackwardLaunch l = backward_on(device, backward_problem(Kind::layer_norm, 2048, 1024));
    EXPECT_EQ(l.geometry.rows_per_block, 4);
    EXPECT_EQ(l.grid, 128);
    EXPECT_EQ(l.partial_rows, 128);
    l = backward_on(device, backward_problem(Kind::layer_norm, 4096, 1024));
    EXPECT_EQ(l.grid, 256);
    for (std::int64_t cols : {64, 1000, 1024, 2048, 3001, 4096, 8192, 16384})
      for (std::int64_t rows : {1000, 1100, 2048, 3000, 4096, 16384})
        for (bool from_output : {false, true})
          for (Kind kind : {Kind::layer_norm, Kind::rms_norm}) {
            l = backward_on(device, backward_problem(kind, rows, cols, from_output));
            SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
            if (l.generic) continue;
            const std::int64_t rows_per_sm = (rows + device.sm_count - 1) / device.sm_count;
            const std::int64_t groups = std::int64_t(l.grid) * l.geometry.rows_per_block;
            if (rows_per_sm > 8 && l.grid > (device.sm_count + l.cluster - 1) / l.cluster * l.cluster) {
              // At least 4 rows per group: the last block may hold the only short groups.
              EXPECT_GE(rows, (groups - l.geometry.rows_per_block) * 4);
            }
          }
  }
}

TEST(NormConfig, H100AndH200TakeTheSameLaunches) {
  // The norm tables key on the SMs and their shared memory, which the two share.
  for (std::int64_t cols : {256, 768, 1024, 2048, 4096, 5120, 8192, 12288, 16384})
    for (Kind kind : {Kind::layer_norm, Kind::rms_norm})
      for (bool from_output : {false, true}) {
        EXPECT_TRUE(same(forward_on(h100(), forward_problem(kind, 16384, cols)),
                         forward_on(h200(), forward_problem(kind, 16384, cols))));
        EXPECT_TRUE(same(backward_on(h100(), backward_problem(kind, 16384, cols, from_output)),
                         backward_on(h200(), backward_problem(kind, 16384, cols, from_output))));
      }
}

// ---- properties over a grid ------------------------------------------------------------------------

std::vector<std::int64_t> grid_cols() {
  std::vector<std::int64_t> cols;
  for (std::int64_t c = 1; c <= 1100; ++c) cols.push_back(c);
  for (std::int64_t c = 1104; c <= 20000; c += 8) cols.push_back(c);
  for (std::int64_t c : {24576, 32768, 49152, 65536}) cols.push_back(c);
  return cols;
}

TEST(NormConfig, EveryForwardLaunchCoversItsRows) {
  for (const auto& device : {h100(), h200()})
    for (std::int64_t cols : grid_cols())
      for (int bytes : {2, 4})
        for (std::int64_t rows : {1, 333, 100003}) {
          const ForwardProblem p = forward_problem(Kind::layer_norm, rows, cols, bytes);
          const ForwardLaunch l = forward_on(device, p);
          SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols) + ", " + std::to_string(bytes) + " bytes");
          ASSERT_GE(l.grid, 1);
          ASSERT_LE(l.grid, rows);
          if (l.generic) continue;
          const int vec = 16 / bytes;
          const int tpr = l.geometry.threads_per_row, vpt = l.variant.vectors_per_thread;
          ASSERT_EQ(l.variant.tail, cols % vec != 0);
          ASSERT_EQ(tpr % 32, 0);
          ASSERT_LE(tpr, kMaxThreadsPerRow);
          ASSERT_GE(vpt, 1);
          ASSERT_LE(vpt, 4);
          ASSERT_GE(std::int64_t(tpr) * vpt * vec, cols);               // the row is covered
          ASSERT_LT(std::int64_t(tpr - 32) * vpt * vec, cols);          // no idle warp
          ASSERT_EQ(l.variant.rows != ForwardRows::any, std::int64_t(tpr) * vpt * vec == cols);
          ASSERT_EQ(l.block_threads, tpr * l.geometry.rows_per_block);
        }
}

TEST(NormConfig, EveryBackwardLaunchFitsAndTheWorkspaceHoldsIt) {
  for (const auto& device : {h100(), h200()}) {
    const HopperOccupancy occupancy(device);
    for (std::int64_t cols : grid_cols())
      for (int bytes : {2, 4})
        for (std::int64_t rows : {1, 3, 333, 16384}) {
          const int workspace_rows = backward_workspace_rows(rows, cols, bytes, device, occupancy);
          for (bool from_output : {false, true})
            for (Kind kind : {Kind::layer_norm, Kind::rms_norm}) {
              const BackwardProblem p = backward_problem(kind, rows, cols, from_output, bytes);
              const BackwardLaunch l = choose_backward_launch(p, device, occupancy);
              SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols) + ", " + std::to_string(bytes) +
                           " bytes" + (from_output ? ", from y" : "") + (p.bias_grad ? ", dbias" : ""));
              ASSERT_GE(l.grid, 1);
              ASSERT_EQ(l.grid % l.cluster, 0);
              ASSERT_EQ(l.partial_rows, l.grid / l.cluster);
              ASSERT_LE(l.partial_rows, workspace_rows);
              ASSERT_GE(l.reduce_blocks * 32 * l.reduce_columns_per_thread, cols);
              if (l.generic) continue;
              const int vec = 16 / bytes;
              const int tpr = l.geometry.threads_per_row, vpt = l.variant.vectors_per_thread;
              ASSERT_TRUE(is_compiled(l.variant));
              ASSERT_EQ(l.variant.tail, cols % vec != 0);
              ASSERT_EQ(l.variant.cluster, l.cluster > 1);
              ASSERT_EQ(l.variant.bias_grad, p.bias_grad);
              ASSERT_EQ(l.variant.source == Source::x, !from_output);
              ASSERT_EQ(tpr % 32, 0);
              ASSERT_GE(std::int64_t(tpr) * vpt * vec, cols);
              ASSERT_LT(std::int64_t(tpr - 32) * vpt * vec, cols);
              if (l.variant.full_rows) {
                ASSERT_EQ(std::int64_t(tpr) * vpt * vec, cols);
              }
              ASSERT_LE(l.geometry.rows_per_block, tpr > 32 ? kMaxRowGroups - 1 : kMaxRowGroups);
              ASSERT_EQ(l.block_threads, tpr * l.geometry.rows_per_block);
              ASSERT_LE(l.block_threads, 512);
              ASSERT_GE(l.geometry.stages, 2);
              ASSERT_LE(l.geometry.stages, kMaxStages);
              // Shared-memory rows of whole vectors (a partial last vector rounded up).
              const std::int64_t pitch = (cols + vec - 1) / vec * vec;
              const std::size_t columns = (l.geometry.cached_columns ? 3 : 1) * pitch * sizeof(float);
              ASSERT_EQ(l.geometry.ring_dsum, 0);
              const std::size_t ring = std::size_t(l.geometry.stages) * l.geometry.rows_per_block * 2 * pitch * bytes;
              ASSERT_EQ(l.smem_bytes, columns + ring);
              ASSERT_LE(l.smem_bytes + HopperOccupancy::kBackwardStaticSmem, device.max_smem_per_block_optin);
              // Every row group has at least one row to start with.
              ASSERT_LE(std::int64_t(l.grid - l.cluster) * l.geometry.rows_per_block, rows);
            }
        }
  }
}

// ---- overrides -------------------------------------------------------------------------------------

TEST(NormConfig, OverridesForceTheirChoice) {
  const auto device = h100();
  LaunchOverrides o;
  o.forward_vectors = 2;
  EXPECT_EQ(forward_on(device, forward_problem(Kind::layer_norm, 4096, 8192), o).geometry.threads_per_row, 512);
  o = {};
  o.backward_vectors = 4;
  BackwardLaunch l = backward_on(device, backward_problem(Kind::layer_norm, 32768, 2048), o);
  EXPECT_EQ(l.variant, (BackwardVariant{4, Source::x, true}));  // g is not kept under the override
  EXPECT_EQ(l.geometry.threads_per_row, 64);
  o = {};
  o.backward_block = 128;
  EXPECT_EQ(backward_on(device, backward_problem(Kind::rms_norm, 16384, 1024), o).geometry.rows_per_block, 4);
  o = {};
  o.backward_stages = 2;
  EXPECT_EQ(backward_on(device, backward_problem(Kind::rms_norm, 16384, 1024), o).geometry.stages, 2);
  o = {};
  o.backward_cluster = 1;
  l = backward_on(device, backward_problem(Kind::layer_norm, 4096, 16384), o);
  EXPECT_EQ(l.cluster, 1);
  EXPECT_FALSE(l.variant.cluster);
}

TEST(NormConfig, OverrideKeysAreRead) {
  detail::clear_overrides();
  EXPECT_EQ(read_launch_overrides().backward_stages, 0);
  detail::set_overrides("norm.forward.vectors=3,norm.backward.vectors=2,norm.backward.block=256,"
                        "norm.backward.stages=3,norm.backward.cluster=1,norm.backward.ring_dsum=off");
  const LaunchOverrides o = read_launch_overrides();
  EXPECT_EQ(o.forward_vectors, 3);
  EXPECT_EQ(o.backward_vectors, 2);
  EXPECT_EQ(o.backward_block, 256);
  EXPECT_EQ(o.backward_stages, 3);
  EXPECT_EQ(o.backward_cluster, 1);
  EXPECT_EQ(o.backward_ring_dsum, -1);
  detail::set_override("norm.backward.ring_dsum", "on");
  EXPECT_EQ(read_launch_overrides().backward_ring_dsum, 1);
  detail::set_override("norm.backward.ring_dsum", "sometimes");
  EXPECT_THROW(read_launch_overrides(), Error);
  detail::set_override("norm.backward.ring_dsum", "");
  detail::set_override("norm.backward.cluster", "3");
  EXPECT_THROW(read_launch_overrides(), Error);
  detail::set_override("norm.backward.cluster", "");
  detail::set_override("norm.backward.stages", "5");
  EXPECT_THROW(read_launch_overrides(), Error);
  detail::clear_overrides();
}

// The element kernels' shape: the fewest threads per row (a power of two from 32 to 512) that
// hold the row in 8 elements a thread or fewer; 4 where 4 do. Past 4096 elements, none.
TEST(NormConfig, ElementShapeCoversTheRowWithinTheKernelsLimits) {
  const std::int64_t limit = std::int64_t(kElementBlockThreads) * kElementMaxPerThread;
  for (std::int64_t cols = 1; cols <= limit + 100; ++cols) {
    const ElementShape e = element_shape(cols);
    SCOPED_TRACE(cols);
    if (cols > limit) {
      EXPECT_EQ(e.elements_per_thread, 0);
      continue;
    }
    EXPECT_GE(e.threads_per_row, 32);
    EXPECT_LE(e.threads_per_row, kElementBlockThreads);
    EXPECT_EQ(e.threads_per_row & (e.threads_per_row - 1), 0);
    EXPECT_TRUE(e.elements_per_thread == 4 || e.elements_per_thread == 8);
    EXPECT_GE(std::int64_t(e.threads_per_row) * e.elements_per_thread, cols);
    EXPECT_EQ(e.elements_per_thread == 4, std::int64_t(e.threads_per_row) * 4 >= cols);
    if (e.threads_per_row > 32) EXPECT_GT(cols, std::int64_t(e.threads_per_row / 2) * kElementMaxPerThread);
  }
  EXPECT_EQ(element_shape(100).threads_per_row, 32);
  EXPECT_EQ(element_shape(100).elements_per_thread, 4);
  EXPECT_EQ(element_shape(259).threads_per_row, 64);
  EXPECT_EQ(element_shape(259).elements_per_thread, 8);
  EXPECT_EQ(element_shape(4095).threads_per_row, 512);
  // The backward's misaligned rows take them too; the workspace's rows stay the generic grid's.
  BackwardProblem b;
  b.rows = 1 << 16;
  b.cols = 3001;
  b.aligned = false;
  b.partials = true;
  b.bias_grad = true;
  const auto device = h100();
  const HopperOccupancy occupancy(device);
  const BackwardLaunch l = choose_backward_launch(b, device, occupancy);
  EXPECT_TRUE(l.generic);
  EXPECT_EQ(l.elements.threads_per_row, 512);
  EXPECT_EQ(l.elements.elements_per_thread, 8);
  EXPECT_EQ(l.partial_rows, l.grid);
  EXPECT_LE(l.grid, backward_workspace_rows(b.rows, b.cols, 2, device, occupancy));
  b.cols = 5001;
  EXPECT_EQ(choose_backward_launch(b, device, occupancy).elements.elements_per_thread, 0);
}

}  // namespace
}  // namespace fusekit::norm
