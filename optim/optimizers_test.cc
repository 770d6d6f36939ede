#include "optim/optimizers.h"

#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <torch/types.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "state_dict/optim_state.h"
#include "state_dict/tensor_dict.h"
#include "testing/golden_fixture.h"

namespace optim {
namespace {

using torch::Tensor;
using torch::optim::OptimizerParamGroup;

constexpr int kSteps = 4;
constexpr int kParams = 4;

// tools/golden/optim_golden.py's fixture: {name: Tensor}.
const test_data::GoldenFixture& golden() {
  static const auto* g =
      new test_data::GoldenFixture(test_data::RunfilePath("optim/testdata/optim_golden.pt"));
  return *g;
}

::testing::AssertionResult Close(const Tensor& actual, const Tensor& expected, double rtol = 1e-5,
                                 double atol = 1e-6) {
  if (!actual.defined() || !expected.defined()) {
    return ::testing::AssertionFailure() << "undefined tensor";
  }
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "shape " << actual.sizes() << " vs " << expected.sizes();
  }
  if (torch::allclose(actual.to(torch::kFloat64), expected.to(torch::kFloat64), rtol, atol)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "max |diff| "
         << (actual.to(torch::kFloat64) - expected.to(torch::kFloat64)).abs().max().item<double>();
}

std::vector<Tensor> Params(const std::function<Tensor(int)>& init) {
  std::vector<Tensor> params;
  for (int i = 0; i < kParams; ++i) params.push_back(init(i).clone().requires_grad_(true));
  return params;
}

// Groups {0, 1} and {2, 3} with their own options, as the golden script.
template <typename Options>
std::vector<OptimizerParamGroup> Groups(const std::vector<Tensor>& p, const Options& g0,
                                        const Options& g1) {
  return {OptimizerParamGroup({p[0], p[1]}, std::make_unique<Options>(g0)),
          OptimizerParamGroup({p[2], p[3]}, std::make_unique<Options>(g1))};
}

void SetGrads(const std::vector<Tensor>& params, int step,
              const std::set<std::pair<int, int>>& missing, double sign = 1.0) {
  for (int i = 0; i < kParams; ++i) {
    if (missing.count({step, i}) != 0) {
      params[i].mutable_grad() = Tensor();
    } else {
      params[i].mutable_grad() =
          golden()["grad." + std::to_string(step) + "." + std::to_string(i)] * sign;
    }
  }
}

const std::set<std::pair<int, int>> kMissingAdam = {{0, 1}, {2, 3}};
const std::set<std::pair<int, int>> kMissingSgd = {{2, 3}};

// Runs `opt` over the golden gradients and compares every step's parameters
// and the final state with Python's `<name>.<impl>`.
void ExpectGolden(const std::string& name, Implementation impl, const std::vector<Tensor>& params,
                  torch::optim::Optimizer& opt, const std::set<std::pair<int, int>>& missing) {
  const std::string prefix = name + "." + implementation_name(impl) + ".";
  for (int s = 0; s < kSteps; ++s) {
    SetGrads(params, s, missing);
    opt.step();
    for (int i = 0; i < kParams; ++i) {
      EXPECT_TRUE(Close(params[i],
                        golden()[prefix + "param." + std::to_string(s) + "." + std::to_string(i)]))
          << prefix << " step " << s << " param " << i;
    }
  }
  auto exported = state_dict::ExportOptimizerState(opt);
  ASSERT_TRUE(exported.ok()) << exported.status();
  int entries = 0;
  for (const auto& [key, dict] : exported->state) {
    const std::string id = state_dict::ParamKeyString(key);
    for (const auto& item : dict) {
      const std::string golden_key = prefix + "state." + id + "." + item.key();
      ASSERT_TRUE(golden().has(golden_key)) << golden_key;
      EXPECT_TRUE(Close(item.value(), golden()[golden_key])) << golden_key;
      ++entries;
    }
  }
  int golden_entries = 0;
  for (int i = 0; i < kParams; ++i) {
    for (const char* e : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step", "momentum_buffer"}) {
      golden_entries += golden().has(prefix + "state." + std::to_string(i) + "." + e) ? 1 : 0;
    }
  }
  EXPECT_EQ(entries, golden_entries) << prefix << ": the state has other entries than Python's";
}

Tensor Init(int i) { return golden()["init." + std::to_string(i)]; }

class GoldenTest : public ::testing::TestWithParam<Implementation> {};

TEST_P(GoldenTest, AdamWEqualsPython) {
  auto p = Params(Init);
  const auto shared = torch::optim::AdamWOptions().betas({0.9, 0.99}).eps(1e-8);
  AdamW opt(Groups(p, torch::optim::AdamWOptions(shared).lr(1e-2).weight_decay(0.1),
                   torch::optim::AdamWOptions(shared).lr(3e-3).weight_decay(0.0)),
            shared, GetParam());
  ExpectGolden("adamw", GetParam(), p, opt, kMissingAdam);
}

TEST_P(GoldenTest, AdamWAmsgradEqualsPython) {
  auto p = Params(Init);
  const auto shared = torch::optim::AdamWOptions().amsgrad(true);
  AdamW opt(Groups(p, torch::optim::AdamWOptions(shared).lr(2e-2).weight_decay(0.05),
                   torch::optim::AdamWOptions(shared).lr(5e-3).weight_decay(0.01)),
            shared, GetParam());
  ExpectGolden("adamw_amsgrad", GetParam(), p, opt, kMissingAdam);
}

TEST_P(GoldenTest, AdamAmsgradMaximizeEqualsPython) {
  auto p = Params(Init);
  const auto shared = torch::optim::AdamOptions().amsgrad(true).betas({0.8, 0.95});
  Adam opt(Groups(p, torch::optim::AdamOptions(shared).lr(1e-2).weight_decay(0.05),
                  torch::optim::AdamOptions(shared).lr(4e-3).weight_decay(0.0)),
           shared, GetParam(), /*maximize=*/true);
  ExpectGolden("adam_amsgrad_maximize", GetParam(), p, opt, kMissingAdam);
}

TEST_P(GoldenTest, AdamEqualsPython) {
  auto p = Params(Init);
  Adam opt(Groups(p, torch::optim::AdamOptions(1e-2).weight_decay(0.0),
                  torch::optim::AdamOptions(2e-2).weight_decay(0.1)),
           {}, GetParam());
  ExpectGolden("adam", GetParam(), p, opt, kMissingAdam);
}

TEST_P(GoldenTest, SgdNesterovEqualsPython) {
  auto p = Params(Init);
  const auto shared = torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true);
  SGD opt(Groups(p, torch::optim::SGDOptions(shared).lr(0.05).weight_decay(0.01),
                 torch::optim::SGDOptions(shared).lr(0.02)),
          shared, GetParam());
  ExpectGolden("sgd_nesterov", GetParam(), p, opt, kMissingSgd);
}

TEST_P(GoldenTest, SgdDampeningMaximizeEqualsPython) {
  auto p = Params(Init);
  const auto shared = torch::optim::SGDOptions(0.1).momentum(0.8).dampening(0.3);
  SGD opt(Groups(p, torch::optim::SGDOptions(shared).lr(0.05),
                 torch::optim::SGDOptions(shared).lr(0.1).weight_decay(0.02)),
          shared, GetParam(), /*maximize=*/true);
  ExpectGolden("sgd_dampening_maximize", GetParam(), p, opt, kMissingSgd);
}

TEST_P(GoldenTest, SgdWithoutMomentumEqualsPython) {
  auto p = Params(Init);
  SGD opt(
      Groups(p, torch::optim::SGDOptions(0.05).weight_decay(0.01), torch::optim::SGDOptions(0.1)),
      torch::optim::SGDOptions(0.1), GetParam());
  ExpectGolden("sgd_plain", GetParam(), p, opt, kMissingSgd);
}

INSTANTIATE_TEST_SUITE_P(Implementations, GoldenTest,
                         ::testing::Values(Implementation::kFused, Implementation::kForeach),
                         [](const auto& info) {
                           return std::string(implementation_name(info.param));
                         });

// ---- against torch::optim, on other shapes and dtypes ---------------------

// Parameters in float32 and float64 (two buckets per group), one of them
// without a gradient until step 2.
std::vector<Tensor> MixedParams(uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({6, 5}).requires_grad_(true),
          torch::randn({9}, torch::kFloat64).requires_grad_(true),
          torch::randn({3, 4}).requires_grad_(true),
          torch::randn({2}, torch::kFloat64).requires_grad_(true)};
}

