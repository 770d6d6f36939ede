#include "trainer/data.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>
#include <utility>

#include <ATen/ops/empty.h>

#include "absl/strings/str_cat.h"
#include "formats/io/file_io.h"

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

int32_t Int32At(const std::string& bytes, size_t at) {
  uint32_t v = 0;
  for (int k = 3; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(bytes[at + k]);
  return static_cast<int32_t>(v);
}

// How errors name the file: "--data='PATH'", or the flag of another tool
// that reads token files (generate's --score).
std::string DataFlag(const std::string& path, const char* flag = "--data") {
  return absl::StrCat(flag, "='", path, "'");
}

// A token file's layout: the width of its ids and where they start.
struct TokenLayout {
  size_t width = 2;   // bytes per id: 2 (uint16) or 4 (uint32)
  size_t offset = 0;  // the ids' first byte
  const char* name = "uint16, headerless nanoGPT .bin";
};

// The layout of `bytes`, read as tokens: llm.c's header when it starts with
// one of llm.c's magics, else nanoGPT's headerless uint16 ids.
absl::StatusOr<TokenLayout> ReadTokenLayout(const std::string& named, const std::string& bytes) {
  const int32_t magic = bytes.size() >= 4 ? Int32At(bytes, 0) : 0;
  if (magic != kLlmcGpt2Magic && magic != kLlmcLlama3Magic) {
    if (bytes.size() % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          named, ": ", bytes.size(),
          " bytes: expected a whole number of uint16 token ids (an even size), as nanoGPT's "
          ".bin (or --data-format=bytes for text)"));
    }
    return TokenLayout{};
  }
  const bool gpt2 = magic == kLlmcGpt2Magic;
  const char* kind = gpt2 ? "GPT-2" : "Llama 3";
  if (bytes.size() < static_cast<size_t>(kLlmcHeaderBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        named, ": starts with llm.c's ", kind, " magic ", magic, " but has ", bytes.size(),
        " bytes: expected at least its ", kLlmcHeaderBytes, "-byte header (truncated?)"));
  }
  const int32_t version = Int32At(bytes, 4);
  const int32_t expected_version = gpt2 ? kLlmcGpt2Version : kLlmcLlama3Version;
  if (version != expected_version) {
    return absl::InvalidArgumentError(absl::StrCat(
        named, ": llm.c header (magic ", magic, ") version ", version, ": expected ",
        expected_version,
        gpt2 ? " (uint16 GPT-2 ids; llm.c writes uint32 ids under magic 20240801, version 7)"
             : " (uint32 Llama 3 ids)"));
  }
  TokenLayout layout;
  layout.width = gpt2 ? 2 : 4;
  layout.offset = static_cast<size_t>(kLlmcHeaderBytes);
  layout.name = gpt2 ? "uint16, llm.c GPT-2 header" : "uint32, llm.c Llama 3 header";
  const int64_t count = Int32At(bytes, 8);
  const int64_t expected = kLlmcHeaderBytes + static_cast<int64_t>(layout.width) * count;
  if (count < 0 || static_cast<int64_t>(bytes.size()) != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(named, ": llm.c ", kind, " header (", gpt2 ? "uint16" : "uint32",
                     " ids) says ", count, " tokens, so ", expected,
                     " bytes: expected that size, the file has ", bytes.size(), " (truncated?)"));
  }
  return layout;
}

// The ids of bytes[layout.offset, end), each checked against `vocab`.
absl::StatusOr<std::vector<uint32_t>> DecodeTokens(const std::string& named,
                                                   const std::string& bytes,
                                                   const TokenLayout& layout, int64_t vocab) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data()) + layout.offset;
  std::vector<uint32_t> tokens((bytes.size() - layout.offset) / layout.width);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint8_t* at = data + i * layout.width;
    uint32_t id = static_cast<uint32_t>(at[0]) | (static_cast<uint32_t>(at[1]) << 8);
    if (layout.width == 4) {
      id |= (static_cast<uint32_t>(at[2]) << 16) | (static_cast<uint32_t>(at[3]) << 24);
    }
    if (static_cast<int64_t>(id) >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat(named, ": token ", i, " is id ", id, ": expected ids < --vocab=", vocab,
                       " (pass the tokenizer's vocabulary size, e.g. --vocab 50257 for GPT-2, "
                       "128256 for Llama 3)"));
    }
    tokens[i] = id;
  }
  return tokens;
}

}  // namespace

namespace {

absl::Status NotReadable(const std::string& named) {
  return absl::NotFoundError(absl::StrCat(named,
                                          ": no such file (or not readable): expected a text file "
                                          "or a token file (.bin)"));
}

absl::Status EmptyFile(const std::string& named) {
  return absl::InvalidArgumentError(
      absl::StrCat(named, ": the file is empty: expected text or tokens"));
}

// IsTokenFile's rule on a file's first bytes (all of them, or at least 4).
bool TokenFileByRule(const std::string& path, const std::string& start) {
  const int32_t magic = start.size() >= 4 ? Int32At(start, 0) : 0;
  return magic == kLlmcGpt2Magic || magic == kLlmcLlama3Magic ||
         std::filesystem::path(path).extension() == ".bin";
}

}  // namespace

absl::StatusOr<bool> IsTokenFile(const std::string& path, const char* flag) {
  const std::string named = DataFlag(path, flag);
  std::ifstream in(path, std::ios::binary);
  std::error_code ec;
  if (!in || std::filesystem::is_directory(path, ec)) return NotReadable(named);
  std::string start(4, '\0');
  in.read(start.data(), static_cast<std::streamsize>(start.size()));
  start.resize(static_cast<size_t>(in.gcount()));
  if (start.empty()) return EmptyFile(named);
  return TokenFileByRule(path, start);
}

