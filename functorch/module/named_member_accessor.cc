#include "functorch/module/named_member_accessor.h"

#include "functorch/module/internal/member_binding_registry.h"
#include "functorch/module/internal/module_internals.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <sstream>

namespace functorch {
namespace internal {
namespace {

class MemberBindingTable {
 public:
  static MemberBindingTable& get() {
    // Function-local static: safe to use from other translation units'
    // static initialisers (the one-line registrations).
    // Leaked on purpose: accessors may still run while other translation
    // units' statics are destroyed.
    static MemberBindingTable* table = [] {
      auto* t = new MemberBindingTable();
      register_stock_module_bindings(
          [t](std::type_index type, std::string name, ModuleMemberBinder binder) {
            t->put(type, std::move(name), std::move(binder));
          });
      return t;
    }();
    return *table;
  }

  void put(std::type_index type, std::string type_name, ModuleMemberBinder binder) {
    auto binding = std::make_shared<const MemberBinding>(
        MemberBinding{std::move(type_name), std::move(binder)});
    std::lock_guard<std::mutex> lock(mutex_);
    bindings_[type] = std::move(binding);
  }

  std::shared_ptr<const MemberBinding> find(std::type_index type) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = bindings_.find(type);
    return it == bindings_.end() ? nullptr : it->second;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::type_index, std::shared_ptr<const MemberBinding>> bindings_;
};

}  // namespace

void register_module_member_binder(std::type_index type, std::string type_name,
                                   ModuleMemberBinder binder) {
  MemberBindingTable::get().put(type, std::move(type_name), std::move(binder));
}

std::shared_ptr<const MemberBinding> find_member_binding(std::type_index type) {
  return MemberBindingTable::get().find(type);
}

}  // namespace internal

// Where one dotted name lives: the registry that holds it (looked up by key
// on every access, so registry growth cannot leave a dangling pointer) and
// the member handles forward() reads (fields of the owning module object,
// which the root keeps alive).
struct NamedMemberAccessor::Slot {
  internal::TensorRegistry* registry = nullptr;
  std::string key;
  std::vector<torch::Tensor*> handles;

