// The BPE model of a byte-level tokenizer.json, on bytes: a word (one piece
// of the pre-tokenizers' output, as raw bytes) starts as the ids of its
// single-byte tokens and the merges join adjacent pairs, the pair of lowest
// rank first and the leftmost of equal pairs first, until none applies
// (`tokenizers`' Word::merge_all). Byte-level token strings are converted
// to their bytes once, at load, so encoding never spells text in
// byte-level characters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace tokenizer::internal {

using TokenId = int32_t;

// Words already merged, with their ids: `tokenizers`' and tiktoken's cache.
// One per thread (never shared, so never locked). Keys and ids live in
// blocks the cache owns, so an insertion allocates rarely; a full cache
// starts over.
class WordCache {
 public:
  // Words longer than this are merged every time.
  static constexpr size_t kMaxWordBytes = 256;

  WordCache();
  WordCache(const WordCache&) = delete;
  WordCache& operator=(const WordCache&) = delete;

  // The ids of `word`, or false.
  bool Find(std::string_view word, const TokenId** ids, size_t* n) const;
  void Insert(std::string_view word, const TokenId* ids, size_t n);
  void Clear();
  size_t size() const { return map_.size(); }

 private:
  struct Entry {
    uint32_t ids_begin;
    uint32_t ids_size;
  };
  std::string_view StoreKey(std::string_view word);

  absl::flat_hash_map<std::string_view, Entry> map_;
  std::vector<std::unique_ptr<char[]>> key_blocks_;
  size_t key_block_used_ = 0;
  std::vector<TokenId> ids_;
};

// What one thread needs to merge words: the cache and reusable buffers.
struct BpeScratch {
  WordCache cache;
  std::vector<TokenId> symbols;
  std::vector<uint64_t> pair_values;
  struct Symbol {
    TokenId id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  std::vector<Symbol> linked;
  std::vector<uint64_t> heap;
};

class Bpe {
 public:
  struct Merge {
    TokenId left;
    TokenId right;
    TokenId merged;
  };

  // `vocab`: the tokens that are spelled in byte-level characters, as their
  // bytes, with their ids. `merges` in rank order (a pair listed twice keeps
  // its last rank, as `tokenizers`' map does). `unk_id`: the id that stands
  // for a byte without a single-byte token (fused into one for a run of
  // them when `fuse_unk`); without it such bytes are dropped, as
  // `tokenizers` drops them. `ignore_merges`: a word that is a token is that
  // token (Llama 3).
  Bpe(const std::vector<std::pair<std::string, TokenId>>& vocab, const std::vector<Merge>& merges,
      bool ignore_merges, std::optional<TokenId> unk_id, bool fuse_unk);

  // Appends the ids of `word` (bytes) to `out`.
  void EncodeWord(std::string_view word, BpeScratch* scratch, std::vector<TokenId>* out) const;

  // Merges `ids` in place, by the short words' algorithm (a scan for the
  // lowest rank) or the long words' one (a heap); tests check they agree.
  enum class Algorithm { kScan, kHeap };
  void MergeForTest(std::vector<TokenId>* ids, Algorithm algorithm, BpeScratch* scratch) const;

  // Words of up to this many symbols are merged by scanning.
  static constexpr size_t kScanMaxSymbols = 48;

 private:
  static constexpr uint64_t kNoMerge = ~uint64_t{0};
  uint64_t PairValue(TokenId left, TokenId right) const;
  void MergeScan(std::vector<TokenId>* symbols, BpeScratch* scratch) const;
  void MergeHeap(std::vector<TokenId>* symbols, BpeScratch* scratch) const;

  std::vector<TokenId> byte_ids_;  // 256 entries, -1 where there is no single-byte token
  absl::flat_hash_map<std::string_view, TokenId> vocab_;  // keys point into vocab_bytes_
  std::string vocab_bytes_;
  // (left << 32 | right) -> (rank << 32 | merged)
  absl::flat_hash_map<uint64_t, uint64_t> merges_;
  bool ignore_merges_;
  std::optional<TokenId> unk_id_;
  bool fuse_unk_;
};

}  // namespace tokenizer::internal
