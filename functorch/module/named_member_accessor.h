// Get, set and swap a module's parameters and buffers by dotted name, so that
// the module's own forward() sees the new tensor.
//
// Why this is needed: a LibTorch module keeps each parameter twice -- in its
// registry (what named_parameters() returns) and in a public member handle
// that forward() reads (LinearImpl::weight). Replacing the registry entry
// alone changes nothing the forward computes. NamedMemberAccessor updates
// both: the registry entry and every member handle bound to that name.
//
// Which members a module type reads is declared once per type ("member
// binding"). Every stock torch::nn module that holds parameters or buffers is
// bound already (Linear, Bilinear, Conv*/ConvTranspose*, BatchNorm*,
// InstanceNorm*, LayerNorm, GroupNorm, Embedding, EmbeddingBag, RNN/LSTM/GRU
// and their cells, MultiheadAttention, PReLU, the weighted losses,
// FractionalMaxPool, ParameterList/ParameterDict; containers and Transformer
// layers by recursion). A user-defined module takes part with one line next
// to its definition:
//
//   struct MyBlockImpl : torch::nn::Cloneable<MyBlockImpl> {
//     torch::Tensor weight, scale;  // registered in reset()
//     ...
//   };
//   static const bool kMyBlockBound = functorch::RegisterModuleMembers<
//       MyBlockImpl>({{"weight", &MyBlockImpl::weight},
//                     {"scale", &MyBlockImpl::scale}});
//
// or, if its forward() reads the registry itself (named_parameters(),
// named_buffers(), parameters_):
//
//   static const bool kMyBlockBound =
//       functorch::RegisterRegistryReadingModule<MyBlockImpl>();
//
// Swapping a name owned by a module whose type holds parameters or buffers but
// is not bound is an error naming the type and this fix -- never a silent
// call with the old weights.
//
// New values are stored as given: functorch-wrapped tensors (BatchedTensor,
// grad TensorWrapper) and non-leaf tensors are neither copied nor touched
// (no set_requires_grad), so autograd flows back to them.
//
// Cost: an accessor resolves each name once (walking the submodule tree) and
// caches where it lives; later get/set/swap of that name are a hash lookup and
// a few handle assignments. The cache assumes the module tree keeps its shape:
// after register_module/replace_module/register_parameter, make a new
// accessor. An accessor is not thread-safe.
#pragma once

#include <torch/nn/module.h>
#include <torch/ordered_dict.h>
#include <torch/types.h>
#include <c10/util/Type.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <typeindex>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

namespace functorch {

// Called by a member binder once per member handle of one module instance:
// `name` is the registry name (e.g. "weight"), `handle` the member forward()
// reads. Several handles may share a name (all are updated).
using MemberHandleVisitor = std::function<void(const std::string& name, torch::Tensor* handle)>;

// Type-erased binder: lists the member handles of `module`, whose dynamic
// type is the one it was registered for.
using ModuleMemberBinder =
    std::function<void(torch::nn::Module& module, const MemberHandleVisitor&)>;

namespace internal {
// Registers `binder` for the module type `type` (replacing an earlier one).
// A null binder declares "forward() reads the registry; no member handles".
void register_module_member_binder(std::type_index type, std::string type_name,
                                   ModuleMemberBinder binder);

template <typename ModuleImpl>
ModuleMemberBinder make_member_list_binder(
    std::vector<std::pair<std::string, torch::Tensor ModuleImpl::*>> members) {
  return
      [members = std::move(members)](torch::nn::Module& module, const MemberHandleVisitor& visit) {
        // dynamic_cast: torch::nn::Cloneable derives virtually from Module.
        auto& typed = dynamic_cast<ModuleImpl&>(module);
        for (const auto& member : members) visit(member.first, &(typed.*member.second));
      };
}

template <typename ModuleImpl>
ModuleMemberBinder make_typed_binder(
    std::function<void(ModuleImpl&, const MemberHandleVisitor&)> binder) {
  return [binder = std::move(binder)](torch::nn::Module& module, const MemberHandleVisitor& visit) {
    binder(dynamic_cast<ModuleImpl&>(module), visit);
  };
}

template <typename ModuleImpl>
std::string type_name_of() {
  return c10::demangle(typeid(ModuleImpl).name());
}
}  // namespace internal

// The one-line registration for a user module whose forward() reads tensor
// members: each pair is (registry name, pointer to the member). Returns true
// so it can initialise a static. `ModuleImpl` is the concrete Impl class
// (what typeid(*module.ptr()) names), not its ModuleHolder; a subclass of a
// bound type needs its own registration.
template <typename ModuleImpl>
bool RegisterModuleMembers(
    std::initializer_list<std::pair<const char*, torch::Tensor ModuleImpl::*>> members) {
  static_assert(std::is_base_of<torch::nn::Module, ModuleImpl>::value,
                "RegisterModuleMembers<T>: T must be a torch::nn::Module "
                "subclass (the Impl class, e.g. LinearImpl)");
  std::vector<std::pair<std::string, torch::Tensor ModuleImpl::*>> list;
  for (const auto& member : members) list.emplace_back(member.first, member.second);
  internal::register_module_member_binder(
      typeid(ModuleImpl), internal::type_name_of<ModuleImpl>(),
      internal::make_member_list_binder<ModuleImpl>(std::move(list)));
  return true;
}

// General form, for members that are not plain Tensor fields (a vector of
// tensors, a tensor inside an options struct): `binder` visits
// (name, Tensor*) pairs of one instance.
template <typename ModuleImpl>
bool RegisterModuleMemberBinder(
    std::function<void(ModuleImpl& module, const MemberHandleVisitor& visit)> binder) {
  static_assert(std::is_base_of<torch::nn::Module, ModuleImpl>::value,
                "RegisterModuleMemberBinder<T>: T must be a torch::nn::Module "
                "subclass");
  internal::register_module_member_binder(
      typeid(ModuleImpl), internal::type_name_of<ModuleImpl>(),
      internal::make_typed_binder<ModuleImpl>(std::move(binder)));
  return true;
}

// Declares that ModuleImpl's forward() reads its parameters and buffers from
// the registry, so swapping the registry entry is enough.
template <typename ModuleImpl>
bool RegisterRegistryReadingModule() {
  internal::register_module_member_binder(typeid(ModuleImpl), internal::type_name_of<ModuleImpl>(),
                                          nullptr);
  return true;
}

class NamedMemberAccessor {
 public:
  // Accessor over `module` and its submodules. Holds `module` alive.
  explicit NamedMemberAccessor(std::shared_ptr<torch::nn::Module> module);
  template <typename Contained>
  explicit NamedMemberAccessor(const torch::nn::ModuleHolder<Contained>& module)
      : NamedMemberAccessor(std::static_pointer_cast<torch::nn::Module>(module.ptr())) {}
  ~NamedMemberAccessor();
  NamedMemberAccessor(NamedMemberAccessor&&) noexcept;
  NamedMemberAccessor& operator=(NamedMemberAccessor&&) noexcept;
  NamedMemberAccessor(const NamedMemberAccessor&) = delete;
  NamedMemberAccessor& operator=(const NamedMemberAccessor&) = delete;