  torch::Tensor& entry(const std::string& name) const {
    torch::Tensor* value = registry->find(key);
    TORCH_CHECK(value != nullptr, "NamedMemberAccessor: '", name,
                "' was removed from its module after the accessor resolved it; "
                "create a new accessor after changing the module tree");
    return *value;
  }
};

NamedMemberAccessor::NamedMemberAccessor(std::shared_ptr<torch::nn::Module> module)
    : module_(std::move(module)) {
  TORCH_CHECK(module_ != nullptr, "NamedMemberAccessor: module is null");
}
NamedMemberAccessor::~NamedMemberAccessor() = default;
NamedMemberAccessor::NamedMemberAccessor(NamedMemberAccessor&&) noexcept = default;
NamedMemberAccessor& NamedMemberAccessor::operator=(NamedMemberAccessor&&) noexcept = default;

const std::shared_ptr<torch::nn::Module>& NamedMemberAccessor::module() const { return module_; }

namespace {

// Walks `path` ("a.b.c", "" = root) through the child registries. Returns
// null, and says which step failed in `why`, if a submodule is missing.
torch::nn::Module* find_submodule(torch::nn::Module& root, const std::string& path,
                                  std::string* why) {
  torch::nn::Module* current = &root;
  std::string walked;
  size_t start = 0;
  while (start < path.size()) {
    size_t dot = path.find('.', start);
    if (dot == std::string::npos) dot = path.size();
    const std::string atom = path.substr(start, dot - start);
    const auto* child = internal::child_registry(*current).find(atom);
    if (child == nullptr || *child == nullptr) {
      if (why != nullptr) {
        *why = current->name() + (walked.empty() ? "" : " (at '" + walked + "')") +
               " has no submodule '" + atom + "'";
      }
      return nullptr;
    }
    current = child->get();
    walked += (walked.empty() ? "" : ".") + atom;
    start = dot + 1;
  }
  return current;
}

std::string unbound_type_error(const std::string& name, const std::string& type,
                               const std::string& path) {
  std::ostringstream out;
  out << "NamedMemberAccessor: cannot reach '" << name << "': its module (type " << type << ", at '"
      << (path.empty() ? "<root>" : path)
      << "') holds parameters or buffers, but the type has no member binding, "
         "so its forward() would keep reading the old tensors. Declare, once, "
         "next to the module's definition, which members its forward() reads: "
         "`static const bool kBound = functorch::RegisterModuleMembers<"
      << type << ">({{\"weight\", &" << type << "::weight}, ...});` or, if "
      << "forward() reads named_parameters()/named_buffers() itself, "
         "`static const bool kBound = functorch::RegisterRegistryReadingModule<"
      << type << ">();` (functorch/module/named_member_accessor.h)";
  return out.str();
}

}  // namespace

NamedMemberAccessor::Slot& NamedMemberAccessor::resolve(const std::string& name) {
  auto cached = slots_.find(name);
  if (cached != slots_.end()) return *cached->second;

  const size_t dot = name.rfind('.');
  const std::string path = dot == std::string::npos ? "" : name.substr(0, dot);
  const std::string key = dot == std::string::npos ? name : name.substr(dot + 1);
  std::string why;
  torch::nn::Module* owner = find_submodule(*module_, path, &why);
  TORCH_CHECK(owner != nullptr, "NamedMemberAccessor: no tensor named '", name, "': ", why);

  auto slot = std::make_unique<Slot>();
  slot->key = key;
  if (internal::parameter_registry(*owner).contains(key)) {
    slot->registry = &internal::parameter_registry(*owner);
  } else if (internal::buffer_registry(*owner).contains(key)) {
    slot->registry = &internal::buffer_registry(*owner);
  } else {
    TORCH_CHECK(false, "NamedMemberAccessor: no tensor named '", name, "': ", owner->name(),
                (path.empty() ? "" : " (at '" + path + "')"), " has no parameter or buffer '", key,
                "'");
  }

  const std::string type_name = c10::demangle(typeid(*owner).name());
  auto binding = internal::find_member_binding(typeid(*owner));
  TORCH_CHECK(binding != nullptr, unbound_type_error(name, type_name, path));
  if (binding->binder) {
    binding->binder(*owner, [&](const std::string& member, torch::Tensor* handle) {
      if (member == key) slot->handles.push_back(handle);
    });
    TORCH_CHECK(!slot->handles.empty(), "NamedMemberAccessor: cannot reach '", name,
                "': the member binding of ", type_name, " lists no member for '", key,
                "', so its forward() would keep reading the old tensor; add {\"", key, "\", &",
                type_name,
                "::<member>} to its "
                "RegisterModuleMembers call");
  }
  return *slots_.emplace(name, std::move(slot)).first->second;
}

torch::Tensor NamedMemberAccessor::get_tensor(const std::string& name) {
  return resolve(name).entry(name);
}

void NamedMemberAccessor::set_tensor(const std::string& name, torch::Tensor value) {
  Slot& slot = resolve(name);
  for (torch::Tensor* handle : slot.handles) *handle = value;
  slot.entry(name) = std::move(value);
}

torch::Tensor NamedMemberAccessor::swap_tensor(const std::string& name, torch::Tensor value) {
  Slot& slot = resolve(name);
  torch::Tensor& entry = slot.entry(name);
  torch::Tensor old = std::move(entry);
  for (torch::Tensor* handle : slot.handles) *handle = value;
  entry = std::move(value);
  return old;
}

std::vector<torch::Tensor> NamedMemberAccessor::get_tensors(const std::vector<std::string>& names) {
  std::vector<torch::Tensor> result;
  result.reserve(names.size());
  for (const auto& name : names) result.push_back(get_tensor(name));
  return result;
}

namespace {
void check_same_length(const char* api, size_t names, size_t values) {
  TORCH_CHECK(names == values, "NamedMemberAccessor::", api, ": expected one value per name, got ",
              names, " names and ", values, " values");
}
}  // namespace

void NamedMemberAccessor::set_tensors(const std::vector<std::string>& names,
                                      std::vector<torch::Tensor> values) {
  check_same_length("set_tensors", names.size(), values.size());
  for (const auto& name : names) resolve(name);  // all names valid, or no change
  for (size_t i = 0; i < names.size(); ++i) set_tensor(names[i], std::move(values[i]));
}

std::vector<torch::Tensor> NamedMemberAccessor::swap_tensors(const std::vector<std::string>& names,
                                                             std::vector<torch::Tensor> values) {
  check_same_length("swap_tensors", names.size(), values.size());
  // Resolving first makes the swap loop below non-throwing.
  std::vector<Slot*> slots;
  slots.reserve(names.size());
  for (const auto& name : names) slots.push_back(&resolve(name));
  std::vector<torch::Tensor> old;
  old.reserve(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    torch::Tensor* entry = slots[i]->registry->find(slots[i]->key);
    if (entry == nullptr) {
      // Undo, then report.
      for (size_t j = i; j-- > 0;) swap_tensor(names[j], std::move(old[j]));
      slots[i]->entry(names[i]);  // throws the "was removed" error
    }
    old.push_back(std::move(*entry));
    for (torch::Tensor* handle : slots[i]->handles) *handle = values[i];
    *entry = std::move(values[i]);
  }
  return old;
}

namespace {
// The registry entry `name` names, or null.
const torch::Tensor* find_entry(torch::nn::Module& root, const std::string& name) {
  const size_t dot = name.rfind('.');
  torch::nn::Module* owner =
      find_submodule(root, dot == std::string::npos ? "" : name.substr(0, dot), nullptr);
  if (owner == nullptr) return nullptr;
  const std::string key = dot == std::string::npos ? name : name.substr(dot + 1);
  if (const torch::Tensor* value = internal::parameter_registry(*owner).find(key)) {
    return value;
  }
  return internal::buffer_registry(*owner).find(key);
}
}  // namespace

bool NamedMemberAccessor::has_tensor(const std::string& name) {
  const torch::Tensor* entry = find_entry(*module_, name);
  return entry != nullptr && entry->defined();
}

bool NamedMemberAccessor::has_entry(const std::string& name) {
  return slots_.count(name) != 0 || find_entry(*module_, name) != nullptr;
}

bool NamedMemberAccessor::has_submodule(const std::string& path) {
  return find_submodule(*module_, path, nullptr) != nullptr;
}

std::pair<std::vector<std::string>, std::vector<std::string>> NamedMemberAccessor::check_keys(
    const std::vector<std::string>& keys) {
  std::set<std::string> valid;
  for (const auto& item : module_->named_parameters()) valid.insert(item.key());
  for (const auto& item : module_->named_buffers()) valid.insert(item.key());
  const std::set<std::string> given(keys.begin(), keys.end());
  std::vector<std::string> missing, unexpected;
  std::set_difference(valid.begin(), valid.end(), given.begin(), given.end(),
                      std::back_inserter(missing));
  std::set_difference(given.begin(), given.end(), valid.begin(), valid.end(),
                      std::back_inserter(unexpected));
  return {std::move(missing), std::move(unexpected)};
}

ScopedTensorSwap::ScopedTensorSwap(NamedMemberAccessor& accessor, std::vector<std::string> names,
                                   std::vector<torch::Tensor> values)
    : accessor_(accessor),
      names_(std::move(names)),
      originals_(accessor_.swap_tensors(names_, std::move(values))) {}

ScopedTensorSwap::~ScopedTensorSwap() {
  // Reverse order: a name swapped twice ends at its true original.
  for (size_t i = names_.size(); i-- > 0;) {
    try {
      accessor_.set_tensor(names_[i], originals_[i]);
    } catch (const std::exception& e) {
      // A destructor must not throw; this only happens if forward() removed
      // the entry from its module.
      TORCH_WARN("functorch::ScopedTensorSwap: could not restore '", names_[i], "': ", e.what());
    }
  }
}

}  // namespace functorch
