"""Golden values for the loss sweep of //functorch/transforms (issue 17).

Run from the repo root with the venv's Python that `tools/setup.sh
--with-python` makes (the `torch` wheel the build links, 2.15; torch.func):

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \
        tools/golden/functorch_losses_golden.py

For every stock loss of torch.nn.functional (the ones LibTorch's
torch::nn::functional also has), applied to a small tanh MLP through
functional_call, this records, in float64:

  * the inputs (parameters, examples, targets), so C++ feeds the same numbers;
  * reference values from plain autograd, independent of functorch:
      ref.<loss>.hess.<p>.<q>   torch.autograd.functional.hessian of the loss
                                of example 0 w.r.t. the parameter dict
      ref.<loss>.psg.<p>        per-example torch.autograd.grad, stacked
  * what Python torch.func itself does for hessian, jacfwd(jacrev) and
    vmap(grad): status.<loss>.<transform> = 1 (ran and matched the
    reference), 0 (raised) or 2 (ran; nothing to check against / differs).

Writes functorch/transforms/testdata/losses_golden.pt ({name: Tensor}, read by
C++ with torch::pickle_load) and losses_python_status.txt (Python's error
message for every case it cannot do; the C++ test and README cite it).
"""
import os
import warnings

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, vmap

HERE = os.path.dirname(os.path.abspath(__file__))
TESTDATA = os.path.join(HERE, "..", "..", "functorch", "transforms", "testdata")
N, K, C = 4, 2, 3  # examples, rows per example, classes/features


def losses(g):
    """name -> (loss(out, *targets), targets with a leading example dim)."""
    dt = torch.float64
    r = lambda *s: torch.randn(*s, generator=g, dtype=dt)
    u = lambda *s: torch.rand(*s, generator=g, dtype=dt)
    sign = lambda *s: torch.randint(0, 2, s, generator=g).to(dt) * 2 - 1
    cls = lambda *s: torch.randint(0, C, s, generator=g)
    mlm = torch.full((N, K, C), -1, dtype=torch.long)
    mlm[:, :, 0] = cls(N, K)
    return {
        "mse": (lambda o, t: F.mse_loss(o, t), [r(N, K, C)]),
        "l1": (lambda o, t: F.l1_loss(o, t), [r(N, K, C)]),
        "smooth_l1": (lambda o, t: F.smooth_l1_loss(o, t), [r(N, K, C)]),
        "huber": (lambda o, t: F.huber_loss(o, t, delta=0.5), [r(N, K, C)]),
        "cross_entropy": (lambda o, t: F.cross_entropy(o, t), [cls(N, K)]),
        "cross_entropy_probs": (lambda o, t: F.cross_entropy(o, t),
                                [torch.softmax(r(N, K, C), -1)]),
        "nll": (lambda o, t: F.nll_loss(F.log_softmax(o, -1), t), [cls(N, K)]),
        "bce": (lambda o, t: F.binary_cross_entropy(torch.sigmoid(o), t),
                [u(N, K, C)]),
        "bce_with_logits": (lambda o, t: F.binary_cross_entropy_with_logits(o, t),
                            [u(N, K, C)]),
        "kl_div": (lambda o, t: F.kl_div(F.log_softmax(o, -1), t,
                                         reduction="batchmean"),
                   [torch.softmax(r(N, K, C), -1)]),
        "poisson_nll": (lambda o, t: F.poisson_nll_loss(o, t), [u(N, K, C) * 3]),
        "soft_margin": (lambda o, t: F.soft_margin_loss(o, t), [sign(N, K, C)]),
        "multilabel_soft_margin": (
            lambda o, t: F.multilabel_soft_margin_loss(o, t),
            [torch.randint(0, 2, (N, K, C), generator=g).to(dt)]),
        "hinge_embedding": (lambda o, t: F.hinge_embedding_loss(o, t),
                            [sign(N, K, C)]),
        "multi_margin": (lambda o, t: F.multi_margin_loss(o, t), [cls(N, K)]),
        "multilabel_margin": (lambda o, t: F.multilabel_margin_loss(o, t), [mlm]),
        "cosine_embedding": (lambda o, t, y: F.cosine_embedding_loss(o, t, y),
                             [r(N, K, C), sign(N, K)]),
        "margin_ranking": (
            lambda o, y: F.margin_ranking_loss(o[:, 0], o[:, 1], y, margin=0.1),
            [sign(N, K)]),
        "triplet_margin": (lambda o, p, n: F.triplet_margin_loss(o, p, n),
                           [r(N, K, C), r(N, K, C)]),
        "triplet_margin_with_distance": (
            lambda o, p, n: F.triplet_margin_with_distance_loss(o, p, n),
            [r(N, K, C), r(N, K, C)]),
        # log_probs [T=K, batch=1, C]; one target label (1..C-1) per example.
        "ctc": (lambda o, t: F.ctc_loss(
            F.log_softmax(o, -1).unsqueeze(1), t.view(1, 1),
            torch.full((1,), K, dtype=torch.long),
            torch.ones(1, dtype=torch.long)),
            [torch.randint(1, C, (N,), generator=g)]),
    }


