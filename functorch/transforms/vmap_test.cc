// Tests for functorch::vmap and the pytree layer.
//
// Golden values: tools/golden/functorch_transforms_golden.py (functorch 1.13).
//
// Ported from PyTorch's test/functorch/test_vmap.py (TestVmapAPI unless
// noted), rewritten in C++:
//   test_non_tensor_output_raises, test_different_map_dim_size_raises,
//   test_func_with_no_inputs, test_func_with_no_tensors,
//   test_constant_function, test_single_input, test_multiple_inputs,
//   test_multiple_outputs, test_multiple_outputs_error_cases,
//   test_out_dims_and_num_outputs_mismatch_err_msg,
//   test_out_dim_out_of_bounds_err_msg, test_non_zero_out_dims,
//   test_out_dims_none, test_out_dims_none_tuple, test_out_dims_edge_case,
//   test_not_enough_in_dims_err_msg,
//   test_integer_in_dim_but_not_tensor_input_err_msg,
//   test_in_dim_not_in_tensor_err_msg, test_non_zero_in_dims,
//   test_none_in_dims, test_nested_tuple_in_dims, test_nested_dict_in_dims,
//   test_nested_list_in_dims, test_nested_dict_out_dims,
//   test_nested_with_same_map_dim, test_nested_with_diag_embed (nested
//   vmap with out_dims), test_noop_in_inner_vmap, test_nested_out_dims,
//   test_inplace_fallback_unary (in-place op on a BatchedTensor),
//   test_vmap_chunk_size (chunk_size: same results, <= 0 rejected),
//   TestRandomness: test_randomness_error / same / different (randn, rand,
//   dropout), with chunk_size under randomness=same.
// Also: negative in_dims/out_dims, non-tensor passthrough with out_dims None,
// a throwing function leaves the DynamicLayer stack empty, the typed layer.

#include <ATen/functorch/DynamicLayer.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "functorch/transforms/testing/golden.h"
#include "functorch/transforms/transforms.h"

namespace functorch {
namespace {

using testing::AllClose;
using testing::golden;
using torch::Tensor;

Tensor mul(const Tensor& a, const Tensor& b) { return a * b; }
// torch::mm is overloaded (out_dtype); vmap needs one function.
Tensor mm(const Tensor& a, const Tensor& b) { return torch::mm(a, b); }

size_t stack_depth() { return at::functorch::getDynamicLayerStack().size(); }

class VmapTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(stack_depth(), 0u); }
  void TearDown() override { EXPECT_EQ(stack_depth(), 0u); }
};

TEST_F(VmapTest, GoldenDot) {
  const auto& g = golden();
  Tensor x = g["dot.x"], y = g["dot.y"];
  auto batched_dot = vmap(torch::dot);
  EXPECT_TRUE(AllClose(batched_dot(x, y), g["vmap_dot"]));
  EXPECT_TRUE(AllClose(vmap(torch::dot, 1)(x, y), g["vmap_dot_in_dims_1"]));
  EXPECT_TRUE(AllClose(vmap(torch::dot, {0, std::nullopt})(x, y[0]), g["vmap_dot_0_none"]));
  EXPECT_TRUE(AllClose(vmap(vmap(torch::dot))(g["nested.x"], g["nested.y"]), g["vmap_vmap_dot"]));
  EXPECT_TRUE(AllClose(vmap(torch::mv, {std::nullopt, 0}, 1)(g["mv.m"], x.slice(1, 0, 3)),
                       g["vmap_mv_out_dims_1"]));
  EXPECT_TRUE(AllClose(vmap([](Tensor a) { return a.sin() * 2; }, -1)(x), g["vmap_neg_in_dim"]));
}

TEST_F(VmapTest, IsVectorizedNotALoop) {
  // Inside vmap the function sees one example: a BatchedTensor whose logical
  // shape lacks the batch dim, and it runs exactly once.
  int calls = 0;
  Tensor x = torch::randn({6, 3});
  Tensor out = vmap([&calls](Tensor a) {
    ++calls;
    EXPECT_EQ(a.sizes(), torch::IntArrayRef({3}));
    return a * 2;
  })(x);
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(AllClose(out, x * 2));
}

