// Tokenizer: a Hugging Face tokenizer.json read and run as Python's
// `tokenizers` runs it, for the byte-level BPE tokenizers of GPT-2, Llama 3
// and Qwen2/3: the same ids for the same text, and the same text back.
//
//   absl::StatusOr<tokenizer::Tokenizer> tok =
//       tokenizer::Tokenizer::FromFile("Llama-3.2-1B/tokenizer.json");
//   if (!tok.ok()) return tok.status();
//   absl::StatusOr<std::vector<tokenizer::TokenId>> ids = tok->Encode("Hello world");
//   // {128000, 9906, 1917}: <|begin_of_text|> from the post-processor, then the text.
//   absl::StatusOr<std::string> text = tok->Decode(*ids);  // "Hello world"
//
// What Encode does, in `tokenizers`' order:
//   1. added tokens ("added_tokens": <|endoftext|>, <|im_start|>, ...) are
//      found in the text first and become their ids, never split or merged
//      into (their single_word, lstrip, rstrip and normalized options as
//      `tokenizers` applies them);
//   2. the normalizer ("normalizer": NFC, NFD, NFKC, NFKD or a Sequence of
//      them; computed by ICU) runs on the text between them;
//   3. the pre-tokenizers ("pre_tokenizer": Split with a regular expression,
//      the Isolated behaviour; ByteLevel with add_prefix_space and use_regex,
//      GPT-2's expression; or a Sequence of Splits ending with ByteLevel) cut
//      it into words; the expressions run on PCRE2 with its JIT;
//   4. the BPE model ("model": vocab, merges in either form, "a b" strings or
//      ["a", "b"] pairs, ignore_merges, unk_token and fuse_unk) merges each
//      word by rank; merged words are cached per thread;
//   5. the post-processor ("post_processor": TemplateProcessing's single
//      template, such as Llama 3's "<|begin_of_text|> $A"; ByteLevel; a
//      Sequence of them) adds its tokens when add_special_tokens is true.
// Decode maps ids back to their tokens and bytes (the ByteLevel decoder, or
// none) and replaces what is not UTF-8 as `tokenizers` does.
//
// Not implemented, and refused by FromFile / FromJson with the type or field
// and where it is in the file (kUnimplemented): models other than BPE
// (WordPiece, Unigram, WordLevel); BPE with dropout, byte_fallback, a
// continuing_subword_prefix or end_of_word_suffix, or without a ByteLevel
// pre-tokenizer (a vocabulary not spelled in bytes); other normalizers
// (Lowercase, Replace, Prepend, Strip, BertNormalizer, ...), pre-tokenizers
// (Metaspace, Whitespace, Digits, Punctuation, ...), Split behaviours other
// than Isolated, inverted Splits and string patterns, post-processors
// (BertProcessing, RobertaProcessing) and decoders (Metaspace, WordPiece,
// ...); truncation and padding set in the file.
//
// A SentencePiece tokenizer.model (Llama 2, Mistral before v0.3) is read
// too, by FromFile (which tells the two apart by their content) or
// FromSentencePiece, and run through Debian's libsentencepiece as
// transformers' sentencepiece-backed ("slow") LlamaTokenizer runs it
// (legacy=True): its special pieces (<s>, </s>, <unk>, any control piece)
// written in the text become their ids, the text between them is the
// library's Encode (BPE or unigram, byte fallback to <0x..> pieces); the
// model's BOS comes first when add_special_tokens (add_bos_token True,
// add_eos_token False); decoding drops the dummy prefix's space and replaces
// bytes that are not UTF-8 as the library does
// (internal/sentencepiece_tokenizer.h). Its ids, special pieces and
// bos/eos/unk/pad ids are the model's.
//
// Errors follow the project's rule (who, what, the value, what was
// expected); the codes: kNotFound for a file that cannot be read, kDataLoss
// for malformed JSON, a missing or mistyped field, or a merge naming a token
// that is not in the vocabulary, kUnimplemented as above, kInvalidArgument
// for text that is not UTF-8 and for an id that is in neither the
// vocabulary nor the added tokens.
//
// A Tokenizer is immutable once made: every method is const and may be
// called from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace tokenizer {
namespace internal {
struct TokenizerImpl;  // tokenizer.cc
}  // namespace internal

// A token id, as in the tokenizer.json (`tokenizers`' u32; ids of 2^31 and
// above are refused when the file is read).
using TokenId = int32_t;

struct EncodeOptions {
  // Adds what the post-processor adds (`tokenizers`' add_special_tokens):
  // Llama 3's <|begin_of_text|> before the text; for a tokenizer.model, its
  // BOS (Llama 2's <s>). Added tokens (a tokenizer.model's special pieces)
  // written in the text are found either way.
  bool add_special_tokens = true;

  // What Encode does with bytes that are not UTF-8. `tokenizers` takes
  // Python str and Rust &str only, so it never sees them.
  enum class InvalidUtf8 {
    // kInvalidArgument naming the offset of the first bad byte.
    kError,
    // Each maximal invalid subpart becomes U+FFFD first: the ids are those
    // `tokenizers` gives for Python's bytes.decode("utf-8", "replace").
    kReplace,
  };
  InvalidUtf8 invalid_utf8 = InvalidUtf8::kError;
};

struct DecodeOptions {
  // Leaves out the special added tokens (those with "special": true; a
  // tokenizer.model's control pieces and <unk>), as Python's
  // Tokenizer.decode does by default.
  bool skip_special_tokens = true;
};

