// What the parts of the runtime share: the module -> runtime registry,
// unit names in messages, the units' pre-order and the optimizer-facing
// parameters.
#include "fsdp/internal/runtime_state.h"

#include <unordered_set>

namespace fsdp {
namespace internal {

std::string describe(const std::string& fqn) { return fqn.empty() ? "<root>" : fqn; }

std::string unit_name(const std::string& fqn) { return "'" + describe(fqn) + "'"; }

Registry& Registry::get() {
  static auto* registry = new Registry();  // leaked: used from destructors
  return *registry;
}

std::shared_ptr<Runtime> Registry::find(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(module);
  return it == map_.end() ? nullptr : it->second.lock();
}

void Registry::add(const torch::nn::Module* module, const std::shared_ptr<Runtime>& rt) {
  std::lock_guard<std::mutex> lock(mu_);
  map_[module] = rt;
}

void Registry::remove(const torch::nn::Module* module, const Runtime* rt) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(module);
  if (it == map_.end()) return;
  auto held = it->second.lock();
  if (held == nullptr || held.get() == rt) map_.erase(it);
}

Runtime::~Runtime() {
  for (auto& handle : hook_handles_) handle.remove();
  for (const auto& item : owner_of_) Registry::get().remove(item.first, this);
}

std::vector<int> Runtime::preorder() const {
  std::vector<int> order;
  for (const auto& m : root_->modules(/*include_self=*/true)) {
    auto it = unit_of_.find(m.get());
    if (it != unit_of_.end()) order.push_back(it->second);
  }
  return order;
}

torch::OrderedDict<std::string, at::Tensor> Runtime::named_parameters() const {
  torch::OrderedDict<std::string, at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  if (options_.use_orig_params) {
    for (const auto& item : root_->named_parameters()) {
      if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
        out.insert(item.key(), item.value());
      }
    }
    return out;
  }
  for (int i : preorder()) {
    const auto& unit = *units_[i];
    if (!unit.handle) continue;
    out.insert(unit.fqn.empty() ? "flat_param" : unit.fqn + ".flat_param",
               unit.handle->flat_param());
  }
  for (const auto& item : unmanaged_params_) {
    if (seen.insert(item.second.unsafeGetTensorImpl()).second) {
      out.insert(item.first, item.second);
    }
  }
  return out;
}

}  // namespace internal
}  // namespace fsdp