// Ops dispatched on this thread while `f` runs (RecordFunction sees every
// dispatcher call, not redispatches). Its callbacks are plain function
// pointers, hence the thread_local.
thread_local std::vector<std::string>* recorded_ops = nullptr;

template <typename F>
std::vector<std::string> ops_called(F&& f) {
  std::vector<std::string> names;
  recorded_ops = &names;
  auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction& fn)
                                     -> std::unique_ptr<at::ObserverContext> {
        recorded_ops->emplace_back(fn.name());
        return nullptr;
      }).scopes({at::RecordScope::FUNCTION}));
  f();
  at::removeCallback(handle);
  recorded_ops = nullptr;
  return names;
}

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// A real product is one rounding whichever kernel computes it, so the rule's
// multiply has ATen's bits. A complex product is two products and a sum, and
// a BLAS cgemm may fuse them (FMA) where ATen's multiply does not: on a CPU
// whose MKL takes such a path (seen on an AVX-512 Xeon, 2026-11-26: 2.7e-7
// apart) only closeness holds for complex.
bool same_result(const Tensor& actual, const Tensor& expected) {
  if (actual.is_complex()) return torch::allclose(actual, expected, 1e-6, 1e-6);
  return torch::equal(actual, expected);
}

TEST_F(VmapTest, MmWithContractionOneIsAMultiply) {
  // The per-sample weight gradient of a linear layer, x^T . grad_out for one
  // example, is such an mm. Each real element is one rounded product either
  // way.
  for (auto dtype : {torch::kFloat, torch::kDouble, torch::kComplexFloat}) {
    Tensor a = torch::randn({7, 5, 1}, dtype), b = torch::randn({7, 1, 4}, dtype);
    Tensor out;
    auto names = ops_called([&] { out = vmap(mm)(a, b); });
    EXPECT_TRUE(same_result(out, torch::bmm(a, b))) << dtype;
    EXPECT_TRUE(contains(names, "aten::mul")) << dtype;
    EXPECT_FALSE(contains(names, "aten::bmm")) << dtype;
    // One side batched, either side; the batch dim elsewhere.
    EXPECT_TRUE(same_result(vmap(mm, {0, std::nullopt})(a, b[0]), torch::matmul(a, b[0]))) << dtype;
    EXPECT_TRUE(same_result(vmap(mm, {std::nullopt, 0})(a[0], b), torch::matmul(a[0], b))) << dtype;
    EXPECT_TRUE(same_result(vmap(mm, {2, 0})(a.permute({1, 2, 0}), b), torch::bmm(a, b))) << dtype;
  }
  // Nested: each level's mm reaches the rule.
  Tensor a = torch::randn({3, 7, 5, 1}), b = torch::randn({3, 7, 1, 4});
  Tensor out;
  auto names = ops_called([&] { out = vmap(vmap(mm))(a, b); });
  EXPECT_TRUE(torch::equal(out, torch::matmul(a, b)));
  EXPECT_FALSE(contains(names, "aten::bmm"));
}

TEST_F(VmapTest, MmWithALongerContractionKeepsATenRule) {
  Tensor a = torch::randn({7, 5, 3}), b = torch::randn({7, 3, 4});
  Tensor out;
  auto names = ops_called([&] { out = vmap(mm)(a, b); });
  EXPECT_TRUE(contains(names, "aten::bmm"));
  EXPECT_TRUE(AllClose(out, torch::bmm(a, b)));
  // What mm refuses, it still refuses under vmap: mixed dtypes, wrong ranks.
  Tensor d = torch::randn({7, 1, 4}, torch::kDouble);
  EXPECT_THROW(vmap(mm)(a.narrow(2, 0, 1), d), c10::Error);
  EXPECT_THROW(vmap(mm)(torch::randn({7, 5}), torch::randn({7, 1, 4})), c10::Error);
  // Integer mm (not rewritten) agrees with the loop.
  Tensor ia = torch::randint(-5, 5, {7, 5, 1}), ib = torch::randint(-5, 5, {7, 1, 4});
  EXPECT_TRUE(torch::equal(vmap(mm)(ia, ib), torch::bmm(ia, ib)));
}

