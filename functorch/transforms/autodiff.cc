// grad, grad_and_value, vjp, jvp, jacrev, jacfwd, hessian on ATen's functorch
// engine, following torch/_functorch/eager_transforms.py (PyTorch 1.13).
//
// The Python bindings those use (_grad_increment_nesting, _wrap_for_grad,
// _unwrap_for_grad, _jvp_increment_nesting, fwAD.dual_level, ...) live in
// libtorch_python, not in LibTorch; each is a few lines over the public
// engine API (DynamicLayer.h, TensorWrapper.h, ForwardADLevel) and is
// re-expressed here, with RAII levels in place of try/finally.

#include <ATen/ATen.h>
#include <ATen/functorch/TensorWrapper.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/forward_grad.h>

#include <numeric>
#include <sstream>

#include "functorch/transforms/internal/decompositions.h"
#include "functorch/transforms/grad.h"
#include "functorch/transforms/internal/levels.h"
#include "functorch/transforms/jacobian.h"
#include "functorch/transforms/jvp.h"
#include "functorch/transforms/pytree.h"
#include "functorch/transforms/vjp.h"
#include "functorch/transforms/vmap.h"

namespace functorch {

std::string Argnums::to_string() const {
  std::ostringstream os;
  if (!is_tuple_) {
    os << values_[0];
    return os.str();
  }
  os << "(";
  for (size_t i = 0; i < values_.size(); ++i) {
    os << (i ? ", " : "") << values_[i];
  }
  os << (values_.size() == 1 ? ",)" : ")");
  return os.str();
}

std::vector<int64_t> Argnums::validate(int64_t num_args) const {
  std::vector<int64_t> wrapped;
  for (int64_t argnum : values_) {
    TORCH_CHECK(argnum >= -num_args && argnum < num_args, "Got argnum=", argnum, ", but only ",
                num_args, " positional inputs");
    wrapped.push_back(argnum < 0 ? argnum + num_args : argnum);
  }
  if (is_tuple_) {
    TORCH_CHECK(!wrapped.empty(), "argnums must be non-empty");
    std::vector<int64_t> sorted = wrapped;
    std::sort(sorted.begin(), sorted.end());
    TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                "argnums elements must be unique, got ", to_string());
  }
  return wrapped;
}

namespace {

using c10::IValue;

IValue make_tuple(std::vector<IValue> elements) {
  return c10::ivalue::Tuple::create(std::move(elements));
}

std::vector<IValue> tuple_elements(const IValue& tuple) {
  return tuple.toTupleRef().elements().vec();
}

// _wrap_for_grad over a tree: tensors become TensorWrappers of `level`.
IValue wrap_all(const IValue& tree, int64_t level) {
  return tree_map(
      [level](const IValue& leaf) -> IValue {
        if (!leaf.isTensor()) return leaf;
        return at::functorch::makeTensorWrapper(leaf.toTensor(), level);
      },
      tree);
}

at::Tensor unwrap_for_grad(const at::Tensor& tensor, int64_t level) {
  auto* wrapper = at::functorch::maybeGetTensorWrapper(tensor);
  if (wrapper == nullptr) return tensor;
  TORCH_INTERNAL_ASSERT(wrapper->level().has_value());
  return *wrapper->level() == level ? wrapper->value() : tensor;
}

// Python's _undo_create_differentiable: strips this level's wrappers.
IValue undo_create_differentiable(const IValue& tree, int64_t level) {
  return tree_map(
      [level](const IValue& leaf) -> IValue {
        TORCH_CHECK(leaf.isTensor(), "Expected tensors, got unsupported type ",
                    python_type_repr(leaf));
        return unwrap_for_grad(leaf.toTensor(), level);
      },
      tree);
}

// Python's _create_differentiable: requires_grad_() on every leaf (the
// leaves are this level's wrappers, shared with the arguments f receives).
void create_differentiable(const IValue& tree) {
  internal::InplaceRequiresGradAllowed allowed;
  for (const auto& leaf : tree_flatten(tree).first) {
    TORCH_CHECK_VALUE(leaf.isTensor(), "Thing passed to transform API must be Tensor, got ",
                      python_type_repr(leaf));
    leaf.toTensor().requires_grad_();
  }
}

// Python's _slice_argnums.
IValue slice_argnums(const std::vector<IValue>& args, const Argnums& argnums, bool as_tuple) {
  std::vector<int64_t> indices = argnums.validate(args.size());
  if (!argnums.is_tuple()) {
    return as_tuple ? make_tuple({args[indices[0]]}) : args[indices[0]];
  }
  std::vector<IValue> sliced;
  for (int64_t i : indices) sliced.push_back(args[i]);
  return make_tuple(std::move(sliced));
}

std::vector<at::Tensor> as_tensors(const std::vector<IValue>& leaves) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(leaves.size());
  for (const auto& leaf : leaves) tensors.push_back(leaf.toTensor());
  return tensors;
}

