// fully_shard's float8 all-gather (FullyShardOptions::float8_all_gather_fn,
// torchao's enable_fsdp_float8_all_gather) against torchao's own under
// PyTorch's fully_shard (golden values, below), and on 1-4 Gloo ranks
// against the same model unsharded, whose float8 linears cast their own weights
// (kernels::Float8Linear, itself held to torchao bit for bit by
// //kernels:float8_linear_test): the gathered bytes are the whole weight's
// cast bit for bit, the output is the unsharded model's bit for bit, the
// gradients its gradients (bit for bit where averaging over the ranks is
// exact: 1, 2 and 4 ranks), through SGD steps that change the weights and
// so the scales; the post-forward shards of an int reshard_after_forward
// keep the float8 bytes; HSDP reduces the amaxes over the shard group; a
// model built on the meta device materialises its float8 buffers;
// mixed precision casts the float32 shards, not a
// bfloat16 copy; bad choices of parameters are refused by name.
//
// Every rank computes on the whole batch, so the average of the ranks'
// gradients is the batch's gradient whatever the world size.
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include "comm/device_mesh.h"
#include "comm/process_group.h"
#include "fsdp/fully_shard.h"
#include "functorch/module/named_member_accessor.h"
#include "kernels/float8_linear.h"
#include "module_call/call.h"
#include "testing/golden_fixture.h"
#include "testing/multiprocess.h"

