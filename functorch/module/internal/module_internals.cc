// The one place that reaches past torch::nn::Module's access control, and why:
//
// - Module::parameters_ is protected: a pointer-to-member formed inside a
//   class derived from Module names it legally, and can then be applied to
//   any Module.
// - Module::buffers_ and Module::children_ are private, with no accessor that
//   returns a reference. Explicit template instantiations are exempt from
//   access checking ([temp.explicit]/12 in C++17), so instantiating a template
//   with &Module::buffers_ as an argument may name it; the instantiation
//   stores the pointer-to-member in a friend function we can call.
//
// Both only read the layout LibTorch's own headers declare; nothing is cast.
#include "functorch/module/internal/module_internals.h"

namespace functorch {
namespace internal {
namespace {

struct ParameterRegistryAccess : torch::nn::Module {
  static TensorRegistry torch::nn::Module::*member() {
    return &ParameterRegistryAccess::parameters_;
  }
};

// Tag types: each declares the friend function its instantiation defines.
struct BuffersTag {
  using type = TensorRegistry torch::nn::Module::*;
  friend type member_pointer(BuffersTag);
};
struct ChildrenTag {
  using type = ChildRegistry torch::nn::Module::*;
  friend type member_pointer(ChildrenTag);
};

template <typename Tag, typename Tag::type Member>
struct PrivateMember {
  friend typename Tag::type member_pointer(Tag) { return Member; }
};

template struct PrivateMember<BuffersTag, &torch::nn::Module::buffers_>;
template struct PrivateMember<ChildrenTag, &torch::nn::Module::children_>;

}  // namespace

TensorRegistry& parameter_registry(torch::nn::Module& module) {
  return module.*ParameterRegistryAccess::member();
}

TensorRegistry& buffer_registry(torch::nn::Module& module) {
  return module.*member_pointer(BuffersTag{});
}

const ChildRegistry& child_registry(const torch::nn::Module& module) {
  return module.*member_pointer(ChildrenTag{});
}

}  // namespace internal
}  // namespace functorch