std::vector<Tensor> Clones(const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// Steps both optimizers on the same gradients (negated for the reference
// when ours maximizes) and compares parameters and exported state.
void ExpectSameAsReference(std::vector<Tensor>& ours, torch::optim::Optimizer& opt,
                           std::vector<Tensor>& ref, torch::optim::Optimizer& ref_opt, int steps,
                           bool maximize = false, int first_step = 0) {
  for (int s = first_step; s < first_step + steps; ++s) {
    torch::manual_seed(100 + s);
    for (size_t i = 0; i < ours.size(); ++i) {
      Tensor g = torch::randn(ours[i].sizes(), ours[i].options().requires_grad(false));
      const bool none = (i == 1 && s < 2);
      ours[i].mutable_grad() = none ? Tensor() : g;
      ref[i].mutable_grad() = none ? Tensor() : (maximize ? -g : g.clone());
    }
    opt.step();
    ref_opt.step();
    for (size_t i = 0; i < ours.size(); ++i) {
      EXPECT_TRUE(Close(ours[i], ref[i])) << "step " << s << " param " << i;
    }
  }
  auto a = state_dict::ExportOptimizerState(opt);
  auto b = state_dict::ExportOptimizerState(ref_opt);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->state.size(), b->state.size());
  for (size_t k = 0; k < a->state.size(); ++k) {
    EXPECT_EQ(a->state[k].first, b->state[k].first);
    ASSERT_EQ(a->state[k].second.size(), b->state[k].second.size());
    for (const auto& item : b->state[k].second) {
      const Tensor mine = a->state[k].second[item.key()];
      EXPECT_EQ(mine.scalar_type(), item.value().scalar_type()) << item.key();
      EXPECT_TRUE(Close(mine, item.value())) << item.key() << " of " << k;
    }
  }
  ASSERT_EQ(a->param_groups.size(), b->param_groups.size());
  for (size_t g = 0; g < a->param_groups.size(); ++g) {
    EXPECT_EQ(a->param_groups[g].params, b->param_groups[g].params);
    ASSERT_EQ(a->param_groups[g].options.size(), b->param_groups[g].options.size());
    for (const auto& item : b->param_groups[g].options) {
      EXPECT_EQ(a->param_groups[g].options[item.key()], item.value()) << item.key();
    }
  }
}

class ReferenceTest : public ::testing::TestWithParam<Implementation> {};

TEST_P(ReferenceTest, AdamWEqualsLibTorch) {
  auto ours = MixedParams(1), ref = Clones(ours);
  const auto g0 = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  const auto g1 = torch::optim::AdamWOptions(5e-3).weight_decay(0.02).betas({0.8, 0.9});
  AdamW opt(Groups(ours, g0, g1), {}, GetParam());
  torch::optim::AdamW ref_opt(Groups(ref, g0, g1));
  ExpectSameAsReference(ours, opt, ref, ref_opt, 5);
}

TEST_P(ReferenceTest, AdamAmsgradWeightDecayEqualsLibTorch) {
  auto ours = MixedParams(2), ref = Clones(ours);
  const auto g0 = torch::optim::AdamOptions(1e-2).weight_decay(0.1).amsgrad(true);
  const auto g1 = torch::optim::AdamOptions(3e-2).amsgrad(true);
  Adam opt(Groups(ours, g0, g1), {}, GetParam());
  torch::optim::Adam ref_opt(Groups(ref, g0, g1));
  ExpectSameAsReference(ours, opt, ref, ref_opt, 5);
}

TEST_P(ReferenceTest, AdamMaximizeEqualsLibTorchOnNegatedGradients) {
  auto ours = MixedParams(3), ref = Clones(ours);
  const auto g = torch::optim::AdamOptions(1e-2).weight_decay(0.05);
  Adam opt(Groups(ours, g, g), {}, GetParam(), /*maximize=*/true);
  torch::optim::Adam ref_opt(Groups(ref, g, g));
  ExpectSameAsReference(ours, opt, ref, ref_opt, 4, /*maximize=*/true);
}

TEST_P(ReferenceTest, SgdNesterovEqualsLibTorch) {
  auto ours = MixedParams(4), ref = Clones(ours);
  const auto g0 = torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01);
  const auto g1 = torch::optim::SGDOptions(0.1).momentum(0.5).dampening(0.2);
  SGD opt(Groups(ours, g0, g1), g0, GetParam());
  torch::optim::SGD ref_opt(Groups(ref, g0, g1), g0);
  ExpectSameAsReference(ours, opt, ref, ref_opt, 5);
}