TEST_F(VmapTest, MmWithContractionOneComposesWithAutodiff) {
  Tensor a = torch::randn({6, 5, 1}, torch::kDouble), b = torch::randn({6, 1, 4}, torch::kDouble);
  Tensor w = torch::randn({6, 5, 4}, torch::kDouble);
  // grad outside vmap: the multiply is what the outer autograd records.
  auto weighted = [&w](Tensor a, Tensor b) { return (vmap(mm)(a, b) * w).sum(); };
  Tree g = grad(weighted, {0, 1})(a, b);
  EXPECT_TRUE(AllClose(g[0], torch::bmm(w, b.transpose(1, 2)), 1e-12, 1e-12));
  EXPECT_TRUE(AllClose(g[1], torch::bmm(a.transpose(1, 2), w), 1e-12, 1e-12));
  // jvp through it: the product rule.
  Tensor ta = torch::randn_like(a), tb = torch::randn_like(b);
  auto [primal, tangent] = jvp([](Tensor a, Tensor b) { return vmap(mm)(a, b); },
                               std::make_tuple(a, b), std::make_tuple(ta, tb));
  EXPECT_TRUE(AllClose(primal, torch::bmm(a, b), 1e-12, 1e-12));
  EXPECT_TRUE(AllClose(tangent, torch::bmm(ta, b) + torch::bmm(a, tb), 1e-12, 1e-12));
}

TEST_F(VmapTest, SingleAndMultipleInputs) {
  Tensor x = torch::randn({3, 4}), y = torch::randn({3, 4});
  EXPECT_TRUE(AllClose(vmap([](Tensor a) { return a * 2; })(x), x * 2));
  EXPECT_TRUE(AllClose(vmap(mul)(x, y), x * y));
  EXPECT_TRUE(AllClose(vmap([](Tensor a, Tensor b) { return a * b; }, {0, 1})(x, y.t()), x * y));
}

TEST_F(VmapTest, MultipleOutputs) {
  Tensor x = torch::randn({3, 4});
  auto f = [](Tensor a) { return std::make_tuple(a * 2, a * 3); };
  auto [a, b] = vmap(f)(x);
  EXPECT_TRUE(AllClose(a, x * 2));
  EXPECT_TRUE(AllClose(b, x * 3));
  auto [c, d] = vmap(f, 0, {0, 1})(x);
  EXPECT_TRUE(AllClose(c, x * 2));
  EXPECT_TRUE(AllClose(d, (x * 3).t()));
  auto lists = vmap([](Tensor a) { return std::vector<Tensor>{a, a + 1}; })(x);
  ASSERT_EQ(lists.size(), 2u);
  EXPECT_TRUE(AllClose(lists[1], x + 1));
}

TEST_F(VmapTest, ConstantFunctionIsExpanded) {
  Tensor x = torch::randn({3});
  Tensor c = torch::tensor({1.0});
  Tensor out = vmap([c](Tensor) { return c; })(x);
  EXPECT_TRUE(AllClose(out, c.expand({3, 1})));
}

TEST_F(VmapTest, NonZeroAndNegativeOutDims) {
  Tensor x = torch::randn({2, 3, 5});
  EXPECT_TRUE(AllClose(vmap([](Tensor a) { return a; }, 0, 1)(x), x.permute({1, 0, 2})));
  EXPECT_TRUE(AllClose(vmap([](Tensor a) { return a; }, 0, -1)(x), x.permute({1, 2, 0})));
  EXPECT_TRUE(AllClose(vmap([](Tensor a) { return a; }, 0, 2)(x), x.permute({1, 2, 0})));
  // Single output with a one-element out_dims tuple (test_out_dims_edge_case).
  EXPECT_TRUE(AllClose(vmap([](Tensor a) { return a; }, 0, {1})(x), x.permute({1, 0, 2})));
}

