#include "functorch/module/functional_call.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

namespace functorch {
namespace {

using NamedList = std::vector<std::pair<std::string, torch::Tensor>>;

// Python's repr of a list of strings: ['a', 'b'].
std::string py_list(const std::vector<std::string>& names) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < names.size(); ++i) {
    out << (i ? ", " : "") << '\'' << names[i] << '\'';
  }
  out << ']';
  return out.str();
}

// Merges the dicts; a key in more than one is PyTorch's ValueError.
NamedList merge(const ParameterAndBufferDicts& dicts) {
  NamedList merged;
  if (dicts.dicts().size() == 1) {
    for (const auto& item : *dicts.dicts().front()) merged.emplace_back(item.key(), item.value());
    return merged;
  }
  std::unordered_map<std::string, int> count;
  std::vector<std::string> order;  // first appearance, as Python's Counter
  for (const NamedTensors* dict : dicts.dicts()) {
    for (const auto& item : *dict) {
      if (count[item.key()]++ == 0) order.push_back(item.key());
      merged.emplace_back(item.key(), item.value());
    }
  }
  std::vector<std::string> repeated;
  for (const auto& key : order) {
    if (count[key] > 1) repeated.push_back(key);
  }
  TORCH_CHECK_VALUE(repeated.empty(), py_list(repeated),
                    " appeared in multiple dictionaries; behavior of functional "
                    "call is ambiguous");
  return merged;
}

// tie_weights: a value given for one name of a tied tensor goes to all its
// names (PyTorch's _untie_named_tensors_map).
NamedList untie(const torch::nn::Module& module, const NamedList& given) {
  std::map<const c10::TensorImpl*, std::vector<std::string>> tied_by_tensor;
  std::vector<std::pair<std::string, const c10::TensorImpl*>> all;
  for (const auto& item : module.named_parameters()) {
    all.emplace_back(item.key(), item.value().unsafeGetTensorImpl());
  }
  for (const auto& item : module.named_buffers()) {
    all.emplace_back(item.key(), item.value().unsafeGetTensorImpl());
  }
  for (const auto& entry : all) tied_by_tensor[entry.second].push_back(entry.first);
  std::unordered_map<std::string, const std::vector<std::string>*> tied_names;
  for (const auto& tie : tied_by_tensor) {
    if (tie.second.size() > 1) {
      for (const auto& name : tie.second) tied_names[name] = &tie.second;
    }
  }
  if (tied_names.empty()) return given;

  std::unordered_map<std::string, const torch::Tensor*> given_by_name;
  for (const auto& item : given) given_by_name[item.first] = &item.second;
  for (const auto& item : given) {
    auto tie = tied_names.find(item.first);
    if (tie == tied_names.end()) continue;
    std::set<const c10::TensorImpl*> values;
    for (const auto& name : *tie->second) {
      auto value = given_by_name.find(name);
      if (value != given_by_name.end()) values.insert(value->second->unsafeGetTensorImpl());
    }
    if (values.size() > 1) {
      std::vector<std::string> sorted = *tie->second;
      std::sort(sorted.begin(), sorted.end());
      TORCH_CHECK_VALUE(false, "functional_call got multiple values for keys ", py_list(sorted),
                        ", which are tied. Consider using tie_weights=False");
    }
  }
  NamedList untied = given;
  for (const auto& item : given) {
    auto tie = tied_names.find(item.first);
    if (tie == tied_names.end()) continue;
    for (const auto& name : *tie->second) {
      if (given_by_name.count(name) == 0) {
        untied.emplace_back(name, item.second);
        given_by_name[name] = &item.second;
      }
    }
  }
  return untied;
}

std::string quoted_join(const std::vector<std::string>& names) {
  std::ostringstream out;
  for (size_t i = 0; i < names.size(); ++i) out << (i ? ", " : "") << '\'' << names[i] << '\'';
  return out.str();
}

}  // namespace

ParameterAndBufferDicts::ParameterAndBufferDicts(const std::vector<NamedTensors>& dicts) {
  for (const auto& dict : dicts) dicts_.push_back(&dict);
}

ParameterAndBufferDicts::ParameterAndBufferDicts(std::initializer_list<NamedTensors> dicts) {
  for (const auto& dict : dicts) dicts_.push_back(&dict);
}

ReparametrizeGuard::ReparametrizeGuard(std::shared_ptr<torch::nn::Module> module,
                                       const ParameterAndBufferDicts& parameters_and_buffers,
                                       const FunctionalCallOptions& options)
    : accessor_(std::move(module)) {
  const torch::nn::Module& root = *accessor_.module();
  NamedList given = merge(parameters_and_buffers);
  NamedList untied = options.tie_weights ? untie(root, given) : given;

  if (options.strict) {
    std::vector<std::string> keys;
    for (const auto& item : given) keys.push_back(item.first);
    auto [missing, unexpected] = accessor_.check_keys(keys);
    std::vector<std::string> errors;
    if (!unexpected.empty())
      errors.push_back("Unexpected key(s): " + quoted_join(unexpected) + ".");
    if (!missing.empty()) errors.push_back("Missing key(s): " + quoted_join(missing) + ".");
    if (!errors.empty()) {
      std::string joined;
      for (const auto& error : errors) joined += "\n\t" + error;
      TORCH_CHECK(false, "Error(s) in reparametrizing for ", root.name(), ":", joined);
    }
  }

  std::vector<std::string> names;
  std::vector<torch::Tensor> values;
  names.reserve(untied.size());
  values.reserve(untied.size());
  for (auto& item : untied) {
    const size_t dot = item.first.rfind('.');
    const std::string path = dot == std::string::npos ? "" : item.first.substr(0, dot);
    // As PyTorch (which would set a new attribute nobody reads): a key naming
    // no parameter or buffer of an existing submodule changes nothing; a key
    // whose submodule does not exist is an error (resolve() says which).
    if (!accessor_.has_entry(item.first) && accessor_.has_submodule(path)) continue;
    names.push_back(std::move(item.first));
    values.push_back(std::move(item.second));
  }
  swap_ = std::make_unique<ScopedTensorSwap>(accessor_, std::move(names), std::move(values));
}

ReparametrizeGuard::~ReparametrizeGuard() = default;

}  // namespace functorch
