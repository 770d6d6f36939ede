// Save on 4 ranks, load on 2, 3 and 1, continue training: the parameters
// equal those of the uninterrupted run.
//
// FSDP is simulated in one process the way it shards: the model's originals
// form one flat parameter, each rank owns an even contiguous shard of it and
// runs Adam on that shard with its slice of the gradient (Adam is elementwise,
// so sharded Adam equals Adam on the whole). The checkpoint holds, per
// original parameter, each rank's pieces of the parameter and of Adam's
// exp_avg / exp_avg_sq, plus the step count.
#include <memory>

#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "formats/testing/python_interop.h"
#include "state_dict/checkpoint.h"
#include "state_dict/optim_state.h"
#include "state_dict/sharded_tensor.h"

namespace state_dict {
namespace {

const FlatParamLayout& Layout() {
  static const FlatParamLayout* layout =
      new FlatParamLayout{{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"},
                          {{5, 7}, {5}, {3, 5}, {3}},  // 58 elements: uneven over 4, 3 and 2 ranks
                          torch::kFloat};
  return *layout;
}

const torch::optim::AdamOptions kAdam = torch::optim::AdamOptions(0.05).betas({0.8, 0.9});

// The gradient of a fixed per-step loss at flat parameters `flat`.
torch::Tensor Gradient(const torch::Tensor& flat, int step) {
  torch::Tensor p = flat.detach().clone().requires_grad_(true);
  std::vector<torch::Tensor> views;
  int64_t start = 0;
  for (size_t i = 0; i < Layout().shapes.size(); ++i) {
    const int64_t n = c10::multiply_integers(Layout().shapes[i]);
    views.push_back(p.narrow(0, start, n).view(Layout().shapes[i]));
    start += n;
  }
  torch::manual_seed(100 + step);
  torch::Tensor x = torch::randn({4, 7});
  torch::Tensor h = torch::tanh(torch::addmm(views[1], x, views[0].t()));
  torch::addmm(views[3], h, views[2].t()).pow(2).sum().backward();
  return p.grad();
}

struct Rank {
  FlatRange range;
  torch::Tensor shard;
  std::unique_ptr<torch::optim::Adam> adam;
};

std::vector<Rank> MakeRanks(const torch::Tensor& flat, int world) {
  std::vector<Rank> ranks(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    Rank& rank = ranks[static_cast<size_t>(r)];
    rank.range = EvenShardRange(flat.numel(), world, r);
    rank.shard = flat.narrow(0, rank.range.offset, rank.range.numel).clone().requires_grad_(true);
    rank.adam = std::make_unique<torch::optim::Adam>(std::vector<torch::Tensor>{rank.shard}, kAdam);
  }
  return ranks;
}

torch::Tensor Gather(const std::vector<Rank>& ranks) {
  std::vector<torch::Tensor> shards;
  for (const Rank& rank : ranks) shards.push_back(rank.shard.detach());
  return torch::cat(shards);
}

void Train(std::vector<Rank>& ranks, int from, int to) {
  for (int step = from; step < to; ++step) {
    torch::Tensor grad = Gradient(Gather(ranks), step);
    for (Rank& rank : ranks) {
      rank.shard.mutable_grad() = grad.narrow(0, rank.range.offset, rank.range.numel).clone();
      rank.adam->step();
    }
  }
}

void Save(const std::string& root, int64_t step, const std::vector<Rank>& ranks) {
  const int world = static_cast<int>(ranks.size());
  for (int r = 0; r < world; ++r) {
    const Rank& rank = ranks[static_cast<size_t>(r)];
    auto optim = ExportOptimizerState(*rank.adam);
    ASSERT_TRUE(optim.ok()) << optim.status();
    ASSERT_EQ(optim->state.size(), 1u);
    const TensorDict& adam = optim->state[0].second;
    ShardedStateDict sd = SplitFlatShard(Layout(), rank.range, rank.shard);
    for (const char* entry : {"exp_avg", "exp_avg_sq"}) {
      for (const auto& item :
           SplitFlatShard(Layout(), rank.range, adam[entry], std::string("/") + entry)) {
        sd.insert(item.key(), item.value());
      }
    }
    // The step count is the same on all ranks; rank 0 stores it.
    ShardedTensor step_count;
    step_count.global_shape = {};
    if (r == 0) step_count.pieces.push_back({{0, 1}, adam["step"].reshape({1})});
    sd.insert("optim.step", step_count);
    ASSERT_TRUE(SaveShard(root, step, r, world, sd).ok());
  }
  ASSERT_TRUE(CommitShardedCheckpoint(root, step, world).ok());
}

std::vector<Rank> Load(const std::string& step_dir, int world) {
  std::vector<Rank> ranks =
      MakeRanks(torch::zeros({Layout().numel()}), world);  // values come from disk
  for (Rank& rank : ranks) {
    std::vector<std::pair<std::string, ShardRequest>> requests =
        FlatShardRequests(Layout(), rank.range);
    for (const char* entry : {"/exp_avg", "/exp_avg_sq"}) {
      for (auto& request : FlatShardRequests(Layout(), rank.range, entry)) {
        requests.push_back(std::move(request));
      }
    }
    requests.push_back({"optim.step", ShardRequest{{}, torch::kFloat, {{0, 1}}}});
    auto loaded = LoadResharded(step_dir, requests);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    if (!loaded.ok()) return {};

    EXPECT_TRUE(FillFlatShard(Layout(), rank.range, *loaded, "", rank.shard).ok());
    TensorDict adam;
    adam.insert("step", (*loaded)["optim.step"].pieces.at(0).data.reshape({}));
    for (const char* entry : {"exp_avg", "exp_avg_sq"}) {
      torch::Tensor t = torch::zeros({rank.range.numel});
      EXPECT_TRUE(FillFlatShard(Layout(), rank.range, *loaded, std::string("/") + entry, t).ok());
      adam.insert(entry, t);
    }
    auto optim = ExportOptimizerState(*rank.adam);  // hyperparameters
    optim->state = {{int64_t{0}, adam}};
    absl::Status status = ImportOptimizerState(*rank.adam, *optim);
    EXPECT_TRUE(status.ok()) << status;
  }
  return ranks;
}

TEST(ReshardTrainingTest, FourRanksResumeOnTwoThreeAndOne) {
  torch::manual_seed(0);
  const torch::Tensor init = torch::randn({Layout().numel()});

  std::vector<Rank> uninterrupted = MakeRanks(init, 1);
  Train(uninterrupted, 0, 6);
  const torch::Tensor expected = Gather(uninterrupted);

  std::vector<Rank> four = MakeRanks(init, 4);
  Train(four, 0, 3);
  const std::string root = formats::testing::TempDir("reshard_training");
  Save(root, 3, four);
  ASSERT_TRUE(VerifyCheckpoint(StepDirectory(root, 3)).ok());

  // The FULL view of the sharded checkpoint is the parameters after 3 steps.
  auto full = LoadFullStateDict(StepDirectory(root, 3));
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_TRUE(torch::equal((*full)["fc1.weight"].view({-1}), Gather(four).narrow(0, 0, 35)));

  for (int world : {2, 3, 1}) {
    std::vector<Rank> resumed = Load(StepDirectory(root, 3), world);
    ASSERT_EQ(resumed.size(), static_cast<size_t>(world));
    Train(resumed, 3, 6);
    EXPECT_TRUE(torch::allclose(Gather(resumed), expected, 1e-6, 1e-7))
        << "world " << world << " max diff "
        << (Gather(resumed) - expected).abs().max().item<float>();
  }
}

}  // namespace
}  // namespace state_dict
