// A SentencePiece tokenizer.model (Llama 2, Mistral before v0.3) run as
// transformers' sentencepiece-backed LlamaTokenizer runs it (the "slow"
// LlamaTokenizer, legacy=True; transformers 5's SentencePieceBackend):
//
//   encode  the model's special pieces (its control pieces, <s> </s> and any
//           <pad>, and the unknown piece <unk>) written in the text are found
//           first (leftmost, longest) and become their ids; the text between
//           them goes through the library's own Encode (its normalizer, the
//           dummy-prefix "▁", BPE or unigram, byte fallback to <0x..>
//           pieces); with add_bos the model's BOS comes first (add_bos_token
//           True, add_eos_token False, as Llama 2's tokenizer_config.json).
//   decode  each piece's text with "▁" as a space, a byte piece's byte, the
//           special pieces left out (skip_special) or written as they are
//           spelled; the leading space that encoding's dummy prefix added is
//           dropped as the library drops it (the first piece's one "▁", every
//           leading "▁" for a model that removes extra whitespace); bytes that
//           are not UTF-8 become U+FFFD one byte at a time, as the library
//           replaces them.
//
// The library itself is behind internal/sentencepiece_model.h.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tokenizer/internal/added_tokens.h"

namespace tokenizer::internal {

class SentencePieceModel;

class SentencePieceTokenizer {
 public:
  // The model in `serialized`, a tokenizer.model's bytes. Errors name `who`
  // and `origin` (the file): kDataLoss when the library refuses the bytes,
  // kUnimplemented for a model whose decoding is not implemented here
  // (treat_whitespace_as_suffix, a denormalizer). When the library refuses
  // the bytes, its own message also goes to *library_error (if not null).
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> Load(
      std::string_view serialized, std::string_view who, std::string_view origin,
      std::string* library_error = nullptr);
  ~SentencePieceTokenizer();

  // Appends the ids of `text` (UTF-8, already checked): the BOS when
  // `add_bos` and the model has one, then the text's. An error (kInternal:
  // the library failed) carries no `who`.
  absl::Status Encode(std::string_view text, bool add_bos, std::vector<int32_t>* out) const;

  // The bytes of `ids` (each in [0, size())), not checked for UTF-8.
  std::string DecodeBytes(absl::Span<const int32_t> ids, bool skip_special) const;

  // `bytes` with each byte that does not begin a well-formed UTF-8 sequence
  // replaced by U+FFFD (the library's replacement: "\xE6\x97" is two
  // U+FFFD, not one as with maximal subparts).
  static std::string ReplaceInvalidUtf8(std::string_view bytes);

  int size() const { return static_cast<int>(pieces_.size()); }
  std::optional<int32_t> Find(std::string_view piece) const;
  // For ids in [0, size()).
  const std::string& piece(int32_t id) const { return pieces_[id]; }
  // The control pieces and the unknown piece.
  bool IsSpecial(int32_t id) const;

  std::optional<int32_t> unk_id() const { return unk_id_; }
  std::optional<int32_t> bos_id() const { return bos_id_; }
  std::optional<int32_t> eos_id() const { return eos_id_; }
  std::optional<int32_t> pad_id() const { return pad_id_; }

 private:
  SentencePieceTokenizer();

  // How decoding drops the space of encoding's dummy prefix.
  enum class LeadingSpace { kKeep, kDropOne, kDropAll };

  std::unique_ptr<SentencePieceModel> model_;
  std::vector<std::string> pieces_;
  std::vector<uint8_t> types_;      // SentencePieceModel::PieceType, by id
  std::vector<std::string> texts_;  // by id: what decoding writes ("▁" as a space; a byte)
  LeadingSpace leading_space_ = LeadingSpace::kDropOne;
  std::optional<int32_t> unk_id_, bos_id_, eos_id_, pad_id_;
  std::vector<AddedToken> specials_;  // found in text before the library encodes it
  AddedTokenMatcher special_matcher_;
};

}  // namespace tokenizer::internal
