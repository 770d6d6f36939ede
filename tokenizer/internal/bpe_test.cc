// The BPE merge loop: the scan (short words) and the heap (long words) give
// the same merges, both the lowest rank first and the leftmost of equal
// pairs first; unk_token and fuse_unk; ignore_merges; the word cache.
#include "tokenizer/internal/bpe.h"

#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tokenizer::internal {
namespace {

// Tokens: the bytes 'a'..'d' (ids 0-3), then merged tokens.
struct Toy {
  std::vector<std::pair<std::string, TokenId>> vocab;
  std::vector<Bpe::Merge> merges;
  TokenId Add(const std::string& bytes) {
    for (const auto& [b, id] : vocab) {
      if (b == bytes) return id;
    }
    vocab.emplace_back(bytes, static_cast<TokenId>(vocab.size()));
    return vocab.back().second;
  }
  void Merge(const std::string& left, const std::string& right) {
    merges.push_back({Add(left), Add(right), Add(left + right)});
  }
  std::vector<TokenId> Ids(const std::vector<std::string>& tokens) {
    std::vector<TokenId> ids;
    for (const std::string& t : tokens) ids.push_back(Add(t));
    return ids;
  }
};

Toy MakeToy() {
  Toy toy;
  for (const char* b : {"a", "b", "c", "d"}) toy.Add(b);
  toy.Merge("a", "a");
  toy.Merge("aa", "aa");
  toy.Merge("b", "c");
  toy.Merge("a", "b");
  toy.Merge("ab", "c");
  toy.Merge("aaaa", "bc");
  toy.Merge("c", "d");
  toy.Merge("d", "a");
  toy.Merge("aaaa", "aaaa");
  return toy;
}

std::vector<TokenId> Encode(const Bpe& bpe, const std::string& word) {
  BpeScratch scratch;
  std::vector<TokenId> out;
  bpe.EncodeWord(word, &scratch, &out);
  return out;
}

TEST(Bpe, LowestRankFirstLeftmostOfEquals) {
  Toy toy = MakeToy();
  Bpe bpe(toy.vocab, toy.merges, false, std::nullopt, false);
  // "aaa": a+a at 0 first, not at 1.
  EXPECT_EQ(Encode(bpe, "aaa"), toy.Ids({"aa", "a"}));
  // "abc": b+c (rank 2) before a+b (rank 3).
  EXPECT_EQ(Encode(bpe, "abc"), toy.Ids({"a", "bc"}));
  EXPECT_EQ(Encode(bpe, "aaaabc"), toy.Ids({"aaaabc"}));
  // 100 a's: 50 aa, 25 aaaa, then 12 of 8 a's and one aaaa left over.
  std::vector<TokenId> want(12, toy.Add("aaaaaaaa"));
  want.push_back(toy.Add("aaaa"));
  EXPECT_EQ(Encode(bpe, std::string(100, 'a')), want);
}

TEST(Bpe, ScanAndHeapAgree) {
  Toy toy = MakeToy();
  Bpe bpe(toy.vocab, toy.merges, false, std::nullopt, false);
  std::mt19937 rng(7);
  BpeScratch scratch;
  for (int trial = 0; trial < 3000; ++trial) {
    const size_t n = 1 + rng() % 200;
    std::vector<TokenId> ids;
    for (size_t i = 0; i < n; ++i) ids.push_back(static_cast<TokenId>(rng() % 4));
    std::vector<TokenId> scan = ids, heap = ids;
    bpe.MergeForTest(&scan, Bpe::Algorithm::kScan, &scratch);
    bpe.MergeForTest(&heap, Bpe::Algorithm::kHeap, &scratch);
    ASSERT_EQ(scan, heap) << "trial " << trial;
  }
}

TEST(Bpe, UnknownBytesFusedOrNotOrDropped) {
  Toy toy = MakeToy();
  const TokenId unk = toy.Add("<unk>");
  Bpe fused(toy.vocab, toy.merges, false, unk, true);
  Bpe separate(toy.vocab, toy.merges, false, unk, false);
  Bpe dropped(toy.vocab, toy.merges, false, std::nullopt, false);
  EXPECT_EQ(Encode(fused, "axyza"), (std::vector<TokenId>{0, unk, 0}));
  EXPECT_EQ(Encode(separate, "axyza"), (std::vector<TokenId>{0, unk, unk, unk, 0}));
  EXPECT_EQ(Encode(dropped, "axyza"), toy.Ids({"aa"}));  // merged across the dropped bytes
  EXPECT_EQ(Encode(fused, "x"), std::vector<TokenId>{unk});
  EXPECT_EQ(Encode(dropped, "x"), std::vector<TokenId>{});
}

TEST(Bpe, IgnoreMergesTakesAWholeWord) {
  Toy toy = MakeToy();
  // "dab" is a token that the merges never make (d+a, then da+b is no merge).
  const TokenId dab = toy.Add("dab");
  Bpe plain(toy.vocab, toy.merges, false, std::nullopt, false);
  Bpe ignore(toy.vocab, toy.merges, true, std::nullopt, false);
  EXPECT_EQ(Encode(plain, "dab"), toy.Ids({"d", "ab"}));  // a+b before d+a
  EXPECT_EQ(Encode(ignore, "dab"), std::vector<TokenId>{dab});
}

TEST(Bpe, CacheGivesTheSameIds) {
  Toy toy = MakeToy();
  Bpe bpe(toy.vocab, toy.merges, false, std::nullopt, false);
  BpeScratch scratch;
  std::vector<TokenId> first, second;
  bpe.EncodeWord("aaaabcd", &scratch, &first);
  EXPECT_EQ(scratch.cache.size(), 1u);
  bpe.EncodeWord("aaaabcd", &scratch, &second);
  EXPECT_EQ(first, second);
  // Words past the limit are not cached.
  bpe.EncodeWord(std::string(WordCache::kMaxWordBytes + 1, 'a'), &scratch, &second);
  EXPECT_EQ(scratch.cache.size(), 1u);
}

}  // namespace
}  // namespace tokenizer::internal
