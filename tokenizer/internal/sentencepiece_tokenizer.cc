#include "tokenizer/internal/sentencepiece_tokenizer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "tokenizer/internal/sentencepiece_model.h"
#include "tokenizer/internal/utf8.h"

namespace tokenizer::internal {
namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581 "▁"
constexpr char kReplacement[] = "\xEF\xBF\xBD";            // U+FFFD

// Debian's Abseil has its own string_view, which std::string_view does not
// convert to.
absl::string_view Absl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// The few options of a ModelProto (sentencepiece_model.proto) that the
// library does not expose and decoding needs, read from the protobuf wire
// format of bytes the library has already parsed. Defaults as in the .proto.
struct ModelOptions {
  bool add_dummy_prefix = true;             // normalizer_spec (3).add_dummy_prefix (3)
  bool remove_extra_whitespaces = true;     // normalizer_spec (3).remove_extra_whitespaces (4)
  bool treat_whitespace_as_suffix = false;  // trainer_spec (2).treat_whitespace_as_suffix (24)
  bool denormalizer = false;                // denormalizer_spec (5) with a precompiled_charsmap (2)
};

// One field of a protobuf message: its number, and its value as a varint or
// the bytes of a length-delimited field.
struct WireField {
  uint64_t number = 0;
  int wire_type = 0;
  uint64_t varint = 0;
  std::string_view bytes;
};

bool ReadVarint(std::string_view data, size_t* pos, uint64_t* value) {
  *value = 0;
  for (int shift = 0; shift < 64 && *pos < data.size(); shift += 7) {
    const auto byte = static_cast<unsigned char>(data[(*pos)++]);
    *value |= static_cast<uint64_t>(byte & 0x7F) << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

// The fields of `message` in order, calling on_field(field) for each. False
// when the bytes are not a well-formed message.
template <typename OnField>
bool ForEachField(std::string_view message, OnField&& on_field) {
  size_t pos = 0;
  while (pos < message.size()) {
    uint64_t key;
    if (!ReadVarint(message, &pos, &key)) return false;
    WireField field;
    field.number = key >> 3;
    field.wire_type = static_cast<int>(key & 7);
    switch (field.wire_type) {
      case 0:  // varint
        if (!ReadVarint(message, &pos, &field.varint)) return false;
        break;
      case 1:  // 64-bit
        if (message.size() - pos < 8) return false;
        pos += 8;
        break;
      case 2: {  // length-delimited
        uint64_t length;
        if (!ReadVarint(message, &pos, &length) || length > message.size() - pos) return false;
        field.bytes = message.substr(pos, length);
        pos += length;
        break;
      }
      case 5:  // 32-bit
        if (message.size() - pos < 4) return false;
        pos += 4;
        break;
      default:  // groups (3, 4), which sentencepiece_model.proto has none of
        return false;
    }
    on_field(field);
  }
  return true;
}

bool ReadModelOptions(std::string_view serialized, ModelOptions* options) {
  return ForEachField(serialized, [&](const WireField& field) {
    if (field.wire_type != 2) return;
    if (field.number == 3) {  // normalizer_spec
      ForEachField(field.bytes, [&](const WireField& f) {
        if (f.wire_type != 0) return;
        if (f.number == 3) options->add_dummy_prefix = f.varint != 0;
        if (f.number == 4) options->remove_extra_whitespaces = f.varint != 0;
      });
    } else if (field.number == 2) {  // trainer_spec
      ForEachField(field.bytes, [&](const WireField& f) {
        if (f.wire_type == 0 && f.number == 24) options->treat_whitespace_as_suffix = f.varint != 0;
      });
    } else if (field.number == 5) {  // denormalizer_spec
      ForEachField(field.bytes, [&](const WireField& f) {
        if (f.wire_type == 2 && f.number == 2 && !f.bytes.empty()) options->denormalizer = true;
      });
    }
  });
}

// The byte of a byte piece, spelled "<0x41>".
bool ParseBytePiece(std::string_view piece, char* byte) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return false;
  int value = 0;
  for (char c : piece.substr(3, 2)) {
    value <<= 4;
    if (c >= '0' && c <= '9') {
      value |= c - '0';
    } else if (c >= 'A' && c <= 'F') {
      value |= c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      value |= c - 'a' + 10;
    } else {
      return false;
    }
  }
  *byte = static_cast<char>(value);
  return true;
}

std::string ReplaceSpaceSymbol(std::string_view piece) {
  std::string text;
  text.reserve(piece.size());
  for (size_t i = 0; i < piece.size();) {
    if (piece.substr(i, kSpaceSymbol.size()) == kSpaceSymbol) {
      text += ' ';
      i += kSpaceSymbol.size();
    } else {
      text += piece[i++];
    }
  }
  return text;
}

std::optional<int32_t> Reserved(int id, int size) {
  if (id < 0 || id >= size) return std::nullopt;
  return id;
}

}  // namespace

SentencePieceTokenizer::SentencePieceTokenizer() = default;
SentencePieceTokenizer::~SentencePieceTokenizer() = default;

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::Load(
    std::string_view serialized, std::string_view who, std::string_view origin,
    std::string* library_error) {
  const std::string where = absl::StrCat(Absl(who), ": ", Absl(origin), ": ");
  std::string error;
  std::unique_ptr<SentencePieceModel> model = SentencePieceModel::Load(serialized, &error);
  if (model == nullptr) {
    if (library_error != nullptr) *library_error = error;
    return absl::DataLossError(
        absl::StrCat(where, "not a SentencePiece model (libsentencepiece: ", error,
                     "): expected a tokenizer.model, a serialized sentencepiece ModelProto"));
  }
  ModelOptions options;
  if (!ReadModelOptions(serialized, &options)) {
    return absl::DataLossError(
        absl::StrCat(where,
                     "malformed protobuf: expected a tokenizer.model, a serialized sentencepiece "
                     "ModelProto"));
  }
  if (options.treat_whitespace_as_suffix) {
    return absl::UnimplementedError(absl::StrCat(
        where,
        "trainer_spec.treat_whitespace_as_suffix = true: not supported: expected false "
        "(the \"▁\" of a word's start, as Llama 2's and Mistral's models have it)"));
  }
  if (options.denormalizer) {
    return absl::UnimplementedError(
        absl::StrCat(where,
                     "denormalizer_spec has a precompiled_charsmap: not supported: expected "
                     "none (decoding writes the pieces' text as it is)"));
  }

  auto tok = std::unique_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer());
  const int size = model->size();
  tok->pieces_.reserve(size);
  tok->types_.reserve(size);
  tok->texts_.reserve(size);
  size_t specials = 0;
  for (int id = 0; id < size; ++id) {
    const std::string& piece = model->piece(id);
    const SentencePieceModel::PieceType type = model->type(id);
    tok->pieces_.push_back(piece);
    tok->types_.push_back(static_cast<uint8_t>(type));
    std::string text;
    switch (type) {
      case SentencePieceModel::PieceType::kByte: {
        char byte;
        if (!ParseBytePiece(piece, &byte)) {
          return absl::DataLossError(
              absl::StrCat(where, "piece ", id, " = \"", piece,
                           "\" is a byte piece: expected it spelled <0x00> to <0xFF>"));
        }
        text.assign(1, byte);
        break;
      }
      case SentencePieceModel::PieceType::kControl:
      case SentencePieceModel::PieceType::kUnknown: ++specials; break;
      case SentencePieceModel::PieceType::kNormal:
      case SentencePieceModel::PieceType::kUnused: text = ReplaceSpaceSymbol(piece); break;
    }
    tok->texts_.push_back(std::move(text));
  }
  tok->unk_id_ = Reserved(model->unk_id(), size);
  tok->bos_id_ = Reserved(model->bos_id(), size);
  tok->eos_id_ = Reserved(model->eos_id(), size);
  tok->pad_id_ = Reserved(model->pad_id(), size);
  tok->leading_space_ = options.remove_extra_whitespaces ? LeadingSpace::kDropAll
                        : options.add_dummy_prefix       ? LeadingSpace::kDropOne
                                                         : LeadingSpace::kKeep;