// Python's _autograd_grad: only outputs that require grad take part, and an
// input the outputs do not depend on gets zeros, not None.
std::vector<at::Tensor> autograd_grad(const std::vector<at::Tensor>& outputs,
                                      const std::vector<at::Tensor>& inputs,
                                      const std::vector<at::Tensor>& grad_outputs,
                                      bool retain_graph, bool create_graph) {
  std::vector<at::Tensor> diff_outputs, diff_grad_outputs;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].requires_grad()) continue;
    diff_outputs.push_back(outputs[i]);
    if (!grad_outputs.empty()) diff_grad_outputs.push_back(grad_outputs[i]);
  }
  std::vector<at::Tensor> result;
  if (diff_outputs.empty()) {
    for (const auto& input : inputs) result.push_back(at::zeros_like(input));
    return result;
  }
  result =
      torch::autograd::grad(diff_outputs, inputs, diff_grad_outputs, retain_graph, create_graph,
                            /*allow_unused=*/true);
  for (size_t i = 0; i < result.size(); ++i) {
    if (!result[i].defined()) result[i] = at::zeros_like(inputs[i]);
  }
  return result;
}

void assert_non_empty_tensor_output(const std::vector<IValue>& flat, const IValue& output,
                                    const std::string& api) {
  if (flat.empty() || (flat.size() == 1 && flat[0].isNone())) {
    std::ostringstream os;
    os << output;
    TORCH_CHECK(false, api,
                ": Expected f to be a function that has non-empty output "
                "(got output = ",
                os.str(), ")");
  }
  for (const auto& o : flat) {
    TORCH_CHECK(o.isTensor(), api,
                ": expected f(*primals) to return only tensors, got "
                "unsupported type ",
                python_type_repr(o));
  }
}

std::pair<IValue, IValue> split_aux(const IValue& output, const std::string& api) {
  const bool ok = output.isTuple() && output.toTupleRef().size() == 2;
  TORCH_CHECK(ok, api,
              ": output of function f should be a tuple: (output, aux) if "
              "has_aux is True");
  const auto& elements = output.toTupleRef().elements();
  return {elements[0], elements[1]};
}

IValue grad_and_value_impl(const TreeFn& f, const Argnums& argnums, bool has_aux,
                           const std::vector<IValue>& args) {
  const std::string api = "grad_and_value(f)(*args)";
  internal::register_decompositions();
  internal::GradLevel grad_level;
  const int64_t level = grad_level.level();
  std::vector<IValue> wrapped;
  wrapped.reserve(args.size());
  for (const auto& arg : args) wrapped.push_back(wrap_all(arg, level));
  IValue diff_args = slice_argnums(wrapped, argnums, /*as_tuple=*/false);
  create_differentiable(diff_args);

  IValue output = f(wrapped);
  IValue aux;
  if (has_aux) std::tie(output, aux) = split_aux(output, api);
  TORCH_CHECK(output.isTensor(), api, ": Expected f(*args) to return a Tensor, got ",
              python_type_repr(output));
  const at::Tensor out = output.toTensor();
  TORCH_CHECK(out.dim() == 0, api,
              ": Expected f(*args) to return a scalar Tensor, got tensor "
              "with ",
              out.dim(),
              " dims. Maybe you wanted to use the vjp or jacrev APIs "
              "instead?");

  auto flat_diff = tree_flatten(diff_args);
  std::vector<at::Tensor> grads = autograd_grad({out}, as_tensors(flat_diff.first), {},
                                                /*retain_graph=*/false, /*create_graph=*/true);
  IValue grad_input =
      tree_unflatten(std::vector<IValue>(grads.begin(), grads.end()), flat_diff.second);
  grad_input = undo_create_differentiable(grad_input, level);
  IValue value = unwrap_for_grad(out, level);
  if (has_aux) {
    aux = undo_create_differentiable(aux, level);
    return make_tuple({grad_input, make_tuple({value, aux})});
  }
  return make_tuple({grad_input, value});
}

