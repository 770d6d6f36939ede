#include "trainer/finite_state.h"

#include <cmath>
#include <cstdio>

#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/zeros.h>

#include "absl/strings/str_cat.h"
#include "state_dict/sharded_tensor.h"

namespace trainer {
namespace {

std::string Number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
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

absl::Status CheckStateFinite(state_dict::ShardedModel& model,
                              const torch::optim::Optimizer& optimizer, const std::string& what) {
  auto state = state_dict::ModelAndOptimizerState(model, &optimizer);
  if (!state.ok()) return state.status();
  for (const auto& item : state->sharded) {
    int64_t count = 0, numel = 0, first = -1;
    double value = 0;
    for (const state_dict::ShardPiece& piece : item.value().pieces) {
      numel += piece.data.numel();
      const at::Tensor& t = piece.data;
      if (!at::isFloatingType(t.scalar_type()) || t.numel() == 0) continue;
      const at::Tensor bad = at::logical_not(at::isfinite(t.detach())).reshape({-1});
      const int64_t here = bad.sum().item<int64_t>();
      if (here > 0 && first < 0) {
        const int64_t at = at::nonzero(bad).reshape({-1})[0].item<int64_t>();
        first = piece.range.offset + at;
        value = t.detach().reshape({-1})[at].item<double>();
      }
      count += here;
    }
    if (count == 0) continue;
    const bool optimizer_entry = item.key().find('/') != std::string::npos;
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": ", optimizer_entry ? "optimizer state " : "parameter ", item.key(),
                     " holds ", count, " NaN/Inf value", count == 1 ? "" : "s", " of ", numel,
                     " on this rank (the first at flat index ", first, ": ", Number(value),
                     "): expected finite values"));
  }
  return absl::OkStatus();
}

}  // namespace trainer
