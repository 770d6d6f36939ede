// fully_shard (issue 37) against Python's fully_shard (FSDP2) on Gloo:
// tests/testdata/fully_shard_golden.pt from tools/golden/fully_shard_golden.py
// holds the initial parameters, the batches, and Python's loss, full
// gradients and full parameters after every SGD step for 1-4 ranks with
// reshard_after_forward true, false and 2, and a frozen parameter. The same
// run here must give the same loss and, on each rank, the same rows of every
// gradient and parameter, to 1e-6 relative.
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "comm/collectives.h"
#include "fsdp/fully_shard.h"
#include "module_call/call.h"
#include "testing/multiprocess.h"
#include "tests/fsdp_test_models.h"

namespace fsdp_test {
namespace {

constexpr int kSteps = 3;
constexpr double kLr = 0.1;

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr && workspace != nullptr) {
    return std::string(srcdir) + "/" + workspace + "/" + path;
  }
  return path;
}

class Golden {
 public:
  Golden() {
    const std::string path = Runfile("tests/testdata/fully_shard_golden.pt");
    std::ifstream in(path, std::ios::binary);
    EXPECT_TRUE(in.good()) << "cannot open " << path;
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    dict_ = torch::pickle_load(bytes).toGenericDict();
  }
  bool has(const std::string& key) const { return dict_.contains(key); }
  at::Tensor operator[](const std::string& key) const {
    auto it = dict_.find(key);
    TORCH_CHECK(it != dict_.end(), "golden value '", key, "' missing");
    return it->value().toTensor();
  }

 private:
  c10::impl::GenericDict dict_{c10::StringType::get(), c10::AnyType::get()};
};

void ExpectRel(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(torch::allclose(actual.to(torch::kDouble), expected.to(torch::kDouble), 1e-6, 1e-7))
      << what << ": max abs diff "
      << (actual.to(torch::kDouble) - expected.to(torch::kDouble)).abs().max().item<double>();
}

at::Tensor Rows(const at::Tensor& shard, const at::Tensor& full) {
  std::optional<fsdp::ShardedParamSpec> spec = fsdp::sharded_param_spec(shard);
  TORCH_CHECK(spec.has_value(), "not a sharded parameter");
  return full.narrow(0, spec->dim0_offset, shard.size(0));
}

void RunCase(comm::ProcessGroup& pg, const Golden& golden, const std::string& mode) {
  const std::string name = "w" + std::to_string(pg.size()) + "." +
                           (mode == "frozen" ? std::string("frozen") : "raf_" + mode);
  SCOPED_TRACE(name);
  Net model(3);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters()) p.value().copy_(golden["init." + p.key()]);
  }
  if (mode == "frozen") model->in->weight.set_requires_grad(false);
  fsdp::FullyShardOptions options;
  options.process_group = pg;
  if (mode == "2") {
    options.reshard_after_forward = 2;
  } else {
    options.reshard_after_forward = mode != "false";
  }
  for (const auto& block : *model->blocks) fsdp::fully_shard(block, options);
  fsdp::fully_shard(model, options);
  std::vector<at::Tensor> trainable;
  for (const auto& p : model->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  torch::optim::SGD optim(trainable, torch::optim::SGDOptions(kLr));
  for (int step = 0; step < kSteps; ++step) {
    const std::string s = std::to_string(step);
    const int64_t n = golden["x." + s].size(0) / pg.size();
    at::Tensor x = golden["x." + s].narrow(0, pg.rank() * n, n);
    at::Tensor y = golden["y." + s].narrow(0, pg.rank() * n, n);
    optim.zero_grad();
    at::Tensor loss = Loss(module_call::call(model, x), y);
    loss.backward();
    at::Tensor total = loss.detach().clone().reshape({1});
    comm::all_reduce(pg, total, comm::ReduceOp::kAvg).wait();
    const double want = golden[name + ".loss." + s].item<double>();
    EXPECT_NEAR(total.item<double>(), want, 1e-6 * want) << "loss " << s;
    for (const auto& p : model->named_parameters()) {
      const std::string key = name + ".grad." + s + "." + p.key();
      if (!golden.has(key)) {
        EXPECT_FALSE(p.value().grad().defined()) << key;
        continue;
      }
      ASSERT_TRUE(p.value().grad().defined()) << key;
      ExpectRel(p.value().grad(), Rows(p.value(), golden[key]), key);
    }
    optim.step();
    for (const auto& p : model->named_parameters()) {
      const std::string key = name + ".param." + s + "." + p.key();
      ExpectRel(p.value(), Rows(p.value(), golden[key]), key);
    }
  }
}

void RunWorld(int world, const std::vector<std::string>& modes) {
  const Golden golden;
  comm::testing::RunOnRanks(world, [&](comm::ProcessGroup& pg) {
    for (const auto& mode : modes) RunCase(pg, golden, mode);
  });
}

TEST(FullyShardGolden, MatchesPythonOn1Rank) { RunWorld(1, {"true", "false"}); }
TEST(FullyShardGolden, MatchesPythonOn2Ranks) { RunWorld(2, {"true", "false", "frozen"}); }
TEST(FullyShardGolden, MatchesPythonOn3Ranks) { RunWorld(3, {"true", "false", "frozen"}); }
TEST(FullyShardGolden, MatchesPythonOn4Ranks) { RunWorld(4, {"true", "false", "2"}); }

}  // namespace
}  // namespace fsdp_test