// The standard basis of the space of `tensors` (concatenated and
// flattened): one [total, *t.shape] chunk per tensor, so that row r of the
// concatenation is the r-th unit vector. Python's
// _construct_standard_basis_for.
std::vector<IValue> standard_basis_for(const std::vector<at::Tensor>& tensors,
                                       const std::vector<int64_t>& numels) {
  const int64_t total = std::accumulate(numels.begin(), numels.end(), static_cast<int64_t>(0));
  std::vector<IValue> chunks;
  int64_t start = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor chunk = tensors[i].new_zeros({total, numels[i]});
    chunk.diagonal(-start).fill_(1);
    std::vector<int64_t> shape{total};
    for (int64_t s : tensors[i].sizes()) shape.push_back(s);
    chunks.emplace_back(chunk.view(shape));
    start += numels[i];
  }
  return chunks;
}

std::vector<int64_t> shape_concat(c10::IntArrayRef a, c10::IntArrayRef b) {
  std::vector<int64_t> shape(a.begin(), a.end());
  shape.insert(shape.end(), b.begin(), b.end());
  return shape;
}

// Forward-AD dual level shared by nested jvps: only the outermost jvp opens
// one (Python's JVP_NESTING / fwAD.dual_level); inner levels are told apart
// by the Jvp layers of the DynamicLayer stack.
thread_local int64_t jvp_nesting = 0;
thread_local int64_t current_dual_level = -1;

class JvpNesting {
 public:
  JvpNesting() {
    if (++jvp_nesting == 1) {
      current_dual_level = static_cast<int64_t>(torch::autograd::ForwardADLevel::get_next_idx());
      opened_ = true;
    }
  }
  ~JvpNesting() {
    if (opened_) {
      torch::autograd::ForwardADLevel::release_idx(static_cast<uint64_t>(current_dual_level));
      current_dual_level = -1;
    }
    --jvp_nesting;
  }
  JvpNesting(const JvpNesting&) = delete;
  JvpNesting& operator=(const JvpNesting&) = delete;

 private:
  bool opened_ = false;
};

at::Tensor make_dual(const at::Tensor& primal, const at::Tensor& tangent) {
  TORCH_CHECK_VALUE(primal.is_floating_point() || primal.is_complex(),
                    "Expected primal to be floating point or complex, but "
                    "got: ",
                    primal.scalar_type());
  TORCH_CHECK_VALUE(tangent.is_floating_point() || tangent.is_complex(),
                    "Expected tangent to be floating point or complex, but "
                    "got: ",
                    tangent.scalar_type());
  return at::_make_dual(primal, tangent, current_dual_level);
}

void assert_non_empty_list_of_tensors(const std::vector<IValue>& flat, const std::string& api,
                                      const std::string& argname) {
  TORCH_CHECK(!flat.empty(), api, ": Expected ", argname, " to contain at least one Tensor.");
  for (const auto& leaf : flat) {
    TORCH_CHECK(leaf.isTensor(), api, ": Expected ", argname, " to only contain Tensors, got ",
                python_type_repr(leaf));
  }
}

// Python's _replace_args: the arguments of f, with those in argnums
// replaced by `new_args` (one per argnums entry).
std::vector<IValue> replace_args(const std::vector<IValue>& old_args,
                                 const std::vector<IValue>& new_args,
                                 const std::vector<int64_t>& argnums) {
  std::vector<IValue> result = old_args;
  for (size_t k = 0; k < argnums.size(); ++k) result[argnums[k]] = new_args[k];
  return result;
}

}  // namespace

