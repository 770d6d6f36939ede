#!/usr/bin/python3
"""Python functorch (PyTorch 1.13) timings for the cases of
//benchmarks:transforms_bench, for benchmarks/RESULTS.md.

    /usr/bin/python3 functorch/transforms/bench/functorch_reference_bench.py

Same shapes and formulations as benchmarks/transforms_bench.cc.
"""
import time

import torch
import torch.nn.functional as F
from functorch import grad, jacrev, vmap


def bench(name, fn, unit="ms", min_time=1.0):
    """Mean wall and CPU time per call (CPU time is the steadier number when
    other processes share the machine, as Google Benchmark's CPU column)."""
    fn()
    n, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time and n >= 3:
            break
    cpu = (time.process_time() - cpu_start) / n
    per = elapsed / n
    scale = 1e3 if unit == "ms" else 1e6
    print(f"{name:34s} wall {per * scale:10.3f} {unit}  cpu {cpu * scale:10.3f} {unit}"
          f"   ({n} iterations)")
    return cpu


def main():
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    w1, b1 = torch.randn(256, 128) * 0.05, torch.zeros(256)
    w2, b2 = torch.randn(10, 256) * 0.05, torch.zeros(10)
    x, t = torch.randn(256, 128), torch.randint(0, 10, (256,))

    def example_loss(w1, b1, w2, b2, x, t):
        h = F.linear(x, w1, b1).relu()
        logits = F.linear(h, w2, b2)
        return F.cross_entropy(logits.unsqueeze(0), t.unsqueeze(0))

    per_sample = vmap(grad(example_loss, argnums=(0, 1, 2, 3)),
                      in_dims=(None, None, None, None, 0, 0))
    vg = bench("PerSampleGrad_VmapGrad", lambda: per_sample(w1, b1, w2, b2, x, t))
    params = [p.clone().requires_grad_() for p in (w1, b1, w2, b2)]

    def loop():
        per = [[] for _ in params]
        for i in range(x.shape[0]):
            loss = example_loss(*params, x[i], t[i])
            for k, g in enumerate(torch.autograd.grad(loss, params)):
                per[k].append(g)
        return [torch.stack(g) for g in per]

    lp = bench("PerSampleGrad_Loop", loop)
    print(f"  loop / vmap(grad) = {lp / vg:.2f}x (cpu)")

    jw1, jb1 = torch.randn(64, 16) * 0.25, torch.randn(64) * 0.1
    jw2, jb2 = torch.randn(16, 64) * 0.125, torch.randn(16) * 0.1

    def f(x):
        return F.linear(F.linear(x, jw1, jb1).tanh(), jw2, jb2).tanh()

    xs = torch.randn(1024, 16)
    batched_jacobian = vmap(jacrev(f))
    vj = bench("BatchedJacobian_VmapJacrev", lambda: batched_jacobian(xs))

    def jloop():
        jacobians = []
        for i in range(xs.shape[0]):
            xi = xs[i].detach().requires_grad_()
            y = f(xi)
            rows = [torch.autograd.grad(y[r], xi, retain_graph=True)[0]
                    for r in range(y.shape[0])]
            jacobians.append(torch.stack(rows))
        return torch.stack(jacobians)

    jl = bench("BatchedJacobian_Loop", jloop, min_time=2.0)
    print(f"  loop / vmap(jacrev) = {jl / vj:.2f}x (cpu)")

    a, b = torch.randn(8, 5), torch.randn(8, 5)
    batched_dot = vmap(torch.dot)
    bench("VmapDot_Tiny", lambda: batched_dot(a, b), unit="us")
    bench("Dot_Tiny_Direct", lambda: (a * b).sum(1), unit="us")


if __name__ == "__main__":
    main()
