// A SentencePiece model (a tokenizer.model: Llama 2's, Mistral's before v0.3)
// run by Debian's libsentencepiece, behind an interface of the standard
// library alone.
//
// Why alone: sentencepiece_processor.h declares
// `namespace absl { using std::string_view; }`, and Debian's Abseil
// defines absl::string_view as a class of its own, so a file that includes
// both does not compile. sentencepiece_model.cc is the one file of the
// project that includes the library's header, and it includes no Abseil; this
// header includes neither, so the rest of tokenizer/ (which reports errors
// as absl::Status) includes it freely.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}  // namespace sentencepiece

namespace tokenizer::internal {

class SentencePieceModel {
 public:
  // A piece's type, as the model records it.
  enum class PieceType : uint8_t {
    kNormal,   // text (user-defined pieces too: the library matches them in text)
    kUnknown,  // the unknown piece, <unk>
    kControl,  // <s>, </s>, <pad>, ...: never made from text, decoded to nothing
    kByte,     // <0x00> ... <0xFF>, byte fallback
    kUnused,
  };

  // The model whose serialized ModelProto is `serialized` (a tokenizer.model's
  // bytes). nullptr with *error set to the library's message when the
  // library refuses it.
  static std::unique_ptr<SentencePieceModel> Load(std::string_view serialized, std::string* error);

  ~SentencePieceModel();
  SentencePieceModel(const SentencePieceModel&) = delete;
  SentencePieceModel& operator=(const SentencePieceModel&) = delete;

  // The number of pieces; ids are 0 to size() - 1.
  int size() const;
  // For ids in [0, size()).
  const std::string& piece(int id) const;
  PieceType type(int id) const;

  // The model's reserved ids, -1 where it has none (Llama 2: pad).
  int unk_id() const;
  int bos_id() const;
  int eos_id() const;
  int pad_id() const;

  // The id of the piece spelled `piece`, or -1 when no piece is.
  int Find(std::string_view piece) const;

  // Appends the ids of `text` as the library encodes it (its normalizer,
  // dummy prefix, model and byte fallback; no BOS or EOS). False with
  // *error set to the library's message when it fails. May be called from
  // several threads at once.
  bool Encode(std::string_view text, std::vector<int32_t>* out, std::string* error) const;

 private:
  explicit SentencePieceModel(std::unique_ptr<sentencepiece::SentencePieceProcessor> processor);
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
};

}  // namespace tokenizer::internal
