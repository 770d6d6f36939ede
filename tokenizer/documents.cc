#include "tokenizer/documents.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tokenizer {

absl::StatusOr<EosToken> FindEosToken(const Tokenizer& tokenizer, std::string_view name,
                                      std::string_view origin) {
  if (!name.empty()) {
    const std::optional<TokenId> id = tokenizer.TokenToId(name);
    if (!id) {
      return absl::NotFoundError(absl::StrCat("end-of-text token '", std::string(name),
                                              "': not in the vocabulary or the added tokens of ",
                                              std::string(origin)));
    }
    return EosToken{*id, std::string(name)};
  }
  // A tokenizer.model names its own.
  if (const std::optional<TokenId> id = tokenizer.eos_id()) {
    return EosToken{*id, std::string(tokenizer.IdToToken(*id).value_or(""))};
  }
  for (std::string_view usual : kEosTokenNames) {
    if (const std::optional<TokenId> id = tokenizer.TokenToId(usual)) {
      return EosToken{*id, std::string(usual)};
    }
  }
  // (This Abseil's StrCat and StrJoin take absl::string_view, not std's.)
  std::string names;
  for (std::string_view usual : kEosTokenNames) {
    names += (names.empty() ? "" : ", ") + std::string(usual);
  }
  return absl::NotFoundError(absl::StrCat(std::string(origin), " has none of ", names,
                                          ": expected one of them as the end-of-text token "
                                          "between documents, or a name for it"));
}

absl::StatusOr<std::vector<uint32_t>> EncodeDocuments(const Tokenizer& tokenizer,
                                                      absl::Span<const std::string> documents,
                                                      TokenId eos,
                                                      const DocumentsOptions& options) {
  const auto name = [&options](size_t i) {
    return options.document_name ? options.document_name(i) : absl::StrCat("document ", i);
  };
  std::vector<uint32_t> ids;
  // Batches, so that progress shows between them; each batch on every thread.
  constexpr size_t kBatch = 256;
  for (size_t first = 0; first < documents.size(); first += kBatch) {
    const size_t end = std::min(documents.size(), first + kBatch);
    auto encoded = tokenizer.EncodeBatch(documents.subspan(first, end - first), options.encode,
                                         options.num_threads);
    if (!encoded.ok()) {
      // EncodeBatch names the text by its index in the batch: encode the
      // batch's documents one at a time to name the first failing one by
      // the caller's name (this costs time only on the way to an error).
      for (size_t i = first; i < end; ++i) {
        auto one = tokenizer.Encode(documents[i], options.encode);
        if (!one.ok()) {
          return absl::Status(one.status().code(),
                              absl::StrCat(name(i), ": ", one.status().message()));
        }
      }
      // Not reproduced alone (a thread's regex stack ran out): the batch.
      return absl::Status(encoded.status().code(), absl::StrCat(name(first), " to ", name(end - 1),
                                                                ": ", encoded.status().message()));
    }
    for (const std::vector<TokenId>& document : *encoded) {
      ids.insert(ids.end(), document.begin(), document.end());
      ids.push_back(static_cast<uint32_t>(eos));
    }
    if (options.progress) options.progress(end, ids.size());
  }
  return ids;
}

}  // namespace tokenizer
