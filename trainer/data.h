// Training data: a byte-level text corpus every Debian machine has, and a
// deterministic sampler that makes each batch a function of (seed, step).
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

}  // namespace trainer
