// Tests of the trainer on the CPU backend: the whole model's gradients against central finite
// differences, bitwise-identical steps after a checkpoint resume, data parallelism (replicas on
// host threads averaged on the host: the batch split, the averaging, resume on another number of
// replicas), and the host-side pieces; on a GPU where one exists, the step replayed as a CUDA graph.
#include <fusekit/runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint.h"
#include "data.h"
#include "optimizer.h"
#include "parallel.h"
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
// whose size grows with the sample while the rounding noise does not). With dropout on (the masks
// are a function of the step, so every evaluation sees the same ones) and off (the projections'
// biases then in their GEMMs' epilogues).
class TrainGptGradients : public ::testing::TestWithParam<float> {};

TEST_P(TrainGptGradients, MatchFiniteDifferences) {
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
  const DropoutConfig dropout{GetParam(), 11, 3};
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

INSTANTIATE_TEST_SUITE_P(Dropout, TrainGptGradients, ::testing::Values(0.1f, 0.0f));

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

// On a GPU at dropout 0 the step is replayed from a recorded CUDA graph from the second step on:
// the same kernels on the same buffers as launched one by one, so the run is bitwise the run
// without it, also across a validation pass (which runs its ops directly on the same buffers).
TEST(TrainGptGpu, StepGraphReplaysTheDirectSteps) {
  if (fusekit::cuda_device_count() == 0 || !fusekit::cuda_device_supported(0)) GTEST_SKIP() << "no supported GPU";
  const TokenSplit tokens = shakespeare();
  struct Run {
    std::vector<StepStats> steps;
    float validation = 0.0f;
    std::vector<float> params;
    std::int64_t replays = 0;
  };
  auto run = [&](bool graph) {
    TrainerOptions o = small_run();
    o.model = ModelConfig{2, 2, 128, 128, 256, 256};  // head dim 64
    o.backend = Backend::cuda(0);
    o.dropout = 0.0f;
    o.deterministic = true;  // attention's dQ summed in a fixed order: two runs can be compared bitwise
    o.step_graph = graph;
    Trainer t(o, tokens);
    Run r;
    for (int i = 0; i < 3; ++i) r.steps.push_back(t.train_step());
    r.validation = t.validation_loss(2);
    for (int i = 0; i < 3; ++i) r.steps.push_back(t.train_step());
    r.params = t.params().master_values();
    r.replays = t.model().graph_replays();
    return r;
  };
  const Run direct = run(false), graphed = run(true);
  EXPECT_EQ(direct.replays, 0);
  EXPECT_EQ(graphed.replays, 5);  // steps 2..6
  ASSERT_EQ(direct.steps.size(), graphed.steps.size());
  for (std::size_t i = 0; i < direct.steps.size(); ++i) {
    EXPECT_EQ(graphed.steps[i].loss, direct.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(graphed.steps[i].grad_norm, direct.steps[i].grad_norm) << "step " << i + 1;
  }
  EXPECT_EQ(graphed.validation, direct.validation);
  EXPECT_TRUE(graphed.params == direct.params);
  EXPECT_LT(graphed.steps.back().loss, graphed.steps.front().loss);
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

// ---- data parallelism -------------------------------------------------------------------

// Rank r of N trains on rows [r B/N, (r+1) B/N) of exactly the batch one device takes.
TEST(TrainGptParallel, ReplicaRowsAreTheSingleDeviceBatch) {
  const std::int64_t batch = 8, seq = 5;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(batch * seq));
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(1000 + i);
  for (int ranks : {1, 2, 4, 8}) {
    std::vector<std::int32_t> joined;
    for (int r = 0; r < ranks; ++r) {
      const std::vector<std::int32_t> rows = rank_rows(tokens, batch, seq, ranks, r);
      ASSERT_EQ(rows.size(), static_cast<std::size_t>(batch / ranks * seq));
      // Its first token is row r * batch / ranks's first token.
      EXPECT_EQ(rows.front(), tokens[static_cast<std::size_t>(r * (batch / ranks) * seq)]);
      joined.insert(joined.end(), rows.begin(), rows.end());
    }
    EXPECT_EQ(joined, tokens) << ranks << " ranks";
  }
  EXPECT_THROW(rank_rows(tokens, batch, seq, 2, 2), std::invalid_argument);
  EXPECT_THROW(rank_rows(tokens, batch, seq + 1, 2, 0), std::invalid_argument);
}

TEST(TrainGptParallel, BatchMustSplitEvenlyOverGpus) {
  EXPECT_EQ(micro_batch(16, 4), 4);
  EXPECT_EQ(micro_batch(16, 1), 16);
  const TokenSplit tokens = shakespeare();
  TrainerOptions o = small_run();
  o.batch = 6;
  o.replicas = 4;
  try {
    Trainer t(o, tokens);
    FAIL() << "a batch of 6 over 4 replicas was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--batch 6"), std::string::npos) << what;
    EXPECT_NE(what.find("--gpus 4"), std::string::npos) << what;
  }
  EXPECT_THROW(micro_batch(4, 0), std::invalid_argument);
  EXPECT_THROW(micro_batch(2, 4), std::invalid_argument);
}