TreeFn grad_and_value(TreeFn f, Argnums argnums, bool has_aux) {
  std::string name = f.name();
  return TreeFn(
      [f = std::move(f), argnums = std::move(argnums), has_aux](const std::vector<IValue>& args) {
        return grad_and_value_impl(f, argnums, has_aux, args);
      },
      std::move(name));
}

TreeFn grad(TreeFn f, Argnums argnums, bool has_aux) {
  std::string name = f.name();
  return TreeFn(
      [f = std::move(f), argnums = std::move(argnums),
       has_aux](const std::vector<IValue>& args) -> IValue {
        IValue results = grad_and_value_impl(f, argnums, has_aux, args);
        const auto& pair = results.toTupleRef().elements();
        if (has_aux) {
          return make_tuple({pair[0], pair[1].toTupleRef().elements()[1]});
        }
        return pair[0];
      },
      std::move(name));
}

namespace internal {

VjpResult vjp_with_argnums(const TreeFn& f, const std::vector<IValue>& args,
                           const std::optional<Argnums>& argnums, bool has_aux) {
  IValue results, aux;
  std::vector<at::Tensor> flat_primals_out, flat_diff_primals;
  TreeSpec primals_out_spec, primals_spec;
  register_decompositions();
  {
    internal::GradLevel grad_level;
    const int64_t level = grad_level.level();
    std::vector<IValue> primals;
    for (const auto& arg : args) primals.push_back(wrap_all(arg, level));
    IValue diff_primals = argnums.has_value() ? slice_argnums(primals, *argnums, /*as_tuple=*/false)
                                              : make_tuple(primals);
    create_differentiable(diff_primals);

    IValue primals_out = f(primals);
    if (has_aux) {
      std::tie(primals_out, aux) = split_aux(primals_out, "vjp(f, *primals)");
      aux = undo_create_differentiable(aux, level);
    }
    auto flat_out = tree_flatten(primals_out);
    assert_non_empty_tensor_output(flat_out.first, primals_out, "vjp(f, *primals)");
    primals_out_spec = flat_out.second;
    flat_primals_out = as_tensors(flat_out.first);
    auto flat_diff = tree_flatten(diff_primals);
    primals_spec = flat_diff.second;
    flat_diff_primals = as_tensors(flat_diff.first);
    results = undo_create_differentiable(primals_out, level);
    for (const auto& out : flat_primals_out) {
      TORCH_CHECK(out.is_floating_point() || out.is_complex(),
                  "vjp(f, ...): All outputs of f must be floating-point or "
                  "complex Tensors, got Tensor with dtype ",
                  out.scalar_type());
    }
  }
  // The wrappers captured here belong to a level that has been popped; the
  // engine treats such dead wrappers as plain tensors, which is what lets
  // vjp_fn run later, outside the level, and under vmap (Python does the
  // same).
  auto vjp_fn = [flat_primals_out, flat_diff_primals, primals_out_spec,
                 primals_spec](const Tree& cotangents) -> Tree {
    auto flat_cot = tree_flatten(cotangents.ivalue());
    TORCH_CHECK(flat_cot.second == primals_out_spec,
                "Expected pytree structure of cotangents to be the same as "
                "pytree structure of outputs to the function. cotangents: ",
                flat_cot.second.to_string(), ", primal output: ", primals_out_spec.to_string());
    for (const auto& c : flat_cot.first) {
      TORCH_CHECK(c.isTensor(), "vjp_fn(cotangents): expected Tensors, got ", python_type_repr(c));
    }
    std::vector<at::Tensor> result =
        autograd_grad(flat_primals_out, flat_diff_primals, as_tensors(flat_cot.first),
                      /*retain_graph=*/true,
                      /*create_graph=*/c10::GradMode::is_enabled());
    return Tree(tree_unflatten(std::vector<IValue>(result.begin(), result.end()), primals_spec));
  };
  return VjpResult{Tree(results), std::move(vjp_fn), Tree(aux)};
}

JvpResult jvp_with_argnums(const TreeFn& f, const std::vector<IValue>& primals,
                           const IValue& tangents, const std::optional<Argnums>& argnums,
                           bool strict, bool has_aux) {
  const std::string api = "jvp(f, primals, tangents)";
  IValue diff_args = argnums.has_value() ? slice_argnums(primals, *argnums, /*as_tuple=*/true)
                                         : make_tuple(primals);
  auto flat_primals = tree_flatten(diff_args);
  auto flat_tangents = tree_flatten(tangents);
  TORCH_CHECK(flat_primals.second == flat_tangents.second, api,
              ": Expected primals and tangents to have the same python "
              "structure. For example, if primals is a tuple of 3 tensors, "
              "tangents also must be. Got primals with structure ",
              flat_primals.second.to_string(), " and tangents with structure ",
              flat_tangents.second.to_string());
  assert_non_empty_list_of_tensors(flat_primals.first, api, "primals");
  assert_non_empty_list_of_tensors(flat_tangents.first, api, "tangents");

  register_decompositions();
  internal::JvpLevel jvp_level;
  const int64_t level = jvp_level.level();
  JvpNesting nesting;
  std::vector<IValue> flat_duals;
  for (size_t i = 0; i < flat_primals.first.size(); ++i) {
    flat_duals.emplace_back(
        make_dual(flat_primals.first[i].toTensor(), flat_tangents.first[i].toTensor()));
  }
  std::vector<IValue> duals = tuple_elements(tree_unflatten(flat_duals, flat_primals.second));
  std::vector<IValue> call_args;
  if (argnums.has_value()) {
    std::vector<IValue> wrapped;
    for (const auto& p : primals) wrapped.push_back(wrap_all(p, level));
    call_args = replace_args(wrapped, duals, argnums->validate(primals.size()));
  } else {
    call_args = std::move(duals);
  }

  IValue result = f(call_args);
  IValue aux;
  if (has_aux) {
    std::tie(result, aux) = split_aux(result, api);
    aux = undo_create_differentiable(aux, level);
  }
  auto flat_result = tree_flatten(result);
  assert_non_empty_tensor_output(flat_result.first, result, api);
  std::vector<IValue> primals_out, tangents_out;
  for (const auto& dual : flat_result.first) {
    auto unpacked = at::_unpack_dual(dual.toTensor(), current_dual_level);
    at::Tensor primal = std::get<0>(unpacked);
    at::Tensor tangent = std::get<1>(unpacked);
    if (!tangent.defined()) {
      TORCH_CHECK(!strict,
                  "jvp(f, primals, tangents, strict=True): The output of f is "
                  "independent of the inputs. This is not allowed with "
                  "strict=True.");
      tangent = at::zeros_like(primal);
    }
    primals_out.emplace_back(unwrap_for_grad(primal, level));
    tangents_out.emplace_back(unwrap_for_grad(tangent, level));
  }
  return JvpResult{Tree(tree_unflatten(primals_out, flat_result.second)),
                   Tree(tree_unflatten(tangents_out, flat_result.second)), Tree(aux)};
}

}  // namespace internal