TEST_F(VmapTest, OutDimsNonePassesThrough) {
  Tensor x = torch::randn({3, 2});
  Tensor y = torch::randn({2});
  // An unbatched tensor and a non-tensor can leave vmap unmapped.
  auto f = TreeFn([y](const std::vector<c10::IValue>& args) -> c10::IValue {
    return c10::ivalue::Tuple::create(
        {args[0].toTensor() * 2, y, c10::IValue(3.5), c10::IValue("tag")});
  });
  c10::IValue out = vmap(f, 0, {0, std::nullopt, std::nullopt, std::nullopt})({c10::IValue(x)});
  const auto& elems = out.toTupleRef().elements();
  EXPECT_TRUE(AllClose(elems[0].toTensor(), x * 2));
  EXPECT_TRUE(elems[1].toTensor().is_same(y));
  EXPECT_EQ(elems[2].toDouble(), 3.5);
  EXPECT_EQ(elems[3].toStringRef(), "tag");
  // Typed: (Tensor, double) with the double unmapped.
  auto [t, d] = vmap([](Tensor a) { return std::make_tuple(a + 1, 2.0); }, 0, {0, std::nullopt})(x);
  EXPECT_TRUE(AllClose(t, x + 1));
  EXPECT_EQ(d, 2.0);
  // A batched output cannot be unmapped.
  EXPECT_THROW_WITH(vmap([](Tensor a) { return a; }, 0, std::nullopt)(x),
                    "can not return a BatchedTensor when out_dim is None");
}

TEST_F(VmapTest, InDimsNoneAndNested) {
  Tensor x = torch::randn({2, 3}), y = torch::randn({3});
  EXPECT_TRUE(AllClose(vmap(mul, {0, std::nullopt})(x, y), x * y));
  // Nested tuple in_dims: f((a, b), c), b unmapped.
  Tensor a = torch::randn({4, 3}), b = torch::randn({3}), c = torch::randn({3, 4});
  auto f = [](std::tuple<Tensor, Tensor> ab, Tensor c) {
    return std::get<0>(ab) * std::get<1>(ab) + c;
  };
  Tensor out = vmap(f, {{0, std::nullopt}, 1})(std::make_tuple(a, b), c);
  EXPECT_TRUE(AllClose(out, a * b + c.t()));
}

TEST_F(VmapTest, DictAndListInDims) {
  Tensor w = torch::randn({5, 3}), bias = torch::randn({3});
  NamedTensors params{{"w", w}, {"b", bias}};
  auto f = [](NamedTensors p) { return p["w"] + p["b"]; };
  Tensor out = vmap(f, DimTree::tuple({DimTree::dict({{"b", std::nullopt}, {"w", 0}})}))(params);
  EXPECT_TRUE(AllClose(out, w + bias));
  // in_dims as a broadcast int over a list argument.
  std::vector<Tensor> list{torch::randn({5, 2}), torch::randn({5, 2})};
  Tensor sum = vmap([](std::vector<Tensor> l) { return l[0] + l[1]; })(list);
  EXPECT_TRUE(AllClose(sum, list[0] + list[1]));
  // Per-element list in_dims.
  Tensor sum2 =
      vmap([](std::vector<Tensor> l) { return l[0] + l[1]; },
           DimTree::tuple({DimTree::list({0, 1})}))(std::vector<Tensor>{list[0], list[1].t()});
  EXPECT_TRUE(AllClose(sum2, list[0] + list[1]));
}

TEST_F(VmapTest, DictOutDims) {
  Tensor x = torch::randn({4, 2});
  auto f = [](Tensor a) { return std::map<std::string, Tensor>{{"a", a}, {"b", a * 2}}; };
  auto out = vmap(f, 0, DimTree::dict({{"a", 0}, {"b", 1}}))(x);
  EXPECT_TRUE(AllClose(out["a"], x));
  EXPECT_TRUE(AllClose(out["b"], (x * 2).t()));
}

