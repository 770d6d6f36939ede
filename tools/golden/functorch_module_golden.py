"""Golden values for functorch/module's tests, computed by real PyTorch.

Run from the repo root with the venv's Python that `tools/setup.sh
--with-python` makes (the `torch` wheel the build links, 2.15; torch.func):

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \
        tools/golden/functorch_module_golden.py

Writes functorch/module/testdata/<case>.pt: each a torch.save of a plain
dict {str: Tensor} (LibTorch reads it with torch::pickle_load). Keys:
  param.<name>   the model's parameters/buffers (loaded into the C++ model)
  sub.<name>     substitute parameters/buffers passed to functional_call
  in.<k>         inputs
  out.<k>        outputs of functional_call with the substitutes
  grad.<name>    d loss / d sub.<name>, loss = sum of squares of the outputs
  after.<name>   a substitute buffer after the call (BatchNorm running stats)
Seeds are fixed, so a rerun reproduces the files. Every functional_call
is also checked against the plain module with the substitutes loaded into a
copy (load_state_dict), so a call that ran with the old weights fails here.
"""
import copy
import os

import torch
import torch.nn as nn
from torch.func import functional_call, stack_module_state, vmap

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                   "functorch", "module", "testdata")


def save(case, d):
    d = {k: v.detach().clone().contiguous() for k, v in d.items()}
    path = os.path.normpath(os.path.join(OUT, case + ".pt"))
    torch.save(d, path)
    print(path, len(d), "tensors")


def state(model):
    d = {}
    d.update(model.named_parameters())
    d.update(model.named_buffers())
    return d


def substitutes(model, scale=0.5):
    """Fresh leaves (params) / copies (buffers) differing from the model's."""
    sub = {}
    for name, p in model.named_parameters():
        sub[name] = (p.detach() + scale * torch.randn_like(p)).requires_grad_()
    for name, b in model.named_buffers():
        sub[name] = b.detach().clone()
    return sub


def sum_sq(outputs):
    return sum((o ** 2).sum() for o in outputs)


def record(case, model, inputs, run, extra=None):
    """run(model, sub) -> tuple of outputs, under functional_call."""
    d = {"param." + k: v for k, v in state(model).items()}
    for k, v in inputs.items():
        d["in." + k] = v
    sub = substitutes(model)
    # Snapshot now: the call updates substitute buffers in place.
    d.update({"sub." + k: v.detach().clone() for k, v in sub.items()})
    # The plain module with the substitutes loaded, for the check below
    # (1.13's nn.utils.stateless.functional_call did not refresh nn.LSTM's
    # _flat_weights and ran the LSTM with the old weights; the 1.13 script
    # used functorch.make_functional_with_buffers for that reason).
    plain = copy.deepcopy(model)
    plain.load_state_dict({k: v.detach().clone() for k, v in sub.items()})
    outs = run(lambda *a: functional_call(model, sub, a), inputs)
    for i, o in enumerate(outs):
        d["out.%d" % i] = o
    with torch.no_grad():
        plain_outs = run(plain, inputs)
    for i, (o, p) in enumerate(zip(outs, plain_outs)):
        assert torch.allclose(o, p, rtol=1e-5, atol=1e-6), (case, "out.%d" % i)
    for k, b in plain.named_buffers():
        assert torch.equal(sub[k], b), (case, "after." + k)
    params = [k for k, _ in model.named_parameters()]
    grads = torch.autograd.grad(sum_sq(outs), [sub[k] for k in params])
    d.update({"grad." + k: g for k, g in zip(params, grads)})
    for k, _ in model.named_buffers():
        d["after." + k] = sub[k]
    if extra:
        d.update(extra)
    save(case, d)


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 3))
    x = torch.randn(5, 4)
    record("mlp", model, {"x": x}, lambda f, i: (f(i["x"]),))


def cnn(train):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    # Non-trivial running statistics before the recorded call.
    model.train()
    with torch.no_grad():
        model(torch.randn(6, 2, 5, 5))
    model.train(train)
    x = torch.randn(3, 2, 5, 5)
    record("cnn_train" if train else "cnn_eval", model, {"x": x},
           lambda f, i: (f(i["x"]),))


def lstm():
    torch.manual_seed(2)
    model = nn.LSTM(3, 5, num_layers=2)
    x = torch.randn(4, 2, 3)
    def run(f, i):
        y, (h, c) = f(i["x"])
        return y, h, c
    record("lstm", model, {"x": x}, run)


def transformer():
    torch.manual_seed(3)
    model = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16,
                                       dropout=0.0)
    model.train()  # dropout=0; train mode keeps PyTorch off its fused fast path
    x = torch.randn(5, 2, 8)
    record("transformer", model, {"x": x}, lambda f, i: (f(i["x"]),))


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 6)
        self.decoder = nn.Linear(6, 10, bias=False)
        self.decoder.weight = self.embedding.weight

    def forward(self, tokens):
        return self.decoder(self.embedding(tokens))


def tied():
    torch.manual_seed(4)
    model = TiedLM()
    tokens = torch.tensor([[1, 3, 5], [7, 9, 0]])
    d = {"param.embedding.weight": model.embedding.weight, "in.tokens": tokens}
    # One tensor for the tie (as functorch.make_functional gave in 1.13):
    # named_parameters() lists it once, and functional_call's default
    # tie_weights=True puts the substitute in both places.
    params = dict(model.named_parameters())
    assert list(params) == ["embedding.weight"]
    w0 = params["embedding.weight"]
    w = (w0.detach() + 0.5 * torch.randn_like(w0)).requires_grad_()
    y = functional_call(model, {"embedding.weight": w}, (tokens,))
    plain = copy.deepcopy(model)
    with torch.no_grad():
        plain.embedding.weight.copy_(w)
        assert plain.decoder.weight is plain.embedding.weight
        assert torch.allclose(y, plain(tokens))
    (g,) = torch.autograd.grad((y ** 2).sum(), [w])
    d.update({"sub.embedding.weight": w, "out.0": y, "grad.embedding.weight": g})
    save("tied", d)


def ensemble():
    torch.manual_seed(5)
    models = [nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
              for _ in range(3)]
    x = torch.randn(5, 4)
    # stack_module_state + functional_call over a stateless copy: 1.13's
    # functorch.combine_state_for_ensemble.
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    y = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)),
             in_dims=(0, 0, None))(params, buffers, x)
    with torch.no_grad():
        assert torch.allclose(y, torch.stack([m(x) for m in models]))
    d = {"in.x": x, "out.0": y}
    for m, model in enumerate(models):
        for k, v in model.named_parameters():
            d["model%d.%s" % (m, k)] = v
    save("ensemble", d)


if __name__ == "__main__":
    mlp()
    cnn(train=True)
    cnn(train=False)
    lstm()
    transformer()
    tied()
    ensemble()
