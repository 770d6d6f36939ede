#include "tokenizer/internal/normalizer.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>

#include "absl/strings/str_cat.h"

namespace tokenizer::internal {
namespace {

bool IsAscii(std::string_view text) {
  for (unsigned char c : text) {
    if (c >= 0x80) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<Normalizer> Normalizer::Create(std::vector<NormalizationForm> forms) {
  Normalizer normalizer;
  for (NormalizationForm form : forms) {
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* n = nullptr;
    switch (form) {
      case NormalizationForm::kNfc: n = icu::Normalizer2::getNFCInstance(status); break;
      case NormalizationForm::kNfd: n = icu::Normalizer2::getNFDInstance(status); break;
      case NormalizationForm::kNfkc: n = icu::Normalizer2::getNFKCInstance(status); break;
      case NormalizationForm::kNfkd: n = icu::Normalizer2::getNFKDInstance(status); break;
    }
    if (U_FAILURE(status) || n == nullptr) {
      return absl::InternalError(
          absl::StrCat("ICU has no normalizer for it: ", u_errorName(status)));
    }
    normalizer.steps_.push_back(n);
  }
  return normalizer;
}

absl::Status Normalizer::Normalize(std::string_view text, std::string* out, bool* changed) const {
  *changed = false;
  if (steps_.empty() || IsAscii(text)) return absl::OkStatus();
  std::string buffer;
  for (const void* step : steps_) {
    const auto* n = static_cast<const icu::Normalizer2*>(step);
    const std::string_view input = *changed ? std::string_view(*out) : text;
    UErrorCode status = U_ZERO_ERROR;
    const icu::StringPiece piece(input.data(), static_cast<int32_t>(input.size()));
    if (n->isNormalizedUTF8(piece, status) && U_SUCCESS(status)) continue;
    status = U_ZERO_ERROR;
    buffer.clear();
    icu::StringByteSink<std::string> sink(&buffer, static_cast<int32_t>(input.size()));
    n->normalizeUTF8(0, piece, sink, nullptr, status);
    if (U_FAILURE(status)) {
      return absl::InternalError(absl::StrCat("ICU normalization failed: ", u_errorName(status)));
    }
    out->swap(buffer);
    *changed = true;
  }
  return absl::OkStatus();
}

}  // namespace tokenizer::internal
