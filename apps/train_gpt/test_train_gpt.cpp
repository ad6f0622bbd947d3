// Tests of the trainer on the CPU backend: the whole model's gradients against central finite
// differences, bitwise-identical steps after a checkpoint resume, and the host-side pieces.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "checkpoint.h"
#include "data.h"
#include "optimizer.h"
#include "rng.h"
#include "trainer.h"

namespace train_gpt {
namespace {

ModelConfig small_config() {
  // Two blocks, two heads of 16: every kind of layer, small enough for thousands of forward passes.
  return ModelConfig{2, 2, 32, 16, 64, 64};
}

// Every parameter of the model: the gradient forward_backward writes agrees with central
// differences of the loss. The CPU backend computes in float32 tensors (each op's arithmetic in
// float64, its outputs rounded to float32), so the loss carries float32 rounding: a single element's
// difference quotient would drown in it. Each trial therefore perturbs a random sample of up to 16
// elements of one tensor together along random signs s (a directional derivative sum_i g_i s_i,
// whose size grows with the sample while the rounding noise does not), with dropout on (the masks
// are a function of the step, so every evaluation sees the same ones).
TEST(TrainGpt, GradientsMatchFiniteDifferences) {
  const ModelConfig config = small_config();
  Arena arena(fusekit::Device::cpu());
  Parameters params(config, Backend::cpu(), arena);
  params.initialize(7);
  // Move every parameter off its initial constant (biases 0, norm weights 1) so that no term of
  // the gradient is trivially zero.
  {
    std::vector<float> values = params.master_values();
    NormalRng rng(99);
    for (float& v : values) v += 0.05f * rng.next();
    params.set_master_values(values);
  }
  const std::int64_t batch = 2;
  Model model(params, batch, true, arena);
  std::vector<std::int32_t> inputs(static_cast<std::size_t>(batch * config.seq_len)), targets(inputs.size());
  SplitMix64 tokens(5);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    inputs[i] = static_cast<std::int32_t>(tokens.below(static_cast<std::uint64_t>(config.vocab)));
    targets[i] = static_cast<std::int32_t>(tokens.below(static_cast<std::uint64_t>(config.vocab)));
  }
  model.set_batch(inputs, targets, batch);
  const DropoutConfig dropout{0.1f, 11, 3};
  const float loss = model.forward_backward(dropout);
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, std::log(static_cast<float>(config.vocab)), 1.0f);
  const std::vector<float> grads = params.grad_values();

  constexpr float kStep = 1e-2f;
  constexpr int kTrials = 3;
  SplitMix64 pick(17);
  std::size_t offset = 0;
  double worst = 0.0;
  for (std::size_t t = 0; t < params.size(); ++t) {
    const ParamInfo& info = params.layout().info[t];
    float* master = params.master[t].data_as<float>();  // the CPU backend computes from the master
    const std::int64_t n = info.numel();
    for (int trial = 0; trial < kTrials; ++trial) {
      const std::int64_t k = std::min<std::int64_t>(n, 16);
      std::vector<std::int64_t> idx;
      std::vector<float> sign;
      for (std::int64_t j = 0; j < k; ++j) {
        std::int64_t e;
        do e = static_cast<std::int64_t>(pick.below(static_cast<std::uint64_t>(n)));
        while (std::find(idx.begin(), idx.end(), e) != idx.end());
        idx.push_back(e);
        sign.push_back(pick.below(2) ? 1.0f : -1.0f);
      }
      double analytic = 0.0, scale = 0.0;
      for (std::int64_t j = 0; j < k; ++j) {
        const double g = grads[offset + static_cast<std::size_t>(idx[j])];
        analytic += sign[j] * g;
        scale += std::abs(g);
      }
      std::vector<float> saved(static_cast<std::size_t>(k));
      for (std::int64_t j = 0; j < k; ++j) saved[j] = master[idx[j]];
      auto loss_at = [&](float h) {
        for (std::int64_t j = 0; j < k; ++j) master[idx[j]] = saved[j] + h * sign[j];
        return static_cast<double>(model.loss(dropout));
      };
      const double plus = loss_at(kStep), minus = loss_at(-kStep);
      for (std::int64_t j = 0; j < k; ++j) master[idx[j]] = saved[j];
      const double numeric = (plus - minus) / (2.0 * kStep);
      // Noise floor: the loss (about 4) is a float32 value, off by up to a few ulps (4.8e-7 each)
      // through the rounding of the activations, so the quotient carries up to ~1e-4 of noise.
      // Beyond it, 1% of sum |g_i| covers the central difference's O(kStep^2) truncation (largest
      // for the projection biases, whose gradients are the largest). Measured: the agreement is
      // typically 1e-5 absolute, the worst case under half the tolerance.
      const double tolerance = 2e-4 + 0.01 * scale;
      worst = std::max(worst, std::abs(numeric - analytic) / tolerance);
      EXPECT_LE(std::abs(numeric - analytic), tolerance)
          << info.name << " trial " << trial << ": analytic " << analytic << ", numeric " << numeric
          << " (sum |g| " << scale << ")";
    }
    offset += static_cast<std::size_t>(n);
  }
  std::printf("worst |numeric - analytic| / tolerance over %zu tensors: %.3f\n", params.size(), worst);
}

