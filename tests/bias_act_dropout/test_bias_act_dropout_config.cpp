// The launch choices of bias + activation + dropout (bias_act_dropout_config.h), on the CPU: what
// the benchmark shapes get on H100- and H200-like devices, and properties over a grid of shapes.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "bias_act_dropout/bias_act_dropout_config.h"

namespace fusekit {
namespace {

using namespace bias_act_dropout;

detail::DeviceInfo device(int sm_count) {
  detail::DeviceInfo d;
  d.sm_count = sm_count;
  return d;
}
const detail::DeviceInfo kH100 = [] {
  detail::DeviceInfo d = device(132);
  d.dram_bytes_per_sm_clock = 12.83;
  return d;
}();
const detail::DeviceInfo kH200 = [] {
  detail::DeviceInfo d = device(132);
  d.dram_bytes_per_sm_clock = 18.42;
  return d;
}();

Problem problem(std::int64_t rows, std::int64_t cols, DType dtype, Activation act, bool vector_ok = true,
                bool pre = false) {
  Problem p;
  p.rows = rows;
  p.cols = cols;
  p.dtype = dtype;
  p.activation = act;
  p.vector_ok = vector_ok && cols % kChunk == 0;
  p.pre_activation = pre;
  return p;
}

constexpr Activation kAll[] = {Activation::none,         Activation::relu,       Activation::gelu_erf,
                               Activation::gelu_tanh,    Activation::squared_relu, Activation::leaky_relu,
                               Activation::silu};

TEST(BiasActDropoutConfig, ActivationTableCoversEveryActivation) {
  int rows = 0;
  for (Activation a : kAll) {
    bool found = false;
    for (const ActivationRow& row : kActivationRows) found = found || row.activation == a;
    EXPECT_TRUE(found) << static_cast<int>(a);
    ++rows;
  }
  EXPECT_EQ(rows, static_cast<int>(std::size(kActivationRows)));
  EXPECT_TRUE(transcendental_activation(Activation::gelu_tanh));
  EXPECT_TRUE(transcendental_activation(Activation::gelu_erf));
  EXPECT_TRUE(transcendental_activation(Activation::silu));
  EXPECT_FALSE(transcendental_activation(Activation::relu));
  EXPECT_FALSE(transcendental_activation(Activation::leaky_relu));
}

TEST(BiasActDropoutConfig, BenchmarkShapesForward) {
  for (const detail::DeviceInfo& d : {kH100, kH200}) {
    // The cheap activations in bf16 run in row groups up to N = 8192.
    ForwardLaunch l = choose_forward(problem(16384, 4096, DType::bf16, Activation::relu), d);
    EXPECT_EQ(l.kernel, ForwardKernel::row_groups);
    EXPECT_EQ(l.row_groups.threads_per_row, 256);
    EXPECT_EQ(l.row_groups.rows_per_block, 1);
    EXPECT_EQ(l.row_group_blocks, 16384);
    l = choose_forward(problem(16384, 5120, DType::bf16, Activation::none), d);
    EXPECT_EQ(l.kernel, ForwardKernel::row_groups);
    EXPECT_EQ(l.row_groups.threads_per_row, 320);
    l = choose_forward(problem(32768, 1024, DType::bf16, Activation::relu), d);
    EXPECT_EQ(l.kernel, ForwardKernel::row_groups);
    EXPECT_EQ(l.row_groups.threads_per_row, 64);
    EXPECT_EQ(l.row_groups.rows_per_block, 2);
    EXPECT_EQ(l.row_group_blocks, 16384);
    EXPECT_EQ(row_group_l2_ahead(l.row_groups, 4, d.sm_count), 4 * 132 * 2);
    // N = 16384 needs 1024 threads per row: the walking grid, one wave of 2 blocks per SM.
    l = choose_forward(problem(8192, 16384, DType::bf16, Activation::relu), d);
    EXPECT_EQ(l.kernel, ForwardKernel::walking_vector);
    EXPECT_FALSE(l.transcendental);
    EXPECT_EQ(l.grid.tx, 32);
    EXPECT_EQ(l.grid.ty, 16);
    EXPECT_EQ(l.grid.gx, 64);
    EXPECT_EQ(l.grid.gy, 4);
    // The transcendental activations keep the walking grid with their own tuning.
    l = choose_forward(problem(16384, 4096, DType::bf16, Activation::gelu_tanh), d);
    EXPECT_EQ(l.kernel, ForwardKernel::walking_vector);
    EXPECT_TRUE(l.transcendental);
    EXPECT_EQ(l.grid.gx, 16);
    EXPECT_EQ(l.grid.gy, 16);
    // f32, a stored pre-activation, or misalignment leave the row groups.
    EXPECT_EQ(choose_forward(problem(16384, 4096, DType::f32, Activation::relu), d).kernel,
              ForwardKernel::walking_vector);
    EXPECT_EQ(choose_forward(problem(16384, 4096, DType::bf16, Activation::relu, true, true), d).kernel,
              ForwardKernel::walking_vector);
    l = choose_forward(problem(16384, 4096, DType::bf16, Activation::relu, false), d);
    EXPECT_EQ(l.kernel, ForwardKernel::walking_generic);
    EXPECT_EQ(l.grid.gy, 132 / 16);  // one block per SM
  }
}

TEST(BiasActDropoutConfig, BenchmarkShapesBackward) {
  for (const detail::DeviceInfo& d : {kH100, kH200}) {
    BackwardLaunch l = choose_backward(problem(16384, 4096, DType::bf16, Activation::relu), d);
    EXPECT_EQ(l.kernel, BackwardKernel::walking_vector);
    EXPECT_EQ(l.grid.tx, 16);
    EXPECT_EQ(l.grid.gx, 32);
    EXPECT_EQ(l.grid.gy, 8);
    l = choose_backward(problem(16384, 4095, DType::bf16, Activation::relu), d);
    EXPECT_EQ(l.kernel, BackwardKernel::walking_generic);
    EXPECT_EQ(l.grid.gy, 4);
  }
  // Fewer SMs (an H100 PCIe), fewer partial rows.
  EXPECT_EQ(choose_backward(problem(16384, 4096, DType::bf16, Activation::relu), device(114)).grid.gy, 7);
}

TEST(BiasActDropoutConfig, EveryLaunchCoversTheProblem) {
  const std::int64_t rows_set[] = {1, 2, 3, 67, 1000, 16384, 300000};
  const std::int64_t cols_set[] = {1, 7, 8, 504, 512, 1000, 1024, 1536, 4096, 5120, 8192, 8200, 16384, 70000};
  int checked = 0;
  for (int sms : {1, 78, 114, 132})
    for (std::int64_t rows : rows_set)
      for (std::int64_t cols : cols_set)
        for (DType dtype : {DType::f32, DType::f16, DType::bf16})
          for (Activation act : kAll)
            for (bool vector_ok : {false, true})
              for (bool pre : {false, true}) {
                const Problem p = problem(rows, cols, dtype, act, vector_ok, pre);
                const detail::DeviceInfo d = device(sms);
                SCOPED_TRACE("(" + std::to_string(rows) + ", " + std::to_string(cols) + ") sms " + std::to_string(sms));
                const ForwardLaunch f = choose_forward(p, d);
                if (f.kernel == ForwardKernel::row_groups) {
                  const RowGroupShape s = f.row_groups;
                  ASSERT_TRUE(p.vector_ok && !pre && dtype != DType::f32 && !transcendental_activation(act));
                  ASSERT_EQ(s.threads_per_row % 32, 0);
                  ASSERT_EQ(std::int64_t(s.threads_per_row) * kRowGroupVectors * kChunk, cols);
                  const int block = s.threads_per_row * s.rows_per_block;
                  ASSERT_GT(block, kRowGroupMinBlockThreads / 2);  // e.g. 96 threads at N = 1536
                  ASSERT_LE(block, kRowGroupMaxThreads);
                  ASSERT_GE(f.row_group_blocks * s.rows_per_block, rows);
                  ASSERT_LT((f.row_group_blocks - 1) * s.rows_per_block, rows);
                } else {
                  ASSERT_EQ(f.kernel == ForwardKernel::walking_vector, p.vector_ok);
                  ASSERT_EQ(f.grid.tx * f.grid.ty, kThreads);
                  ASSERT_GE(std::int64_t(f.grid.gx) * f.grid.tx * kChunk, cols);
                  ASSERT_GE(std::int64_t(f.grid.gy) * f.grid.ty, 1);
                  ASSERT_LE(f.grid.gy, 65535);
                }
                const BackwardLaunch b = choose_backward(p, d);
                ASSERT_EQ(b.kernel == BackwardKernel::walking_vector, p.vector_ok);
                ASSERT_GE(std::int64_t(b.grid.gx) * b.grid.tx * kChunk, cols);
                // The workspace query covers the partial rows of either backward grid.
                ASSERT_GE(backward_workspace_bytes(rows, cols, d), partial_bytes(b.grid, cols));
                ++checked;
              }
  EXPECT_GT(checked, 0);
}

}  // namespace
}  // namespace fusekit