VjpResult vjp(const TreeFn& f, const std::vector<IValue>& primals, bool has_aux) {
  return internal::vjp_with_argnums(f, primals, std::nullopt, has_aux);
}

JvpResult jvp(const TreeFn& f, const std::vector<IValue>& primals,
              const std::vector<IValue>& tangents, bool strict, bool has_aux) {
  return internal::jvp_with_argnums(f, primals, make_tuple(tangents), std::nullopt, strict,
                                    has_aux);
}

TreeFn jacrev(TreeFn f, Argnums argnums, bool has_aux) {
  std::string name = f.name();
  return TreeFn(
      [f = std::move(f), argnums = std::move(argnums),
       has_aux](const std::vector<IValue>& args) -> IValue {
        VjpResult vjp_out = internal::vjp_with_argnums(f, args, argnums, has_aux);
        auto flat_output = tree_flatten(vjp_out.output.ivalue());
        std::vector<at::Tensor> outputs = as_tensors(flat_output.first);
        std::vector<int64_t> numels;
        for (const auto& o : outputs) numels.push_back(o.numel());
        IValue basis = tree_unflatten(standard_basis_for(outputs, numels), flat_output.second);
        // All rows of the Jacobian in one batched backward pass.
        auto vjp_fn = vjp_out.vjp_fn;
        TreeFn batched_vjp(
            [vjp_fn](const std::vector<IValue>& a) { return vjp_fn(Tree(a[0])).ivalue(); },
            "vjp_fn");
        IValue results = vmap(batched_vjp)({basis});

        auto flat_primals = tree_flatten(slice_argnums(args, argnums, /*as_tuple=*/true));
        auto flat_results = tree_flatten(results);
        // [input leaf][output leaf] -> d output / d input
        std::vector<std::vector<at::Tensor>> in_out;
        for (size_t i = 0; i < flat_results.first.size(); ++i) {
          auto splits = flat_results.first[i].toTensor().split_with_sizes(numels, /*dim=*/0);
          const at::Tensor primal = flat_primals.first[i].toTensor();
          std::vector<at::Tensor> per_output;
          for (size_t o = 0; o < outputs.size(); ++o) {
            per_output.push_back(
                splits[o].reshape(shape_concat(outputs[o].sizes(), primal.sizes())));
          }
          in_out.push_back(std::move(per_output));
        }
        std::vector<IValue> flat_output_input;
        for (size_t o = 0; o < outputs.size(); ++o) {
          std::vector<IValue> per_input;
          for (auto& row : in_out) per_input.emplace_back(row[o]);
          IValue by_input = tree_unflatten(per_input, flat_primals.second);
          flat_output_input.push_back(argnums.is_tuple() ? by_input : tuple_elements(by_input)[0]);
        }
        IValue jacobian = tree_unflatten(flat_output_input, flat_output.second);
        if (has_aux) return make_tuple({jacobian, vjp_out.aux.ivalue()});
        return jacobian;
      },
      std::move(name));
}

