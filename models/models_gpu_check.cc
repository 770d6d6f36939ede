#include "models/models_gpu_check.h"

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/InferenceMode.h>
#include <torch/cuda.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "models/generation.h"
#include "models/llama.h"
#include "models/llama_config.h"

namespace models {
namespace {

using gpu_check::Fail;
using gpu_check::Pass;
using gpu_check::Problems;
using gpu_check::Result;

LlamaConfig RandomConfig(int64_t vocab, int64_t hidden, int64_t layers, int64_t heads,
                         int64_t kv_heads, int64_t intermediate) {
  LlamaConfig c;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.intermediate_size = intermediate;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = hidden / heads;
  c.max_position_embeddings = 256;
  c.rope.theta = 10000.0;
  return c;
}

std::string Ids(const std::vector<int64_t>& ids) {
  return absl::StrCat("[", absl::StrJoin(ids, ", "), "]");
}

// The CPU model's two best logits after prompt + tokens[0, position) are
// within 1e-4: a tie that another device's rounding may break either way.
bool CpuNearTie(LlamaForCausalLMImpl& cpu, const std::vector<int64_t>& prompt,
                const std::vector<int64_t>& tokens, size_t position) {
  std::vector<int64_t> ids = prompt;
  ids.insert(ids.end(), tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(position));
  c10::InferenceMode inference;
  const torch::Tensor logits =
      cpu.ForwardCached(torch::tensor(ids, torch::kLong).unsqueeze(0), {}, nullptr, true)
          .reshape({-1});
  const torch::Tensor top = std::get<0>(logits.topk(2));
  return (top[0] - top[1]).item<double>() < 1e-4;
}

Result CheckGreedy(c10::Device device) {
  LlamaConfig config = RandomConfig(/*vocab=*/512, /*hidden=*/128, /*layers=*/2, /*heads=*/4,
                                    /*kv_heads=*/2, /*intermediate=*/256);
  // Larger weights than a fresh model's 0.02: peaked logits, so that greedy
  // decisions are not ties of rounding.
  config.initializer_range = 0.15;
  LlamaForCausalLM cpu(config, c10::Device(c10::kCPU), /*init_seed=*/7);
  LlamaForCausalLM on_device(config, c10::Device(c10::kCPU), /*init_seed=*/7);
  on_device->to(device);
  const std::vector<int64_t> a = {5, 17, 300, 2, 91};
  const std::vector<int64_t> b = {44, 8, 250, 501, 3, 3, 120, 77, 64, 9, 410};
  GenerationOptions options;
  options.max_new_tokens = 24;
  options.pad_id = 0;
  Problems problems;
  auto run = [&](LlamaForCausalLMImpl& model, const std::vector<std::vector<int64_t>>& prompts,
                 bool cache) {
    GenerationOptions o = options;
    o.use_cache = cache;
    auto out = Generate(model, prompts, o);
    std::vector<std::vector<int64_t>> tokens;
    if (!out.ok()) {
      problems.Add(absl::StrCat("Generate on ", model.output_weight().device().str(), ": ",
                                out.status().message()));
      return tokens;
    }
    for (const auto& g : *out) tokens.push_back(g.tokens);
    return tokens;
  };
  int ties = 0;
  std::vector<std::vector<int64_t>> alone;
  for (const auto& prompt : {a, b}) {
    const auto expected = run(*cpu, {prompt}, true);
    const auto got = run(*on_device, {prompt}, true);
    if (expected.empty() || got.empty()) continue;
    alone.push_back(got[0]);
    for (size_t i = 0; i < expected[0].size() && i < got[0].size(); ++i) {
      if (expected[0][i] == got[0][i]) continue;
      if (CpuNearTie(*cpu, prompt, expected[0], i)) {
        ++ties;
      } else {
        problems.Add(absl::StrCat("prompt ", Ids(prompt), ": ", device.str(), " gave ", Ids(got[0]),
                                  ", the CPU ", Ids(expected[0]), " (first at new ", "token ", i,
                                  ", not a tie)"));
      }
      break;
    }
  }
  if (alone.size() == 2) {
    const auto batched = run(*on_device, {a, b}, true);
    if (batched != alone) {
      problems.Add(
          absl::StrCat("batched (left-padded) on ", device.str(), ": ",
                       batched.empty() ? "failed" : Ids(batched[0]) + " / " + Ids(batched[1]),
                       ", alone: ", Ids(alone[0]), " / ", Ids(alone[1])));
    }
    const auto uncached = run(*on_device, {a}, false);
    if (uncached.empty() || uncached[0] != alone[0]) {
      problems.Add(absl::StrCat("without the cache on ", device.str(), ": ",
                                uncached.empty() ? "failed" : Ids(uncached[0]), ", with it ",
                                Ids(alone[0])));
    }
  }
  if (!problems.empty()) return Fail(problems.Joined());
  return Pass(absl::StrCat("greedy with the cache on ", device.str(), " = the CPU's tokens on 2 ",
                           "prompts x 24 new tokens",
                           ties > 0 ? absl::StrCat(" (", ties, " near-tie)") : "",
                           "; batched = alone; without the cache = with it"));
}

Result CheckSpeed(c10::Device device) {
  const bool cuda = device.is_cuda();
  const LlamaConfig config =
      cuda ? RandomConfig(32000, 2048, 3, 16, 4, 8192) : RandomConfig(4096, 256, 2, 8, 4, 1024);
  torch::NoGradGuard no_grad;
  LlamaForCausalLM model(config, device, /*init_seed=*/std::nullopt);
  for (auto& p : model->parameters()) p.normal_(0.0, 0.02);
  const auto dtype = cuda ? torch::kBFloat16 : torch::kFloat32;
  model->to(dtype);
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  std::vector<int64_t> prompt;
  for (int64_t i = 0; i < 16; ++i) prompt.push_back((i * 997) % config.vocab_size);
  GenerationOptions options;
  options.max_new_tokens = cuda ? 128 : 32;
  (void)Generate(*model, {prompt}, GenerationOptions{});  // warm-up: kernels, allocator
  GenerationTimes times;
  auto out = Generate(*model, {prompt}, options, &times);
  if (!out.ok()) return Fail(absl::StrCat("Generate: ", out.status().message()));
  double decode = 0;
  for (size_t i = 1; i < times.step_seconds.size(); ++i) decode += times.step_seconds[i];
  const double steps = static_cast<double>(times.step_seconds.size() - 1);
  const double tokens_per_s = steps / decode;
  // Each decode step reads every weight once, except the embedding table
  // (one row) when it is not also the output layer.
  const double bytes = static_cast<double>(parameters - config.vocab_size * config.hidden_size) *
                       c10::elementSize(dtype);
  return Pass(absl::StrCat(c10::toString(dtype), " Llama ", config.num_hidden_layers, " x ",
                           config.hidden_size, " (", parameters / 1000000, " M parameters) on ",
                           device.str(), ": ", static_cast<int64_t>(tokens_per_s),
                           " tokens/s decoding (batch 1, ", options.max_new_tokens,
                           " new tokens after 16), weights read at ",
                           static_cast<int64_t>(bytes * tokens_per_s / 1e9), " GB/s"));
}

}  // namespace

std::vector<gpu_check::Check> ModelsGpuChecks(c10::Device device) {
  return {{"models_generate_greedy", [device] { return CheckGreedy(device); }},
          {"models_generate_speed", [device] { return CheckSpeed(device); }}};
}

}  // namespace models
