// Training data: a byte-level text corpus every Debian machine has, a
// user's file (--data PATH: text, or uint16 / uint32 token ids), the writer
// of llm.c's token files, and a deterministic sampler that makes each batch
// a function of (seed, step).
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

#include "absl/status/status.h"
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

// What a run samples from: token ids (bytes of a text, or the ids of a
// token file) and a description for the run's first line. uint32: llm.c's
// Llama 3 files hold uint32 ids (vocabularies beyond 65536: Llama 3's
// 128256, Qwen's 151936), and unsigned is what every format on disk holds,
// so one comparison (id < --vocab) checks an id; a bytes corpus takes 4x its
// size in memory.
struct TokenData {
  std::vector<uint32_t> tokens;
  std::string description;  // "237320 bytes of /usr/share/common-licenses"
};

// llm.c's token files (dev/data/data_common.py, write_datafile): a 1024-byte
// header of 256 little-endian int32 (magic, version, token count, zeros),
// then the ids, little-endian. The magic and version name the id width:
inline constexpr int32_t kLlmcGpt2Magic = 20240520;    // "gpt-2":
inline constexpr int32_t kLlmcGpt2Version = 1;         //   uint16 ids
inline constexpr int32_t kLlmcLlama3Magic = 20240801;  // "llama-3":
inline constexpr int32_t kLlmcLlama3Version = 7;       //   uint32 ids
inline constexpr int64_t kLlmcHeaderBytes = 256 * 4;

// --data-format auto's rule: --data PATH is a token file when it starts
// with one of llm.c's magics (above) or is named *.bin; anything else is
// text. NotFound (naming `flag` and the path) when it cannot be read,
// InvalidArgument when it is empty. Reads its first 4 bytes.
absl::StatusOr<bool> IsTokenFile(const std::string& path, const char* flag = "--data");

// How --data PATH is read: --data-format when it is not auto (ValidateOptions
// checked it against --tokenizer); for auto, by IsTokenFile's rule: tokens
// for a token file, text with --tokenizer (not checked here: text_data.h's
// OpenTextData checks the file on rank 0, where it is encoded), bytes
// otherwise. Refused, naming --data and its value: text without --tokenizer
// under --model llama (a Llama's ids are its tokenizer's, not bytes:
// --tokenizer, or --data-format=bytes to mean the bytes). kAuto for
// --data text and synthetic.
absl::StatusOr<DataFormat> ResolveDataFormat(const Options& o);

// --data PATH, read whole (every rank reads it; each id is checked once):
//   bytes   the file's bytes, as the license corpus is (needs vocab >= 256);
//   tokens  little-endian ids: llm.c's file (above) when it starts with
//           either magic: uint16 ids under (20240520, version 1), uint32
//           under (20240801, version 7), the size must be 1024 + count *
//           (2 or 4); else nanoGPT's headerless .bin (np.uint16
//           array.tofile; uint16 only: a headerless uint32 file could not
//           be told from it); every id must be < vocab;
//   auto    tokens for a file starting with an llm.c magic or named *.bin,
//           bytes otherwise;
//   text    refused (InvalidArgument): text is encoded with a tokenizer
//           (text_data.h), not read here.
// The description names the layout read: "N tokens (uint32, llm.c Llama 3
// header) of PATH", "(uint16, llm.c GPT-2 header)", "(uint16, headerless
// nanoGPT .bin)", "N bytes of PATH".
// Errors, one line each naming `flag` (--data for the trainer; another
// tool's flag, e.g. generate's --score), the value and the expectation:
// NotFound (no such file), InvalidArgument (an odd size, a header shorter
// than 1024 bytes, an unknown version, a header whose count disagrees with
// the size, an id >= --vocab, bytes with --vocab < 256, an empty file).
absl::StatusOr<TokenData> LoadDataFile(const std::string& path, DataFormat format, int64_t vocab,
                                       const char* flag = "--data");

// Writes `ids` as an llm.c token file that LoadDataFile (and llm.c) reads:
// the GPT-2 header and uint16 ids when vocab <= 65536, else the Llama 3
// header and uint32 ids; atomically (a temporary file in the same
// directory, fsynced, renamed over `path`, the directory fsynced), so a
// reader sees the old file or the whole new one. InvalidArgument for a
// vocab outside [1, 2^32] or an id >= vocab (naming its position),
// ResourceExhausted for 2^31 ids or more (the header's count is an int32),
// the file system's error otherwise; every message names `path`.
absl::Status WriteTokenFile(const std::string& path, const std::vector<uint32_t>& ids,
                            int64_t vocab);

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
absl::StatusOr<at::Tensor> SampleTokenBatch(const std::vector<uint32_t>& tokens, int64_t begin,
                                            int64_t end, const BatchSpec& spec);

}  // namespace trainer