namespace {

using ::testing::HasSubstr;

// A float8 linear as a model computes it under fully_shard: the gathered
// cast when its weight was gathered in float8, its own cast otherwise.
at::Tensor Float8LinearOf(const at::Tensor& x, const at::Tensor& weight) {
  if (auto cast = fsdp::float8_unsharded_param(weight)) {
    return kernels::Float8Linear(x, weight, *cast, std::nullopt);
  }
  return kernels::Float8Linear(x, weight, std::nullopt);
}

// Two float8 linears (64 rows over 3 ranks: uneven, padded) and a float32
// scale the all-gather carries beside their float8 bytes.
struct Float8MlpImpl : torch::nn::Module {
  // on_meta: the parameters' shapes on the meta device, nothing allocated.
  explicit Float8MlpImpl(bool on_meta = false) {
    at::manual_seed(11);
    at::Tensor w1_init = at::randn({64, 32}) * 0.2;
    at::Tensor w2_init = at::randn({48, 64}) * 0.2;
    w2_init[5][9] = 3.0;  // an amax in one rank's shard only
    at::Tensor gain_init = at::rand({32}) + 0.5;
    const auto place = [on_meta](const at::Tensor& t) { return on_meta ? t.to(at::kMeta) : t; };
    w1 = register_parameter("w1", place(w1_init));
    w2 = register_parameter("w2", place(w2_init));
    gain = register_parameter("gain", place(gain_init));
  }
  at::Tensor forward(const at::Tensor& x) {
    return Float8LinearOf(at::relu(Float8LinearOf(x * gain, w1)), w2);
  }
  at::Tensor w1, w2, gain;
};
TORCH_MODULE(Float8Mlp);
const bool kFloat8MlpBound = functorch::RegisterModuleMembers<Float8MlpImpl>(
    {{"w1", &Float8MlpImpl::w1}, {"w2", &Float8MlpImpl::w2}, {"gain", &Float8MlpImpl::gain}});

at::Tensor Batch(int step) {
  at::manual_seed(100 + step);
  return at::randn({4, 8, 32});  // 32 rows: _scaled_mm's multiples of 16
}

at::Tensor Bits(const at::Tensor& float8) { return float8.contiguous().view(at::kByte); }

fsdp::FullyShardOptions Float8Options(comm::ProcessGroup& pg) {
  fsdp::FullyShardOptions options;
  options.process_group = pg;
  options.float8_all_gather_fn = [](const at::Tensor& p) { return p.dim() == 2; };
  return options;
}

// The shard's rows of the unsharded `full`.
at::Tensor ShardOf(const at::Tensor& shard, const at::Tensor& full) {
  const std::optional<fsdp::ShardedParamSpec> spec = fsdp::sharded_param_spec(shard);
  EXPECT_TRUE(spec.has_value());
  if (!spec) return full;
  return full.narrow(0, spec->dim0_offset, shard.size(0));
}

// Unsharded: the gathered bytes are the whole weight's cast; the names
// hold NaN stand-ins; the float32 gain is gathered as it is.
void ExpectGatheredCasts(fsdp::FSDPModule& root, Float8Mlp& sharded, Float8Mlp& reference) {
  root.unshard();
  for (const auto& [weight, full] : std::vector<std::pair<at::Tensor, at::Tensor>>{
           {sharded->w1, reference->w1}, {sharded->w2, reference->w2}}) {
    const std::optional<kernels::Float8Tensor> cast = fsdp::float8_unsharded_param(weight);
    ASSERT_TRUE(cast.has_value());
    const kernels::Float8Tensor whole = kernels::CastToFloat8(full, at::kFloat8_e4m3fn);
    EXPECT_EQ(cast->data.scalar_type(), at::kFloat8_e4m3fn);
    EXPECT_TRUE(at::equal(Bits(cast->data), Bits(whole.data)));
    EXPECT_TRUE(at::equal(cast->scale, whole.scale));
    EXPECT_TRUE(at::equal(cast->inv_scale, whole.inv_scale));
    EXPECT_EQ(weight.sizes(), full.sizes());
    EXPECT_TRUE(weight.isnan().all().item<bool>());
  }
  EXPECT_FALSE(fsdp::float8_unsharded_param(sharded->gain).has_value());
  EXPECT_TRUE(at::equal(sharded->gain, reference->gain));
  root.reshard();
  EXPECT_FALSE(fsdp::float8_unsharded_param(sharded->w1).has_value());
}

// Three SGD steps sharded and unsharded, compared at each; the gathered
// casts before and (where the steps were exact) after.
void TrainAgainstUnsharded(comm::ProcessGroup& pg, fsdp::FullyShardOptions options,
                           bool bit_exact_gradients, bool on_meta = false) {
  Float8Mlp reference;
  Float8Mlp sharded(on_meta);
  fsdp::FSDPModule root = fsdp::fully_shard(sharded.ptr(), options);
  if (on_meta) {
    // Deferred initialisation: this rank's rows of the reference's values.
    fsdp::to_empty(*sharded, at::kCPU);
    fsdp::init_sharded_states(*sharded, [&](const std::string& fqn, const at::Tensor& local,
                                            const std::optional<fsdp::ShardedParamSpec>& spec) {
      ASSERT_TRUE(spec.has_value()) << fqn;
      const at::Tensor full = reference->named_parameters()[fqn];
      local.copy_(full.narrow(0, spec->dim0_offset, local.size(0)));
    });
  }
  torch::optim::SGD ref_optim(reference->parameters(), 0.5);
  torch::optim::SGD optim(sharded->parameters(), 0.5);
  ExpectGatheredCasts(root, sharded, reference);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const at::Tensor x = Batch(step);
    const at::Tensor g = at::randn({4, 8, 48});
    ref_optim.zero_grad();
    optim.zero_grad();
    const at::Tensor y_ref = reference->forward(x);
    y_ref.backward(g);
    const at::Tensor y = module_call::call(sharded, x);
    y.backward(g);
    // The same float8 products of the same bits (after a step, of weights
    // that differ in the last bits where averaging over 3 ranks rounds).
    if (bit_exact_gradients || step == 0) {
      EXPECT_TRUE(at::equal(y, y_ref));
    } else {
      EXPECT_TRUE(at::allclose(y, y_ref, 1e-2, 1e-3));
    }
    for (const auto& [name, ref] : std::vector<std::pair<std::string, at::Tensor>>{
             {"w1", reference->w1}, {"w2", reference->w2}, {"gain", reference->gain}}) {
      SCOPED_TRACE(name);
      const at::Tensor shard = sharded->named_parameters()[name];
      ASSERT_TRUE(shard.grad().defined());
      const at::Tensor expected = ShardOf(shard, ref.grad());
      if (bit_exact_gradients) {
        EXPECT_TRUE(at::equal(shard.grad(), expected));
      } else {
        EXPECT_TRUE(at::allclose(shard.grad(), expected, 1e-5, 1e-6));
      }
      // Shards stay high precision.
      EXPECT_EQ(shard.scalar_type(), at::kFloat);
    }
    ref_optim.step();
    optim.step();
  }

  if (bit_exact_gradients) ExpectGatheredCasts(root, sharded, reference);
}

TEST(Float8AllGatherTest, OneRankIsTheUnshardedModel) {
  comm::testing::RunOnRanks(1, [](comm::ProcessGroup& pg) {
    TrainAgainstUnsharded(pg, Float8Options(pg), /*bit_exact_gradients=*/true);
  });
}

TEST(Float8AllGatherTest, TwoRanksBitForBit) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    TrainAgainstUnsharded(pg, Float8Options(pg), /*bit_exact_gradients=*/true);
  });
}

TEST(Float8AllGatherTest, ThreeRanksShardUnevenly) {
  comm::testing::RunOnRanks(3, [](comm::ProcessGroup& pg) {
    TrainAgainstUnsharded(pg, Float8Options(pg), /*bit_exact_gradients=*/false);
  });
}

