#include "tokenizer/internal/bpe.h"

#include <algorithm>
#include <cstring>
#include <functional>

namespace tokenizer::internal {
namespace {

constexpr size_t kKeyBlockBytes = 64 * 1024;
constexpr size_t kMaxEntries = 1 << 16;
constexpr size_t kMaxIds = 1 << 20;

uint64_t PairKey(TokenId left, TokenId right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

WordCache::WordCache() { map_.reserve(1024); }

bool WordCache::Find(std::string_view word, const TokenId** ids, size_t* n) const {
  auto it = map_.find(word);
  if (it == map_.end()) return false;
  *ids = ids_.data() + it->second.ids_begin;
  *n = it->second.ids_size;
  return true;
}

std::string_view WordCache::StoreKey(std::string_view word) {
  if (key_blocks_.empty() || key_block_used_ + word.size() > kKeyBlockBytes) {
    key_blocks_.push_back(std::make_unique<char[]>(kKeyBlockBytes));
    key_block_used_ = 0;
  }
  char* at = key_blocks_.back().get() + key_block_used_;
  std::memcpy(at, word.data(), word.size());
  key_block_used_ += word.size();
  return std::string_view(at, word.size());
}

void WordCache::Insert(std::string_view word, const TokenId* ids, size_t n) {
  if (word.size() > kMaxWordBytes) return;
  if (map_.size() >= kMaxEntries || ids_.size() + n > kMaxIds) Clear();
  const auto begin = static_cast<uint32_t>(ids_.size());
  ids_.insert(ids_.end(), ids, ids + n);
  map_.emplace(StoreKey(word), Entry{begin, static_cast<uint32_t>(n)});
}

void WordCache::Clear() {
  map_.clear();
  ids_.clear();
  // Keep one block for the next keys.
  if (key_blocks_.size() > 1) key_blocks_.resize(1);
  key_block_used_ = 0;
}

Bpe::Bpe(const std::vector<std::pair<std::string, TokenId>>& vocab,
         const std::vector<Merge>& merges, bool ignore_merges, std::optional<TokenId> unk_id,
         bool fuse_unk)
    : byte_ids_(256, -1), ignore_merges_(ignore_merges), unk_id_(unk_id), fuse_unk_(fuse_unk) {
  size_t total = 0;
  for (const auto& [bytes, id] : vocab) total += bytes.size();
  vocab_bytes_.reserve(total);
  for (const auto& [bytes, id] : vocab) vocab_bytes_ += bytes;
  vocab_.reserve(vocab.size());
  size_t at = 0;
  for (const auto& [bytes, id] : vocab) {
    std::string_view key(vocab_bytes_.data() + at, bytes.size());
    at += bytes.size();
    vocab_.emplace(key, id);
    if (bytes.size() == 1) byte_ids_[static_cast<unsigned char>(bytes[0])] = id;
  }
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const Merge& m = merges[rank];
    merges_[PairKey(m.left, m.right)] =
        (static_cast<uint64_t>(rank) << 32) | static_cast<uint32_t>(m.merged);
  }
}

uint64_t Bpe::PairValue(TokenId left, TokenId right) const {
  auto it = merges_.find(PairKey(left, right));
  return it == merges_.end() ? kNoMerge : it->second;
}

void Bpe::EncodeWord(std::string_view word, BpeScratch* scratch, std::vector<TokenId>* out) const {
  if (word.empty()) return;
  if (word.size() == 1) {
    const TokenId id = byte_ids_[static_cast<unsigned char>(word[0])];
    if (id >= 0) {
      out->push_back(id);
    } else if (unk_id_) {
      out->push_back(*unk_id_);
    }
    return;
  }
  if (ignore_merges_) {
    auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  const TokenId* cached;
  size_t n;
  if (scratch->cache.Find(word, &cached, &n)) {
    out->insert(out->end(), cached, cached + n);
    return;
  }
  std::vector<TokenId>& symbols = scratch->symbols;
  symbols.clear();
  bool pending_unk = false;
  for (unsigned char b : word) {
    const TokenId id = byte_ids_[b];
    if (id >= 0) {
      if (pending_unk) symbols.push_back(*unk_id_);
      pending_unk = false;
      symbols.push_back(id);
    } else if (unk_id_) {
      if (pending_unk && !fuse_unk_) symbols.push_back(*unk_id_);
      pending_unk = true;
    }
  }
  if (pending_unk) symbols.push_back(*unk_id_);
  if (symbols.size() <= kScanMaxSymbols) {
    MergeScan(&symbols, scratch);
  } else {
    MergeHeap(&symbols, scratch);
  }
  out->insert(out->end(), symbols.begin(), symbols.end());
  scratch->cache.Insert(word, symbols.data(), symbols.size());
}

void Bpe::MergeForTest(std::vector<TokenId>* ids, Algorithm algorithm, BpeScratch* scratch) const {
  if (algorithm == Algorithm::kScan) {
    MergeScan(ids, scratch);
  } else {
    MergeHeap(ids, scratch);
  }
}

// tiktoken's way: the rank of each adjacent pair in an array; each step finds
// the lowest (the leftmost of equals), merges it and looks up its two new
// neighbours' pairs.
void Bpe::MergeScan(std::vector<TokenId>* symbols_ptr, BpeScratch* scratch) const {
  std::vector<TokenId>& s = *symbols_ptr;
  if (s.size() < 2) return;
  std::vector<uint64_t>& pairs = scratch->pair_values;
  pairs.resize(s.size() - 1);
  for (size_t i = 0; i + 1 < s.size(); ++i) pairs[i] = PairValue(s[i], s[i + 1]);
  while (!pairs.empty()) {
    size_t best = 0;
    for (size_t i = 1; i < pairs.size(); ++i) {
      if (pairs[i] < pairs[best]) best = i;
    }
    if (pairs[best] == kNoMerge) break;
    s[best] = static_cast<TokenId>(static_cast<uint32_t>(pairs[best]));
    s.erase(s.begin() + best + 1);
    pairs.erase(pairs.begin() + best);
    if (best < pairs.size()) pairs[best] = PairValue(s[best], s[best + 1]);
    if (best > 0) pairs[best - 1] = PairValue(s[best - 1], s[best]);
  }
}

// `tokenizers`' way, for long words: a min-heap of (rank, position) over a
// linked list of symbols; an entry whose pair has changed since is skipped.
void Bpe::MergeHeap(std::vector<TokenId>* symbols_ptr, BpeScratch* scratch) const {
  std::vector<TokenId>& s = *symbols_ptr;
  const size_t n = s.size();
  if (n < 2) return;
  auto& linked = scratch->linked;
  linked.resize(n);
  for (size_t i = 0; i < n; ++i) {
    linked[i] = {s[i], static_cast<int32_t>(i) - 1, i + 1 < n ? static_cast<int32_t>(i + 1) : -1,
                 true};
  }
  // An entry: rank (32 bits) | position (32 bits); the merged id is looked up
  // again when the entry is taken (a rank names exactly one pair).
  std::vector<uint64_t>& heap = scratch->heap;
  heap.clear();
  const auto push = [&](size_t pos) {
    const BpeScratch::Symbol& left = linked[pos];
    if (left.next < 0) return;
    const uint64_t value = PairValue(left.id, linked[left.next].id);
    if (value == kNoMerge) return;
    heap.push_back((value & 0xFFFFFFFF00000000ULL) | pos);
    std::push_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
  };
  for (size_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
    const uint64_t top = heap.back();
    heap.pop_back();
    const size_t pos = static_cast<uint32_t>(top);
    BpeScratch::Symbol& left = linked[pos];
    if (!left.alive || left.next < 0) continue;
    const uint64_t value = PairValue(left.id, linked[left.next].id);
    if (value == kNoMerge || (value >> 32) != (top >> 32)) continue;  // stale
    BpeScratch::Symbol& right = linked[left.next];
    left.id = static_cast<TokenId>(static_cast<uint32_t>(value));
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) linked[right.next].prev = static_cast<int32_t>(pos);
    if (left.prev >= 0) push(left.prev);
    push(pos);
  }
  s.clear();
  for (int32_t i = 0; i >= 0; i = linked[i].next) s.push_back(linked[i].id);
}

}  // namespace tokenizer::internal
