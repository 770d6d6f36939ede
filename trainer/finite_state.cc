#include "trainer/finite_state.h"

#include <cmath>
#include <cstdio>
#include <optional>

#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/zeros.h>

#include "absl/strings/str_cat.h"
#include "state_dict/optim_state.h"

namespace trainer {
namespace {

std::string Number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

// `name`'s non-finite elements, described; nullopt when every one is finite
// (or the tensor is not floating point).
std::optional<std::string> DescribeNonFinite(const std::string& name, const at::Tensor& t) {
  if (!t.defined() || !at::isFloatingType(t.scalar_type()) || t.numel() == 0) return std::nullopt;
  const at::Tensor bad = at::logical_not(at::isfinite(t.detach())).reshape({-1});
  const int64_t count = bad.sum().item<int64_t>();
  if (count == 0) return std::nullopt;
  const int64_t first = at::nonzero(bad).reshape({-1})[0].item<int64_t>();
  const double value = t.detach().reshape({-1})[first].item<double>();
  return absl::StrCat(name, " holds ", count, " NaN/Inf value", count == 1 ? "" : "s", " of ",
                      t.numel(), " (the first at flat index ", first, ": ", Number(value), ")");
}

}  // namespace

bool LocalGradsFinite(const std::vector<at::Tensor>& params) {
  at::Tensor bad = at::zeros({}, at::kBool);
  bool any = false;
  for (const at::Tensor& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined() || g.numel() == 0) continue;
    const at::Tensor g_bad = at::logical_not(at::isfinite(g)).any();
    bad = any ? (bad.to(g_bad.device()) | g_bad) : g_bad;
    any = true;
  }
  return !any || !bad.item<bool>();
}

absl::Status CheckStepFinite(int64_t step, double global_loss, double grad_norm,
                             bool grads_finite) {
  std::string what;
  if (!std::isfinite(global_loss)) {
    what = absl::StrCat("the global loss is ", Number(global_loss));
  } else if (!grads_finite) {
    what = absl::StrCat("the gradients hold NaN or Inf (the global loss is ", Number(global_loss),
                        ")");
  } else if (!(grad_norm < 0) && !std::isfinite(grad_norm)) {  // NaN is not < 0
    what = absl::StrCat("the global gradient norm (--clip) is ", Number(grad_norm));
  } else {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "step ", step, ": ", what,
      ": expected a finite number (the run diverged; stopped before this step's optimizer "
      "update: the newest checkpoint holds the last finite state; resume from it with a lower "
      "--lr, or a larger --warmup-steps / --clip)"));
}

absl::Status CheckStateFinite(const fsdp::FullyShardedDataParallel& model,
                              const torch::optim::Optimizer& optimizer, const std::string& what) {
  const auto named = model.named_parameters();
  std::vector<std::string> names;
  for (const auto& item : named) {
    names.push_back(item.key());
    if (auto bad = DescribeNonFinite(item.key(), item.value())) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": parameter ", *bad, ": expected finite values"));
    }
  }
  auto state = state_dict::ExportOptimizerState(optimizer);
  if (!state.ok()) return state.status();
  for (const auto& [key, entries] : state->state) {
    std::string param = state_dict::ParamKeyString(key);
    if (const int64_t* id = std::get_if<int64_t>(&key);
        id != nullptr && *id >= 0 && *id < static_cast<int64_t>(names.size())) {
      param = names[static_cast<size_t>(*id)];
    }
    for (const auto& entry : entries) {
      if (auto bad = DescribeNonFinite(absl::StrCat(param, "/", entry.key()), entry.value())) {
        return absl::FailedPreconditionError(
            absl::StrCat(what, ": optimizer state ", *bad, ": expected finite values"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace trainer