TokenSplit shakespeare() {
  return split_tokens(encode_bytes(read_text_file(TRAIN_GPT_TEST_DATA)), 0.1);
}

TrainerOptions small_run() {
  TrainerOptions o;
  o.model = small_config();
  o.model.vocab = 256;
  o.model.padded_vocab = 256;
  o.backend = Backend::cpu();
  o.batch = 4;
  o.dropout = 0.1f;
  o.seed = 4242;
  o.optimizer.total_steps = 8;
  o.optimizer.warmup_steps = 2;
  o.optimizer.lr = 3e-3f;
  return o;
}

// Saving after step 3 and resuming gives steps 4 and 5 exactly as the uninterrupted run had them:
// the same losses, gradient norms and parameters, bit for bit.
TEST(TrainGpt, CheckpointResumeIsBitwise) {
  const TokenSplit tokens = shakespeare();
  const std::string path = ::testing::TempDir() + "train_gpt_resume_test.bin";
  std::vector<StepStats> uninterrupted;
  std::vector<float> final_params;
  {
    Trainer a(small_run(), tokens);
    for (int i = 0; i < 3; ++i) a.train_step();
    a.save(path);
    uninterrupted.push_back(a.train_step());
    uninterrupted.push_back(a.train_step());
    final_params = a.params().master_values();
  }
  const TrainingState state = read_checkpoint_state(path);
  EXPECT_EQ(state.step, 3);
  EXPECT_EQ(state.seed, 4242u);
  EXPECT_EQ(state.data_position, 3u * 4u);

  TrainerOptions resumed = small_run();
  resumed.resume = path;
  Trainer b(resumed, tokens);
  EXPECT_EQ(b.step(), 3);
  for (const StepStats& expected : uninterrupted) {
    const StepStats got = b.train_step();
    EXPECT_EQ(got.step, expected.step);
    EXPECT_EQ(got.loss, expected.loss) << "step " << got.step;  // bitwise: the exact float
    EXPECT_EQ(got.grad_norm, expected.grad_norm) << "step " << got.step;
  }
  EXPECT_TRUE(b.params().master_values() == final_params);
  std::remove(path.c_str());
}

TEST(TrainGpt, CheckpointRefusesAnotherModel) {
  const TokenSplit tokens = shakespeare();
  const std::string path = ::testing::TempDir() + "train_gpt_shape_test.bin";
  { Trainer(small_run(), tokens).save(path); }
  TrainerOptions other = small_run();
  other.model.n_embd = 64;
  other.resume = path;
  EXPECT_THROW(Trainer(other, tokens), std::runtime_error);
  std::remove(path.c_str());
}

TEST(TrainGpt, LossFallsOnShakespeare) {
  const TokenSplit tokens = shakespeare();
  TrainerOptions o = small_run();
  o.dropout = 0.0f;
  o.optimizer.total_steps = 30;
  Trainer t(o, tokens);
  const float before = t.validation_loss(2);
  for (int i = 0; i < 30; ++i) t.train_step();
  const float after = t.validation_loss(2);
  EXPECT_NEAR(before, std::log(256.0f), 0.3f);
  EXPECT_LT(after, before - 1.0f) << "validation loss " << before << " -> " << after;
}

TEST(TrainGpt, LearningRateSchedule) {
  OptimizerConfig c;
  c.lr = 1.0f;
  c.min_lr_ratio = 0.1f;
  c.warmup_steps = 10;
  c.total_steps = 110;
  EXPECT_FLOAT_EQ(learning_rate(c, 1), 0.1f);
  EXPECT_FLOAT_EQ(learning_rate(c, 10), 1.0f);
  EXPECT_FLOAT_EQ(learning_rate(c, 60), 0.55f);  // halfway down the cosine
  EXPECT_FLOAT_EQ(learning_rate(c, 110), 0.1f);
}

TEST(TrainGpt, DataOrderIsAPermutationPerEpoch) {
  std::vector<std::int32_t> stream(1 + 8 * 10);
  for (std::size_t i = 0; i < stream.size(); ++i) stream[i] = static_cast<std::int32_t>(i);
  BatchLoader loader(stream, 2, 8, 3, true);
  ASSERT_EQ(loader.windows(), 10);
  std::vector<int> seen(10, 0);
  std::vector<std::int32_t> in, tg;
  for (int b = 0; b < 5; ++b) {
    loader.next(in, tg);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(in[r * 8] % 8, 0);
      EXPECT_EQ(tg[r * 8], in[r * 8] + 1);
      ++seen[static_cast<std::size_t>(in[r * 8] / 8)];
    }
  }
  for (int s : seen) EXPECT_EQ(s, 1);
  BatchLoader again(stream, 2, 8, 3, true);
  again.seek(4);
  std::vector<std::int32_t> in2, tg2;
  again.next(in2, tg2);
  loader.seek(4);
  loader.next(in, tg);
  EXPECT_EQ(in, in2);
}

TEST(TrainGpt, ByteTokenizerRoundTrips) {
  const std::string text = "To be, or not to be: that is the question.\n\xc3\xa9";
  EXPECT_EQ(decode_bytes(encode_bytes(text)), text);
}

}  // namespace
}  // namespace train_gpt
