// The normalizers of a tokenizer.json that this library implements: the
// Unicode normalization forms (NFC, NFD, NFKC, NFKD) and a Sequence of them,
// computed by ICU.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tokenizer::internal {

enum class NormalizationForm { kNfc, kNfd, kNfkc, kNfkd };

class Normalizer {
 public:
  // Applies `forms` in order. Errors: ICU's, when its data cannot be loaded.
  static absl::StatusOr<Normalizer> Create(std::vector<NormalizationForm> forms);

  // Normalizes `text` (well-formed UTF-8): sets *changed, and when it is
  // true the result is in *out (`text` must not point into *out); ASCII
  // text and text already normalized cost a scan and no copy.
  absl::Status Normalize(std::string_view text, std::string* out, bool* changed) const;

 private:
  std::vector<const void*> steps_;  // icu::Normalizer2 instances, owned by ICU
};

}  // namespace tokenizer::internal