TEST_P(ReferenceTest, SgdMaximizeEqualsLibTorchOnNegatedGradients) {
  auto ours = MixedParams(5), ref = Clones(ours);
  const auto g = torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01);
  SGD opt(Groups(ours, g, g), g, GetParam(), /*maximize=*/true);
  torch::optim::SGD ref_opt(Groups(ref, g, g), g);
  ExpectSameAsReference(ours, opt, ref, ref_opt, 4, /*maximize=*/true);
}

// A checkpoint written by torch::optim resumes in ours: state exported from
// torch::optim::AdamW after 3 steps, written in PyTorch's format, read and
// imported into a fresh optim::AdamW, which then steps as torch::optim
// would (the cached float steps are refreshed from the imported int64 ones).
TEST_P(ReferenceTest, ResumesFromTorchOptimState) {
  auto ref = MixedParams(6);
  const auto g0 = torch::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true);
  const auto g1 = torch::optim::AdamWOptions(2e-2);
  torch::optim::AdamW ref_opt(Groups(ref, g0, g1));
  // Ours first takes two steps of its own, so that its step cache is stale.
  auto ours = Clones(ref);
  AdamW opt(Groups(ours, g0, g1), {}, GetParam());
  for (int s = 0; s < 2; ++s) {
    for (auto& p : ours) p.mutable_grad() = torch::ones_like(p);
    opt.step();
  }
  for (int s = 0; s < 3; ++s) {
    torch::manual_seed(50 + s);
    for (auto& p : ref)
      p.mutable_grad() = torch::randn(p.sizes(), p.options().requires_grad(false));
    ref_opt.step();
  }
  auto exported = state_dict::ExportOptimizerState(ref_opt);
  ASSERT_TRUE(exported.ok()) << exported.status();
  const std::string path =
      std::string(std::getenv("TEST_TMPDIR") ? std::getenv("TEST_TMPDIR") : "/tmp") +
      "/optim_resume.pt";
  ASSERT_TRUE(state_dict::SaveIValue(state_dict::OptimStateDictToIValue(*exported), path).ok());
  auto ivalue = state_dict::LoadIValue(path);
  ASSERT_TRUE(ivalue.ok()) << ivalue.status();
  auto loaded = state_dict::OptimStateDictFromIValue(*ivalue);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < ours.size(); ++i) ours[i].copy_(ref[i]);
  }
  ASSERT_TRUE(state_dict::ImportOptimizerState(opt, *loaded).ok());
  ExpectSameAsReference(ours, opt, ref, ref_opt, 3, /*maximize=*/false, /*first_step=*/3);
}

INSTANTIATE_TEST_SUITE_P(Implementations, ReferenceTest,
                         ::testing::Values(Implementation::kFused, Implementation::kForeach),
                         [](const auto& info) {
                           return std::string(implementation_name(info.param));
                         });

// ---- what the kernels cannot take ------------------------------------------

