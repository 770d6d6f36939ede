#include "trainer/data.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <utility>

#include <ATen/ops/empty.h>

#include "absl/strings/str_cat.h"

namespace trainer {
namespace {

// SplitMix64's finaliser: a fixed bijection with good avalanche, so the
// rows of (seed, step) are spread over the corpus and reproducible anywhere
// (unlike std::uniform_int_distribution, whose algorithm is unspecified).
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t Hash(uint64_t seed, int64_t step, int64_t row, int64_t column) {
  uint64_t h = Mix(seed);
  h = Mix(h ^ static_cast<uint64_t>(step));
  h = Mix(h ^ static_cast<uint64_t>(row));
  return Mix(h ^ static_cast<uint64_t>(column));
}

}  // namespace

absl::StatusOr<std::vector<uint8_t>> LoadTextCorpus(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat(
        "text corpus directory '", dir, "' not found (it comes with Debian's base-files package)"));
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  std::vector<uint8_t> corpus;
  std::set<std::pair<dev_t, ino_t>> seen;  // files already read, by identity
  for (const std::string& name : names) {
    const std::string path = dir + "/" + name;
    struct stat st {};
    // stat follows the symlink: its target's identity is what we dedupe on.
    if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (!seen.insert({st.st_dev, st.st_ino}).second) continue;
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      return absl::NotFoundError(absl::StrCat("cannot read corpus file '", path, "'"));
    }
    corpus.insert(corpus.end(), std::istreambuf_iterator<char>(in),
                  std::istreambuf_iterator<char>());
  }
  if (corpus.empty()) {
    return absl::NotFoundError(
        absl::StrCat("text corpus directory '", dir, "' holds no readable file"));
  }
  return corpus;
}

absl::StatusOr<RowRange> RankRows(int64_t global_batch, int rank, int world_size) {
  if (world_size <= 0 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, ": expected a rank in [0, world size ", world_size, ")"));
  }
  if (global_batch <= 0 || global_batch % world_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("global batch ", global_batch, " is not a multiple of the world size ",
                     world_size, ": every rank must take an equal share"));
  }
  const int64_t per_rank = global_batch / world_size;
  return RowRange{rank * per_rank, per_rank};
}

absl::StatusOr<at::Tensor> SampleTextBatch(const std::vector<uint8_t>& corpus,
                                           const BatchSpec& spec) {
  auto rows = RankRows(spec.global_batch, spec.rank, spec.world_size);
  if (!rows.ok()) return rows.status();
  const int64_t corpus_size = static_cast<int64_t>(corpus.size());
  if (spec.row_length < 1 || corpus_size < spec.row_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows of ", spec.row_length, " tokens: expected at most the corpus size ", corpus_size));
  }
  const uint64_t starts = static_cast<uint64_t>(corpus_size - spec.row_length + 1);
  at::Tensor out = at::empty({rows->count, spec.row_length}, at::kLong);
  int64_t* data = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows->count; ++i) {
    const int64_t row = rows->first + i;
    const int64_t start = static_cast<int64_t>(Hash(spec.seed, spec.step, row, -1) % starts);
    for (int64_t j = 0; j < spec.row_length; ++j) {
      data[i * spec.row_length + j] = corpus[start + j];
    }
  }
  return out;
}

absl::StatusOr<at::Tensor> SampleSyntheticBatch(int64_t vocab, const BatchSpec& spec) {
  auto rows = RankRows(spec.global_batch, spec.rank, spec.world_size);
  if (!rows.ok()) return rows.status();
  if (vocab < 1 || spec.row_length < 1) {
    return absl::InvalidArgumentError(absl::StrCat("synthetic batch: vocab ", vocab,
                                                   " and row length ", spec.row_length,
                                                   ": expected both >= 1"));
  }
  at::Tensor out = at::empty({rows->count, spec.row_length}, at::kLong);
  int64_t* data = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows->count; ++i) {
    for (int64_t j = 0; j < spec.row_length; ++j) {
      data[i * spec.row_length + j] = static_cast<int64_t>(
          Hash(spec.seed, spec.step, rows->first + i, j) % static_cast<uint64_t>(vocab));
    }
  }
  return out;
}

}  // namespace trainer
