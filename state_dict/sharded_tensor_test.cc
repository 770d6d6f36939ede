#include "state_dict/sharded_tensor.h"

#include <cmath>

#include <gtest/gtest.h>
#include <torch/types.h>

namespace state_dict {
namespace {

// The FSDP picture: originals of these shapes concatenated into one flat
// parameter of 3*5 + 7 + 2*2 + 1 = 27 elements (uneven over 2, 3 and 4 ranks).
const std::vector<std::vector<int64_t>> kShapes = {{3, 5}, {7}, {2, 2}, {1}};

std::vector<torch::Tensor> Originals() {
  std::vector<torch::Tensor> out;
  int64_t start = 0;
  for (const auto& shape : kShapes) {
    torch::Tensor t =
        torch::arange(start, start + c10::multiply_integers(shape), torch::kDouble).view(shape);
    start += t.numel();
    out.push_back(t);
  }
  return out;
}

std::vector<int64_t> Numels() {
  std::vector<int64_t> numels;
  for (const auto& t : Originals()) numels.push_back(t.numel());
  return numels;
}

// What rank `rank` of `world` holds of each original under FSDP's even split
// of the flat parameter.
std::vector<ShardedTensor> RankShards(int world, int rank) {
  int64_t total = 0;
  for (int64_t n : Numels()) total += n;
  const std::vector<FlatRange> ranges =
      OriginalRangesInShard(Numels(), EvenShardRange(total, world, rank));
  std::vector<ShardedTensor> out;
  const auto originals = Originals();
  for (size_t i = 0; i < originals.size(); ++i) {
    out.push_back(ShardFullTensor(originals[i], {ranges[i]}));
  }
  return out;
}

TEST(ShardedTensorTest, EvenShardRangeMatchesFsdpChunking) {
  EXPECT_EQ(EvenShardRange(27, 4, 0), (FlatRange{0, 7}));
  EXPECT_EQ(EvenShardRange(27, 4, 3), (FlatRange{21, 6}));
  EXPECT_EQ(EvenShardRange(3, 4, 3), (FlatRange{3, 0}));  // nothing left
}

TEST(ShardedTensorTest, OriginalRangesInShardFindsMiddlePiecesAndNone) {
  // Rank 1 of 4 owns flat [7, 14): the middle of the 3x5 original and none
  // of the others.
  auto ranges = OriginalRangesInShard(Numels(), EvenShardRange(27, 4, 1));
  EXPECT_EQ(ranges[0], (FlatRange{7, 7}));
  EXPECT_EQ(ranges[1].numel, 0);
  // Rank 2 owns [14, 21): the last element of the 3x5 and 6 of the 7.
  ranges = OriginalRangesInShard(Numels(), EvenShardRange(27, 4, 2));
  EXPECT_EQ(ranges[0], (FlatRange{14, 1}));
  EXPECT_EQ(ranges[1], (FlatRange{0, 6}));
  EXPECT_EQ(ranges[2].numel, 0);
}

TEST(ShardedTensorTest, AssemblesFullTensorsFromFourRanks) {
  std::vector<std::vector<ShardedTensor>> by_param(kShapes.size());
  for (int r = 0; r < 4; ++r) {
    auto shards = RankShards(4, r);
    for (size_t i = 0; i < shards.size(); ++i) by_param[i].push_back(shards[i]);
  }
  const auto originals = Originals();
  for (size_t i = 0; i < originals.size(); ++i) {
    auto full = AssembleFullTensor("p" + std::to_string(i), by_param[i]);
    ASSERT_TRUE(full.ok()) << full.status();
    EXPECT_TRUE(torch::equal(*full, originals[i])) << i;
  }
}

TEST(ShardedTensorTest, MissingRankIsAGapNamingTheTensor) {
  std::vector<ShardedTensor> shards;
  for (int r = 0; r < 4; ++r) {
    if (r != 1) shards.push_back(RankShards(4, r)[0]);
  }
  auto full = AssembleFullTensor("layer.weight", shards);
  ASSERT_FALSE(full.ok());
  EXPECT_NE(full.status().message().find("'layer.weight'"), std::string::npos);
  EXPECT_NE(full.status().message().find("from 7"), std::string::npos) << full.status();
}

// Replicated tensors (a LOCAL save) overlap as identical copies: accepted;
// copies that differ are rejected by every reader, naming the element.
TEST(ShardedTensorTest, OverlapsMustBeIdenticalCopies) {
  const torch::Tensor w = Originals()[0];
  ShardedTensor a = ShardFullTensor(w, {{0, 8}});
  ShardedTensor b = ShardFullTensor(w, {{6, 9}});
  ShardedTensor c = ShardFullTensor(w, {{2, 3}});  // inside a, not reaching b
  EXPECT_TRUE(CheckOverlapsAgree("w", {a, b, c}).ok());
  auto full = AssembleFullTensor("w", {c, b, a});
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_TRUE(torch::equal(*full, w));
  auto resharded = Reshard("w", {a, b, c}, {{5, 10}});
  ASSERT_TRUE(resharded.ok()) << resharded.status();
  EXPECT_TRUE(torch::equal(resharded->pieces[0].data, w.view({-1}).narrow(0, 5, 10)));

  // A NaN copied bitwise is an identical copy; -0 against +0 is not.
  ShardedTensor nan_a = a, nan_b = b;
  nan_a.pieces[0].data = a.pieces[0].data.clone();
  nan_b.pieces[0].data = b.pieces[0].data.clone();
  nan_a.pieces[0].data[7] = std::nan("");
  nan_b.pieces[0].data[1] = std::nan("");
  EXPECT_TRUE(CheckOverlapsAgree("w", {nan_a, nan_b}).ok());

  ShardedTensor differs = ShardFullTensor(w, {{6, 9}});
  differs.pieces[0].data[1] = 100.0;  // element 7
  for (const absl::Status& status :
       {CheckOverlapsAgree("w", {a, differs}), AssembleFullTensor("w", {a, differs}).status(),
        Reshard("w", {a, differs}, {{0, 3}}).status()}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_NE(status.message().find("tensor 'w': pieces [0, 8) and [6, 15) overlap but differ "
                                    "at element 7"),
              std::string::npos)
        << status;
  }
  ShardedTensor zero_a = ShardFullTensor(torch::zeros({4}, torch::kDouble), {{0, 4}});
  ShardedTensor zero_b = ShardFullTensor(-torch::zeros({4}, torch::kDouble), {{2, 2}});
  EXPECT_NE(CheckOverlapsAgree("z", {zero_a, zero_b}).message().find("differ at element 2"),
            std::string::npos);
}

TEST(ShardedTensorTest, BadPiecesAreRejected) {
  ShardedTensor a = ShardFullTensor(Originals()[0], {{0, 8}});
  ShardedTensor bad = a;
  bad.pieces[0].data = bad.pieces[0].data.to(torch::kFloat);
  EXPECT_NE(ValidateShardedTensor("w", bad).message().find("Float"), std::string::npos);
  bad = a;
  bad.pieces[0].range.offset = 10;
  EXPECT_NE(ValidateShardedTensor("w", bad).message().find("outside"), std::string::npos);
}

// Saved by 4 ranks, loaded by 2, 1 and 3: each new rank's pieces come from
// whichever old ranks held them.
TEST(ShardedTensorTest, ReshardsFourRanksOntoTwoOneAndThree) {
  std::vector<std::vector<ShardedTensor>> saved(kShapes.size());
  for (int r = 0; r < 4; ++r) {
    auto shards = RankShards(4, r);
    for (size_t i = 0; i < shards.size(); ++i) saved[i].push_back(shards[i]);
  }
  for (int world : {2, 1, 3}) {
    for (int rank = 0; rank < world; ++rank) {
      const auto expected = RankShards(world, rank);
      for (size_t i = 0; i < kShapes.size(); ++i) {
        std::vector<FlatRange> needed;
        for (const ShardPiece& p : expected[i].pieces) needed.push_back(p.range);
        auto got = Reshard("p" + std::to_string(i), saved[i], needed);
        ASSERT_TRUE(got.ok()) << got.status();
        ASSERT_EQ(got->pieces.size(), expected[i].pieces.size());
        for (size_t k = 0; k < needed.size(); ++k) {
          EXPECT_EQ(got->pieces[k].range, expected[i].pieces[k].range);
          EXPECT_TRUE(torch::equal(got->pieces[k].data, expected[i].pieces[k].data))
              << "world " << world << " rank " << rank << " param " << i;
        }
      }
    }
  }
}

TEST(ShardedTensorTest, ReshardReportsUncoveredElement) {
  std::vector<ShardedTensor> saved = {RankShards(4, 0)[0], RankShards(4, 2)[0]};
  auto got = Reshard("w", saved, {{0, 15}});
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("element 7"), std::string::npos) << got.status();
}

}  // namespace
}  // namespace state_dict
