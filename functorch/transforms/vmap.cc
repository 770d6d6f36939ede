#include "functorch/transforms/vmap.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <sstream>
#include <vector>

#include "functorch/transforms/internal/decompositions.h"
#include "functorch/transforms/internal/levels.h"

namespace functorch {
namespace {

using FlatDims = std::vector<std::optional<int64_t>>;

at::functorch::RandomnessType to_engine(Randomness randomness) {
  switch (randomness) {
    case Randomness::kError: return at::functorch::RandomnessType::Error;
    case Randomness::kDifferent: return at::functorch::RandomnessType::Different;
    case Randomness::kSame: return at::functorch::RandomnessType::Same;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown Randomness");
}

struct Call {
  const TreeFn& f;
  const DimTree& in_dims;
  const DimTree& out_dims;
  Randomness randomness;
  std::string prefix_in() const {
    return "vmap(" + f.name() + ", in_dims=" + in_dims.to_string() + ", ...)(<inputs>): ";
  }
};

struct BatchedInputs {
  int64_t batch_size;
  FlatDims flat_in_dims;
  std::vector<c10::IValue> flat_args;
  TreeSpec args_spec;
};

// Python's _process_batched_inputs + _validate_and_get_batch_size.
BatchedInputs process_inputs(const Call& call, const std::vector<c10::IValue>& args) {
  TORCH_CHECK_VALUE(!args.empty(), "vmap(", call.f.name(),
                    ")(<inputs>): got no inputs. Maybe you forgot to add inputs, or you "
                    "are trying to vmap over a function with no inputs. The latter is "
                    "unsupported.");
  BatchedInputs out;
  std::tie(out.flat_args, out.args_spec) = tree_flatten(c10::ivalue::Tuple::create(args));
  auto flat_in_dims = call.in_dims.broadcast_to(out.args_spec);
  TORCH_CHECK_VALUE(flat_in_dims.has_value(), call.prefix_in(),
                    "in_dims is not compatible with the structure of `inputs`. "
                    "in_dims has structure ",
                    call.in_dims.structure(), " but inputs has structure ",
                    out.args_spec.to_string(), ".");
  out.flat_in_dims = std::move(*flat_in_dims);
  std::vector<int64_t> batch_sizes;
  for (size_t i = 0; i < out.flat_args.size(); ++i) {
    auto& in_dim = out.flat_in_dims[i];
    if (!in_dim.has_value()) continue;
    const auto& arg = out.flat_args[i];
    TORCH_CHECK_VALUE(arg.isTensor(), call.prefix_in(), "Got in_dim=", *in_dim,
                      " for an input but the input is of type ", python_type_repr(arg),
                      ". We cannot vmap over non-Tensor arguments, please use None as the "
                      "respective in_dim");
    const int64_t rank = arg.toTensor().dim();
    TORCH_CHECK_VALUE(*in_dim >= -rank && *in_dim < rank, call.prefix_in(), "Got in_dim=", *in_dim,
                      " for some input, but that input is a Tensor of "
                      "dimensionality ",
                      rank, " so expected in_dim to satisfy -", rank, " <= in_dim < ", rank, ".");
    if (*in_dim < 0) in_dim = *in_dim + rank;
    batch_sizes.push_back(arg.toTensor().size(*in_dim));
  }
  TORCH_CHECK_VALUE(!batch_sizes.empty(), "vmap: Expected at least one Tensor to vmap over");
  for (int64_t size : batch_sizes) {
    TORCH_CHECK_VALUE(size == batch_sizes[0],
                      "vmap: Expected all tensors to have the same size in "
                      "the mapped dimension, got sizes ",
                      c10::IntArrayRef(batch_sizes), " for the mapped dimension");
  }
  out.batch_size = batch_sizes[0];
  return out;
}

// Moves the batch dim of `level` out of `self` to `out_dim`, or materialises
// it (expand) when `self` never met a tensor of this level. (The binding
// Python calls, torch._C._functorch._remove_batch_dim, is not part of
// LibTorch; this is the same operation on the public engine API.)
at::Tensor remove_batch_dim(const at::Tensor& self, int64_t level, int64_t batch_size,
                            int64_t out_dim) {
  const auto* batched = at::functorch::maybeGetBatchedImpl(self);
  if (batched == nullptr || batched->level() < level) {
    std::vector<int64_t> sizes = self.sizes().vec();
    sizes.insert(sizes.begin() + out_dim, batch_size);
    return self.expand(sizes);
  }
  TORCH_INTERNAL_ASSERT(batched->level() == level, "vmap: output batched at level ",
                        batched->level(), " while unwrapping level ", level);
  // Already in place: skip the view (this is most calls, and it is the
  // largest piece of a tiny op's overhead).
  if (batched->bdim() == out_dim) return batched->value();
  return batched->value().movedim(batched->bdim(), out_dim);
}

struct Outputs {
  std::vector<c10::IValue> flat;
  TreeSpec spec;
  FlatDims flat_out_dims;
};

// Python's _unwrap_batched: flattens the outputs, matches out_dims against
// them and removes this level's batch dim from every mapped output.
Outputs unwrap_outputs(const Call& call, const c10::IValue& batched_outputs, int64_t level,
                       int64_t batch_size) {
  Outputs out;
  std::tie(out.flat, out.spec) = tree_flatten(batched_outputs);
  auto incompatible = [&]() {
    std::ostringstream os;
    os << "vmap(" << call.f.name() << ", ..., out_dims=" << call.out_dims.to_string()
       << ")(<inputs>): out_dims is not compatible with the structure of "
          "`outputs`. out_dims has structure "
       << call.out_dims.structure() << " but outputs has structure " << out.spec.to_string() << ".";
    return os.str();
  };
  if (out.spec.is_leaf() && !call.out_dims.is_leaf()) {
    // A single output may come with a one-element out_dims tuple.
    TORCH_CHECK_VALUE(call.out_dims.children().size() == 1 && call.out_dims.children()[0].is_leaf(),
                      incompatible());
    out.flat_out_dims = {call.out_dims.children()[0].dim()};
  } else {
    auto flat = call.out_dims.broadcast_to(out.spec);
    TORCH_CHECK_VALUE(flat.has_value(), incompatible());
    out.flat_out_dims = std::move(*flat);
  }
  const std::string& name = call.f.name();
  for (size_t i = 0; i < out.flat.size(); ++i) {
    auto& value = out.flat[i];
    const auto& out_dim = out.flat_out_dims[i];
    if (!out_dim.has_value()) {
      if (value.isTensor()) {
        const auto* batched = at::functorch::maybeGetBatchedImpl(value.toTensor());
        TORCH_CHECK_VALUE(batched == nullptr || batched->level() < level, "vmap(", name,
                          ", ...): `", name,
                          "` can not return a BatchedTensor when out_dim is "
                          "None");
      }
      continue;  // passed through unchanged
    }
    TORCH_CHECK_VALUE(value.isTensor(), "vmap(", name, ", ...): `", name,
                      "` must only return Tensors, got type ", python_type_repr(value),
                      ". Did you mean to set out_dims= to None for output?");
    const at::Tensor& tensor = value.toTensor();
    const int64_t rank = tensor.dim() + 1;  // with the batch dim restored
    int64_t dim = *out_dim;
    TORCH_CHECK_VALUE(dim >= -rank && dim < rank, "vmap(", name,
                      ", ..., out_dims=", call.out_dims.to_string(), "): Got out_dim=", dim,
                      " for an output of dimensionality ", rank,
                      " (with the vmapped dim) so expected out_dim to satisfy -", rank,
                      " <= out_dim < ", rank, ".");
    if (dim < 0) dim += rank;
    value = remove_batch_dim(tensor, level, batch_size, dim);
    out.flat_out_dims[i] = dim;
  }
  return out;
}

Outputs flat_vmap(const Call& call, int64_t batch_size, const FlatDims& flat_in_dims,
                  const std::vector<c10::IValue>& flat_args, const TreeSpec& args_spec) {
  internal::VmapLevel vmap_level(batch_size, to_engine(call.randomness));
  const int64_t level = vmap_level.level();
  std::vector<c10::IValue> batched(flat_args.size());
  for (size_t i = 0; i < flat_args.size(); ++i) {
    batched[i] = flat_in_dims[i].has_value()
                     ? c10::IValue(at::functorch::addBatchDim(flat_args[i].toTensor(),
                                                              *flat_in_dims[i], level))
                     : flat_args[i];
  }
  c10::IValue inputs = tree_unflatten(batched, args_spec);
  c10::IValue outputs = call.f(inputs.toTupleRef().elements().vec());
  return unwrap_outputs(call, outputs, level, batch_size);
}

// chunk_size: vmaps slices of the batch one after another and concatenates
// the per-chunk outputs along their out_dims.
c10::IValue chunked_vmap(const Call& call, const BatchedInputs& in, int64_t chunk_size) {
  std::vector<int64_t> split_points;
  for (int64_t end = chunk_size; end < in.batch_size; end += chunk_size) {
    split_points.push_back(end);
  }
  const size_t num_chunks = split_points.size() + 1;
  std::vector<std::vector<c10::IValue>> chunk_args(num_chunks,
                                                   std::vector<c10::IValue>(in.flat_args.size()));
  for (size_t i = 0; i < in.flat_args.size(); ++i) {
    if (!in.flat_in_dims[i].has_value()) {
      for (auto& chunk : chunk_args) chunk[i] = in.flat_args[i];
      continue;
    }
    auto pieces = in.flat_args[i].toTensor().tensor_split(split_points, *in.flat_in_dims[i]);
    for (size_t c = 0; c < num_chunks; ++c) chunk_args[c][i] = pieces[c];
  }
  at::Tensor rng_state;
  auto generator = at::detail::getDefaultCPUGenerator();
  if (call.randomness == Randomness::kSame) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    rng_state = generator.get_state();
  }
  std::vector<Outputs> chunk_outputs;
  for (size_t c = 0; c < num_chunks; ++c) {
    const int64_t size = c + 1 < num_chunks ? chunk_size : in.batch_size - chunk_size * int64_t(c);
    if (rng_state.defined()) {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(rng_state);
    }
    chunk_outputs.push_back(flat_vmap(call, size, in.flat_in_dims, chunk_args[c], in.args_spec));
  }
  Outputs& first = chunk_outputs.front();
  std::vector<c10::IValue> flat(first.flat.size());
  for (size_t i = 0; i < flat.size(); ++i) {
    if (!first.flat_out_dims[i].has_value()) {
      flat[i] = first.flat[i];  // unmapped: identical in every chunk
      continue;
    }
    std::vector<at::Tensor> pieces;
    pieces.reserve(num_chunks);
    for (auto& chunk : chunk_outputs) {
      pieces.push_back(chunk.flat[i].toTensor());
      chunk.flat[i] = c10::IValue();  // free as we go: peak memory
    }
    flat[i] = at::cat(pieces, *first.flat_out_dims[i]);
  }
  return tree_unflatten(flat, first.spec);
}

c10::IValue vmap_call(const TreeFn& f, const DimTree& in_dims, const DimTree& out_dims,
                      Randomness randomness, const std::optional<int64_t>& chunk_size,
                      const std::vector<c10::IValue>& args) {
  internal::register_decompositions();
  Call call{f, in_dims, out_dims, randomness};
  BatchedInputs in = process_inputs(call, args);
  if (chunk_size.has_value() && *chunk_size < in.batch_size) {
    return chunked_vmap(call, in, *chunk_size);
  }
  Outputs out = flat_vmap(call, in.batch_size, in.flat_in_dims, in.flat_args, in.args_spec);
  return tree_unflatten(out.flat, out.spec);
}

}  // namespace

Randomness parse_randomness(const std::string& randomness) {
  if (randomness == "error") return Randomness::kError;
  if (randomness == "different") return Randomness::kDifferent;
  if (randomness == "same") return Randomness::kSame;
  TORCH_CHECK(false,
              "Only allowed values for randomness are 'error', 'different', "
              "or 'same'. Got ",
              randomness);
}

namespace internal {
void check_vmap_args(const std::optional<int64_t>& chunk_size) {
  TORCH_CHECK_VALUE(!chunk_size.has_value() || *chunk_size > 0,
                    "vmap: chunk_size should be None or greater than 0. (got ", *chunk_size, ")");
}
}  // namespace internal

TreeFn vmap(TreeFn f, DimTree in_dims, DimTree out_dims, Randomness randomness,
            std::optional<int64_t> chunk_size) {
  internal::check_vmap_args(chunk_size);
  std::string name = f.name();
  return TreeFn(
      [f = std::move(f), in_dims = std::move(in_dims), out_dims = std::move(out_dims), randomness,
       chunk_size](const std::vector<c10::IValue>& args) {
        return vmap_call(f, in_dims, out_dims, randomness, chunk_size, args);
      },
      std::move(name));
}

}  // namespace functorch
