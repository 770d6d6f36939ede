#include "models/generation.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <set>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "absl/strings/str_cat.h"
#include "models/kv_cache.h"

namespace models {
namespace {

absl::Status CheckOptions(const LlamaConfig& config,
                          const std::vector<std::vector<int64_t>>& prompts,
                          const GenerationOptions& o) {
  const int64_t vocab = config.vocab_size;
  if (prompts.empty()) return absl::InvalidArgumentError("no prompts: expected at least one");
  if (o.max_new_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens ", o.max_new_tokens, ": expected at least 1"));
  }
  if (!(o.temperature >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature ", o.temperature, ": expected >= 0 (0: greedy)"));
  }
  if (o.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("top_k ", o.top_k, ": expected >= 0 (0: off)"));
  }
  if (!(o.top_p > 0 && o.top_p <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_p ", o.top_p, ": expected in (0, 1] (1: off)"));
  }
  if (o.pad_id < 0 || o.pad_id >= vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("pad id ", o.pad_id, ": outside the model's vocabulary [0, ", vocab, ")"));
  }
  for (int64_t eos : o.eos_ids) {
    if (eos < 0 || eos >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("EOS id ", eos, ": outside the model's vocabulary [0, ", vocab, ")"));
    }
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto& prompt = prompts[i];
    if (prompt.empty()) return absl::InvalidArgumentError(absl::StrCat("prompt ", i, " is empty"));
    for (size_t j = 0; j < prompt.size(); ++j) {
      if (prompt[j] < 0 || prompt[j] >= vocab) {
        return absl::InvalidArgumentError(
            absl::StrCat("prompt ", i, ": id ", prompt[j], " at index ", j,
                         " is outside the model's vocabulary [0, ", vocab, ")"));
      }
    }
    const int64_t total = static_cast<int64_t>(prompt.size()) + o.max_new_tokens;
    if (total > config.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt ", i, ": ", prompt.size(), " tokens + max_new_tokens ", o.max_new_tokens, " = ",
          total, " positions, beyond the model's max_position_embeddings ",
          config.max_position_embeddings));
    }
  }
  return absl::OkStatus();
}

// The next token of each row from its last logits (float32 [B, vocab]), on
// the CPU: int64 [B].
torch::Tensor Choose(torch::Tensor logits, const GenerationOptions& o, at::Generator& generator) {
  if (o.temperature == 0) return logits.argmax(-1).cpu();
  logits = logits / o.temperature;
  const double minus_inf = -std::numeric_limits<double>::infinity();
  if (o.top_k > 0 && o.top_k < logits.size(-1)) {
    const torch::Tensor kth = std::get<0>(logits.topk(o.top_k, -1)).narrow(-1, o.top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, minus_inf);
  }
  if (o.top_p < 1) {
    // transformers' TopPLogitsWarper: ascending order, drop the tokens whose
    // cumulative probability stays within 1 - top_p; the likeliest always
    // stays.
    auto [sorted, order] = logits.sort(/*dim=*/-1, /*descending=*/false);
    torch::Tensor drop = sorted.softmax(-1).cumsum(-1) <= (1 - o.top_p);
    drop.select(-1, drop.size(-1) - 1).fill_(false);
    logits = logits.masked_fill(drop.scatter(-1, order, drop), minus_inf);
  }
  // Drawn on the CPU from the seeded generator: the same tokens from a seed
  // on every device.
  const torch::Tensor probs = logits.softmax(-1).cpu();
  return torch::multinomial(probs, 1, /*replacement=*/false, generator).squeeze(-1);
}

}  // namespace

const char* StopName(Generated::Stop stop) {
  return stop == Generated::Stop::kEos ? "eos" : "length";
}

absl::StatusOr<std::vector<Generated>> Generate(LlamaForCausalLMImpl& model,
                                                const std::vector<std::vector<int64_t>>& prompts,
                                                const GenerationOptions& options,
                                                GenerationTimes* times) {
  using Clock = std::chrono::steady_clock;
  if (absl::Status s = CheckOptions(model.config(), prompts, options); !s.ok()) return s;
  c10::InferenceMode inference;  // no autograd bookkeeping at all (NoGradGuard keeps some)
  const torch::Tensor weight = model.output_weight();
  const c10::Device device = weight.device();
  const int64_t batch = static_cast<int64_t>(prompts.size());
  size_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, p.size());
  const int64_t length = static_cast<int64_t>(longest);

  // Left padding: every row's last prompt token in the same column, so the
  // next tokens of all rows are appended together.
  torch::Tensor ids = torch::full({batch, length}, options.pad_id, torch::kLong);
  torch::Tensor mask = torch::zeros({batch, length}, torch::kBool);
  std::vector<Generated> out(prompts.size());
  for (int64_t b = 0; b < batch; ++b) {
    const auto& p = prompts[b];
    const int64_t start = length - static_cast<int64_t>(p.size());
    ids[b].narrow(0, start, p.size()).copy_(torch::tensor(p, torch::kLong));
    mask[b].narrow(0, start, p.size()).fill_(true);
    out[b].prompt = p;
  }
  ids = ids.to(device);
  mask = mask.to(device);

  std::optional<KvCache> cache;
  if (options.use_cache) {
    cache.emplace(model.config(), batch, length + options.max_new_tokens, device,
                  weight.scalar_type());
  }
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  const std::set<int64_t> eos(options.eos_ids.begin(), options.eos_ids.end());
  std::vector<bool> done(batch, false);
  int64_t remaining = batch;
  torch::Tensor step_ids = ids, step_mask = mask;
  for (int64_t step = 0; step < options.max_new_tokens && remaining > 0; ++step) {
    const auto begin = Clock::now();
    const torch::Tensor logits =
        options.use_cache ? model.ForwardCached(step_ids, step_mask, &*cache, /*last_only=*/true)
                          : model.ForwardCached(ids, mask, nullptr, /*last_only=*/true);
    torch::Tensor next = Choose(logits.select(1, 0).to(torch::kFloat), options, generator);
    auto chosen = next.accessor<int64_t, 1>();
    for (int64_t b = 0; b < batch; ++b) {
      if (done[b]) {
        // A finished row goes on as padding (transformers' pad after EOS);
        // its tokens are no longer recorded.
        chosen[b] = options.pad_id;
        continue;
      }
      out[b].tokens.push_back(chosen[b]);
      if (eos.count(chosen[b])) {
        done[b] = true;
        out[b].stop = Generated::Stop::kEos;
        --remaining;
      }
    }
    step_ids = next.to(device).unsqueeze(1);
    step_mask = torch::ones({batch, 1}, torch::TensorOptions().device(device).dtype(torch::kBool));
    if (!options.use_cache) {
      ids = torch::cat({ids, step_ids}, 1);
      mask = torch::cat({mask, step_mask}, 1);
    }
    if (times != nullptr) {
      // The step's token is on the CPU already (.cpu() above waited for the
      // device), so this is the step's whole time.
      times->step_seconds.push_back(std::chrono::duration<double>(Clock::now() - begin).count());
    }
  }
  return out;
}

}  // namespace models
