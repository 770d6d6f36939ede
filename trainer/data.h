// Training data: a byte-level text corpus every Debian machine has, a
// user's file (--data PATH: text or uint16 tokens), and a deterministic
// sampler that makes each batch a function of (seed, step).
//
// Corpus: the license texts in /usr/share/common-licenses (package
// base-files, Essential: yes, so present without network; ~300 KB). Files
// are read in sorted name order; symlinks are followed, and a file whose
// target was already read (e.g. GPL -> GPL-3) is skipped, so the corpus is
// the same bytes on every machine with the same base-files.
//
// Sampler: the GLOBAL batch of a step is fixed by (seed, step): row i starts
// at an offset hashed from (seed, step, i). Rank r of W ranks takes rows
// [r*B/W, (r+1)*B/W), so the union over ranks — and hence the loss and the
// gradient mean — does not depend on the world size. No generator state is
// kept: resuming at step N needs nothing but N.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "trainer/options.h"

namespace trainer {

inline constexpr char kLicenseDir[] = "/usr/share/common-licenses";

// The concatenated bytes of the regular files under `dir` (see above).
// NotFound when the directory is missing or holds no file.
absl::StatusOr<std::vector<uint8_t>> LoadTextCorpus(const std::string& dir = kLicenseDir);

struct BatchSpec {
  uint64_t seed = 0;
  int64_t step = 0;          // any value; each step gets a different batch
  int64_t global_batch = 1;  // rows in the global batch
  int64_t row_length = 2;    // tokens per row (seq + 1)
  int rank = 0;
  int world_size = 1;
};

// Rows [first, first + count) of the global batch that `rank` takes.
// InvalidArgument when global_batch is not a multiple of world_size (naming
// both) or rank is out of range.
struct RowRange {
  int64_t first = 0;
  int64_t count = 0;
};
absl::StatusOr<RowRange> RankRows(int64_t global_batch, int rank, int world_size);

// This rank's rows of the batch: int64 [count, row_length], each row
// `row_length` consecutive bytes of `corpus`. InvalidArgument when the corpus
// is shorter than one row.
absl::StatusOr<at::Tensor> SampleTextBatch(const std::vector<uint8_t>& corpus,
                                           const BatchSpec& spec);

// The same rows as uniformly random tokens in [0, vocab), hashed from
// (seed, step, row, column): for benchmarks, where the loss does not matter.
absl::StatusOr<at::Tensor> SampleSyntheticBatch(int64_t vocab, const BatchSpec& spec);

// What a run samples from: token ids (bytes of a text, or uint16 ids of a
// token file) and a description for the run's first line.
struct TokenData {
  std::vector<uint16_t> tokens;
  std::string description;  // "237320 bytes of /usr/share/common-licenses"
};

// --data PATH, read whole (every rank reads it; each id is checked once):
//   bytes   the file's bytes, as the license corpus is (needs vocab >= 256);
//   tokens  uint16 ids, little-endian: llm.c's .bin (a 1024-byte header of
//           256 int32: magic 20240520, version 1, token count; then the
//           ids: the size must be 1024 + 2 * count) when the file starts
//           with that magic, else nanoGPT's headerless .bin (np.uint16
//           array.tofile); every id must be < vocab;
//   auto    tokens for a file starting with llm.c's magic or named *.bin,
//           bytes otherwise.
// Errors, one line each naming --data, the value and the expectation:
// NotFound (no such file), InvalidArgument (an odd size, a header whose
// count disagrees with the size, an id >= --vocab, bytes with --vocab <
// 256, an empty file).
absl::StatusOr<TokenData> LoadDataFile(const std::string& path, DataFormat format, int64_t vocab);

// The part of `tokens` a run trains on and the part it holds out.
struct TokenSplit {
  int64_t train_begin = 0, train_end = 0;  // [begin, end)
  int64_t val_begin = 0, val_end = 0;      // empty without hold-out
};

// With `hold_out` (--eval-every): the last tenth (rounded down) held out,
// the rest trained on; without, all of it trained on. InvalidArgument,
// naming `what` (the data's flag and value), when a part is shorter than
// one row of `row_length` tokens (seq + 1).
absl::StatusOr<TokenSplit> SplitTokens(int64_t size, int64_t row_length, bool hold_out,
                                       const std::string& what);

// This rank's rows of the batch as SampleTextBatch samples them, from
// tokens[begin, end): row i starts at begin + (a hash of (seed, step, i)) %
// (end - begin - row_length + 1). SampleTextBatch(corpus, spec) is
// SampleTokenBatch over the same bytes and [0, corpus size).
absl::StatusOr<at::Tensor> SampleTokenBatch(const std::vector<uint16_t>& tokens, int64_t begin,
                                            int64_t end, const BatchSpec& spec);

}  // namespace trainer