std::string StepError(torch::optim::Optimizer& opt) {
  try {
    opt.step();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

TEST(OptimizersErrorTest, GradientOfAnotherDtypeNamesParameterAndExpectation) {
  std::vector<Tensor> p = {torch::zeros({2}, torch::requires_grad()),
                           torch::zeros({3}, torch::requires_grad())};
  p[1].mutable_grad() = torch::ones({3}, torch::kFloat64);
  AdamW opt(p, torch::optim::AdamWOptions(1e-3));
  EXPECT_EQ(StepError(opt),
            "optim::AdamW (fused): parameter 1 is Float on cpu but its gradient is Double on cpu: "
            "expected the gradient on the parameter's device, with its dtype");
}

TEST(OptimizersErrorTest, SparseGradient) {
  Tensor p = torch::zeros({4}, torch::requires_grad());
  p.mutable_grad() = torch::ones({4}).to_sparse();
  SGD opt({p}, torch::optim::SGDOptions(0.1), Implementation::kForeach);
  EXPECT_EQ(StepError(opt),
            "optim::SGD (foreach): parameter 0 has a sparse gradient: expected a dense one "
            "(optim::SGD does not support sparse gradients)");
}

TEST(OptimizersErrorTest, IntegerParameter) {
  Tensor p = torch::zeros({4}, torch::kInt64);
  p.mutable_grad() = torch::ones({4}, torch::kInt64);
  Adam opt({p}, torch::optim::AdamOptions(0.1));
  EXPECT_EQ(StepError(opt),
            "optim::Adam (fused): parameter 0 is Long on cpu: expected a floating-point "
            "tensor on cpu or cuda (fused=True requires all the params to be floating point "
            "Tensors of supported devices)");
}

TEST(OptimizersErrorTest, StateOfAnotherDtype) {
  Tensor p = torch::zeros({4}, torch::requires_grad());
  AdamW opt({p}, torch::optim::AdamWOptions(0.1));
  p.mutable_grad() = torch::ones({4});
  opt.step();
  auto& s = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
  s.exp_avg_sq(s.exp_avg_sq().to(torch::kFloat64));
  EXPECT_EQ(StepError(opt),
            "optim::AdamW (fused): parameter 0 is Float on cpu but its optimizer state "
            "'exp_avg_sq' is Double on cpu: expected the parameter's device and dtype (load state "
            "onto the parameters' devices)");
}

// Python's own optimizer state dicts (tools/golden/optim_golden.py's
// optim_state_dict_golden.pt), saved by AdamW / SGD with fused=True and
// foreach=True after step kSteps - 2: their param_groups carry 'fused':
// True or 'foreach': True. state_dict::ImportOptimizerState accepts them
// (fused / foreach pick how the update is computed, not the update or its
// state) into our fused and foreach optimizers and into torch::optim's, and
// replaying the last step from there gives Python's parameters.
c10::IValue PythonStateDict(const std::string& key) {
  const std::string path = test_data::RunfilePath("optim/testdata/optim_state_dict_golden.pt");
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto dict = torch::pickle_load(bytes).toGenericDict();
  auto it = dict.find(key);
  if (it == dict.end()) {
    ADD_FAILURE() << "optim_state_dict_golden.pt has no '" << key << "'";
    return c10::IValue();
  }
  return it->value();
}

// Imports Python's `<name>.<saved_impl>` state into `opt` (over `params`,
// set to Python's parameters after step kSteps - 2), replays step kSteps - 1
// and compares with Python's parameters after it.
void ExpectImportedStepMatches(const std::string& name, const std::string& saved_impl,
                               const std::vector<Tensor>& params, torch::optim::Optimizer& opt,
                               const std::set<std::pair<int, int>>& missing,
                               const std::string& what) {
  const std::string prefix = name + "." + saved_impl + ".";
  const c10::IValue saved = PythonStateDict(name + "." + saved_impl);
  ASSERT_TRUE(saved.isGenericDict());
  const auto groups = saved.toGenericDict().at("param_groups").toList();
  const auto group0 = groups.get(0).toGenericDict();
  EXPECT_TRUE(group0.at(saved_impl).toBool())
      << "the fixture's group 0 lacks '" << saved_impl << "': True";
  auto state = state_dict::OptimStateDictFromIValue(saved);
  ASSERT_TRUE(state.ok()) << state.status();
  const absl::Status imported = state_dict::ImportOptimizerState(opt, *state);
  ASSERT_TRUE(imported.ok()) << what << ": " << imported;
  {
    torch::NoGradGuard no_grad;
    for (int i = 0; i < kParams; ++i) {
      params[i].copy_(
          golden()[prefix + "param." + std::to_string(kSteps - 2) + "." + std::to_string(i)]);
    }
  }
  SetGrads(params, kSteps - 1, missing);
  opt.step();
  for (int i = 0; i < kParams; ++i) {
    EXPECT_TRUE(
        Close(params[i],
              golden()[prefix + "param." + std::to_string(kSteps - 1) + "." + std::to_string(i)]))
        << what << ": param " << i;
  }
}

TEST(PythonFusedStateImportTest, AdamW) {
  for (const std::string saved : {"fused", "foreach"}) {
    for (const Implementation impl : {Implementation::kFused, Implementation::kForeach}) {
      // Options other than Python's (lr 1, no weight decay): the import
      // replaces them with the saved groups'.
      auto params = Params([](int i) { return golden()["init." + std::to_string(i)]; });
      const auto o = torch::optim::AdamWOptions(1.0).weight_decay(0.0);
      AdamW opt(Groups(params, o, o), o, impl);
      ExpectImportedStepMatches(
          "adamw", saved, params, opt, kMissingAdam,
          "Python AdamW(" + saved + "=True) into optim::AdamW (" + implementation_name(impl) + ")");
    }
    auto params = Params([](int i) { return golden()["init." + std::to_string(i)]; });
    const auto o = torch::optim::AdamWOptions(1.0).weight_decay(0.0);
    torch::optim::AdamW opt(Groups(params, o, o), o);
    ExpectImportedStepMatches("adamw", saved, params, opt, kMissingAdam,
                              "Python AdamW(" + saved + "=True) into torch::optim::AdamW");
  }
}

TEST(PythonFusedStateImportTest, SgdNesterov) {
  for (const std::string saved : {"fused", "foreach"}) {
    for (const Implementation impl : {Implementation::kFused, Implementation::kForeach}) {
      auto params = Params([](int i) { return golden()["init." + std::to_string(i)]; });
      const auto o = torch::optim::SGDOptions(1.0).momentum(0.9).nesterov(true);
      SGD opt(Groups(params, o, o), o, impl);
      ExpectImportedStepMatches(
          "sgd_nesterov", saved, params, opt, kMissingSgd,
          "Python SGD(" + saved + "=True) into optim::SGD (" + implementation_name(impl) + ")");
    }
  }
}

// 'fused' / 'foreach' must still be a bool or None; the Python-only switches
// that change the update ('maximize', 'capturable', 'differentiable') stay
// refused when on.
TEST(PythonFusedStateImportTest, BadSwitchesAreRefused) {
  auto state = state_dict::OptimStateDictFromIValue(PythonStateDict("adamw.fused"));
  ASSERT_TRUE(state.ok()) << state.status();
  auto params = Params([](int i) { return golden()["init." + std::to_string(i)]; });
  const auto o = torch::optim::AdamWOptions(1.0);
  AdamW opt(Groups(params, o, o), o);

  auto bad = *state;
  bad.param_groups[1].options["fused"] = c10::IValue(std::string("yes"));
  absl::Status s = state_dict::ImportOptimizerState(opt, bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message())
                .find("param_groups[1]['fused'] is String, expected a bool "
                      "or None"),
            std::string::npos)
      << s;

  bad = *state;
  bad.param_groups[0].options["capturable"] = c10::IValue(true);
  s = state_dict::ImportOptimizerState(opt, bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(std::string(s.message()).find("param_groups[0]['capturable'] is True"),
            std::string::npos)
      << s;
}

// ---- capturable mode ------------------------------------------------------
//
// The capturable optimizers run here on the CPU, against the ordinary ones.
// The device learning rate is float32 (what ATen's CUDA kernels read), so
// the reference runs with each learning rate rounded to float32 (AsFloat):
// then kFused is bit for bit the ordinary kFused (the same kernels, on the
// same float32 step tensors; the CPU kernel reads the lr tensor as a
// double). kForeach in capturable mode computes Adam's bias corrections
// from the float32 step tensors on the device (Python's capturable path)
// instead of in double on the host, and SGD's update as
// params + grads * (-lr) instead of add(alpha=-lr); AdamW's decay factor
// 1 - lr * weight_decay is a float32 tensor (as in Python): within rtol 1e-6,
// atol 1e-6 of the ordinary kForeach over these steps (the largest
// difference seen is 4.8e-7 on float32 parameters of magnitude ~2, a few
// float32 ulps; 1e-7 on float64 ones).

double AsFloat(double v) { return static_cast<double>(static_cast<float>(v)); }

// Group g's learning rate at step s: different at every step (a schedule),
// and not a float32 number.
double ScheduledLr(double base, int s) { return base * (0.35 + 0.65 * std::cos(0.45 * s)) / 3.0; }

void SetLrs(torch::optim::Optimizer& opt, const std::vector<double>& bases, int s, bool as_float) {
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    const double lr = ScheduledLr(bases[g], s);
    opt.param_groups()[g].options().set_lr(as_float ? AsFloat(lr) : lr);
  }
}

// Exact equality (rtol == 0) or Close.
::testing::AssertionResult Same(const Tensor& a, const Tensor& b, double rtol, double atol) {
  if (rtol == 0) {
    if (a.defined() && b.defined() && a.scalar_type() == b.scalar_type() && torch::equal(a, b)) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure()
           << "not bit for bit: " << Close(a, b, 0, 0).failure_message();
  }
  return Close(a, b, rtol, atol);
}

// Every exported state entry and option of `a` against `b`.
void ExpectSameState(const torch::optim::Optimizer& a, const torch::optim::Optimizer& b,
                     double rtol, double atol, const std::string& what) {
  auto x = state_dict::ExportOptimizerState(a);
  auto y = state_dict::ExportOptimizerState(b);
  ASSERT_TRUE(x.ok() && y.ok()) << what;
  ASSERT_EQ(x->state.size(), y->state.size()) << what;
  for (size_t k = 0; k < x->state.size(); ++k) {
    EXPECT_EQ(x->state[k].first, y->state[k].first) << what;
    ASSERT_EQ(x->state[k].second.size(), y->state[k].second.size()) << what;
    for (const auto& item : y->state[k].second) {
      const Tensor mine = x->state[k].second[item.key()];
      // The int64 steps are counts: always exact.
      const double r = item.key() == "step" ? 0 : rtol;
      EXPECT_TRUE(Same(mine, item.value(), r, atol)) << what << ": " << item.key() << " of " << k;
    }
  }
}

// Steps `ours` (capturable, exact scheduled learning rates) and `ref`
// (ordinary, the rates rounded to float32) on the same random gradients,
// parameter 1 without one in the first two steps. `write_every`: steps
// where write_device_values() comes first (the others leave the stale lr to
// step(), which then is not replayable).
void ExpectCapturableMatchesOrdinary(std::vector<Tensor>& ours, torch::optim::Optimizer& opt,
                                     std::vector<Tensor>& ref, torch::optim::Optimizer& ref_opt,
                                     const std::vector<double>& bases, double rtol, double atol,
                                     bool maximize = false) {
  auto& cap = dynamic_cast<Capturable&>(opt);
  ASSERT_TRUE(cap.capturable());
  for (int s = 0; s < 6; ++s) {
    torch::manual_seed(300 + s);
    for (size_t i = 0; i < ours.size(); ++i) {
      Tensor g = torch::randn(ours[i].sizes(), ours[i].options().requires_grad(false));
      const bool none = (i == 1 && s < 2);
      ours[i].mutable_grad() = none ? Tensor() : (maximize ? -g : g);
      ref[i].mutable_grad() = none ? Tensor() : (maximize ? -g.clone() : g.clone());
    }
    SetLrs(opt, bases, s, /*as_float=*/false);
    SetLrs(ref_opt, bases, s, /*as_float=*/true);
    const bool written = s % 2 == 1;
    if (written) cap.write_device_values();
    opt.step();
    ref_opt.step();
    // A step after write_device_values() on existing state only enqueues
    // device work (parameter 1's state is created in step 2, unwritten).
    EXPECT_EQ(cap.last_step_replayable(), written) << "step " << s;
    for (size_t g = 0; g < opt.param_groups().size(); ++g) {
      EXPECT_EQ(cap.lr_tensor(g).item<double>(), AsFloat(ScheduledLr(bases[g], s))) << g;
      EXPECT_EQ(cap.lr_tensor(g).scalar_type(), torch::kFloat32);
    }
    for (size_t i = 0; i < ours.size(); ++i) {
      EXPECT_TRUE(Same(ours[i], ref[i], rtol, atol)) << "step " << s << " param " << i;
    }
  }
  ExpectSameState(opt, ref_opt, rtol, atol, "after 6 steps");
}

struct Tolerance {
  double rtol, atol;
};

Tolerance CapturableTolerance(Implementation impl) {
  return impl == Implementation::kFused ? Tolerance{0, 0} : Tolerance{1e-6, 1e-6};
}

class CapturableTest : public ::testing::TestWithParam<Implementation> {};

TEST_P(CapturableTest, AdamWEqualsOrdinaryWithAScheduledLr) {
  auto ours = MixedParams(11), ref = Clones(ours);
  const auto g0 = torch::optim::AdamWOptions(3e-2).weight_decay(0.1).amsgrad(true);
  const auto g1 = torch::optim::AdamWOptions(2e-2).weight_decay(0.02).betas({0.8, 0.9});
  AdamW opt(Groups(ours, g0, g1), {}, GetParam(), /*maximize=*/false, /*capturable=*/true);
  AdamW ref_opt(Groups(ref, g0, g1), {}, GetParam());
  const Tolerance t = CapturableTolerance(GetParam());
  ExpectCapturableMatchesOrdinary(ours, opt, ref, ref_opt, {3e-2, 2e-2}, t.rtol, t.atol);
}

TEST_P(CapturableTest, AdamAmsgradWeightDecayEqualsOrdinaryWithAScheduledLr) {
  auto ours = MixedParams(12), ref = Clones(ours);
  const auto g0 = torch::optim::AdamOptions(3e-2).weight_decay(0.1).amsgrad(true);
  const auto g1 = torch::optim::AdamOptions(5e-2);
  Adam opt(Groups(ours, g0, g1), {}, GetParam(), /*maximize=*/false, /*capturable=*/true);
  Adam ref_opt(Groups(ref, g0, g1), {}, GetParam());
  const Tolerance t = CapturableTolerance(GetParam());
  ExpectCapturableMatchesOrdinary(ours, opt, ref, ref_opt, {3e-2, 5e-2}, t.rtol, t.atol);
}

TEST_P(CapturableTest, AdamMaximizeEqualsOrdinaryWithAScheduledLr) {
  auto ours = MixedParams(13), ref = Clones(ours);
  const auto g = torch::optim::AdamOptions(3e-2).weight_decay(0.05);
  Adam opt(Groups(ours, g, g), {}, GetParam(), /*maximize=*/true, /*capturable=*/true);
  Adam ref_opt(Groups(ref, g, g), {}, GetParam(), /*maximize=*/true);
  const Tolerance t = CapturableTolerance(GetParam());
  ExpectCapturableMatchesOrdinary(ours, opt, ref, ref_opt, {3e-2, 1e-2}, t.rtol, t.atol,
                                  /*maximize=*/true);
}

TEST_P(CapturableTest, SgdNesterovAndDampeningEqualOrdinaryWithAScheduledLr) {
  auto ours = MixedParams(14), ref = Clones(ours);
  const auto g0 = torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.01);
  const auto g1 = torch::optim::SGDOptions(0.2).momentum(0.5).dampening(0.2);
  SGD opt(Groups(ours, g0, g1), g0, GetParam(), /*maximize=*/false, /*capturable=*/true);
  SGD ref_opt(Groups(ref, g0, g1), g0, GetParam());
  const Tolerance t = CapturableTolerance(GetParam());
  ExpectCapturableMatchesOrdinary(ours, opt, ref, ref_opt, {0.1, 0.2}, t.rtol, t.atol);
}

