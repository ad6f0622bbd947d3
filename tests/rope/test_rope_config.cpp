// The launch choice of the rotary-embedding kernel (rope_config.h) on the CPU: what the benchmark
// shapes get on H100- and H200-like devices, the access width under every alignment, the forced
// choices, and properties of every launch over a grid of problems.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "rope/rope_config.h"
#include "tests/harness/devices.h"

namespace fusekit::rope {
namespace {

// B * S = 16384 tokens of Llama's attention (Hq = 32, Hk = 8), fully aligned, out of place.
Problem llama(DType dtype = DType::bf16, std::int64_t head_dim = 128, std::int64_t rotary_dim = 128,
              RopeStyle style = RopeStyle::rotate_half) {
  Problem p;
  p.dtype = dtype;
  p.style = style;
  p.tokens = 16384;
  p.heads_q = 32;
  p.heads_k = 8;
  p.head_dim = head_dim;
  p.rotary_dim = rotary_dim;
  p.q_copies = p.k_copies = true;
  p.aligned_elements = 16 / static_cast<int>(dtype_size(dtype));
  return p;
}

TEST(RopeConfig, BenchmarkShapes) {
  for (const detail::DeviceInfo& d : {testing::h100_device(), testing::h200_device()}) {
    // D = 128: 16-byte accesses, 8 lanes per row (8 units of 8 pairs), 3 tokens per block
    // (120 of the 128 rows that 32 row groups at 4 rows in flight take in one batch).
    Launch l = choose_launch(llama(), d);
    EXPECT_FALSE(l.elementwise);
    EXPECT_EQ(l.access_elements, 8);
    EXPECT_EQ(l.rotation_units, 8);
    EXPECT_EQ(l.pass_units, 0);
    EXPECT_EQ(l.lanes_per_row, 8);
    EXPECT_EQ(l.rows_in_flight, 4);
    EXPECT_EQ(l.tokens_per_block, 3);
    EXPECT_EQ(l.blocks, (16384 + 2) / 3);
    EXPECT_EQ(l.cos_sin_stride, 64);
    EXPECT_EQ(l.smem_bytes, 3u * (64 * 8 + 4 * sizeof(void*)));
    // D = 64: 4 lanes per row, 6 tokens per block (240 of a batch's 256 rows).
    l = choose_launch(llama(DType::bf16, 64, 64), d);
    EXPECT_EQ(l.access_elements, 8);
    EXPECT_EQ(l.lanes_per_row, 4);
    EXPECT_EQ(l.tokens_per_block, 6);
    // Partial rotary (r = 32 of 128, GPT-NeoX / Pythia): 2 rotation units and 6 copied units of
    // two accesses per row, 8 lanes per row as at r = 128, 3 tokens per block; in place only the
    // 2 rotation units, 128 row groups: 12 tokens (480 of one batch's 512 rows).
    l = choose_launch(llama(DType::bf16, 128, 32), d);
    EXPECT_EQ(l.access_elements, 8);
    EXPECT_EQ(l.rotation_units, 2);
    EXPECT_EQ(l.pass_accesses, 2);
    EXPECT_EQ(l.pass_units, 6);
    EXPECT_EQ(l.lanes_per_row, 8);
    EXPECT_EQ(l.tokens_per_block, 3);
    Problem in_place = llama(DType::bf16, 128, 32);
    in_place.q_copies = in_place.k_copies = false;
    l = choose_launch(in_place, d);
    EXPECT_EQ(row_units(l, false), 2);
    EXPECT_EQ(l.lanes_per_row, 2);
    EXPECT_EQ(l.tokens_per_block, 12);
    // Interleaved: a unit is 8 elements, 4 pairs; 16 units per row, one access a row: 8 rows in
    // flight, 3 tokens per block (120 of a batch's 128 rows).
    l = choose_launch(llama(DType::bf16, 128, 128, RopeStyle::interleaved), d);
    EXPECT_EQ(l.access_elements, 8);
    EXPECT_EQ(l.rotation_units, 16);
    EXPECT_EQ(l.lanes_per_row, 16);
    EXPECT_EQ(l.rows_in_flight, 8);
    EXPECT_EQ(l.tokens_per_block, 3);
    // f32: 4 elements per 16-byte access.
    l = choose_launch(llama(DType::f32), d);
    EXPECT_EQ(l.access_elements, 4);
    EXPECT_EQ(l.rotation_units, 16);
    EXPECT_EQ(l.lanes_per_row, 16);
  }
}

TEST(RopeConfig, AccessWidthFollowsAlignmentAndDims) {
  const detail::DeviceInfo d = testing::h100_device();
  // GPT-NeoX-20B: D = 96, r = 24: halves of 12 elements take 8-byte accesses.
  Launch l = choose_launch(llama(DType::bf16, 96, 24), d);
  EXPECT_FALSE(l.elementwise);
  EXPECT_EQ(l.access_elements, 4);
  EXPECT_EQ(l.rotation_units, 3);
  EXPECT_EQ(l.pass_accesses, 2);
  EXPECT_EQ(l.pass_units, 9);
  EXPECT_EQ(l.lanes_per_row, 16);
  // Pointers or strides aligned to fewer elements narrow the accesses.
  for (int aligned : {8, 4, 2, 1}) {
    Problem p = llama();
    p.aligned_elements = aligned;
    l = choose_launch(p, d);
    EXPECT_EQ(l.elementwise, aligned == 1) << aligned;
    EXPECT_EQ(l.access_elements, aligned) << aligned;
    p.style = RopeStyle::interleaved;
    l = choose_launch(p, d);
    EXPECT_EQ(l.elementwise, aligned == 1) << aligned;
    EXPECT_EQ(l.access_elements, aligned == 1 ? 2 : aligned) << aligned;  // whole pairs
  }
  // f32 interleaved aligned to single elements: element accesses of one pair.
  Problem f32 = llama(DType::f32, 128, 128, RopeStyle::interleaved);
  f32.aligned_elements = 1;
  l = choose_launch(f32, d);
  EXPECT_TRUE(l.elementwise);
  EXPECT_EQ(l.access_elements, 2);
  // ... while rotate_half takes 4-byte accesses of one element.
  f32.style = RopeStyle::rotate_half;
  l = choose_launch(f32, d);
  EXPECT_FALSE(l.elementwise);
  EXPECT_EQ(l.access_elements, 1);
  // Odd halves (r = 6): single elements.
  l = choose_launch(llama(DType::bf16, 8, 6), d);
  EXPECT_TRUE(l.elementwise);
  EXPECT_EQ(l.rotation_units, 3);
  EXPECT_EQ(l.pass_accesses, 2);
  EXPECT_EQ(l.pass_units, 1);
  // The passed-through dims only constrain the width where they are copied: D = 132 stored in
  // rows of 136 elements (every stride a multiple of 8), r = 128: 4 dims pass through.
  Problem tail = llama(DType::bf16, 132, 128);
  EXPECT_EQ(choose_launch(tail, d).access_elements, 4);
  tail.q_copies = tail.k_copies = false;
  l = choose_launch(tail, d);
  EXPECT_EQ(l.access_elements, 8);
  EXPECT_EQ(row_units(l, false), 8);
}

TEST(RopeConfig, ForcedChoicesAndSmallProblems) {
  const detail::DeviceInfo d = testing::h200_device();
  ForcedChoices f;
  f.max_access_bytes = 8;
  EXPECT_EQ(choose_launch(llama(), d, f).access_elements, 4);
  f.max_access_bytes = 4;
  EXPECT_EQ(choose_launch(llama(), d, f).access_elements, 2);
  f.max_access_bytes = 1;
  Launch l = choose_launch(llama(), d, f);
  EXPECT_TRUE(l.elementwise);
  EXPECT_EQ(l.access_elements, 1);
  EXPECT_EQ(l.lanes_per_row, 32);  // 64 single-element units
  f = {};
  f.tokens_per_block = 3;
  l = choose_launch(llama(), d, f);
  EXPECT_EQ(l.tokens_per_block, 3);
  EXPECT_EQ(l.blocks, (16384 + 2) / 3);
  // Few tokens: one token per block, so that every SM gets work.
  Problem small = llama();
  small.tokens = 100;
  l = choose_launch(small, d);
  EXPECT_EQ(l.tokens_per_block, 1);
  EXPECT_EQ(l.blocks, 100);
  // Many heads: fewer tokens per block.
  Problem wide = llama();
  wide.heads_q = 128, wide.heads_k = 128;
  EXPECT_EQ(choose_launch(wide, d).tokens_per_block, 1);
}

TEST(RopeConfig, EveryLaunchCoversTheProblem) {
  int checked = 0;
  for (int sms : {1, 114, 132})
    for (DType dtype : {DType::f32, DType::f16, DType::bf16})
      for (RopeStyle style : {RopeStyle::rotate_half, RopeStyle::interleaved})
        for (std::int64_t d : {2, 6, 8, 24, 64, 80, 96, 128, 130, 256, 512})
          for (std::int64_t r : {std::int64_t(2), d / 4 * 2, d - d % 2, std::int64_t(24)})
            for (int aligned : {1, 2, 4, 8})
              for (bool copies : {false, true})
                for (std::int64_t tokens : {1, 37, 16384, 2147483647})
                  for (auto [hq, hk] : {std::pair<std::int64_t, std::int64_t>{32, 8}, {1, 0}, {0, 3}, {7, 65528}}) {
                    if (r < 2 || r > d || aligned > 16 / static_cast<int>(dtype_size(dtype))) continue;
                    Problem p;
                    p.dtype = dtype, p.style = style, p.tokens = tokens, p.heads_q = hq, p.heads_k = hk;
                    p.head_dim = d, p.rotary_dim = r, p.q_copies = copies, p.k_copies = !copies || hk == 0;
                    p.aligned_elements = aligned;
                    detail::DeviceInfo device = testing::h100_device();
                    device.sm_count = sms;
                    const Launch l = choose_launch(p, device);
                    SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + rope_style_name(style) + " D=" +
                                 std::to_string(d) + " r=" + std::to_string(r) + " aligned " + std::to_string(aligned) +
                                 " tokens " + std::to_string(tokens));
                    const int size = static_cast<int>(dtype_size(dtype));
                    const std::int64_t span = style == RopeStyle::rotate_half ? r / 2 : r;
                    const int w = l.access_elements;
                    ASSERT_EQ(std::int64_t(l.rotation_units) * w, span);
                    const int pass_w = w * l.pass_accesses;
                    ASSERT_TRUE(l.pass_accesses == 1 || (style == RopeStyle::rotate_half && l.pass_accesses == 2));
                    ASSERT_EQ(std::int64_t(l.pass_units) * pass_w, (d - r) / pass_w * pass_w);
                    const bool any_copies = p.q_copies || (hk > 0 && p.k_copies);
                    if (any_copies) {
                      ASSERT_EQ(std::int64_t(l.pass_units) * pass_w, d - r);
                    }
                    if (style == RopeStyle::interleaved) {
                      ASSERT_EQ(w % 2, 0);
                    }
                    if (l.elementwise) {
                      ASSERT_EQ(w, style == RopeStyle::interleaved ? 2 : 1);
                    } else {
                      const int bytes = w * size;
                      ASSERT_TRUE(bytes == 16 || bytes == 8 || bytes == 4);
                      ASSERT_LE(w, aligned);
                    }
                    const int units = std::max(row_units(l, p.q_copies), hk > 0 ? row_units(l, p.k_copies) : 0);
                    ASSERT_EQ(l.lanes_per_row & (l.lanes_per_row - 1), 0);
                    ASSERT_LE(l.lanes_per_row, 32);
                    ASSERT_GE(l.lanes_per_row, std::min(32, units));
                    ASSERT_EQ(l.threads, kThreads);
                    ASSERT_EQ(l.threads % l.lanes_per_row, 0);
                    ASSERT_EQ(l.rows_in_flight, rows_in_flight(style));
                    ASSERT_GE(l.tokens_per_block, 1);
                    ASSERT_LE(l.tokens_per_block, kMaxTokensPerBlock);
                    ASSERT_GE(l.blocks * l.tokens_per_block, tokens);
                    ASSERT_LT((l.blocks - 1) * l.tokens_per_block, tokens);
                    ASSERT_LE(l.blocks, 2147483647);
                    ASSERT_EQ(l.cos_sin_stride % 2, 0);
                    ASSERT_GE(l.cos_sin_stride, r / 2);
                    ASSERT_LE(l.smem_bytes, 48u * 1024);  // no opt-in needed
                    ++checked;
                  }
  EXPECT_GT(checked, 1000);
}

}  // namespace
}  // namespace fusekit::rope
