"""Golden values for //functorch/transforms tests, from PyTorch's torch.func.

Run from the repo root with the venv's Python that `tools/setup.sh
--with-python` makes (the `torch` wheel the build links, 2.15):

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \
        tools/golden/functorch_transforms_golden.py

Writes functorch/transforms/testdata/transforms_golden.pt: torch.save of a
plain dict {name: Tensor}, which C++ reads with torch::pickle_load. Inputs
are stored next to the outputs so the C++ tests feed the same numbers.
"""
import os

import torch
import torch.nn.functional as F
from torch.func import grad, grad_and_value, hessian, jacfwd, jacrev, jvp, vjp, vmap

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "functorch",
                   "transforms", "testdata", "transforms_golden.pt")


def main():
    torch.manual_seed(0)
    g = {}
    dt = torch.float64

    # vmap over dot: in_dims variants, nesting, out_dims.
    x, y = torch.randn(3, 5, dtype=dt), torch.randn(3, 5, dtype=dt)
    g["dot.x"], g["dot.y"] = x, y
    g["vmap_dot"] = vmap(torch.dot)(x, y)
    g["vmap_dot_in_dims_1"] = vmap(torch.dot, in_dims=1)(x, y)
    g["vmap_dot_0_none"] = vmap(torch.dot, in_dims=(0, None))(x, y[0])
    x3, y3 = torch.randn(2, 3, 5, dtype=dt), torch.randn(2, 3, 5, dtype=dt)
    g["nested.x"], g["nested.y"] = x3, y3
    g["vmap_vmap_dot"] = vmap(vmap(torch.dot))(x3, y3)
    m = torch.randn(4, 3, dtype=dt)
    g["mv.m"] = m
    g["vmap_mv_out_dims_1"] = vmap(torch.mv, in_dims=(None, 0), out_dims=1)(m, x[:, :3])
    g["vmap_neg_in_dim"] = vmap(lambda a: a.sin() * 2, in_dims=-1)(x)

    # grad, grad_and_value, higher order, argnums, has_aux, pytrees.
    s = torch.randn((), dtype=dt)
    g["scalar"] = s
    g["grad_sin"] = grad(torch.sin)(s)
    g["grad_grad_sin"] = grad(grad(torch.sin))(s)
    g["grad_grad_grad_sin"] = grad(grad(grad(torch.sin)))(s)
    a, b = torch.randn(4, dtype=dt), torch.randn(4, dtype=dt)
    g["ab.a"], g["ab.b"] = a, b

    def fab(a, b):
        return (a * b.sin()).sum()

    ga, gb = grad(fab, argnums=(0, 1))(a, b)
    g["grad_ab_0"], g["grad_ab_1"] = ga, gb
    g["grad_ab_argnum1"] = grad(fab, argnums=1)(a, b)
    gv = grad_and_value(fab)(a, b)
    g["grad_and_value_grad"], g["grad_and_value_value"] = gv

    def with_aux(a):
        y = a.exp()
        return y.sum(), y.cos()

    ga, aux = grad(with_aux, has_aux=True)(a)
    g["grad_aux_grad"], g["grad_aux_aux"] = ga, aux

    w, bias = torch.randn(3, 4, dtype=dt), torch.randn(3, dtype=dt)
    g["tree.w"], g["tree.b"] = w, bias

    def ftree(params, x):
        return (params["w"] @ x + params["b"]).tanh().sum()

    gt = grad(ftree)({"w": w, "b": bias}, a)
    g["grad_tree_w"], g["grad_tree_b"] = gt["w"], gt["b"]

    # Per-sample gradients of a small MLP with cross-entropy.
    w1, b1 = torch.randn(8, 4, dtype=dt), torch.randn(8, dtype=dt)
    w2, b2 = torch.randn(3, 8, dtype=dt), torch.randn(3, dtype=dt)
    xs, ts = torch.randn(6, 4, dtype=dt), torch.randint(0, 3, (6,))
    g.update({"mlp.w1": w1, "mlp.b1": b1, "mlp.w2": w2, "mlp.b2": b2,
              "mlp.x": xs, "mlp.t": ts})

    def loss(w1, b1, w2, b2, x, t):
        h = F.relu(F.linear(x, w1, b1))
        logits = F.linear(h, w2, b2)
        return F.cross_entropy(logits.unsqueeze(0), t.unsqueeze(0))

    psg = vmap(grad(loss, argnums=(0, 1, 2, 3)),
               in_dims=(None, None, None, None, 0, 0))(w1, b1, w2, b2, xs, ts)
    for name, t in zip(["w1", "b1", "w2", "b2"], psg):
        g["psg_" + name] = t

    # vjp and jvp.
    def fsin_mul(x, y):
        return x.sin() * y

    out, vjp_fn = vjp(fsin_mul, a, b)
    ct = torch.randn(4, dtype=dt)
    g["vjp.ct"] = ct
    g["vjp_out"] = out
    g["vjp_0"], g["vjp_1"] = vjp_fn(ct)
    ta, tb = torch.randn(4, dtype=dt), torch.randn(4, dtype=dt)
    g["jvp.ta"], g["jvp.tb"] = ta, tb
    g["jvp_out"], g["jvp_tangent"] = jvp(fsin_mul, (a, b), (ta, tb))

    # Jacobians and Hessians.
    def fvec(x):
        return x.sin() * x.sum()

    g["jacrev_fvec"] = jacrev(fvec)(a)
    g["jacfwd_fvec"] = jacfwd(fvec)(a)
    g["jacrev_ab_0"], g["jacrev_ab_1"] = jacrev(fsin_mul, argnums=(0, 1))(a, b)
    g["jacfwd_ab_1"] = jacfwd(fsin_mul, argnums=1)(a, b)
    W1, W2 = torch.randn(5, 4, dtype=dt), torch.randn(4, 5, dtype=dt)
    g["tanh.W1"], g["tanh.W2"] = W1, W2

    def tanh_mlp(x):
        return (W2 @ (W1 @ x).tanh()).tanh()

    g["jacrev_jacrev_sum"] = jacrev(jacrev(lambda x: tanh_mlp(x).sum()))(a)
    g["hessian_sum"] = hessian(lambda x: tanh_mlp(x).sum())(a)
    xb = torch.randn(7, 4, dtype=dt)
    g["batch.x"] = xb
    g["vmap_jacrev_tanh"] = vmap(jacrev(tanh_mlp))(xb)
    g["vmap_jacfwd_tanh"] = vmap(jacfwd(tanh_mlp))(xb)

    # has_aux on vjp and jvp (drawn after everything above, so the earlier
    # values do not move when cases are added here).
    def sin_mul_aux(x, y):
        out = x.sin() * y
        return out, {"cos": x.cos() * y, "sq": out * out}

    out, vjp_fn, aux = vjp(sin_mul_aux, a, b, has_aux=True)
    ct2 = torch.randn(4, dtype=dt)
    g["vjp_aux.ct"] = ct2
    g["vjp_aux_out"] = out
    g["vjp_aux_0"], g["vjp_aux_1"] = vjp_fn(ct2)
    g["vjp_aux_aux_cos"], g["vjp_aux_aux_sq"] = aux["cos"], aux["sq"]
    out, jvp_out, aux = jvp(sin_mul_aux, (a, b), (ta, tb), has_aux=True)
    g["jvp_aux_out"], g["jvp_aux_tangent"] = out, jvp_out
    g["jvp_aux_aux_cos"], g["jvp_aux_aux_sq"] = aux["cos"], aux["sq"]

    # vjp of a two-output function (cotangents are a tuple) and of a loss
    # over a parameter dict; vjp_fn's results are a tuple, one per primal.
    def two_outputs(x, y):
        return x * y, (x + y).exp()

    out, vjp_fn = vjp(two_outputs, a, b)
    c0, c1 = torch.randn(4, dtype=dt), torch.randn(4, dtype=dt)
    g["vjp2.ct0"], g["vjp2.ct1"] = c0, c1
    g["vjp2_out0"], g["vjp2_out1"] = out
    g["vjp2_0"], g["vjp2_1"] = vjp_fn((c0, c1))

    def dict_loss(params, x):
        y = (params["w"] @ x + params["b"]).tanh()
        return y.sum(), y

    loss, vjp_fn, aux = vjp(dict_loss, {"w": w, "b": bias}, a, has_aux=True)
    one = torch.ones((), dtype=dt)
    dparams, dx = vjp_fn(one)
    g["vjp_dict_loss"], g["vjp_dict_aux"] = loss, aux
    g["vjp_dict_w"], g["vjp_dict_b"], g["vjp_dict_x"] = dparams["w"], dparams["b"], dx
    out, jvp_out, aux = jvp(dict_loss, ({"w": w, "b": bias}, a),
                            ({"w": torch.ones_like(w), "b": torch.zeros_like(bias)},
                             torch.zeros_like(a)), has_aux=True)
    g["jvp_dict_out"], g["jvp_dict_tangent"], g["jvp_dict_aux"] = out, jvp_out, aux

    for k, v in g.items():
        assert isinstance(v, torch.Tensor), k
    g = {k: v.detach().clone().contiguous() for k, v in g.items()}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    torch.save(g, OUT)
    print(f"wrote {len(g)} tensors to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