TEST_P(CapturableTest, SgdMaximizeAndWithoutMomentumEqualOrdinaryWithAScheduledLr) {
  auto ours = MixedParams(15), ref = Clones(ours);
  const auto g0 = torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01);
  const auto g1 = torch::optim::SGDOptions(0.3).weight_decay(0.02);
  SGD opt(Groups(ours, g0, g1), g0, GetParam(), /*maximize=*/true, /*capturable=*/true);
  SGD ref_opt(Groups(ref, g0, g1), g0, GetParam(), /*maximize=*/true);
  const Tolerance t = CapturableTolerance(GetParam());
  ExpectCapturableMatchesOrdinary(ours, opt, ref, ref_opt, {0.1, 0.3}, t.rtol, t.atol,
                                  /*maximize=*/true);
}

// A capturable optimizer's state dict: exported after 3 steps, imported into
// a fresh capturable optimizer (other options: the import replaces them)
// and into an ordinary one; all three then step alike, the fresh capturable
// one bit for bit as the original (its device step tensors written from the
// imported int64 steps). With kFused the ordinary one is bit for bit too.
TEST_P(CapturableTest, StateDictRoundTrip) {
  auto a = MixedParams(16);
  const auto g0 = torch::optim::AdamWOptions(3e-2).weight_decay(0.1).amsgrad(true);
  const auto g1 = torch::optim::AdamWOptions(2e-2);
  const std::vector<double> bases = {3e-2, 2e-2};
  AdamW opt_a(Groups(a, g0, g1), {}, GetParam(), false, /*capturable=*/true);
  for (int s = 0; s < 3; ++s) {
    torch::manual_seed(400 + s);
    for (auto& p : a) p.mutable_grad() = torch::randn(p.sizes(), p.options().requires_grad(false));
    SetLrs(opt_a, bases, s, false);
    opt_a.step();
  }
  auto exported = state_dict::ExportOptimizerState(opt_a);
  ASSERT_TRUE(exported.ok()) << exported.status();
  for (const auto& [key, dict] : exported->state) {
    EXPECT_EQ(dict["step"].item<int64_t>(), 3) << state_dict::ParamKeyString(key);
  }
  auto b = Clones(a), c = Clones(a);
  const auto other = torch::optim::AdamWOptions(1.0);
  AdamW opt_b(Groups(b, other, other), {}, GetParam(), false, /*capturable=*/true);
  AdamW opt_c(Groups(c, other, other), {}, GetParam());
  // opt_b has stepped before: its step tensors hold other counts.
  for (auto& p : b) p.mutable_grad() = torch::ones_like(p);
  opt_b.step();
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
  }
  ASSERT_TRUE(state_dict::ImportOptimizerState(opt_b, *exported).ok());
  ASSERT_TRUE(state_dict::ImportOptimizerState(opt_c, *exported).ok());
  ExpectSameState(opt_b, opt_a, 0, 0, "imported");
  const Tolerance t = CapturableTolerance(GetParam());
  for (int s = 3; s < 6; ++s) {
    torch::manual_seed(400 + s);
    for (size_t i = 0; i < a.size(); ++i) {
      const Tensor g = torch::randn(a[i].sizes(), a[i].options().requires_grad(false));
      a[i].mutable_grad() = g;
      b[i].mutable_grad() = g.clone();
      c[i].mutable_grad() = g.clone();
    }
    SetLrs(opt_a, bases, s, false);
    SetLrs(opt_b, bases, s, false);
    SetLrs(opt_c, bases, s, true);
    opt_b.write_device_values();
    opt_a.step();
    opt_b.step();
    opt_c.step();
    EXPECT_TRUE(opt_b.last_step_replayable()) << s;
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(Same(b[i], a[i], 0, 0)) << "step " << s << " param " << i;
      EXPECT_TRUE(Same(c[i], a[i], t.rtol, t.atol)) << "step " << s << " param " << i;
    }
  }
  ExpectSameState(opt_b, opt_a, 0, 0, "after resuming");
  ExpectSameState(opt_c, opt_a, t.rtol, t.atol, "ordinary after resuming");
}

