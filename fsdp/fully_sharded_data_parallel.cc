// The public FullyShardedDataParallel object: a thin handle on the shared
// internal::Runtime; which internal file does what: internal/runtime_state.h.
#include "fsdp/fully_sharded_data_parallel.h"

#include <ATen/ATen.h>

#include <unordered_set>

#include "fsdp/internal/runtime_state.h"

namespace fsdp {

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                   Options options) {
  TORCH_CHECK(module != nullptr, "FullyShardedDataParallel: module is null");
  rt_ = std::make_shared<internal::Runtime>(std::move(module), std::move(options));
  rt_->init();
}

FullyShardedDataParallel::~FullyShardedDataParallel() = default;

void FullyShardedDataParallel::check_root_callable() const {
  TORCH_CHECK(root_sequential_ != nullptr || !root_any_.is_empty(),
              "FullyShardedDataParallel::forward: the root module (", rt_->root_->name(),
              ") has no single forward() FSDP could call (wrapped type-erased, or its "
              "forward is a template or overloaded): wrap the typed module "
              "(std::shared_ptr<Impl> or its ModuleHolder), or enter the root through "
              "FullyShardedDataParallel::run(fn)");
}

std::vector<at::Tensor> FullyShardedDataParallel::parameters() const {
  return rt_->named_parameters().values();
}

torch::OrderedDict<std::string, at::Tensor> FullyShardedDataParallel::named_parameters() const {
  return rt_->named_parameters();
}

torch::OrderedDict<std::string, at::Tensor> FullyShardedDataParallel::named_buffers() const {
  torch::OrderedDict<std::string, at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : rt_->root_->named_buffers()) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second)
      out.insert(item.key(), item.value());
  }
  return out;
}

at::Tensor FullyShardedDataParallel::clip_grad_norm_(double max_norm, double norm_type) {
  return rt_->clip_grad_norm(max_norm, norm_type);
}

FullyShardedDataParallel::NoSyncGuard FullyShardedDataParallel::no_sync() {
  return NoSyncGuard(rt_);
}

FullyShardedDataParallel::NoSyncGuard::NoSyncGuard(std::shared_ptr<internal::Runtime> rt)
    : rt_(std::move(rt)) {
  TORCH_CHECK(rt_->state_ == internal::TrainingState::kIdle, "no_sync: called during ",
              "forward or backward: expected it around whole iterations");
  TORCH_CHECK(!rt_->no_sync_, "no_sync: already inside a no_sync() scope");
  rt_->finish_reductions();
  rt_->no_sync_ = true;
}

FullyShardedDataParallel::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept
    : rt_(std::move(other.rt_)) {}

FullyShardedDataParallel::NoSyncGuard::~NoSyncGuard() {
  if (rt_) rt_->no_sync_ = false;
}

FullyShardedDataParallel::FullParamsGuard FullyShardedDataParallel::summon_full_params(
    SummonOptions options) {
  return FullParamsGuard(rt_, options);
}

FullyShardedDataParallel::FullParamsGuard::FullParamsGuard(std::shared_ptr<internal::Runtime> rt,
                                                           SummonOptions options)
    : rt_(std::move(rt)), options_(options) {
  rt_->summon(options_);
}

FullyShardedDataParallel::FullParamsGuard::FullParamsGuard(FullParamsGuard&& other) noexcept
    : rt_(std::move(other.rt_)), options_(other.options_) {}

FullyShardedDataParallel::FullParamsGuard::~FullParamsGuard() {
  if (rt_) rt_->unsummon(options_);
}

void FullyShardedDataParallel::apply(const std::function<void(torch::nn::Module&)>& fn) {
  TORCH_CHECK(fn != nullptr, "FullyShardedDataParallel::apply: fn is empty");
  SummonOptions options;
  options.writeback = true;
  auto guard = summon_full_params(options);
  at::NoGradGuard no_grad;
  rt_->root_->apply(fn);
}

std::vector<std::shared_ptr<torch::nn::Module>> FullyShardedDataParallel::fsdp_modules() const {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (int i : rt_->preorder()) out.push_back(rt_->units_[i]->module);
  return out;
}

std::vector<std::string> FullyShardedDataParallel::fsdp_unit_names() const {
  std::vector<std::string> out;
  for (int i : rt_->preorder()) out.push_back(rt_->units_[i]->fqn);
  return out;
}

std::vector<const FlatParamHandle*> FullyShardedDataParallel::handles() const {
  std::vector<const FlatParamHandle*> out;
  for (int i : rt_->preorder()) out.push_back(rt_->units_[i]->handle.get());
  return out;
}

int64_t FullyShardedDataParallel::peak_unsharded_bytes() const {
  return rt_->peak_unsharded_bytes_;
}

void FullyShardedDataParallel::reset_peak_unsharded_bytes() { rt_->peak_unsharded_bytes_ = 0; }

const std::shared_ptr<torch::nn::Module>& FullyShardedDataParallel::module() const {
  return rt_->root_;
}

const FullyShardedDataParallel::Options& FullyShardedDataParallel::options() const {
  return rt_->options_;
}

}  // namespace fsdp
