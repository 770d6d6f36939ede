// Documents into one stream of token ids to train on: each document's ids,
// then an end-of-text token, so that documents never run into each other
// unseparated. What //tools:tokenize writes into a token file and what the
// trainer's `--data TEXT --tokenizer tokenizer.json` trains on: both call
// EncodeDocuments, so the two give the same ids for the same text.
//
//   auto eos = tokenizer::FindEosToken(*tok);  // <|end_of_text|>, <|endoftext|>, ...
//   if (!eos.ok()) return eos.status();
//   absl::StatusOr<std::vector<uint32_t>> ids =
//       tokenizer::EncodeDocuments(*tok, documents, eos->id);
//   // Encode(documents[0]) (Llama 3: <|begin_of_text|> ...), eos, Encode(documents[1]), eos, ...
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tokenizer/tokenizer.h"

namespace tokenizer {

// The separator's usual names, tried in this order when none is given:
// Llama 3's, GPT-2's and Qwen's base models', SentencePiece-era models',
// Qwen's chat models'.
inline constexpr std::array<std::string_view, 4> kEosTokenNames = {
    "<|end_of_text|>", "<|endoftext|>", "</s>", "<|im_end|>"};

struct EosToken {
  TokenId id = 0;
  std::string name;
};

// `name`'s id when `name` is not empty, else a tokenizer.model's own EOS
// (Tokenizer::eos_id: Llama 2's </s>), else the first of kEosTokenNames the
// vocabulary (or the added tokens) has. kNotFound otherwise, naming
// `origin` (the tokenizer.json's path) and, for an unnamed separator, the
// names tried.
absl::StatusOr<EosToken> FindEosToken(const Tokenizer& tokenizer, std::string_view name = {},
                                      std::string_view origin = "tokenizer.json");

struct DocumentsOptions {
  // Each document's Encode options: add_special_tokens adds the
  // post-processor's tokens (Llama 3's <|begin_of_text|>) to every document.
  EncodeOptions encode;
  // EncodeBatch's threads (0: one per core). A document is encoded on one
  // thread, so one document takes one core whatever this says.
  int num_threads = 0;
  // Called after each batch of documents with the documents encoded and
  // the ids so far (a progress line). Batches are of 256 documents.
  std::function<void(size_t documents_done, size_t ids)> progress;
  // How an error names document i (a path, "path:line"); default
  // "document i".
  std::function<std::string(size_t index)> document_name;
};

// The ids of documents[0], eos, documents[1], eos, ..., in order, each
// document's as Encode(document, options.encode) gives them, whatever the
// number of threads. uint32: what token files hold (a TokenId is never
// negative). Errors: Encode's (kInvalidArgument for text that is not
// UTF-8, with the byte's offset), naming the document.
absl::StatusOr<std::vector<uint32_t>> EncodeDocuments(const Tokenizer& tokenizer,
                                                      absl::Span<const std::string> documents,
                                                      TokenId eos,
                                                      const DocumentsOptions& options = {});

}  // namespace tokenizer