  // The special pieces, found in text as LlamaTokenizer finds its special
  // tokens (<s>, </s>, <unk>): the pointers into specials_ stay valid, it is
  // reserved first.
  tok->specials_.reserve(specials);
  std::vector<std::string> patterns;
  std::vector<const AddedToken*> tokens;
  for (int id = 0; id < size; ++id) {
    if (!tok->IsSpecial(id)) continue;
    AddedToken token;
    token.id = id;
    token.content = tok->pieces_[id];
    token.normalized = false;
    token.special = true;
    tok->specials_.push_back(std::move(token));
    patterns.push_back(tok->specials_.back().content);
    tokens.push_back(&tok->specials_.back());
  }
  tok->special_matcher_ = AddedTokenMatcher(patterns, tokens);
  tok->model_ = std::move(model);
  return tok;
}

absl::Status SentencePieceTokenizer::Encode(std::string_view text, bool add_bos,
                                            std::vector<int32_t>* out) const {
  if (add_bos && bos_id_.has_value()) out->push_back(*bos_id_);
  std::string error;
  const auto encode = [&](std::string_view piece) { return model_->Encode(piece, out, &error); };
  bool ok;
  if (special_matcher_.empty()) {
    ok = text.empty() || encode(text);
  } else {
    ok = special_matcher_.Split(text, encode, [&](int32_t id) {
      out->push_back(id);
      return true;
    });
  }
  if (!ok) return absl::InternalError(absl::StrCat("libsentencepiece failed to encode: ", error));
  return absl::OkStatus();
}