TEST_F(VmapTest, NestedVmap) {
  Tensor x = torch::randn({2, 3, 5}), y = torch::randn({2, 3, 5});
  // A float32 dot and mul+sum round differently (the BLAS kernel picks its
  // own summation order), so the tolerance is float32's, not the default.
  Tensor expected = (x * y).sum(-1);
  EXPECT_TRUE(AllClose(vmap(vmap(torch::dot))(x, y), expected, 1e-5, 1e-6));
  // Different map dims at each level.
  EXPECT_TRUE(AllClose(vmap(vmap(torch::dot), 1)(x.transpose(0, 1), y.transpose(0, 1)), expected,
                       1e-5, 1e-6));
  // Inner out_dims.
  Tensor out = vmap(vmap([](Tensor a) { return a * 2; }, 0, 1))(x);
  EXPECT_TRUE(AllClose(out, (x * 2).transpose(1, 2)));
  // No-op in the inner vmap: the outer value is expanded along the inner map.
  Tensor u = torch::randn({3}), v = torch::randn({5});
  Tensor noop = vmap([v](Tensor a) { return vmap([a](Tensor) { return a; })(v); })(u);
  EXPECT_TRUE(AllClose(noop, u.unsqueeze(1).expand({3, 5})));
}

TEST_F(VmapTest, InPlaceOnBatchedTensor) {
  Tensor x = torch::randn({3, 4});
  Tensor y = x.clone();
  vmap([](Tensor a) { return a.mul_(2); })(y);
  EXPECT_TRUE(AllClose(y, x * 2));
}

TEST_F(VmapTest, ChunkSizeSameResults) {
  Tensor x = torch::randn({10, 6}), y = torch::randn({10, 6});
  Tensor full = vmap(torch::dot)(x, y);
  for (int64_t chunk : {1, 3, 4, 10, 64}) {
    Tensor chunked = vmap(torch::dot, 0, 0, Randomness::kError, chunk)(x, y);
    EXPECT_TRUE(AllClose(chunked, full)) << "chunk_size=" << chunk;
  }
  // Out dims and unmapped inputs with chunks.
  Tensor w = torch::randn({6, 2});
  auto f = [](Tensor a, Tensor w) { return std::make_tuple(a.matmul(w), a); };
  auto [m1, a1] = vmap(f, {0, std::nullopt}, {1, 0})(x, w);
  auto [m2, a2] = vmap(f, {0, std::nullopt}, {1, 0}, Randomness::kError, 3)(x, w);
  EXPECT_TRUE(AllClose(m1, m2));
  EXPECT_TRUE(AllClose(a1, a2));
}

TEST_F(VmapTest, RandomnessError) {
  Tensor x = torch::randn({4, 3});
  EXPECT_THROW_WITH(vmap([](Tensor a) { return a + torch::randn({3}); })(x), "randomness");
  EXPECT_THROW_WITH(vmap([](Tensor a) { return torch::dropout(a, 0.5, true); })(x), "randomness");
}

