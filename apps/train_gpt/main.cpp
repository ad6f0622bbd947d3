// train_gpt: trains a GPT-2-style model end to end through fusekit's public C++ API.
//
//   train_gpt                      the default: GPT-2 124M shapes on a GPU, the tiny model on the CPU
//   train_gpt --device cpu --steps 100 --save ckpt.bin
//   train_gpt --resume ckpt.bin --steps 200
//   train_gpt --gpus 2 --batch 32          data-parallel over 2 GPUs (NCCL), 16 sequences on each
//
// Prints one progress line per step (loss, learning rate, gradient norm, time, tokens/s in all and
// per GPU, MFU on a GPU, memory), the validation loss at intervals, and a text sample at the end.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fusekit/error.h>
#include <fusekit/runtime.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint.h"
#include "trainer.h"

#ifndef TRAIN_GPT_DEFAULT_DATA
#define TRAIN_GPT_DEFAULT_DATA "data/tinyshakespeare.txt"
#endif

using namespace train_gpt;

namespace {

// Dense bf16 tensor-core peak of the GPUs the kernels are built for (H100 SXM and H200: 989
// TFLOP/s); 0 (MFU not printed) for anything else unless --peak-tflops says.
double detected_peak_tflops(const std::string& description) {
  if (description.find("H100") != std::string::npos || description.find("H200") != std::string::npos) return 989.0;
  return 0.0;
}

std::string mib(std::size_t bytes) { return fmt::format("{:.0f} MiB", static_cast<double>(bytes) / (1024.0 * 1024.0)); }

struct LossRecord {
  std::int64_t step;
  float loss;
  double ms;
  double enqueue_ms;  // the host's share: the step's calls until the last kernel was enqueued
};

void write_losses_json(const std::string& path, const std::vector<LossRecord>& train,
                       const std::vector<std::pair<std::int64_t, float>>& val, const TrainerOptions& o) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write '" + path + "'");
  out << "{\n  \"program\": \"train_gpt\",\n";
  out << fmt::format("  \"device\": \"{}\",\n  \"gpus\": {},\n  \"batch\": {},\n  \"seq_len\": {},\n",
                     o.backend.device.is_cuda() ? "cuda" : "cpu", o.replicas, o.batch, o.model.seq_len);
  out << "  \"train\": [";
  for (std::size_t i = 0; i < train.size(); ++i)
    out << fmt::format("{}\n    {{\"step\": {}, \"loss\": {:.9g}, \"ms\": {:.4f}}}", i ? "," : "", train[i].step,
                       train[i].loss, train[i].ms);
  out << "\n  ],\n  \"val\": [";
  for (std::size_t i = 0; i < val.size(); ++i)
    out << fmt::format("{}\n    {{\"step\": {}, \"loss\": {:.9g}}}", i ? "," : "", val[i].first, val[i].second);
  out << "\n  ]\n}\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"train_gpt: a GPT-2-style model trained through fusekit's C++ API"};
  std::string device_name = "auto", preset, data_path = TRAIN_GPT_DEFAULT_DATA, save_path, save_init, resume,
              losses_json, prompt = "\n";
  std::int64_t layers = 0, heads = 0, embd = 0, seq = 0, batch = 0, steps = 0, warmup = -1, val_every = 0,
               val_batches = 8, save_every = 0, sample_tokens = 300, stop_after = 0, check_replicas = 0;
  int gpus = 1;
  float lr = 0.0f, min_lr_ratio = 0.1f, weight_decay = 0.1f, grad_clip = 1.0f, dropout = 0.0f, temperature = 0.8f;
  float beta2 = OptimizerConfig{}.beta2;
  double peak_tflops = -1.0;
  std::uint64_t seed = 1337;
  bool deterministic = false, cuda_graph = true;
  app.add_option("--device", device_name, "cpu, cuda or auto (a GPU where one exists)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--preset", preset, "tiny or gpt2-124m (default: gpt2-124m on a GPU, tiny on the CPU)");
  app.add_option("--layers", layers, "override the preset's layers");
  app.add_option("--heads", heads, "override the preset's heads");
  app.add_option("--embd", embd, "override the preset's width");
  app.add_option("--seq", seq, "override the preset's context length");
  app.add_option("--data", data_path, "the text corpus (byte-level tokens; the last 10% validate)");
  app.add_option("--batch", batch, "sequences per step, over all GPUs (default: 16)");
  app.add_option("--gpus", gpus,
                 "data-parallel over this many GPUs of this host (NCCL), each training on batch / gpus sequences "
                 "(on the CPU backend: replicas on host threads, averaged on the host)");
  app.add_option("--steps", steps, "optimizer steps (the schedule's length; default tiny 100, gpt2-124m 50)");
  app.add_option("--lr", lr, "peak learning rate (default tiny 1e-3, gpt2-124m 6e-4)");
  app.add_option("--min-lr-ratio", min_lr_ratio, "the cosine's final learning rate / peak");
  app.add_option("--warmup", warmup, "warm-up steps (default: steps / 10)");
  app.add_option("--weight-decay", weight_decay, "AdamW weight decay of the 2-D weights");
  app.add_option("--beta2", beta2, "AdamW beta2 (default 0.99)");
  app.add_option("--grad-clip", grad_clip, "clip gradients to this global norm (0: off)");
  app.add_option("--dropout", dropout, "dropout on attention probabilities and residual projections");
  app.add_option("--seed", seed, "the run seed (initialization, data order, dropout)");
  app.add_option("--val-every", val_every, "validation loss every N steps (default: steps / 5)");
  app.add_option("--val-batches", val_batches, "validation batches per evaluation");
  app.add_option("--save", save_path, "write a checkpoint here at the end (and every --save-every steps)");
  app.add_option("--save-every", save_every, "checkpoint interval in steps (0: only at the end)");
  app.add_option("--save-init", save_init, "write the initial state here before training (reference.py loads it)");
  app.add_option("--stop-after", stop_after,
                 "end this run after that step (saving as at the end); the schedule still spans --steps");
  app.add_option("--check-replicas", check_replicas,
                 "every N steps, check that the data-parallel replicas' parameters are bitwise identical (0: never)");
  app.add_option("--resume", resume, "continue from this checkpoint (model shape and seed from the file)");
  app.add_option("--sample-tokens", sample_tokens, "bytes to sample at the end (0: none)");
  app.add_option("--prompt", prompt, "the sample's prompt");
  app.add_option("--temperature", temperature, "the sample's softmax temperature");
  app.add_option("--peak-tflops", peak_tflops, "the GPU's peak for MFU (default: 989 on H100/H200, else no MFU)");
  app.add_option("--losses-json", losses_json, "write per-step losses and times here");
  app.add_flag("--deterministic", deterministic, "bitwise-reproducible attention backward on the GPU");
  app.add_option("--cuda-graph", cuda_graph,
                 "replay each step's forward and backward as one recorded CUDA graph (one GPU, dropout 0; default on)");
  CLI11_PARSE(app, argc, argv);

