// KvCache: the keys and values a Llama-family decoder has computed so far,
// so that generating a token costs one position, not the whole sequence.
//
//   models::KvCache cache(model->config(), /*batch=*/2, /*capacity=*/prompt + new_tokens,
//                         device, dtype);
//   logits = model->ForwardCached(prompt_ids, prompt_mask, &cache);  // [B, T, vocab]
//   logits = model->ForwardCached(next_ids, {}, &cache);             // [B, 1, vocab]
//
// Per layer, keys and values [batch, kv_heads, capacity, head_dim] allocated
// once for the whole generation (appending never reallocates, so a step's
// time does not depend on how the cache grew), and per slot whether it holds
// a real token or padding. Rows of a batch share the slot index (left-padded
// prompts end together) but not their positions: a row's RoPE position is
// the number of real tokens before it, as transformers derives position_ids
// from the attention mask.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "models/llama_config.h"

namespace models {

class KvCache {
 public:
  KvCache(const LlamaConfig& config, int64_t batch, int64_t capacity, c10::Device device,
          c10::ScalarType dtype);

  int64_t batch() const { return valid_.size(0); }
  int64_t capacity() const { return valid_.size(1); }
  // Slots filled so far (padding included); the next token goes to slot
  // length().
  int64_t length() const { return length_; }

  // Layer `layer`'s keys / values, [batch, kv_heads, capacity, head_dim]:
  // slots [0, length()) are written.
  const at::Tensor& keys(int64_t layer) const { return keys_[layer]; }
  const at::Tensor& values(int64_t layer) const { return values_[layer]; }
  // bool [batch, capacity]: slot holds a real token (not padding).
  const at::Tensor& valid() const { return valid_; }
  // int64 [batch]: real tokens seen per row (the next real token's position).
  const at::Tensor& seen() const { return seen_; }

  // Writes a step's keys and values ([batch, kv_heads, T, head_dim]) of
  // `layer` at slots [length(), length() + T). Advance() then moves past
  // them, once every layer has written.
  void Write(int64_t layer, const at::Tensor& k, const at::Tensor& v);
  // Records the step's `mask` (bool [batch, T], true for real tokens;
  // `padded`: some slot so far is padding) and moves length() by T.
  void Advance(const at::Tensor& mask, bool padded);
  // Some slot so far holds padding: attention needs a mask and rows have
  // their own positions.
  bool padded() const { return padded_; }

 private:
  std::vector<at::Tensor> keys_, values_;
  at::Tensor valid_, seen_;
  int64_t length_ = 0;
  bool padded_ = false;
};

}  // namespace models