class Tokenizer {
 public:
  // Reads a tokenizer.json, or a SentencePiece tokenizer.model: a file
  // whose text starts with '{' or whose name ends in .json is read as JSON,
  // anything else as a SentencePiece model (as is one that starts with '{'
  // but is not JSON, when the library reads it: a model's second byte may be
  // '{'). Errors: kNotFound when it cannot
  // be read; kDataLoss for an empty file, or one that is neither (naming its
  // first byte and libsentencepiece's complaint; for a *.model name, the
  // complaint alone); those of FromJson and FromSentencePiece, naming `path`.
  static absl::StatusOr<Tokenizer> FromFile(const std::string& path);

  // Reads the text of a tokenizer.json; `origin` names it in errors (a path,
  // a URL). About 30 MB of JSON a second (Llama 3's 9 MB file: about 0.3 s).
  static absl::StatusOr<Tokenizer> FromJson(std::string_view json,
                                            std::string_view origin = "tokenizer.json");

  // Reads the bytes of a SentencePiece tokenizer.model (a serialized
  // sentencepiece ModelProto); `origin` names it in errors. Errors:
  // kDataLoss when libsentencepiece refuses the bytes (with its message),
  // kUnimplemented for a model with treat_whitespace_as_suffix or a
  // denormalizer.
  static absl::StatusOr<Tokenizer> FromSentencePiece(std::string_view model,
                                                     std::string_view origin = "tokenizer.model");

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // The ids of `text` (UTF-8), as `tokenizers`' encode(text,
  // add_special_tokens).ids. Errors: kInvalidArgument for bytes that are
  // not UTF-8 (unless options.invalid_utf8 is kReplace), kResourceExhausted
  // when the regular expression needs more than its 8 MB stack.
  absl::StatusOr<std::vector<TokenId>> Encode(std::string_view text,
                                              const EncodeOptions& options = {}) const;

  // Encode of each of `texts`, on `num_threads` threads (0: one per core,
  // std::thread::hardware_concurrency), each text on one thread; result i is
  // Encode(texts[i]), whatever the number of threads. An error is that of
  // the first failing text, naming its index.
  absl::StatusOr<std::vector<std::vector<TokenId>>> EncodeBatch(
      absl::Span<const std::string_view> texts, const EncodeOptions& options = {},
      int num_threads = 0) const;
  absl::StatusOr<std::vector<std::vector<TokenId>>> EncodeBatch(absl::Span<const std::string> texts,
                                                                const EncodeOptions& options = {},
                                                                int num_threads = 0) const;

  // The text of `ids`, as `tokenizers`' decode(ids, skip_special_tokens):
  // with the ByteLevel decoder, each token's bytes (a token that is not
  // spelled in byte-level characters, such as an added token with a space,
  // as its own UTF-8) joined, and every maximal subpart that is not UTF-8,
  // also one cut across tokens, replaced by U+FFFD; without a decoder, the
  // tokens joined with spaces. Unlike `tokenizers`, which skips them
  // silently, an id that is in neither the vocabulary nor the added tokens
  // is an error (kInvalidArgument naming its index). A tokenizer.model's
  // ids: each piece's text ("▁" as a space, a byte piece's byte, special
  // pieces as spelled unless skipped), the space of the dummy prefix dropped
  // at the start as libsentencepiece drops it, and each byte that does not
  // begin a UTF-8 character replaced by U+FFFD, as the library replaces it.
  absl::StatusOr<std::string> Decode(absl::Span<const TokenId> ids,
                                     const DecodeOptions& options = {}) const;

  // Decode without the replacement: the bytes themselves, which need not be
  // UTF-8 (a character may be cut where `ids` end: for streaming, keep the
  // incomplete tail for the next call; a tokenizer.model drops the dummy
  // prefix's space at the start of every call, so decode from the start).
  absl::StatusOr<std::string> DecodeBytes(absl::Span<const TokenId> ids,
                                          const DecodeOptions& options = {}) const;

  // One more than the largest id of the vocabulary and the added tokens
  // (a tokenizer.model's number of pieces): the rows an embedding needs.
  int vocab_size() const;

  // The id of a token, as the file spells it (byte-level characters for the
  // vocabulary: "Ġworld"; an added token's content: "<|eot_id|>"; a
  // tokenizer.model's piece: "▁world", "<0x0A>", "<s>"); added tokens
  // first, as in `tokenizers`' token_to_id.
  std::optional<TokenId> TokenToId(std::string_view token) const;

  // The token of an id, as the file spells it (an added token's content
  // first, as in `tokenizers`' id_to_token, and like it, normalized for an
  // added token with "normalized": true: "ﬁle" under NFKC is "file"). Decode
  // writes these strings.
  std::optional<std::string_view> IdToToken(TokenId id) const;

  // Whether `id` is an added token marked "special", or a tokenizer.model's
  // control or unknown piece (what skip_special_tokens leaves out).
  bool IsSpecial(TokenId id) const;

  // The ids a tokenizer.model reserves (SentencePiece's bos_id, eos_id,
  // unk_id, pad_id; Llama 2: 1, 2, 0 and none); std::nullopt where the
  // model has none, and always for a tokenizer.json, which does not name
  // them (transformers reads them from tokenizer_config.json).
  std::optional<TokenId> bos_id() const;
  std::optional<TokenId> eos_id() const;
  std::optional<TokenId> unk_id() const;
  std::optional<TokenId> pad_id() const;

 private:
  explicit Tokenizer(std::unique_ptr<internal::TokenizerImpl> impl);
  std::unique_ptr<internal::TokenizerImpl> impl_;
};

}  // namespace tokenizer