// What a CUDA graph's replay does, emulated on the CPU: write_device_values,
// the step's device work (here step(), whose own host counting is undone:
// a replay runs no host code), then record_replayed_step. The host counts
// and the device values must stay those of ordinary steps.
TEST_P(CapturableTest, RecordReplayedStepCountsAsAStepDoes) {
  auto ours = MixedParams(17), ref = Clones(ours);
  const auto g0 = torch::optim::AdamOptions(3e-2).weight_decay(0.1);
  const auto g1 = torch::optim::AdamOptions(2e-2).amsgrad(true);
  const std::vector<double> bases = {3e-2, 2e-2};
  Adam opt(Groups(ours, g0, g1), {}, GetParam(), false, /*capturable=*/true);
  Adam ref_opt(Groups(ref, g0, g1), {}, GetParam());
  for (int s = 0; s < 7; ++s) {
    torch::manual_seed(500 + s);
    for (size_t i = 0; i < ours.size(); ++i) {
      const Tensor g = torch::randn(ours[i].sizes(), ours[i].options().requires_grad(false));
      ours[i].mutable_grad() = g;
      ref[i].mutable_grad() = g.clone();
    }
    SetLrs(opt, bases, s, false);
    SetLrs(ref_opt, bases, s, true);
    opt.write_device_values();
    if (s < 2) {
      opt.step();  // the warm-up and the capture: step() counts itself
    } else {
      std::vector<int64_t> before;
      for (const auto& p : ours) {
        before.push_back(
            static_cast<torch::optim::AdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()))
                .step());
      }
      opt.step();
      ASSERT_TRUE(opt.last_step_replayable()) << s;
      for (size_t i = 0; i < ours.size(); ++i) {
        static_cast<torch::optim::AdamParamState&>(*opt.state().at(ours[i].unsafeGetTensorImpl()))
            .step(before[i]);
      }
      opt.record_replayed_step();
    }
    ref_opt.step();
    for (size_t i = 0; i < ours.size(); ++i) {
      const Tolerance t = CapturableTolerance(GetParam());
      EXPECT_TRUE(Same(ours[i], ref[i], t.rtol, t.atol)) << "step " << s << " param " << i;
    }
  }
  const Tolerance t = CapturableTolerance(GetParam());
  ExpectSameState(opt, ref_opt, t.rtol, t.atol, "after the replays");
}

