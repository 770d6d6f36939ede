// text_data.h for a trainer built without the tokenizer: what the CMake GPU
// build (benchmarks/gpu/CMakeLists.txt) links in place of text_data.cc
// where CMake finds no PCRE2, ICU or SentencePiece, the libraries
// tokenizer/ needs (the GPU machine has no Debian packages, and ICU's data
// alone would take half of what can be carried there). Bazel always links
// text_data.cc.
// --tokenizer is refused before anything is written, on every rank alike
// (no collective: each rank refuses by itself); token files still train.
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "trainer/text_data.h"

namespace trainer {

absl::StatusOr<std::unique_ptr<TextData>> OpenTextData(const Options& o,
                                                       const comm::ProcessGroup& group) {
  if (o.tokenizer.empty()) return std::unique_ptr<TextData>();
  return absl::FailedPreconditionError(absl::StrCat(
      "--tokenizer='", o.tokenizer,
      "': this trainer was built without the tokenizer: PCRE2/ICU/SentencePiece not found by "
      "CMake (or TORCHFSDP_TOKENIZER=OFF); make the token file with //tools:tokenize (bazel run "
      "//tools:tokenize -- --tokenizer ",
      o.tokenizer, " --out FILE.bin ", o.data_path, ") and pass it as --data FILE.bin"));
}

}  // namespace trainer