TreeFn jacfwd(TreeFn f, Argnums argnums, bool has_aux, Randomness randomness) {
  std::string name = f.name();
  return TreeFn(
      [f = std::move(f), argnums = std::move(argnums), has_aux,
       randomness](const std::vector<IValue>& args) -> IValue {
        auto flat_primals = tree_flatten(slice_argnums(args, argnums, /*as_tuple=*/true));
        std::vector<at::Tensor> primals = as_tensors(flat_primals.first);
        std::vector<int64_t> numels;
        for (const auto& p : primals) numels.push_back(p.numel());
        IValue basis = tree_unflatten(standard_basis_for(primals, numels), flat_primals.second);
        // One forward pass per basis vector, all at once under vmap.
        TreeFn push_jvp(
            [&f, &args, &argnums, has_aux](const std::vector<IValue>& b) {
              JvpResult out =
                  internal::jvp_with_argnums(f, args, b[0], argnums, /*strict=*/false, has_aux);
              if (has_aux) {
                return make_tuple({out.tangent.ivalue(), out.aux.ivalue()});
              }
              return out.tangent.ivalue();
            },
            "push_jvp");
        IValue results = vmap(push_jvp, 0, 0, randomness)({basis});
        IValue aux;
        if (has_aux) {
          auto pair = tuple_elements(results);
          results = pair[0];
          aux = tree_map([](const IValue& v) -> IValue { return v.toTensor()[0]; }, pair[1]);
        }
        auto flat_jac = tree_flatten(results);
        std::vector<IValue> jac_outs_ins;
        for (const auto& jac_out_value : flat_jac.first) {
          at::Tensor jac_out = jac_out_value.toTensor().movedim(0, -1);
          auto pieces = jac_out.split_with_sizes(numels, /*dim=*/-1);
          std::vector<IValue> per_input;
          for (size_t i = 0; i < primals.size(); ++i) {
            auto lead = pieces[i].sizes().slice(0, pieces[i].dim() - 1);
            per_input.emplace_back(pieces[i].reshape(shape_concat(lead, primals[i].sizes())));
          }
          IValue by_input = tree_unflatten(per_input, flat_primals.second);
          jac_outs_ins.push_back(argnums.is_tuple() ? by_input : tuple_elements(by_input)[0]);
        }
        IValue jacobian = tree_unflatten(jac_outs_ins, flat_jac.second);
        if (has_aux) return make_tuple({jacobian, aux});
        return jacobian;
      },
      std::move(name));
}

TreeFn hessian(TreeFn f, Argnums argnums) { return jacfwd(jacrev(std::move(f), argnums), argnums); }

}  // namespace functorch
