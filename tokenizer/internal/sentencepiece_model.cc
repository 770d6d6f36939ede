// No Abseil header may be included here: see sentencepiece_model.h.
#include "tokenizer/internal/sentencepiece_model.h"

#include <sentencepiece_processor.h>

#include <exception>
#include <utility>

namespace tokenizer::internal {

SentencePieceModel::SentencePieceModel(
    std::unique_ptr<sentencepiece::SentencePieceProcessor> processor)
    : processor_(std::move(processor)) {}

SentencePieceModel::~SentencePieceModel() = default;

std::unique_ptr<SentencePieceModel> SentencePieceModel::Load(std::string_view serialized,
                                                             std::string* error) {
  auto processor = std::make_unique<sentencepiece::SentencePieceProcessor>();
  sentencepiece::util::Status status;
  try {
    status = processor->LoadFromSerializedProto(serialized);
  } catch (const std::exception& e) {
    *error = e.what();
    return nullptr;
  }
  if (!status.ok()) {
    *error = status.ToString();
    return nullptr;
  }
  if (processor->GetPieceSize() <= 0) {
    *error = "the model has no pieces";
    return nullptr;
  }
  return std::unique_ptr<SentencePieceModel>(new SentencePieceModel(std::move(processor)));
}

int SentencePieceModel::size() const { return processor_->GetPieceSize(); }

const std::string& SentencePieceModel::piece(int id) const { return processor_->IdToPiece(id); }

SentencePieceModel::PieceType SentencePieceModel::type(int id) const {
  if (processor_->IsUnknown(id)) return PieceType::kUnknown;
  if (processor_->IsControl(id)) return PieceType::kControl;
  if (processor_->IsByte(id)) return PieceType::kByte;
  if (processor_->IsUnused(id)) return PieceType::kUnused;
  return PieceType::kNormal;
}

int SentencePieceModel::unk_id() const { return processor_->unk_id(); }
int SentencePieceModel::bos_id() const { return processor_->bos_id(); }
int SentencePieceModel::eos_id() const { return processor_->eos_id(); }
int SentencePieceModel::pad_id() const { return processor_->pad_id(); }

int SentencePieceModel::Find(std::string_view piece) const {
  // PieceToId answers the unknown piece's id for a string that is no piece.
  const int id = processor_->PieceToId(piece);
  if (id < 0 || id >= size() || processor_->IdToPiece(id) != piece) return -1;
  return id;
}

bool SentencePieceModel::Encode(std::string_view text, std::vector<int32_t>* out,
                                std::string* error) const {
  std::vector<int> ids;
  sentencepiece::util::Status status;
  try {
    status = processor_->Encode(text, &ids);
  } catch (const std::exception& e) {
    *error = e.what();
    return false;
  }
  if (!status.ok()) {
    *error = status.ToString();
    return false;
  }
  out->insert(out->end(), ids.begin(), ids.end());
  return true;
}

}  // namespace tokenizer::internal