  try {
    const bool gpu = device_name == "cuda" || (device_name == "auto" && fusekit::cuda_device_count() > 0);
    if (gpu && fusekit::cuda_device_count() == 0) throw std::runtime_error("--device cuda: no CUDA device found");
    TrainerOptions o;
    o.backend = gpu ? Backend::cuda(0) : Backend::cpu();
    if (!resume.empty()) {
      const TrainingState state = read_checkpoint_state(resume);
      o.model = state.config;
      seed = state.seed;
    } else {
      o.model = preset_config(preset.empty() ? (gpu ? "gpt2-124m" : "tiny") : preset);
      if (layers) o.model.n_layer = layers;
      if (heads) o.model.n_head = heads;
      if (embd) o.model.n_embd = embd;
      if (seq) o.model.seq_len = seq;
      validate(o.model);
    }
    const bool tiny = o.model.n_embd <= 256;
    o.batch = batch ? batch : 16;
    o.replicas = gpus;
    micro_batch(o.batch, gpus);  // refuses a batch that does not split evenly before anything is loaded
    o.dropout = dropout;
    o.seed = seed;
    o.deterministic = deterministic;
    o.step_graph = cuda_graph;
    o.resume = resume;
    OptimizerConfig& oc = o.optimizer;
    oc.total_steps = steps ? steps : (tiny ? 100 : 50);
    oc.lr = lr > 0.0f ? lr : (tiny ? 1e-3f : 6e-4f);
    oc.min_lr_ratio = min_lr_ratio;
    oc.warmup_steps = warmup >= 0 ? warmup : oc.total_steps / 10;
    oc.weight_decay = weight_decay;
    oc.beta2 = beta2;
    oc.max_grad_norm = grad_clip;
    if (!val_every) val_every = std::max<std::int64_t>(1, oc.total_steps / 5);

    const std::string text = read_text_file(data_path);
    const TokenSplit tokens = split_tokens(encode_bytes(text), 0.1);
    fmt::print("train_gpt: fusekit {}, {}\n", fusekit::version(),
               gpu ? "cuda: " + fusekit::describe_cuda_device(0) : std::string("cpu backend (float32)"));
    fmt::print("data: {} ({} bytes; byte-level tokens: {} train, {} val)\n", data_path, text.size(), tokens.train.size(),
               tokens.val.size());
    Trainer trainer(o, tokens);
    const double peak = peak_tflops >= 0.0 ? peak_tflops : (gpu ? detected_peak_tflops(fusekit::describe_cuda_device(0)) : 0.0);
    fmt::print("model: {}; {:.2f}M parameters; batch {} x {} tokens; {} steps, lr {:.2e} (warm-up {}, cosine to {:.2e}), "
               "weight decay {}, clip {}, dropout {}, seed {}\n",
               describe(o.model), static_cast<double>(trainer.params().layout().count()) / 1e6, o.batch, o.model.seq_len,
               oc.total_steps, oc.lr, oc.warmup_steps, oc.lr * oc.min_lr_ratio, oc.weight_decay, oc.max_grad_norm,
               o.dropout, o.seed);
    if (trainer.replicas() > 1)
      fmt::print("data parallel: {} {}, {} sequences each; {}{}\n", trainer.replicas(),
                 gpu ? fmt::format("GPUs (devices 0..{})", trainer.replicas() - 1) : std::string("replicas on host threads"),
                 trainer.micro_batch(), trainer.describe_parallelism(),
                 o.dropout > 0.0f ? "; dropout masks differ from a run on another number of GPUs" : "");
    if (gpu)
      fmt::print("step: {}\n", trainer.model().step_graph_taken(DropoutConfig{o.dropout, 0, 0})
                                   ? "forward and backward replayed as one CUDA graph (recorded at the second step)"
                                   : !o.step_graph   ? "ops launched one by one (--cuda-graph off)"
                                   : o.replicas > 1  ? "ops launched one by one (data-parallel replicas)"
                                                     : "ops launched one by one (dropout's masks change every step)");
    fmt::print("memory: {} in {} arena{}\n", mib(trainer.arena_bytes()),
               trainer.replicas() > 1 ? "each replica's" : "the trainer's",
               gpu ? fmt::format(", {} in use on GPU 0", mib(device_bytes_in_use(o.backend.device))) : "");
    if (!save_init.empty()) {
      trainer.save(save_init);
      fmt::print("saved the initial state to {}\n", save_init);
    }
    if (!resume.empty()) fmt::print("resumed from {} at step {}\n", resume, trainer.step());

    std::vector<LossRecord> losses;
    std::vector<std::pair<std::int64_t, float>> val_losses;
    auto validate_now = [&] {
      const float v = trainer.validation_loss(val_batches);
      val_losses.emplace_back(trainer.step(), v);
      fmt::print("step {:5d} | val loss {:.4f}\n", trainer.step(), v);
      std::fflush(stdout);
    };
    if (trainer.step() == 0) validate_now();
    const double tokens_per_step = static_cast<double>(o.batch * o.model.seq_len);
    const int n_gpus = trainer.replicas();
    const std::int64_t last_step = stop_after > 0 ? std::min(stop_after, oc.total_steps) : oc.total_steps;
    while (trainer.step() < last_step) {
      const StepStats s = trainer.train_step();
      const double tok_s = tokens_per_step / s.seconds;
      std::string line = fmt::format("step {:5d}/{} | loss {:.4f} | lr {:.2e} | norm {:.4f} | {:8.1f} ms | {:9.0f} tok/s", s.step,
                                     oc.total_steps, s.loss, s.lr, s.grad_norm, s.seconds * 1e3, tok_s);
      if (n_gpus > 1) line += fmt::format(" ({:.0f} per {})", tok_s / n_gpus, gpu ? "GPU" : "replica");
      // MFU per GPU: each does 1 / n_gpus of the step's work.
      if (peak > 0.0)
        line += fmt::format(" | MFU {:5.1f}%", 100.0 * trainer.flops_per_token() * tok_s / n_gpus / (peak * 1e12));
      line += " | mem " + mib(gpu ? device_bytes_in_use(o.backend.device) : trainer.arena_bytes());
      fmt::print("{}\n", line);
      std::fflush(stdout);
      losses.push_back({s.step, s.loss, s.seconds * 1e3, s.enqueue_seconds * 1e3});
      if (check_replicas > 0 && n_gpus > 1 && (s.step % check_replicas == 0 || s.step == last_step)) {
        trainer.check_replicas();
        fmt::print("step {:5d} | the {} replicas' parameters are bitwise identical\n", s.step, n_gpus);
      }
      if (s.step % val_every == 0 || s.step == oc.total_steps) validate_now();
      if (!save_path.empty() && save_every > 0 && s.step % save_every == 0 && s.step != last_step) {
        trainer.save(save_path);
        fmt::print("saved checkpoint {} (step {})\n", save_path, s.step);
      }
    }
    if (losses.size() > 1) {
      // The median step after the first few (autotuning, allocator warm-up).
      std::vector<double> ms, enqueue_ms;
      for (std::size_t i = std::min<std::size_t>(5, losses.size() - 1); i < losses.size(); ++i) {
        ms.push_back(losses[i].ms);
        enqueue_ms.push_back(losses[i].enqueue_ms);
      }
      auto median = [](std::vector<double>& v) {
        std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
        return v[v.size() / 2];
      };
      const double step_ms = median(ms);
      const double tok_s = tokens_per_step / (step_ms * 1e-3);
      // When the host's enqueueing takes most of the step, the GPU waits for launches.
      fmt::print("throughput: {:.0f} tok/s{} (median step {:.1f} ms over the last {} steps; the host enqueued a step "
                 "in {:.1f} ms)\n",
                 tok_s, n_gpus > 1 ? fmt::format(", {:.0f} per {}", tok_s / n_gpus, gpu ? "GPU" : "replica") : std::string(),
                 step_ms, ms.size(), median(enqueue_ms));
    }
    if (!save_path.empty()) {
      trainer.save(save_path);
      fmt::print("saved checkpoint {} (step {})\n", save_path, trainer.step());
    }
    if (!losses_json.empty()) write_losses_json(losses_json, losses, val_losses, o);
    if (sample_tokens > 0) {
      const std::string text_out = trainer.sample(prompt, sample_tokens, temperature, seed);
      fmt::print("---- sample ({} bytes, temperature {}) ----\n{}{}\n----\n", sample_tokens, temperature, prompt, text_out);
    }
  } catch (const fusekit::Error& e) {
    fmt::print(stderr, "train_gpt: {}\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "train_gpt: {}\n", e.what());
    return 1;
  }
  return 0;
}