// reshard_after_forward = 2 on 4 ranks: backward gathers the float8
// post-forward shards within pairs, with the forward's scale.
TEST(Float8AllGatherTest, PostForwardShardsKeepTheFloat8Bytes) {
  comm::testing::RunOnRanks(4, [](comm::ProcessGroup& pg) {
    fsdp::FullyShardOptions options = Float8Options(pg);
    options.reshard_after_forward = 2;
    TrainAgainstUnsharded(pg, options, /*bit_exact_gradients=*/true);
  });
}

// Built on the meta device, sharded, then materialised (fsdp::to_empty,
// init_sharded_states), as the trainer builds models too large for a rank:
// the float8 buffers and stand-ins are made on the real device.
TEST(Float8AllGatherTest, MetaDeviceInitialisation) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    TrainAgainstUnsharded(pg, Float8Options(pg), /*bit_exact_gradients=*/true, /*on_meta=*/true);
  });
}

// HSDP (2 replicas x 2 shards): the amaxes are reduced over the shard
// group, where the whole weight's shards are.
TEST(Float8AllGatherTest, HybridShardingReducesTheAmaxOverTheShardGroup) {
  comm::testing::RunOnRanks(4, [](comm::ProcessGroup& pg) {
    fsdp::FullyShardOptions options = Float8Options(pg);
    options.process_group.reset();
    auto mesh = comm::init_hybrid_shard_mesh(pg, 2, 2);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    options.mesh = *mesh;
    TrainAgainstUnsharded(pg, options, /*bit_exact_gradients=*/true);
  });
}

// bfloat16 compute over float32 shards: torchao casts the float32 shard,
// not a bfloat16 copy of it; the stand-in and its gradient are bfloat16,
// the shards' .grad float32.
TEST(Float8AllGatherTest, MixedPrecisionCastsTheFloat32Shards) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    Float8Mlp reference;
    Float8Mlp sharded;
    fsdp::FullyShardOptions options = Float8Options(pg);
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.reduce_dtype = at::kFloat;
    fsdp::FSDPModule root = fsdp::fully_shard(sharded.ptr(), options);
    root.unshard();
    const std::optional<kernels::Float8Tensor> cast = fsdp::float8_unsharded_param(sharded->w2);
    ASSERT_TRUE(cast.has_value());
    EXPECT_TRUE(at::equal(Bits(cast->data),
                          Bits(kernels::CastToFloat8(reference->w2, at::kFloat8_e4m3fn).data)));
    EXPECT_EQ(sharded->w2.scalar_type(), at::kBFloat16);
    root.reshard();

    const at::Tensor x = Batch(0);
    const at::Tensor y = module_call::call(sharded, x);
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    y.to(at::kFloat).square().sum().backward();
    // Against the unsharded model at the same precision: bfloat16 inputs,
    // the float32 weights' casts.
    const at::Tensor xb = x.to(at::kBFloat16) * reference->gain.to(at::kBFloat16);
    const at::Tensor w1 = at::full({64, 32}, NAN, at::kBFloat16).requires_grad_();
    const at::Tensor w2 = at::full({48, 64}, NAN, at::kBFloat16).requires_grad_();
    const at::Tensor h = at::relu(kernels::Float8Linear(
        xb, w1, kernels::CastToFloat8(reference->w1, at::kFloat8_e4m3fn), std::nullopt));
    const at::Tensor y_ref = kernels::Float8Linear(
        h, w2, kernels::CastToFloat8(reference->w2, at::kFloat8_e4m3fn), std::nullopt);
    EXPECT_TRUE(at::equal(y, y_ref));
    y_ref.to(at::kFloat).square().sum().backward();
    for (const auto& [shard, full_grad] : std::vector<std::pair<at::Tensor, at::Tensor>>{
             {sharded->named_parameters()["w1"], w1.grad()},
             {sharded->named_parameters()["w2"], w2.grad()}}) {
      ASSERT_TRUE(shard.grad().defined());
      EXPECT_EQ(shard.grad().scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(shard.grad(), ShardOf(shard, full_grad).to(at::kFloat)));
    }
  });
}

// ---- against torchao's float8 all-gather under PyTorch's fully_shard --------

