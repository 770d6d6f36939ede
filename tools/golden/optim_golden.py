"""Golden values for //optim (issue 36): Python's fused=True and foreach=True
Adam, AdamW and SGD over several steps.

Run from the repo root with the venv's Python (the `torch` wheel the build
links, 2.15):

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \
        tools/golden/optim_golden.py

Four float32 parameters of different shapes in two param groups (their own
lr and weight decay), STEPS steps of fixed gradients; parameter 1 has no
gradient on step 0 (so its state starts a step late; Adam and AdamW only)
and parameter 3 none on step 2. For every case below and both implementations this records the
parameters after every step and the final optimizer state:

  init.<p>                  the initial parameters
  grad.<s>.<p>              the gradient of parameter p at step s (absent: None
                            in every case; (0, 1) is None for Adam and AdamW)
  <case>.<impl>.param.<s>.<p>   parameter p after step s
  <case>.<impl>.state.<p>.<entry>  the state after the last step
                               (exp_avg, exp_avg_sq, max_exp_avg_sq, step,
                               momentum_buffer)

with <impl> "fused" or "foreach". Writes optim/testdata/optim_golden.pt
({name: Tensor}, read by C++ with torch::pickle_load).

Also writes optim/testdata/optim_state_dict_golden.pt: {"<case>.<impl>":
opt.state_dict()} for the adamw and sgd_nesterov cases, taken after step
STEPS - 2 (so the last step can be replayed from it): Python's own optimizer
state dicts, whose param_groups carry 'fused': True or 'foreach': True, for
state_dict/optim_state_test (importing them into our optimizers).
"""
import copy
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "optim", "testdata", "optim_golden.pt")
STATE_DICT_OUT = os.path.join(HERE, "..", "..", "optim", "testdata", "optim_state_dict_golden.pt")
STATE_DICT_CASES = ("adamw", "sgd_nesterov")
SHAPES = [(5, 3), (7,), (2, 3, 4), (1,)]
STEPS = 4
MISSING = {(0, 1), (2, 3)}  # (step, param) without a gradient
# Python's fused SGD fails (TypeError in torch._fused_sgd_) when a parameter
# gets its first gradient after others have momentum buffers: the SGD cases
# skip only (2, 3). //optim's test covers the late start against torch::optim.
MISSING_SGD = {(2, 3)}

# name -> (optimizer class, options of group 0, options of group 1, shared options)
CASES = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.0),
              dict(betas=(0.9, 0.99), eps=1e-8)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(lr=2e-2, weight_decay=0.05),
                      dict(lr=5e-3, weight_decay=0.01), dict(amsgrad=True)),
    "adam_amsgrad_maximize": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05),
                              dict(lr=4e-3, weight_decay=0.0),
                              dict(amsgrad=True, maximize=True, betas=(0.8, 0.95))),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.0), dict(lr=2e-2, weight_decay=0.1),
             dict()),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, weight_decay=0.01), dict(lr=0.02),
                     dict(momentum=0.9, nesterov=True)),
    "sgd_dampening_maximize": (torch.optim.SGD, dict(lr=0.05), dict(lr=0.1, weight_decay=0.02),
                               dict(momentum=0.8, dampening=0.3, maximize=True)),
    "sgd_plain": (torch.optim.SGD, dict(lr=0.05, weight_decay=0.01), dict(lr=0.1), dict()),
}


def run(out, name, impl, init, grads, state_dicts):
    cls, g0, g1, shared = CASES[name]
    params = [t.clone().requires_grad_(True) for t in init]
    groups = [dict(params=params[:2], **g0), dict(params=params[2:], **g1)]
    opt = cls(groups, **shared, **{impl: True})
    missing = MISSING_SGD if cls is torch.optim.SGD else MISSING
    for s in range(STEPS):
        for i, p in enumerate(params):
            p.grad = None if (s, i) in missing else grads[s][i].clone()
        opt.step()
        for i, p in enumerate(params):
            out[f"{name}.{impl}.param.{s}.{i}"] = p.detach().clone()
        if s == STEPS - 2 and name in STATE_DICT_CASES:
            state_dicts[f"{name}.{impl}"] = copy.deepcopy(opt.state_dict())
    for i, p in enumerate(params):
        for entry, value in opt.state[p].items():
            if value is None:
                continue
            out[f"{name}.{impl}.state.{i}.{entry}"] = torch.as_tensor(value).detach().clone()


def main():
    g = torch.Generator().manual_seed(36)
    init = [torch.randn(*s, generator=g) for s in SHAPES]
    grads = [[torch.randn(*s, generator=g) for s in SHAPES] for _ in range(STEPS)]
    out = {}
    for i, t in enumerate(init):
        out[f"init.{i}"] = t
    for s in range(STEPS):
        for i in range(len(SHAPES)):
            if (s, i) not in MISSING_SGD:  # MISSING_SGD is within MISSING
                out[f"grad.{s}.{i}"] = grads[s][i]
    state_dicts = {}
    for name in CASES:
        for impl in ("fused", "foreach"):
            run(out, name, impl, init, grads, state_dicts)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    torch.save(out, OUT)
    print(f"wrote {len(out)} tensors to {os.path.relpath(OUT)} (torch {torch.__version__})")
    torch.save(state_dicts, STATE_DICT_OUT)
    print(f"wrote {len(state_dicts)} optimizer state dicts to {os.path.relpath(STATE_DICT_OUT)}")


if __name__ == "__main__":
    main()
