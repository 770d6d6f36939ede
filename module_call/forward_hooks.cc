// The per-module hook registry: copy-on-write snapshots under one mutex, so
// a call reads its module's hooks with one lookup and runs them unlocked.
#include "module_call/forward_hooks.h"

#include <torch/nn/module.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace module_call {
namespace {

struct Entry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<const internal::ModuleHooks> hooks;
};

struct Registry {
  std::mutex mu;
  std::unordered_map<const torch::nn::Module*, Entry> entries;
  uint64_t next_id = 1;

  // The live entry of `module` (an expired one is dropped); null if none.
  Entry* find(const torch::nn::Module* module) {
    auto it = entries.find(module);
    if (it == entries.end()) return nullptr;
    if (it->second.module.expired()) {
      entries.erase(it);
      return nullptr;
    }
    return &it->second;
  }

  // Replaces `module`'s snapshot with `edit` applied to a copy of it.
  template <typename Edit>
  void update(const std::shared_ptr<torch::nn::Module>& module, Edit&& edit) {
    Entry* entry = find(module.get());
    if (entry == nullptr) {
      entry = &entries[module.get()];
      entry->module = module;
    }
    auto copy = entry->hooks ? std::make_shared<internal::ModuleHooks>(*entry->hooks)
                             : std::make_shared<internal::ModuleHooks>();
    edit(*copy);
    entry->hooks = std::move(copy);
  }
};

Registry& registry() {
  static auto* registry = new Registry();  // leaked: used from destructors
  return *registry;
}

thread_local int rerunning_depth = 0;

}  // namespace

HookHandle register_forward_hooks(const std::shared_ptr<torch::nn::Module>& module,
                                  ForwardHooks hooks) {
  TORCH_CHECK(module != nullptr, "module_call::register_forward_hooks: module is null");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const uint64_t id = r.next_id++;
  r.update(module,
           [&](internal::ModuleHooks& all) { all.forward.emplace_back(id, std::move(hooks)); });
  return HookHandle(module.get(), id);
}

void HookHandle::remove() {
  if (module_ == nullptr) return;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  Entry* entry = r.find(module_);
  if (entry == nullptr) return;
  auto copy = std::make_shared<internal::ModuleHooks>(*entry->hooks);
  auto& forward = copy->forward;
  forward.erase(std::remove_if(forward.begin(), forward.end(),
                               [this](const auto& item) { return item.first == id_; }),
                forward.end());
  entry->hooks = std::move(copy);
  module_ = nullptr;
}

void set_region_runner(const std::shared_ptr<torch::nn::Module>& module, RegionRunner runner) {
  TORCH_CHECK(module != nullptr, "module_call::set_region_runner: module is null");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.update(module, [&](internal::ModuleHooks& all) { all.region_runner = std::move(runner); });
}

bool has_region_runner(const torch::nn::Module& module) {
  auto hooks = internal::hooks_of(module);
  return hooks && hooks->region_runner;
}

void run_before_rerun_hooks(const torch::nn::Module& module) {
  if (auto hooks = internal::hooks_of(module)) {
    for (const auto& item : hooks->forward) {
      if (item.second.before_rerun) item.second.before_rerun();
    }
  }
}

void run_before_rerun_backward_hooks(const torch::nn::Module& module) {
  if (auto hooks = internal::hooks_of(module)) {
    for (const auto& item : hooks->forward) {
      if (item.second.before_rerun_backward) item.second.before_rerun_backward();
    }
  }
}

bool in_rerunning_region() { return rerunning_depth > 0; }
RerunningRegion::RerunningRegion() { ++rerunning_depth; }
RerunningRegion::~RerunningRegion() { --rerunning_depth; }

namespace internal {

std::shared_ptr<const ModuleHooks> hooks_of(const torch::nn::Module& module) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  Entry* entry = r.find(&module);
  return entry == nullptr ? nullptr : entry->hooks;
}

}  // namespace internal
}  // namespace module_call
