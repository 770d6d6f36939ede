// fully_shard (issue 37) against Python's fully_shard (FSDP2) on Gloo:
// tests/testdata/fully_shard_golden.pt from tools/golden/fully_shard_golden.py
// holds the initial parameters, the batches, and Python's loss, full
// gradients and full parameters after every SGD step for 1-4 ranks with
// reshard_after_forward true, false and 2, a frozen parameter, HSDP on a
// 2 x 2 mesh, bf16 mixed precision (output_dtype float32 on the root),
// shard_placement_fn putting 2-D weights on Shard(1), and an ignored
// parameter. The same run here must give the same loss and, on each rank,
// the same part of every gradient and parameter, to 1e-6 relative (bf16:
// to bf16 tolerance).
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/collectives.h"
#include "comm/device_mesh.h"
#include "fsdp/fully_shard.h"
#include "module_call/call.h"
#include "testing/golden_fixture.h"
#include "testing/multiprocess.h"
#include "tests/fsdp_test_models.h"

namespace fsdp_test {
namespace {

constexpr int kSteps = 3;
constexpr double kLr = 0.1;

using Golden = test_data::GoldenFixture;

// float32 cases: 1e-6 relative. bf16 compute (reduced in float32): Python
// and C++ run the same CPU kernels of the same wheel, and were measured to
// agree to 1e-4 relative (2026-11-26); the tolerance, 1e-3, is a quarter of
// bfloat16's 2^-8, so the same run computed in float32 (about 4e-3 away)
// fails.
struct Tolerance {
  double rtol = 1e-6, atol = 1e-7;
};
constexpr Tolerance kFloat32;
constexpr Tolerance kBFloat16{1e-3, 1e-5};

void ExpectRel(const at::Tensor& actual, const at::Tensor& expected, const std::string& what,
               const Tolerance& tol) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(
      torch::allclose(actual.to(torch::kDouble), expected.to(torch::kDouble), tol.rtol, tol.atol))
      << what << ": max abs diff "
      << (actual.to(torch::kDouble) - expected.to(torch::kDouble)).abs().max().item<double>();
}

// This rank's part of `full` for the shard `shard` (on its shard dim); all
// of it for a parameter fully_shard left alone (ignored).
at::Tensor Part(const at::Tensor& shard, const at::Tensor& full) {
  std::optional<fsdp::ShardedParamSpec> spec = fsdp::sharded_param_spec(shard);
  if (!spec.has_value()) return full;
  return full.narrow(spec->shard_dim, spec->shard_offset, shard.size(spec->shard_dim));
}

// The cases of tools/golden/fully_shard_golden.py: "true", "false", "2"
// (reshard_after_forward), "frozen", "hsdp", "bf16", "shard1", "ignored".
void RunCase(comm::ProcessGroup& pg, const Golden& golden, const std::string& mode) {
  const bool raf_case = mode == "true" || mode == "false" || mode == "2";
  const std::string name = "w" + std::to_string(pg.size()) + "." + (raf_case ? "raf_" : "") + mode;
  SCOPED_TRACE(name);
  const Tolerance tol = mode == "bf16" ? kBFloat16 : kFloat32;
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
  if (mode == "hsdp") {
    // 2 replicas x (W/2) shards, ranks in order: Python's
    // init_device_mesh("cpu", (2, W/2), mesh_dim_names=("replicate", "shard")).
    absl::StatusOr<comm::DeviceMesh> mesh = comm::init_hybrid_shard_mesh(pg, 2, pg.size() / 2);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    options.mesh = *mesh;
  }
  if (mode == "bf16") {
    options.mp_policy.param_dtype = torch::kBFloat16;
    options.mp_policy.reduce_dtype = torch::kFloat;
  }
  const int world = pg.size();
  if (mode == "shard1") {
    options.shard_placement_fn = [world](const at::Tensor& p) -> std::optional<int64_t> {
      if (p.dim() == 2 && p.size(1) % world == 0) return 1;
      return std::nullopt;
    };
  }
  for (const auto& block : *model->blocks) fsdp::fully_shard(block, options);
  if (mode == "ignored") options.ignored_params = {model->out->weight};
  if (mode == "bf16") options.mp_policy.output_dtype = torch::kFloat;
  fsdp::fully_shard(model, options);
  for (const auto& p : model->named_parameters()) {
    std::optional<fsdp::ShardedParamSpec> spec = fsdp::sharded_param_spec(p.value());
    if (mode == "ignored" && p.key() == "out.weight") {
      EXPECT_FALSE(spec.has_value()) << p.key() << " is ignored: expected it unsharded";
      continue;
    }
    ASSERT_TRUE(spec.has_value()) << p.key();
    const int64_t want_dim =
        mode == "shard1" && p.value().dim() == 2 && spec->global_shape[1] % world == 0 ? 1 : 0;
    EXPECT_EQ(spec->shard_dim, want_dim) << p.key();
    EXPECT_EQ(spec->replicate_group.has_value(), mode == "hsdp") << p.key();
    if (mode == "hsdp") {
      EXPECT_EQ(spec->group.size(), world / 2);
      EXPECT_EQ(spec->replicate_group->size(), 2);
    }
  }
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
    at::Tensor out = module_call::call(model, x);
    // bf16: the root's output_dtype brings the output back to float32.
    EXPECT_EQ(out.scalar_type(), torch::kFloat);
    at::Tensor loss = Loss(out, y);
    loss.backward();
    at::Tensor total = loss.detach().clone().reshape({1});
    comm::all_reduce(pg, total, comm::ReduceOp::kAvg).wait();
    const double want = golden[name + ".loss." + s].item<double>();
    EXPECT_NEAR(total.item<double>(), want, std::max(tol.rtol * want, tol.atol)) << "loss " << s;
    // A parameter fully_shard left alone differs between ranks (its
    // gradient is not reduced): Python recorded rank 0's.
    auto compared = [&](const at::Tensor& p) {
      return fsdp::sharded_param_spec(p).has_value() || pg.rank() == 0;
    };
    for (const auto& p : model->named_parameters()) {
      const std::string key = name + ".grad." + s + "." + p.key();
      if (!golden.has(key)) {
        EXPECT_FALSE(p.value().grad().defined()) << key;
        continue;
      }
      ASSERT_TRUE(p.value().grad().defined()) << key;
      if (compared(p.value())) ExpectRel(p.value().grad(), Part(p.value(), golden[key]), key, tol);
    }
    optim.step();
    for (const auto& p : model->named_parameters()) {
      const std::string key = name + ".param." + s + "." + p.key();
      if (compared(p.value())) ExpectRel(p.value(), Part(p.value(), golden[key]), key, tol);
    }
  }
}

void RunWorld(int world, const std::vector<std::string>& modes) {
  const Golden golden(test_data::RunfilePath("tests/testdata/fully_shard_golden.pt"));
  comm::testing::RunOptions options;
  options.timeout = std::chrono::seconds(240);
  comm::testing::RunOnRanks(
      world,
      [&](comm::ProcessGroup& pg) {
        for (const auto& mode : modes) RunCase(pg, golden, mode);
      },
      options);
}

TEST(FullyShardGolden, MatchesPythonOn1Rank) { RunWorld(1, {"true", "false"}); }
TEST(FullyShardGolden, MatchesPythonOn2Ranks) {
  RunWorld(2, {"true", "false", "frozen", "bf16", "shard1", "ignored"});
}
TEST(FullyShardGolden, MatchesPythonOn3Ranks) { RunWorld(3, {"true", "false", "frozen"}); }
TEST(FullyShardGolden, MatchesPythonOn4Ranks) {
  RunWorld(4, {"true", "false", "2", "hsdp", "bf16", "shard1"});
}

}  // namespace
}  // namespace fsdp_test