TEST(TrainGptParallel, ReplicaDropoutSeeds) {
  // Rank 0 draws a one-replica run's masks; every other rank its own.
  EXPECT_EQ(replica_dropout_seed(4242, 0), 4242u);
  std::vector<std::uint64_t> seeds;
  for (int r = 0; r < 8; ++r) seeds.push_back(replica_dropout_seed(4242, r));
  std::sort(seeds.begin(), seeds.end());
  EXPECT_EQ(std::adjacent_find(seeds.begin(), seeds.end()), seeds.end());
}

// A rank that fails before the collective does not leave the others waiting: they learn it at the
// barrier and stop, and the failed rank's own error is the one reported.
TEST(TrainGptParallel, AFailedRankStopsTheOthers) {
  RankThreads threads(4);
  RankBarrier barrier(4);
  std::vector<int> entered(4, 0);
  auto step = [&](bool fail_rank_2) {
    threads.run([&](int r) {
      bool arrived = false;
      try {
        if (fail_rank_2 && r == 2) throw std::runtime_error("rank 2 ran out of memory");
        arrived = true;
        if (!barrier.arrive_and_wait(true)) throw PeerFailure("rank " + std::to_string(r) + " stopped");
        ++entered[static_cast<std::size_t>(r)];
      } catch (...) {
        if (!arrived) barrier.arrive_and_wait(false);
        throw;
      }
    });
  };
  try {
    step(true);
    FAIL() << "the failure was not reported";
  } catch (const PeerFailure& e) {
    FAIL() << "reported another rank's stop instead of the failure: " << e.what();
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "rank 2 ran out of memory");
  }
  EXPECT_EQ(entered, std::vector<int>(4, 0));
  // The threads and the barrier still work for the next round.
  step(false);
  EXPECT_EQ(entered, std::vector<int>(4, 1));
}

// A build without NCCL refuses a data-parallel GPU run, saying why.
TEST(TrainGptParallel, WithoutNcclGpusAreRefused) {
  if (!nccl_version().empty()) GTEST_SKIP() << "built with NCCL " << nccl_version();
  try {
    nccl_gradient_average(2, 0);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--gpus 2"), std::string::npos) << what;
    EXPECT_NE(what.find("built without NCCL"), std::string::npos) << what;
  }
}

// |a - b| over every element, relative to the largest |a|.
double max_relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(a[i])));
  }
  return scale > 0.0 ? diff / scale : diff;
}

// The mean of the replicas' gradients (each the gradient of its rows' mean loss) is the gradient
// of the whole batch's mean loss: one step of 2 and 4 replicas leaves in every replica the
// gradient a single replica computes for the whole batch, up to float32 rounding, and the
// replicas' gradients are bitwise the same.
TEST(TrainGptParallel, ReplicaGradientsAverageToTheBatchGradient) {
  const TokenSplit tokens = shakespeare();
  TrainerOptions o = small_run();
  o.dropout = 0.0f;
  Trainer one(o, tokens);
  const StepStats s1 = one.train_step();
  const std::vector<float> full = one.params().grad_values();
  for (int replicas : {2, 4}) {
    o.replicas = replicas;
    Trainer many(o, tokens);
    ASSERT_EQ(many.replicas(), replicas);
    EXPECT_EQ(many.micro_batch(), o.batch / replicas);
    const StepStats s = many.train_step();
    // Every row's activations are the same however the batch is split (the CPU ops compute rows
    // independently); the weight gradients are sums over rows, each replica's rounded to float32
    // before the average: about one float32 ulp of the largest gradient (measured 8e-8 of it).
    EXPECT_NEAR(s.loss, s1.loss, 2e-6f * s1.loss) << replicas << " replicas";
    EXPECT_NEAR(s.grad_norm, s1.grad_norm, 1e-5f * s1.grad_norm) << replicas << " replicas";
    const std::vector<float> averaged = many.params(0).grad_values();
    const double difference = max_relative_difference(full, averaged);
    std::printf("%d replicas: max |averaged - whole-batch gradient| / max |gradient| = %.3g, loss %.9g vs %.9g\n",
                replicas, difference, s.loss, s1.loss);
    EXPECT_LT(difference, 1e-6) << replicas << " replicas";
    for (int r = 1; r < replicas; ++r)
      EXPECT_TRUE(many.params(r).grad_values() == averaged) << "replica " << r << "'s gradients differ from replica 0's";
    EXPECT_NO_THROW(many.check_replicas());
  }
}

