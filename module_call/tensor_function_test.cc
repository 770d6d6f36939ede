// tensor_function.h on its own: it is included first, so it must compile
// with nothing before it (it needs only <ATen/core/Tensor.h>), and the
// plumbing it declares works: tensor arguments in order, other arguments
// carried unchanged, every output kind flattened and rebuilt.
#include "module_call/tensor_function.h"

#include <ATen/ops/ones.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

namespace module_call {
namespace {

TEST(TensorFunction, KeepsTensorArgumentsInOrderAndCarriesTheRest) {
  const at::Tensor a = at::ones({2});
  const at::Tensor b = at::ones({3});
  const std::vector<at::Tensor> inputs = tensor_arguments(a, 7, std::string("x"), b);
  ASSERT_EQ(inputs.size(), 2u);
  EXPECT_TRUE(inputs[0].is_same(a));
  EXPECT_TRUE(inputs[1].is_same(b));

  auto fn = [](const at::Tensor& x, int k, const std::string& s, const at::Tensor& y) {
    EXPECT_EQ(k, 7);
    EXPECT_EQ(s, "x");
    return std::make_tuple(y, x);
  };
  using Out = tensor_function_output_t<decltype(fn), at::Tensor, int, std::string, at::Tensor>;
  static_assert(std::is_same<Out, std::tuple<at::Tensor, at::Tensor>>::value);
  TensorFunction f = as_tensor_function(fn, a, 7, std::string("x"), b);
  // Called again on other inputs (as a rerun in backward would).
  const at::Tensor c = at::ones({4});
  const at::Tensor d = at::ones({5});
  Out out = from_tensors<Out>(f({c, d}));
  EXPECT_TRUE(std::get<0>(out).is_same(d));
  EXPECT_TRUE(std::get<1>(out).is_same(c));
}

TEST(TensorFunction, OutputKinds) {
  static_assert(is_tensor_output<at::Tensor>::value);
  static_assert(is_tensor_output<std::vector<at::Tensor>>::value);
  static_assert(!is_tensor_output<int>::value);
  const at::Tensor a = at::ones({1});
  EXPECT_TRUE(from_tensors<at::Tensor>(to_tensors(a)).is_same(a));
  EXPECT_EQ(from_tensors<std::vector<at::Tensor>>(to_tensors(std::vector<at::Tensor>{a, a})).size(),
            2u);
}

}  // namespace
}  // namespace module_call