std::string SentencePieceTokenizer::DecodeBytes(absl::Span<const int32_t> ids,
                                                bool skip_special) const {
  std::string out;
  // Whether the library would still drop the dummy prefix's space here: no
  // piece has been written yet (control pieces write nothing), or, for
  // kDropAll, only spaces that were dropped.
  bool at_start = leading_space_ != LeadingSpace::kKeep;
  for (const int32_t id : ids) {
    const auto type = static_cast<SentencePieceModel::PieceType>(types_[id]);
    if (type == SentencePieceModel::PieceType::kControl ||
        type == SentencePieceModel::PieceType::kUnknown) {
      if (skip_special) continue;
      out += pieces_[id];
      at_start = false;
      continue;
    }
    std::string_view text = texts_[id];
    if (at_start && type != SentencePieceModel::PieceType::kByte) {
      if (leading_space_ == LeadingSpace::kDropAll) {
        while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
        at_start = text.empty();
      } else {
        if (!text.empty() && text.front() == ' ') text.remove_prefix(1);
        at_start = false;
      }
    } else {
      at_start = false;
    }
    out.append(text);
  }
  return out;
}

std::string SentencePieceTokenizer::ReplaceInvalidUtf8(std::string_view bytes) {
  std::string text;
  text.reserve(bytes.size() + 8);
  while (!bytes.empty()) {
    const size_t bad = FindInvalidUtf8(bytes);
    if (bad == std::string_view::npos) {
      text.append(bytes);
      break;
    }
    text.append(bytes.substr(0, bad));
    text += kReplacement;
    bytes.remove_prefix(bad + 1);
  }
  return text;
}

std::optional<int32_t> SentencePieceTokenizer::Find(std::string_view piece) const {
  const int id = model_->Find(piece);
  if (id < 0) return std::nullopt;
  return id;
}

bool SentencePieceTokenizer::IsSpecial(int32_t id) const {
  if (id < 0 || id >= size()) return false;
  const auto type = static_cast<SentencePieceModel::PieceType>(types_[id]);
  return type == SentencePieceModel::PieceType::kControl ||
         type == SentencePieceModel::PieceType::kUnknown;
}

}  // namespace tokenizer::internal
