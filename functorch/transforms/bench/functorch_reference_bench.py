"""Python torch.func timings for the cases of
//benchmarks:transforms_bench, for benchmarks/RESULTS.md.

    ${TORCHFSDP_HOME:-~/.cache/torchfsdp-cpp}/venv/bin/python3 \
        functorch/transforms/bench/functorch_reference_bench.py
        [--filter REGEX] [--repetitions N] [--json FILE] [--device cuda]
        [--min-time S]

Same shapes and formulations as benchmarks/transforms_bench.cc. --filter
runs only the cases whose name matches (re.search, as
--benchmark_filter); --repetitions N times each case N times and reports
the median of the N means; --json writes {case: {"cpu_s", "wall_s",
"iterations"}} for scripts (benchmarks/compare_pytorch.sh). --device cuda
makes the tensors on cuda:0 and synchronises the device after every timed
call (benchmarks/run_gpu.sh runs the PerSampleGrad_VmapGrad case so, beside
gpu_check's functorch_per_sample_grads); the CPU time is then mostly the
wait. --min-time S: seconds per repetition (default 1).
"""
import argparse
import json
import re
import statistics
import time

import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, vmap


OPTIONS = argparse.Namespace(filter=None, repetitions=1, json=None, device="cpu",
                             min_time=1.0)
RESULTS = {}


def selected(name):
    return OPTIONS.filter is None or re.search(OPTIONS.filter, name) is not None


def sync():
    if OPTIONS.device != "cpu":
        torch.cuda.synchronize()


def bench(name, fn, unit="ms", min_time=None):
    """Mean wall and CPU time per call (CPU time is the steadier number when
    other processes share the machine, as Google Benchmark's CPU column).
    With --repetitions N, the median over N such means. Returns the CPU
    time, or None when --filter skips the case."""
    if not selected(name):
        return None
    min_time = OPTIONS.min_time * (min_time or 1.0)
    fn()
    sync()
    cpus, walls, total = [], [], 0
    for _ in range(OPTIONS.repetitions):
        n, start, cpu_start = 0, time.perf_counter(), time.process_time()
        while True:
            fn()
            sync()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time and n >= 3:
                break
        cpus.append((time.process_time() - cpu_start) / n)
        walls.append(elapsed / n)
        total += n
    cpu, per = statistics.median(cpus), statistics.median(walls)
    RESULTS[name] = {"cpu_s": cpu, "wall_s": per, "iterations": total}
    scale = 1e3 if unit == "ms" else 1e6
    reps = f", median of {len(cpus)}" if len(cpus) > 1 else ""
    print(f"{name:34s} wall {per * scale:10.3f} {unit}  cpu {cpu * scale:10.3f} {unit}"
          f"   ({total} iterations{reps})", flush=True)
    return cpu


def ratio(name, slow, fast):
    if slow is not None and fast is not None:
        print(f"  {name} = {slow / fast:.2f}x (cpu)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--filter", help="only cases whose name matches this regex")
    parser.add_argument("--repetitions", type=int, default=1,
                        help="time each case N times; report the medians")
    parser.add_argument("--json", help="also write the results to this file as JSON")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--min-time", type=float, default=1.0,
                        help="seconds per repetition of a case (default 1)")
    parser.parse_args(namespace=OPTIONS)
    if OPTIONS.repetitions < 1:
        parser.error("--repetitions must be >= 1")
    torch.manual_seed(0)
    device = torch.device(OPTIONS.device)
    where = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {device}{where}")
    w1, b1 = torch.randn(256, 128, device=device) * 0.05, torch.zeros(256, device=device)
    w2, b2 = torch.randn(10, 256, device=device) * 0.05, torch.zeros(10, device=device)
    x = torch.randn(256, 128, device=device)
    t = torch.randint(0, 10, (256,), device=device)

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
    ratio("loop / vmap(grad)", lp, vg)

    jw1, jb1 = torch.randn(64, 16, device=device) * 0.25, torch.randn(64, device=device) * 0.1
    jw2, jb2 = torch.randn(16, 64, device=device) * 0.125, torch.randn(16, device=device) * 0.1

    def f(x):
        return F.linear(F.linear(x, jw1, jb1).tanh(), jw2, jb2).tanh()

    xs = torch.randn(1024, 16, device=device)
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
    ratio("loop / vmap(jacrev)", jl, vj)

    a, b = torch.randn(8, 5, device=device), torch.randn(8, 5, device=device)
    batched_dot = vmap(torch.dot)
    bench("VmapDot_Tiny", lambda: batched_dot(a, b), unit="us")
    bench("Dot_Tiny_Direct", lambda: (a * b).sum(1), unit="us")
    if OPTIONS.json:
        with open(OPTIONS.json, "w", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(),
                       "device": str(device),
                       "cases": RESULTS}, f, indent=1)


if __name__ == "__main__":
    main()
