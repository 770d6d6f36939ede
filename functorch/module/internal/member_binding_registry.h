// The process-wide table: module type -> which member handles its forward()
// reads. Filled with the stock torch::nn bindings on first use, then by
// RegisterModuleMembers & co.
#pragma once

#include "functorch/module/named_member_accessor.h"

#include <functional>
#include <memory>
#include <string>
#include <typeindex>

namespace functorch {
namespace internal {

struct MemberBinding {
  std::string type_name;
  // Null: forward() reads the registry; nothing besides it to update.
  ModuleMemberBinder binder;
};

// The binding for `type`, or null if the type was never registered.
std::shared_ptr<const MemberBinding> find_member_binding(std::type_index type);

// Defined in stock_module_bindings.cc; the table calls it once, when it is
// created, passing its own insert function (not the public registration,
// which would re-enter the table's initialisation).
using BindingSink = std::function<void(std::type_index, std::string, ModuleMemberBinder)>;
void register_stock_module_bindings(const BindingSink& put);

}  // namespace internal
}  // namespace functorch