absl::StatusOr<DataFormat> ResolveDataFormat(const Options& o) {
  if (o.data != DataKind::kFile || o.data_format != DataFormat::kAuto) return o.data_format;
  if (!o.tokenizer.empty()) return DataFormat::kText;
  auto tokens = IsTokenFile(o.data_path);
  if (!tokens.ok()) return tokens.status();
  if (*tokens) return DataFormat::kTokens;
  if (o.model == ModelKind::kLlama) {
    return absl::InvalidArgumentError(absl::StrCat(
        DataFlag(o.data_path),
        " is text (it does not start with an llm.c token header and is not named *.bin): "
        "expected --tokenizer tokenizer.json to encode it with (--model llama's ids are its "
        "tokenizer's), a token file made by //tools:tokenize, or --data-format=bytes to train "
        "on its bytes as ids"));
  }
  return DataFormat::kBytes;
}

absl::StatusOr<TokenData> LoadDataFile(const std::string& path, DataFormat format, int64_t vocab,
                                       const char* flag) {
  const std::string named = DataFlag(path, flag);
  if (format == DataFormat::kText) {
    return absl::InvalidArgumentError(
        absl::StrCat(named,
                     " with --data-format=text: expected a tokenizer to encode it "
                     "(trainer::OpenTextData), not LoadDataFile"));
  }
  std::ifstream in(path, std::ios::binary);
  std::error_code ec;
  if (!in || std::filesystem::is_directory(path, ec)) return NotReadable(named);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.empty()) return EmptyFile(named);
  const bool tokens = format == DataFormat::kTokens ||
                      (format == DataFormat::kAuto && TokenFileByRule(path, bytes));
  TokenData data;
  if (!tokens) {
    if (vocab < 256) {
      return absl::InvalidArgumentError(
          absl::StrCat("--vocab=", vocab, ": expected >= 256 to read ", named, " as bytes"));
    }
    data.tokens.assign(reinterpret_cast<const uint8_t*>(bytes.data()),
                       reinterpret_cast<const uint8_t*>(bytes.data()) + bytes.size());
    data.description = absl::StrCat(bytes.size(), " bytes of ", path);
    return data;
  }
  auto layout = ReadTokenLayout(named, bytes);
  if (!layout.ok()) return layout.status();
  auto ids = DecodeTokens(named, bytes, *layout, vocab);
  if (!ids.ok()) return ids.status();
  data.tokens = std::move(*ids);
  data.description = absl::StrCat(data.tokens.size(), " tokens (", layout->name, ") of ", path);
  return data;
}

absl::Status WriteTokenFile(const std::string& path, const std::vector<uint32_t>& ids,
                            int64_t vocab) {
  const std::string who = absl::StrCat("trainer::WriteTokenFile('", path, "')");
  constexpr int64_t kMaxVocab = int64_t{1} << 32;  // every uint32 id
  if (vocab < 1 || vocab > kMaxVocab) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": vocab ", vocab,
                                                   ": expected a vocabulary size in [1, ",
                                                   kMaxVocab, "] (uint32 ids)"));
  }
  if (ids.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::ResourceExhaustedError(absl::StrCat(
        who, ": ", ids.size(), " ids: expected at most ", std::numeric_limits<int32_t>::max(),
        " (llm.c's header counts them in an int32); split them into shards"));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (static_cast<int64_t>(ids[i]) >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": id ", ids[i], " at position ", i, ": expected ids < vocab ", vocab));
    }
  }
  const bool gpt2 = vocab <= 65536;
  const size_t width = gpt2 ? 2 : 4;
  std::string chunk(static_cast<size_t>(kLlmcHeaderBytes), '\0');
  auto put32 = [&chunk](size_t at, uint32_t v) {
    for (int k = 0; k < 4; ++k) chunk[at + k] = static_cast<char>((v >> (8 * k)) & 0xFF);
  };
  put32(0, static_cast<uint32_t>(gpt2 ? kLlmcGpt2Magic : kLlmcLlama3Magic));
  put32(4, static_cast<uint32_t>(gpt2 ? kLlmcGpt2Version : kLlmcLlama3Version));
  put32(8, static_cast<uint32_t>(ids.size()));
  // The file system's errors name the temporary file or `path`; `who` says
  // whose they are.
  auto fail = [&who](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(who, ": ", s.message()));
  };
  auto writer = formats::AtomicFileWriter::Open(path);
  if (!writer.ok()) return fail(writer.status());
  if (absl::Status s = (*writer)->Append(chunk.data(), chunk.size()); !s.ok()) return fail(s);
  // The ids, little-endian, in chunks of 1 MiB.
  constexpr size_t kChunkIds = size_t{1} << 18;
  for (size_t first = 0; first < ids.size(); first += kChunkIds) {
    const size_t n = std::min(kChunkIds, ids.size() - first);
    chunk.resize(n * width);
    for (size_t i = 0; i < n; ++i) {
      const uint32_t id = ids[first + i];
      for (size_t k = 0; k < width; ++k) {
        chunk[i * width + k] = static_cast<char>((id >> (8 * k)) & 0xFF);
      }
    }
    if (absl::Status s = (*writer)->Append(chunk.data(), chunk.size()); !s.ok()) return fail(s);
  }
  if (absl::Status s = (*writer)->Commit(); !s.ok()) return fail(s);
  return absl::OkStatus();
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

absl::StatusOr<at::Tensor> SampleTokenBatch(const std::vector<uint32_t>& tokens, int64_t begin,
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