// Several steps on 1, 2 and 4 replicas at dropout 0: the same losses within float32 rounding, and
// the replicas stay bitwise identical.
TEST(TrainGptParallel, DataParallelLossesMatchOneReplica) {
  const TokenSplit tokens = shakespeare();
  TrainerOptions o = small_run();
  o.dropout = 0.0f;
  constexpr int kSteps = 5;
  std::vector<float> reference;
  std::vector<float> reference_params;
  {
    Trainer one(o, tokens);
    for (int i = 0; i < kSteps; ++i) reference.push_back(one.train_step().loss);
    reference_params = one.params().master_values();
  }
  for (int replicas : {2, 4}) {
    o.replicas = replicas;
    Trainer many(o, tokens);
    for (int i = 0; i < kSteps; ++i) {
      const float loss = many.train_step().loss;
      EXPECT_NEAR(loss, reference[static_cast<std::size_t>(i)], 1e-5f) << replicas << " replicas, step " << i + 1;
    }
    EXPECT_NO_THROW(many.check_replicas());
    EXPECT_LT(max_relative_difference(reference_params, many.params().master_values()), 1e-4) << replicas << " replicas";
  }
}

// check_replicas notices a replica whose parameters drifted by one bit.
TEST(TrainGptParallel, CheckReplicasFindsADivergedReplica) {
  const TokenSplit tokens = shakespeare();
  TrainerOptions o = small_run();
  o.replicas = 2;
  Trainer t(o, tokens);
  t.train_step();
  EXPECT_NO_THROW(t.check_replicas());
  std::vector<float> values = t.params(1).master_values();
  std::uint32_t bits;
  std::memcpy(&bits, &values[values.size() / 2], 4);
  bits ^= 1u;
  std::memcpy(&values[values.size() / 2], &bits, 4);
  t.params(1).set_master_values(values);
  try {
    t.check_replicas();
    FAIL() << "a replica differing in one bit passed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("replica 1"), std::string::npos) << e.what();
  }
}

// A checkpoint written by 2 replicas resumes on 1, 2 or 4: the state is replicated and the data
// position counts windows of the whole batch. On 2 replicas the next steps repeat the
// uninterrupted run bit for bit; on 1 or 4 they agree within float32 rounding (dropout on: the
// masks of ranks other than 0 differ with the number of replicas, so this runs at dropout 0).
TEST(TrainGptParallel, CheckpointResumesOnAnotherNumberOfReplicas) {
  const TokenSplit tokens = shakespeare();
  const std::string path = ::testing::TempDir() + "train_gpt_parallel_resume_test.bin";
  TrainerOptions o = small_run();
  o.dropout = 0.0f;
  o.replicas = 2;
  std::vector<StepStats> uninterrupted;
  {
    Trainer a(o, tokens);
    for (int i = 0; i < 3; ++i) a.train_step();
    a.save(path);
    uninterrupted.push_back(a.train_step());
    uninterrupted.push_back(a.train_step());
  }
  const TrainingState state = read_checkpoint_state(path);
  EXPECT_EQ(state.step, 3);
  EXPECT_EQ(state.data_position, 3u * 4u);  // 3 steps of the whole batch of 4
  for (int replicas : {1, 2, 4}) {
    TrainerOptions resumed = o;
    resumed.replicas = replicas;
    resumed.resume = path;
    Trainer b(resumed, tokens);
    EXPECT_EQ(b.step(), 3);
    for (const StepStats& expected : uninterrupted) {
      const StepStats got = b.train_step();
      EXPECT_EQ(got.step, expected.step);
      if (replicas == 2) {
        EXPECT_EQ(got.loss, expected.loss) << "step " << got.step;
        EXPECT_EQ(got.grad_norm, expected.grad_norm) << "step " << got.step;
      } else {
        EXPECT_NEAR(got.loss, expected.loss, 1e-5f) << replicas << " replicas, step " << got.step;
        EXPECT_NEAR(got.grad_norm, expected.grad_norm, 1e-4f * expected.grad_norm)
            << replicas << " replicas, step " << got.step;
      }
    }
    EXPECT_NO_THROW(b.check_replicas());
  }
  std::remove(path.c_str());
}

// Validation splits each batch over the replicas too: the same loss within float32 rounding.
TEST(TrainGptParallel, ValidationLossSplitsOverReplicas) {
  const TokenSplit tokens = shakespeare();
  TrainerOptions o = small_run();
  const float one = Trainer(o, tokens).validation_loss(3);
  o.replicas = 4;
  EXPECT_NEAR(Trainer(o, tokens).validation_loss(3), one, 1e-6f * one);
}

}  // namespace
}  // namespace train_gpt