TEST_F(VmapTest, RandomnessDifferentAndSame) {
  Tensor x = torch::zeros({4, 3});
  auto add_noise = [](Tensor a) { return a + torch::randn({3}); };
  Tensor diff = vmap(add_noise, 0, 0, Randomness::kDifferent)(x);
  EXPECT_FALSE(torch::allclose(diff[0], diff[1]));
  Tensor same = vmap(add_noise, 0, 0, Randomness::kSame)(x);
  for (int i = 1; i < 4; ++i) EXPECT_TRUE(AllClose(same[i], same[0]));
  // Random op on a batched input (rand_like) draws per example in
  // 'different' mode; dropout keeps its expected shape.
  Tensor ones = torch::ones({8, 100});
  Tensor dropped = vmap([](Tensor a) { return torch::dropout(a, 0.5, true); }, 0, 0,
                        Randomness::kDifferent)(ones);
  EXPECT_EQ(dropped.sizes(), ones.sizes());
  EXPECT_FALSE(torch::equal(dropped[0], dropped[1]));
  // 'different' matches the unbatched draw of the whole batch from the same
  // seed (one randn of shape [B, 3]).
  torch::manual_seed(7);
  Tensor batched = vmap(add_noise, 0, 0, Randomness::kDifferent)(x);
  torch::manual_seed(7);
  Tensor reference = torch::randn({4, 3});
  EXPECT_TRUE(AllClose(batched, reference));
  // chunk_size with 'same': every chunk replays the same state, so the whole
  // batch still shares one draw.
  Tensor same_chunked = vmap(add_noise, 0, 0, Randomness::kSame, 2)(torch::zeros({5, 3}));
  for (int i = 1; i < 5; ++i) EXPECT_TRUE(AllClose(same_chunked[i], same_chunked[0]));
}

TEST_F(VmapTest, ParseRandomness) {
  EXPECT_EQ(parse_randomness("same"), Randomness::kSame);
  EXPECT_EQ(parse_randomness("different"), Randomness::kDifferent);
  EXPECT_EQ(parse_randomness("error"), Randomness::kError);
  EXPECT_THROW_WITH(parse_randomness("sometimes"),
                    "Only allowed values for randomness are 'error', "
                    "'different', or 'same'. Got sometimes");
}

// ---- PyTorch's errors (torch/_functorch/vmap.py wording) ----

TEST_F(VmapTest, ErrorInconsistentBatchSizes) {
  EXPECT_THROW_WITH(vmap(mul)(torch::randn({2, 3}), torch::randn({3, 3})),
                    "vmap: Expected all tensors to have the same size in the "
                    "mapped dimension, got sizes [2, 3] for the mapped "
                    "dimension");
}

TEST_F(VmapTest, ErrorInDimOutOfRange) {
  EXPECT_THROW_WITH(vmap(torch::dot, 2)(torch::randn({2, 3}), torch::randn({2, 3})),
                    "Got in_dim=2 for some input, but that input is a Tensor "
                    "of dimensionality 2 so expected in_dim to satisfy -2 <= "
                    "in_dim < 2.");
  EXPECT_THROW_WITH(vmap([](Tensor a) { return a; }, -3)(torch::randn({2, 3})), "Got in_dim=-3");
}

TEST_F(VmapTest, ErrorInDimsStructureMismatch) {
  Tensor x = torch::randn({2, 3});
  EXPECT_THROW_WITH(vmap(torch::dot, {0})(x, x),
                    "in_dims is not compatible with the structure of "
                    "`inputs`. in_dims has structure (*,) but inputs has "
                    "structure (*, *).");
  EXPECT_THROW_WITH(vmap(torch::dot, {0, 0, 0})(x, x), "in_dims is not compatible");
}

TEST_F(VmapTest, ErrorInDimForNonTensor) {
  EXPECT_THROW_WITH(vmap([](Tensor a, double s) { return a * s; })(torch::randn({2}), 2.0),
                    "Got in_dim=0 for an input but the input is of type <class 'float'>. "
                    "We cannot "
                    "vmap over non-Tensor arguments, please use None as the respective "
                    "in_dim");
  // With None for the scalar it works.
  Tensor out =
      vmap([](Tensor a, double s) { return a * s; }, {0, std::nullopt})(torch::ones({2}), 2.0);
  EXPECT_TRUE(AllClose(out, torch::full({2}, 2.0)));
}

TEST_F(VmapTest, ErrorNoInputsAndNoTensors) {
  TreeFn f([](const std::vector<c10::IValue>&) -> c10::IValue { return torch::ones({1}); });
  EXPECT_THROW_WITH(vmap(f)({}), "got no inputs");
  EXPECT_THROW_WITH(vmap(f, std::nullopt)({torch::ones({2})}),
                    "vmap: Expected at least one Tensor to vmap over");
}