  const std::shared_ptr<torch::nn::Module>& module() const;

  // The parameter or buffer `name` ("encoder.layers.0.linear1.weight"), as
  // its registry holds it. Throws if no submodule or registry entry has that
  // name, or if the owning module's type has tensors but no member binding
  // (resolving a name checks that it can be set, too).
  torch::Tensor get_tensor(const std::string& name);

  // Points `name` (registry entry and member handles) at `value`.
  void set_tensor(const std::string& name, torch::Tensor value);

  // Like set_tensor; returns the tensor `name` held before.
  torch::Tensor swap_tensor(const std::string& name, torch::Tensor value);

  // Batch forms; `names` and `values` must have the same length. Every name
  // is resolved before anything changes, so a bad name leaves the module as
  // it was.
  std::vector<torch::Tensor> get_tensors(const std::vector<std::string>& names);
  void set_tensors(const std::vector<std::string>& names, std::vector<torch::Tensor> values);
  std::vector<torch::Tensor> swap_tensors(const std::vector<std::string>& names,
                                          std::vector<torch::Tensor> values);

  // True if `name` is a registered parameter or buffer holding a defined
  // tensor (the names named_parameters()/named_buffers() list).
  bool has_tensor(const std::string& name);

  // True if `name` is registered as a parameter or buffer, even one holding
  // an undefined tensor (the bias of Linear(bias=false)), which can be set.
  bool has_entry(const std::string& name);

  // True if `path` ("encoder.layers.0", "" = the root) names a submodule.
  bool has_submodule(const std::string& path);

  // As PyTorch's NamedMemberAccessor.check_keys: the module's parameter and
  // buffer names missing from `keys`, and the `keys` that are not one of
  // them; both sorted.
  std::pair<std::vector<std::string>, std::vector<std::string>> check_keys(
      const std::vector<std::string>& keys);

 private:
  struct Slot;
  Slot& resolve(const std::string& name);

  std::shared_ptr<torch::nn::Module> module_;
  std::unordered_map<std::string, std::unique_ptr<Slot>> slots_;
};

// RAII swap of many names at once: swaps `values` in on construction and the
// previous tensors back on destruction (every exit path, exceptions
// included). Guards nest: an inner guard restores what the outer one set.
// Restores in reverse order, so a name given twice ends at its original.
class ScopedTensorSwap {
 public:
  ScopedTensorSwap(NamedMemberAccessor& accessor, std::vector<std::string> names,
                   std::vector<torch::Tensor> values);
  ~ScopedTensorSwap();
  ScopedTensorSwap(const ScopedTensorSwap&) = delete;
  ScopedTensorSwap& operator=(const ScopedTensorSwap&) = delete;

  // The tensors the names held before the swap, in `names` order.
  const std::vector<torch::Tensor>& originals() const { return originals_; }

 private:
  NamedMemberAccessor& accessor_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> originals_;
};

}  // namespace functorch
