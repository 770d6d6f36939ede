#include "optim/optimizers.h"

#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <torch/types.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <set>
#include <string>
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