TEST_F(VmapTest, ErrorChunkSize) {
  EXPECT_THROW_WITH(vmap(torch::dot, 0, 0, Randomness::kError, 0),
                    "vmap: chunk_size should be None or greater than 0. (got 0)");
  EXPECT_THROW_WITH(vmap(torch::dot, 0, 0, Randomness::kError, -1), "(got -1)");
}

TEST_F(VmapTest, ErrorFunctionReturningNoTensor) {
  Tensor x = torch::randn({2, 3});
  EXPECT_THROW_WITH(vmap([](Tensor) { return 1.5; })(x),
                    "must only return Tensors, got type <class 'float'>. Did you mean "
                    "to set out_dims= to None for output?");
  TreeFn returns_none([](const std::vector<c10::IValue>&) { return c10::IValue(); });
  EXPECT_THROW_WITH(vmap(returns_none)({x}),
                    "must only return Tensors, got type <class 'NoneType'>");
}

TEST_F(VmapTest, ErrorOutDims) {
  Tensor x = torch::randn({2, 3});
  auto two = [](Tensor a) { return std::make_tuple(a, a); };
  EXPECT_THROW_WITH(vmap(two, 0, {0, 0, 0})(x),
                    "out_dims is not compatible with the structure of "
                    "`outputs`. out_dims has structure (*, *, *) but outputs "
                    "has structure (*, *).");
  EXPECT_THROW_WITH(vmap([](Tensor a) { return a; }, 0, 3)(x), "Got out_dim=3");
}

TEST_F(VmapTest, ThrowingFunctionLeavesStackClean) {
  Tensor x = torch::randn({3, 4});
  auto bad = [](Tensor a) -> Tensor {
    EXPECT_GE(stack_depth(), 1u);
    throw std::runtime_error("boom");
    return a;
  };
  EXPECT_THROW(vmap(bad)(x), std::runtime_error);
  EXPECT_EQ(stack_depth(), 0u);
  EXPECT_THROW(vmap(vmap(bad))(torch::randn({2, 3, 4})), std::runtime_error);
  EXPECT_EQ(stack_depth(), 0u);
  // Errors raised by ATen inside vmap (shape mismatch) also unwind.
  EXPECT_THROW(vmap([](Tensor a) { return a.mm(a); })(x), c10::Error);
  EXPECT_EQ(stack_depth(), 0u);
  // Later transforms work.
  EXPECT_TRUE(AllClose(vmap(torch::dot)(x, x), (x * x).sum(1)));
}

TEST_F(VmapTest, PytreeRoundTrip) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("w", torch::ones({2}));
  d.insert("n", c10::IValue());
  c10::IValue tree = c10::ivalue::Tuple::create(
      {c10::IValue(std::vector<Tensor>{torch::zeros({1}), torch::ones({1})}), c10::IValue(d),
       c10::IValue(int64_t{3})});
  auto flat = tree_flatten(tree);
  EXPECT_EQ(flat.first.size(), 5u);
  EXPECT_EQ(flat.second.to_string(), "([*, *], {'w': *, 'n': *}, *)");
  c10::IValue back = tree_unflatten(flat.first, flat.second);
  EXPECT_EQ(tree_flatten(back).second, flat.second);
  EXPECT_TRUE(back.toTupleRef().elements()[0].isTensorList());
  EXPECT_THROW_WITH(tree_unflatten({flat.first[0]}, flat.second), "expected 5 leaves");
  auto dims =
      DimTree({DimTree::list({0, std::nullopt}), 1, std::nullopt}).broadcast_to(flat.second);
  ASSERT_TRUE(dims.has_value());
  EXPECT_EQ(dims->size(), 5u);
  EXPECT_EQ((*dims)[1], std::nullopt);
  EXPECT_EQ((*dims)[2], 1);
  EXPECT_EQ((*dims)[3], 1);
  EXPECT_FALSE(DimTree({0, 0}).broadcast_to(flat.second).has_value());
}

}  // namespace
}  // namespace functorch