def first_line(e):
    return (type(e).__name__ + ": " + str(e).strip().splitlines()[0])[:300]


def main():
    warnings.filterwarnings("ignore", message="There is a performance drop")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(17)
    dt = torch.float64
    model = torch.nn.Sequential(torch.nn.Linear(C, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, C)).to(dt)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    names = list(params)
    xs = torch.randn(N, K, C, generator=g, dtype=dt)
    out = {"xs": xs}
    for k, v in params.items():
        out["param." + k] = v
    status_lines = []

    for lname, (lfn, targets) in losses(g).items():
        for i, t in enumerate(targets):
            out[f"target.{lname}.{i}"] = t

        def loss(p, x, *ts):
            return lfn(functional_call(model, p, (x,)), *ts)

        # References from plain autograd.
        t0 = [t[0] for t in targets]
        flat = tuple(params[n] for n in names)

        def loss_flat(*ps):
            return loss(dict(zip(names, ps)), xs[0], *t0)

        ref = {}
        try:
            ref_h = torch.autograd.functional.hessian(loss_flat, flat)
        except RuntimeError as e:  # no double backward in PyTorch at all
            ref_h = None
            status_lines.append(f"{lname}.reference_hessian\t{first_line(e)}")
        out[f"status.{lname}.reference_hessian"] = torch.tensor(int(ref_h is not None))
        for a, pa in enumerate(names if ref_h is not None else []):
            for b, pb in enumerate(names):
                ref[(pa, pb)] = ref_h[a][b]
                out[f"ref.{lname}.hess.{pa}.{pb}"] = ref_h[a][b]
        per_example = []
        for i in range(N):
            ps = {n: params[n].clone().requires_grad_() for n in names}
            gi = torch.autograd.grad(loss(ps, xs[i], *[t[i] for t in targets]),
                                     [ps[n] for n in names], allow_unused=True)
            per_example.append([torch.zeros_like(params[n]) if x is None else x
                                for n, x in zip(names, gi)])
        for j, n in enumerate(names):
            out[f"ref.{lname}.psg.{n}"] = torch.stack([e[j] for e in per_example])

        # What torch.func does.
        cases = {
            "hessian": lambda: hessian(loss)(params, xs[0], *t0),
            "jacfwd_jacrev": lambda: jacfwd(jacrev(loss))(params, xs[0], *t0),
            "vmap_grad": lambda: vmap(grad(loss), in_dims=(None, 0) + (0,) * len(targets))(
                params, xs, *targets),
        }
        for tname, run in cases.items():
            key = f"{lname}.{tname}"
            try:
                res = run()
            except Exception as e:  # noqa: BLE001 -- recording Python's behaviour
                out["status." + key] = torch.tensor(0)
                status_lines.append(f"{key}\t{first_line(e)}")
                continue
            # Python's values are not stored: C++ is checked against the
            # references, and status records that Python matched them too.
            ok = True
            if tname != "vmap_grad" and not ref:
                ok = False  # ran, but there is nothing to check it against
            elif tname == "vmap_grad":
                for n in names:
                    ok &= torch.allclose(res[n], out[f"ref.{lname}.psg.{n}"])
            else:
                for (pa, pb), r in ref.items():
                    ok &= torch.allclose(res[pa][pb], r)
            out["status." + key] = torch.tensor(1 if ok else 2)
            if not ok:
                status_lines.append(f"{key}\tran, but " + (
                    "differs from plain autograd" if ref or tname == "vmap_grad"
                    else "plain autograd has no Hessian to check it against"))

    out = {k: v.detach().clone().contiguous() for k, v in out.items()}
    torch.save(out, os.path.join(TESTDATA, "losses_golden.pt"))
    with open(os.path.join(TESTDATA, "losses_python_status.txt"), "w") as f:
        f.write(f"# <loss>.<transform>\t<what Python torch.func (torch "
                f"{torch.__version__.split('+')[0]}) does> "
                "(cases not listed: it works and matches plain autograd)\n")
        f.write("\n".join(status_lines) + "\n")
    print(f"wrote {len(out)} tensors; {len(status_lines)} Python failures")


if __name__ == "__main__":
    main()
