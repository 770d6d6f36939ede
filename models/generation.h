// Generation: continuing token prompts with a Llama-family model, as
// transformers' generate() does, with a key/value cache (kv_cache.h) so that
// each new token costs one position.
//
//   models::GenerationOptions options;  // greedy, 16 new tokens
//   options.max_new_tokens = 32;
//   options.eos_ids = model->config().eos_token_ids;
//   absl::StatusOr<std::vector<models::Generated>> out =
//       models::Generate(*model, {{1, 2, 3}, {4, 5}}, options);
//
// Prompts of different lengths run as one batch, left-padded with `pad_id`
// and masked (each row gives its unbatched result: padding is neither
// attended to nor counted in the RoPE positions). Sampling is transformers':
// logits / temperature, then top-k, then top-p (the smallest set of most
// likely tokens whose probability reaches top_p), then one draw from a CPU
// generator seeded with `seed`, so a seed gives the same tokens on every
// device. A row stops at its first EOS (kept in its tokens); the batch stops
// when every row has or after max_new_tokens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "models/llama.h"

namespace models {

struct GenerationOptions {
  int64_t max_new_tokens = 16;
  // 0: greedy (argmax), whatever top_k / top_p say.
  double temperature = 0.0;
  int64_t top_k = 0;   // 0: off
  double top_p = 1.0;  // 1: off
  uint64_t seed = 0;
  std::vector<int64_t> eos_ids;  // empty: never stop early
  int64_t pad_id = 0;            // left padding; and after a row's EOS
  // false: the whole sequence recomputed at every step (no cache): for
  // checking the cache and for timing it.
  bool use_cache = true;
};

struct Generated {
  enum class Stop { kEos, kLength };
  std::vector<int64_t> prompt;
  std::vector<int64_t> tokens;  // the new tokens, the EOS included
  Stop stop = Stop::kLength;
};

const char* StopName(Generated::Stop stop);  // "eos", "length"

// Per-step wall times for a benchmark: filled (seconds, step 0 being the
// prompt's) when not null.
struct GenerationTimes {
  std::vector<double> step_seconds;
};

// InvalidArgument naming the prompt (its index) and the value: an empty
// prompt, an id outside [0, vocab_size), prompt length + max_new_tokens
// beyond max_position_embeddings, an option out of range (temperature < 0,
// top_k < 0, top_p outside (0, 1], max_new_tokens < 1, pad_id or an EOS id
// outside the vocabulary).
absl::StatusOr<std::vector<Generated>> Generate(LlamaForCausalLMImpl& model,
                                                const std::vector<std::vector<int64_t>>& prompts,
                                                const GenerationOptions& options,
                                                GenerationTimes* times = nullptr);

}  // namespace models
