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

namespace {

constexpr int32_t kLlmcMagic = 20240520;  // llm.c's data files (dev/data/data_common.py)
constexpr int64_t kLlmcHeaderBytes = 256 * 4;

int32_t Int32At(const std::string& bytes, size_t at) {
  uint32_t v = 0;
  for (int k = 3; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(bytes[at + k]);
  return static_cast<int32_t>(v);
}

std::string DataFlag(const std::string& path) { return absl::StrCat("--data='", path, "'"); }

// The uint16 ids of bytes[offset, end), each checked against `vocab`.
absl::StatusOr<std::vector<uint16_t>> DecodeTokens(const std::string& path,
                                                   const std::string& bytes, size_t offset,
                                                   int64_t vocab) {
  std::vector<uint16_t> tokens((bytes.size() - offset) / 2);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const size_t at = offset + 2 * i;
    tokens[i] = static_cast<uint16_t>(static_cast<uint8_t>(bytes[at]) |
                                      (static_cast<uint8_t>(bytes[at + 1]) << 8));
    if (tokens[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          DataFlag(path), ": token ", i, " is id ", tokens[i], ": expected ids < --vocab=", vocab,
          " (pass the tokenizer's vocabulary size, e.g. --vocab 50257 for GPT-2)"));
    }
  }
  return tokens;
}

}  // namespace

absl::StatusOr<TokenData> LoadDataFile(const std::string& path, DataFormat format, int64_t vocab) {
  std::ifstream in(path, std::ios::binary);
  std::error_code ec;
  if (!in || std::filesystem::is_directory(path, ec)) {
    return absl::NotFoundError(
        absl::StrCat(DataFlag(path),
                     ": no such file (or not readable): expected a text file "
                     "or a uint16 token file (.bin)"));
  }
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(DataFlag(path), ": the file is empty: expected text or tokens to train on"));
  }
  const bool llmc =
      bytes.size() >= static_cast<size_t>(kLlmcHeaderBytes) && Int32At(bytes, 0) == kLlmcMagic;
  const bool bin_name = std::filesystem::path(path).extension() == ".bin";
  const bool tokens =
      format == DataFormat::kTokens || (format == DataFormat::kAuto && (llmc || bin_name));
  TokenData data;
  if (!tokens) {
    if (vocab < 256) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--vocab=", vocab, ": expected >= 256 to read ", DataFlag(path), " as bytes"));
    }
    data.tokens.assign(reinterpret_cast<const uint8_t*>(bytes.data()),
                       reinterpret_cast<const uint8_t*>(bytes.data()) + bytes.size());
    data.description = absl::StrCat(bytes.size(), " bytes of ", path);
    return data;
  }
  size_t offset = 0;
  if (llmc) {
    const int32_t version = Int32At(bytes, 4);
    const int64_t count = Int32At(bytes, 8);
    if (version != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          DataFlag(path), ": llm.c header version ", version,
          ": expected 1 (uint16 GPT-2 tokens; version 2 holds uint32 ids, not read here)"));
    }
    const int64_t expected = kLlmcHeaderBytes + 2 * count;
    if (count < 0 || static_cast<int64_t>(bytes.size()) != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat(DataFlag(path), ": llm.c header says ", count, " tokens, so ", expected,
                       " bytes: expected that size, the file has ", bytes.size(), " (truncated?)"));
    }
    offset = static_cast<size_t>(kLlmcHeaderBytes);
  } else if (bytes.size() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        DataFlag(path), ": ", bytes.size(),
        " bytes: expected a whole number of uint16 token ids (an even size), as nanoGPT's "
        ".bin (or --data-format=bytes for text)"));
  }
  auto ids = DecodeTokens(path, bytes, offset, vocab);
  if (!ids.ok()) return ids.status();
  data.tokens = std::move(*ids);
  data.description = absl::StrCat(data.tokens.size(), " uint16 tokens (",
                                  llmc ? "llm.c .bin" : "headerless .bin", ") of ", path);
  return data;
}

absl::StatusOr<TokenSplit> SplitTokens(int64_t size, int64_t row_length, bool hold_out,
                                       const std::string& what) {
  TokenSplit split;
  split.train_end = hold_out ? size - size / 10 : size;
  split.val_begin = split.val_end = split.train_end;
  if (hold_out) split.val_end = size;
  if (split.train_end < row_length) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", split.train_end, " tokens to train on",
                     hold_out ? " (after the held-out tenth)" : "",
                     ": expected at least one sequence of --seq + 1 = ", row_length, " tokens"));
  }
  if (hold_out && split.val_end - split.val_begin < row_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": its held-out last tenth (--eval-every) is ", split.val_end - split.val_begin,
        " tokens: expected at least one sequence of --seq + 1 = ", row_length,
        " tokens (a larger file, or a smaller --seq)"));
  }
  return split;
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

namespace {

// Rows of `spec` from data[begin, end) (SampleTokenBatch's rule).
template <typename T>
absl::StatusOr<at::Tensor> SampleRows(const T* data, int64_t begin, int64_t end,
                                      const BatchSpec& spec) {
  auto rows = RankRows(spec.global_batch, spec.rank, spec.world_size);
  if (!rows.ok()) return rows.status();
  const int64_t size = end - begin;
  if (spec.row_length < 1 || size < spec.row_length) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows of ", spec.row_length, " tokens: expected at most the corpus size ", size));
  }
  const uint64_t starts = static_cast<uint64_t>(size - spec.row_length + 1);
  at::Tensor out = at::empty({rows->count, spec.row_length}, at::kLong);
  int64_t* out_data = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows->count; ++i) {
    const int64_t row = rows->first + i;
    const int64_t start =
        begin + static_cast<int64_t>(Hash(spec.seed, spec.step, row, -1) % starts);
    for (int64_t j = 0; j < spec.row_length; ++j) {
      out_data[i * spec.row_length + j] = static_cast<int64_t>(data[start + j]);
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<at::Tensor> SampleTextBatch(const std::vector<uint8_t>& corpus,
                                           const BatchSpec& spec) {
  return SampleRows(corpus.data(), 0, static_cast<int64_t>(corpus.size()), spec);
}

absl::StatusOr<at::Tensor> SampleTokenBatch(const std::vector<uint16_t>& tokens, int64_t begin,
                                            int64_t end, const BatchSpec& spec) {
  if (begin < 0 || end < begin || end > static_cast<int64_t>(tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat("token range [", begin, ", ", end,
                                                   "): expected a range within the ", tokens.size(),
                                                   " tokens"));
  }
  return SampleRows(tokens.data(), begin, end, spec);
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