INSTANTIATE_TEST_SUITE_P(Implementations, CapturableTest,
                         ::testing::Values(Implementation::kFused, Implementation::kForeach),
                         [](const auto& info) {
                           return std::string(implementation_name(info.param));
                         });

// found_inf = 1 (kFused): the step changes no parameter, moment, momentum
// buffer or device step count, whatever the gradients hold; once the caller
// records the skip, the host counts (and the states the step created) are
// as before, and the run goes on exactly as the ordinary optimizer that
// never saw that step. Parameter 1 gets its first gradient in the skipped
// step (its state is created, then removed by record_skipped_step).
template <typename Opt, typename Options>
void ExpectFoundInfSkips(const Options& g0, const Options& g1, const std::vector<double>& bases,
                         bool sgd) {
  auto ours = MixedParams(21), ref = Clones(ours);
  auto make = [&](std::vector<Tensor>& p, bool capturable) {
    if constexpr (std::is_same_v<Options, torch::optim::SGDOptions>) {
      return std::make_unique<Opt>(Groups(p, g0, g1), g0, Implementation::kFused, false,
                                   capturable);
    } else {
      return std::make_unique<Opt>(Groups(p, g0, g1), Options(), Implementation::kFused, false,
                                   capturable);
    }
  };
  auto opt = make(ours, true);
  auto ref_opt = make(ref, false);
  Tensor found_inf = torch::zeros({1});  // GradScaler's shape
  opt->set_found_inf(found_inf);
  int ref_step = 0;
  for (int s = 0; s < 6; ++s) {
    const bool skipped = s == 2;
    torch::manual_seed(600 + s);
    for (size_t i = 0; i < ours.size(); ++i) {
      Tensor g = torch::randn(ours[i].sizes(), ours[i].options().requires_grad(false));
      const bool none = i == 1 && s < 2;
      if (skipped) g.view(-1)[0] = i % 2 == 0 ? NAN : INFINITY;
      ours[i].mutable_grad() = none ? Tensor() : g;
      if (!skipped) ref[i].mutable_grad() = none ? Tensor() : g.clone();
    }
    SetLrs(*opt, bases, s, false);
    found_inf.fill_(skipped ? 1.0 : 0.0);
    if (!skipped) {
      opt->step();
      SetLrs(*ref_opt, bases, s, true);
      ref_opt->step();
      ++ref_step;
      continue;
    }
    std::vector<Tensor> params_before;
    for (const auto& p : ours) params_before.push_back(p.detach().clone());
    auto state_before = state_dict::ExportOptimizerState(*opt);
    ASSERT_TRUE(state_before.ok());
    const size_t states_before = opt->state().size();
    opt->step();
    for (size_t i = 0; i < ours.size(); ++i) {
      EXPECT_TRUE(torch::equal(ours[i], params_before[i])) << "skipped step, param " << i;
    }
    if (!sgd) {
      // Before the skip is recorded, the host counts are one ahead.
      auto counted = state_dict::ExportOptimizerState(*opt);
      ASSERT_TRUE(counted.ok());
      EXPECT_EQ(counted->state[0].second["step"].template item<int64_t>(), 3);
    }
    opt->record_skipped_step();
    EXPECT_EQ(opt->state().size(), states_before) << "the skipped step's new state was removed";
    ExpectSameState(*opt, *ref_opt, 0, 0, "after the skipped step");
  }
  EXPECT_EQ(ref_step, 5);
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_TRUE(torch::equal(ours[i], ref[i])) << "param " << i;
  }
  ExpectSameState(*opt, *ref_opt, 0, 0, "at the end");
}

TEST(CapturableFoundInfTest, AdamWSkipsTheStep) {
  ExpectFoundInfSkips<AdamW>(torch::optim::AdamWOptions(3e-2).weight_decay(0.1).amsgrad(true),
                             torch::optim::AdamWOptions(2e-2), {3e-2, 2e-2}, /*sgd=*/false);
}

TEST(CapturableFoundInfTest, AdamSkipsTheStep) {
  ExpectFoundInfSkips<Adam>(torch::optim::AdamOptions(3e-2).weight_decay(0.1),
                            torch::optim::AdamOptions(2e-2).amsgrad(true), {3e-2, 2e-2},
                            /*sgd=*/false);
}

TEST(CapturableFoundInfTest, SgdSkipsTheStep) {
  // Dampening: a momentum buffer left behind by the skipped first step would
  // change the next update (buf = (1 - dampening) g instead of g).
  ExpectFoundInfSkips<SGD>(torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.3),
                           torch::optim::SGDOptions(0.2).momentum(0.5).nesterov(true), {0.1, 0.2},
                           /*sgd=*/true);
}

// The first step of all skipped: no state remains, and the next step is a
// first step.
TEST(CapturableFoundInfTest, ASkippedFirstStepLeavesNoState) {
  Tensor p = torch::ones({3}, torch::requires_grad());
  Tensor q = torch::ones({3}, torch::requires_grad());
  AdamW opt({p}, torch::optim::AdamWOptions(0.1), Implementation::kFused, false, true);
  AdamW ref({q}, torch::optim::AdamWOptions(AsFloat(0.1)));
  opt.set_found_inf(torch::ones({}));
  p.mutable_grad() = torch::full({3}, NAN);
  opt.step();
  EXPECT_TRUE(torch::equal(p, torch::ones({3})));
  opt.record_skipped_step();
  EXPECT_TRUE(opt.state().empty());
  opt.found_inf().fill_(0);
  p.mutable_grad() = torch::full({3}, 0.5);
  q.mutable_grad() = torch::full({3}, 0.5);
  opt.step();
  ref.step();
  EXPECT_TRUE(torch::equal(p, q));
  ExpectSameState(opt, ref, 0, 0, "after the first real step");
}

// ---- capturable mode: what it refuses --------------------------------------