// tools/golden/float8_all_gather_golden.py: torchao 0.17.0's
// enable_fsdp_float8_all_gather under PyTorch 2.15's fully_shard, on the
// CPU over Gloo, 3 SGD steps (lr 0.1) of the same model from the same
// parameters on the same batches: every step's output and gradients bit
// for bit (averaging over 2 or 4 ranks is exact).
void TrainAgainstTorchao(comm::ProcessGroup& pg, const std::string& name,
                         std::optional<at::ScalarType> param_dtype) {
  const test_data::GoldenFixture golden(
      test_data::RunfilePath("fsdp/testdata/float8_all_gather/golden.pt"));
  ASSERT_EQ(golden[name + ".world"].item<int64_t>(), pg.size());
  Float8Mlp model;
  {
    const at::NoGradGuard no_grad;
    model->w1.copy_(golden[name + ".w1"]);
    model->w2.copy_(golden[name + ".w2"]);
    model->gain.copy_(golden[name + ".gain"]);
  }
  fsdp::FullyShardOptions options = Float8Options(pg);
  options.mp_policy.param_dtype = param_dtype;
  if (param_dtype) options.mp_policy.reduce_dtype = at::kFloat;
  fsdp::fully_shard(model.ptr(), options);
  torch::optim::SGD optim(model->parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    const std::string key = name + ".step" + std::to_string(step);
    SCOPED_TRACE(key);
    optim.zero_grad();
    const at::Tensor y = module_call::call(model, golden[key + ".x"]);
    y.backward(golden[key + ".g"].to(y.scalar_type()));
    EXPECT_EQ(y.scalar_type(), golden[key + ".y"].scalar_type());
    EXPECT_TRUE(at::equal(y, golden[key + ".y"]));
    for (const char* param : {"w1", "w2", "gain"}) {
      SCOPED_TRACE(param);
      const at::Tensor shard = model->named_parameters()[param];
      ASSERT_TRUE(shard.grad().defined());
      EXPECT_TRUE(at::equal(shard.grad(), ShardOf(shard, golden[key + ".grad." + param])));
    }
    optim.step();
  }
}

TEST(Float8AllGatherGoldenTest, TorchaoTwoRanks) {
  comm::testing::RunOnRanks(
      2, [](comm::ProcessGroup& pg) { TrainAgainstTorchao(pg, "f32_w2", std::nullopt); });
}

TEST(Float8AllGatherGoldenTest, TorchaoFourRanks) {
  comm::testing::RunOnRanks(
      4, [](comm::ProcessGroup& pg) { TrainAgainstTorchao(pg, "f32_w4", std::nullopt); });
}

TEST(Float8AllGatherGoldenTest, TorchaoBfloat16ComputeTwoRanks) {
  comm::testing::RunOnRanks(
      2, [](comm::ProcessGroup& pg) { TrainAgainstTorchao(pg, "bf16_w2", at::kBFloat16); });
}

TEST(Float8AllGatherTest, BadChoicesAreRefusedByName) {
  comm::testing::RunOnRanks(2, [](comm::ProcessGroup& pg) {
    struct WithSteps : torch::nn::Module {
      WithSteps() {
        w = register_parameter("w", at::randn({32, 16}));
        steps = register_parameter("steps", at::zeros({4}, at::kLong), /*requires_grad=*/false);
      }
      at::Tensor w, steps;
    };
    static const bool kBound = functorch::RegisterModuleMembers<WithSteps>(
        {{"w", &WithSteps::w}, {"steps", &WithSteps::steps}});
    (void)kBound;
    fsdp::FullyShardOptions all = Float8Options(pg);
    all.float8_all_gather_fn = [](const at::Tensor&) { return true; };
    EXPECT_THAT([&] { fsdp::fully_shard(std::make_shared<WithSteps>(), all); },
                ::testing::ThrowsMessage<c10::Error>(HasSubstr(
                    "float8_all_gather_fn chose parameter 'steps' of dtype Long: expected a "
                    "high-precision floating parameter")));
    struct Empty : torch::nn::Module {
      Empty() { w = register_parameter("w", at::zeros({0, 16})); }
      at::Tensor w;
    };
    static const bool kEmptyBound = functorch::RegisterModuleMembers<Empty>({{"w", &Empty::w}});
    (void)kEmptyBound;
    EXPECT_THAT([&] { fsdp::fully_shard(std::make_shared<Empty>(), all); },
                ::testing::ThrowsMessage<c10::Error>(
                    HasSubstr("float8_all_gather_fn chose parameter 'w' of shape [0, 16]: "
                              "expected at least one element")));
    fsdp::FullyShardOptions on_dim1 = Float8Options(pg);
    on_dim1.shard_placement_fn = [](const at::Tensor&) { return std::optional<int64_t>(1); };
    EXPECT_THAT([&] { fsdp::fully_shard(Float8Mlp().ptr(), on_dim1); },
                ::testing::ThrowsMessage<c10::Error>(
                    HasSubstr("float8_all_gather_fn chose parameter 'w1', which "
                              "shard_placement_fn shards on dim 1: float8 all-gather gathers "
                              "dim-0 shards only")));
  });
}

}  // namespace
