#pragma once

// TreeFn: a function over pytrees, the currency of the transforms.
//
// Every transform maps a TreeFn to a TreeFn (JAX's design), so they compose
// freely: vmap(grad(f)), jacrev(jacrev(f)), vmap(jacrev(f)). The typed layer
// (typed.h) wraps ordinary C++ callables into TreeFns on the fly.

#include <ATen/core/ivalue.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace functorch {

class TreeFn {
 public:
  using Signature = c10::IValue(const std::vector<c10::IValue>& args);

  // `name` appears in error messages where Python prints func.__name__.
  explicit TreeFn(std::function<Signature> fn, std::string name = "f")
      : fn_(std::move(fn)), name_(std::move(name)) {}

  c10::IValue operator()(const std::vector<c10::IValue>& args) const { return fn_(args); }

  const std::string& name() const { return name_; }

 private:
  std::function<Signature> fn_;
  std::string name_;
};

}  // namespace functorch