std::string CallError(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

TEST(CapturableErrorTest, MethodsOfTheModeNeedIt) {
  Tensor p = torch::zeros({2}, torch::requires_grad());
  AdamW opt({p}, torch::optim::AdamWOptions(0.1));
  EXPECT_FALSE(opt.capturable());
  EXPECT_EQ(CallError([&] { opt.write_device_values(); }),
            "optim::AdamW (fused): write_device_values: the optimizer is not capturable: "
            "expected capturable mode (the constructor's capturable=true, or "
            "set_capturable(true))");
  EXPECT_EQ(CallError([&] { opt.set_found_inf(torch::zeros({})); }),
            "optim::AdamW (fused): set_found_inf: the optimizer is not capturable: expected "
            "capturable mode (the constructor's capturable=true, or set_capturable(true))");
  opt.set_capturable(true);
  opt.write_device_values();
  EXPECT_EQ(opt.lr_tensor(0).item<float>(), 0.1f);
}

TEST(CapturableErrorTest, FoundInfOfTheWrongKind) {
  Tensor p = torch::zeros({2}, torch::requires_grad());
  SGD foreach ({p}, torch::optim::SGDOptions(0.1), Implementation::kForeach, false, true);
  EXPECT_EQ(CallError([&] {
              foreach
                .set_found_inf(torch::zeros({}));
            }),
            "optim::SGD (foreach): set_found_inf: found_inf needs Implementation::kFused "
            "(ATen's fused kernels skip the update on the device when it holds 1; neither "
            "ATen's foreach ops nor Python's foreach path take a found_inf)");
  Adam fused({p}, torch::optim::AdamOptions(0.1), Implementation::kFused, false, true);
  EXPECT_EQ(CallError([&] { fused.set_found_inf(torch::zeros({}, torch::kFloat64)); }),
            "optim::Adam (fused): set_found_inf: found_inf is Double on cpu with shape []: "
            "expected a float32 tensor of one element (what ATen's fused kernels read)");
  EXPECT_EQ(CallError([&] { fused.set_found_inf(torch::zeros({2})); }),
            "optim::Adam (fused): set_found_inf: found_inf is Float on cpu with shape [2]: "
            "expected a float32 tensor of one element (what ATen's fused kernels read)");
  // On another device than the parameters (meta stands for a GPU here).
  fused.set_found_inf(torch::zeros({}, torch::TensorOptions().device(torch::kMeta)));
  p.mutable_grad() = torch::ones({2});
  EXPECT_EQ(StepError(fused),
            "optim::Adam (fused, capturable): found_inf is Float on meta but parameter 0 is "
            "Float on cpu: expected found_inf on the parameters' device");
  fused.set_found_inf(Tensor());
  fused.step();
}

TEST(CapturableErrorTest, AParamGroupOnTwoDevices) {
  // The group's learning rate tensor lives on one device (meta stands for a
  // GPU here).
  Tensor p = torch::zeros({2}, torch::requires_grad());
  Tensor m = torch::zeros({2}, torch::TensorOptions().device(torch::kMeta).requires_grad(true));
  AdamW opt({p, m}, torch::optim::AdamWOptions(0.1), Implementation::kFused, false, true);
  p.mutable_grad() = torch::ones({2});
  const std::string expected =
      "optim::AdamW (fused, capturable): parameter 1 is Float on meta but parameter 0 of its "
      "param group is Float on cpu: expected one device per param group (capturable mode "
      "keeps one device learning rate tensor per group)";
  EXPECT_EQ(StepError(opt), expected);
  EXPECT_EQ(CallError([&] { opt.write_device_values(); }), expected);
}

TEST(CapturableErrorTest, ReplaysAndSkipsMustFollowAStep) {
  Tensor p = torch::zeros({2}, torch::requires_grad());
  AdamW opt({p}, torch::optim::AdamWOptions(0.1), Implementation::kFused, false, true);
  EXPECT_EQ(CallError([&] { opt.record_replayed_step(); }),
            "optim::AdamW (fused): record_replayed_step: no step() was recorded in capturable "
            "mode: expected a replay of a graph that captured one");
  EXPECT_EQ(CallError([&] { opt.record_skipped_step(); }),
            "optim::AdamW (fused): record_skipped_step: no step() or replay was recorded since "
            "the last record_skipped_step(): expected one skip per skipped step");
  p.mutable_grad() = torch::ones({2});
  opt.step();  // the first: creates the state
  EXPECT_FALSE(opt.last_step_replayable());
  const std::string not_replayable =
      "optim::AdamW (fused): record_replayed_step: the last step() was not replayable (it made "
      "or filled device values from the host: a first step's state, a changed lr or step count "
      "not written by write_device_values() first): expected a graph to hold only a step() for "
      "which last_step_replayable() is true";
  EXPECT_EQ(CallError([&] { opt.record_replayed_step(); }), not_replayable);
  opt.write_device_values();
  opt.step();
  EXPECT_TRUE(opt.last_step_replayable());
  opt.record_replayed_step();
  // A changed lr not written first: step() writes it, and no graph may hold
  // that step().
  opt.param_groups()[0].options().set_lr(0.05);
  opt.step();
  EXPECT_FALSE(opt.last_step_replayable());
  EXPECT_EQ(opt.lr_tensor(0).item<float>(), 0.05f);
  EXPECT_EQ(CallError([&] { opt.record_replayed_step(); }), not_replayable);
  opt.record_skipped_step();
  EXPECT_EQ(CallError([&] { opt.record_skipped_step(); }),
            "optim::AdamW (fused): record_skipped_step: no step() or replay was recorded since "
            "the last record_skipped_step(): expected one skip per skipped step");
}

// Python's zero_grad(): every gradient dropped, the tensors left as they
// were (no detach_: a gradient tensor someone else still holds keeps its
// value), and the next backward creates fresh ones.
TEST(ZeroGradTest, DropsEveryGradientLikePythonSetToNone) {
  auto params = Params([](int i) { return golden()["init." + std::to_string(i)]; });
  const auto o = torch::optim::AdamWOptions(0.1);
  AdamW opt(Groups(params, o, o), o);
  SetGrads(params, 0, {});
  const Tensor held = params[2].grad();
  const Tensor before = held.clone();
  zero_grad(opt);
  for (int i = 0; i < kParams; ++i) EXPECT_FALSE(params[i].grad().defined()) << i;
  EXPECT_TRUE(torch::equal(held, before));
  (params[0] * 2).sum().backward();
  EXPECT_TRUE(torch::equal(params[0].grad(), torch::full_like(params[0], 2)));
}

}  // namespace
}  // namespace optim
