"""Python torch.func side of //benchmarks:hessian_bench.

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \
        benchmarks/python/hessian_bench.py [--repetitions N] [--filter REGEX]
        [--json FILE] [--device cuda] [--min-time S]

(the venv's Python that `tools/setup.sh --with-python` makes: the same
`torch` wheel, hence the same LibTorch and MKL, as the C++ side).

Same MLP shapes (2 -> 512 -> 512 -> 512 -> 3, tanh, float32) and 1024
points: vmap(jacfwd(jacrev(u))), vmap(hessian(u)), a per-point loop of
hessian(u)(x_i), and sgemm (torch.mm out=) at 1024x512x512, timed in the
same process. Threads are Python's defaults (printed). GFLOP/s use the
analytic matmul count of hessian_bench.cc: 12 C per point, C = 2 (2*512 +
2*512^2 + 512*3). Wall time per call is what is reported (the BLAS runs on
the intra-op OpenMP threads); with --repetitions N, the median of N means.
--device cuda: the same on cuda:0, the device synchronised after every
timed call (benchmarks/run_gpu.sh runs Hessian_VmapJacfwdJacrev so, beside
gpu_check's functorch_batched_hessians). --min-time S: seconds per
repetition (default 1). The per-point loop is checked against the batched
result on the first 64 points.
"""
import argparse
import json
import os
import re
import statistics
import time

import torch
from torch.func import hessian, jacfwd, jacrev, vmap

POINTS, IN, HIDDEN, OUT = 1024, 2, 512, 3
FLOPS = POINTS * (1 + IN + OUT + OUT * IN) * 2 * (IN * HIDDEN + 2 * HIDDEN * HIDDEN + HIDDEN * OUT)


def blas_description():
    """The BLAS this torch was built with (the wheel links MKL statically)."""
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    out = f"BLAS {blas.group(1) if blas else 'unknown'}"
    threads = re.search(r"mkl_get_max_threads\(\) : (\d+)", torch.__config__.parallel_info())
    if threads:
        out += f" ({threads.group(1)} threads)"
    out += f", CPU capability {torch.backends.cpu.get_cpu_capability()}"
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        out += f", {name}={os.environ.get(name, '(unset)')}"
    return out


def bench(fn, repetitions, min_time=1.0, min_iters=2, sync=lambda: None):
    fn()
    sync()
    walls = []
    for _ in range(repetitions):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            sync()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time and n >= min_iters:
                break
        walls.append(elapsed / n)
    return statistics.median(walls)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repetitions", type=int, default=1)
    p.add_argument("--filter")
    p.add_argument("--json")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--min-time", type=float, default=1.0,
                   help="seconds per repetition of a case (default 1)")
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    def randn(*shape):
        return torch.randn(*shape, device=device)

    w1, b1 = randn(HIDDEN, IN) / IN ** 0.5, randn(HIDDEN) * 0.1
    w2, b2 = randn(HIDDEN, HIDDEN) / HIDDEN ** 0.5, randn(HIDDEN) * 0.1
    w3, b3 = randn(HIDDEN, HIDDEN) / HIDDEN ** 0.5, randn(HIDDEN) * 0.1
    w4, b4 = randn(OUT, HIDDEN) / HIDDEN ** 0.5, randn(OUT) * 0.1
    F = torch.nn.functional

    def u(x):
        h = F.linear(x, w1, b1).tanh()
        h = F.linear(h, w2, b2).tanh()
        h = F.linear(h, w3, b3).tanh()
        return F.linear(h, w4, b4)

    xs = torch.rand(POINTS, IN, device=device) * 2 - 1
    batched = vmap(jacfwd(jacrev(u)))
    batched_h = vmap(hessian(u))
    per_point = hessian(u)

    def loop(x):
        return torch.stack([per_point(x[i]) for i in range(x.shape[0])])

    a, b = randn(POINTS, HIDDEN), randn(HIDDEN, HIDDEN)
    c = torch.empty(POINTS, HIDDEN, device=device)
    ref = batched(xs)
    assert ref.shape == (POINTS, OUT, IN, IN)
    assert torch.allclose(ref, batched_h(xs))
    assert torch.allclose(ref[:64], loop(xs[:64]), rtol=1e-4, atol=1e-5)

    label = f"intra-op threads {torch.get_num_threads()}; {blas_description()}"
    if cuda:
        label = f"device {device} ({torch.cuda.get_device_name(device)}); {label}"
    print(f"torch {torch.__version__}; {label}")
    cases = [
        ("Hessian_VmapJacfwdJacrev", lambda: batched(xs), FLOPS),
        ("Hessian_VmapHessian", lambda: batched_h(xs), FLOPS),
        ("Hessian_PerPointLoop", lambda: loop(xs), FLOPS),
        ("Sgemm_1024x512x512", lambda: torch.mm(a, b, out=c), 2 * POINTS * HIDDEN * HIDDEN),
    ]
    results = {}
    for name, fn, flops in cases:
        if args.filter and not re.search(args.filter, name):
            continue
        wall = bench(fn, args.repetitions, min_time=args.min_time, sync=sync)
        results[name] = {"wall_s": wall, "gflops": flops / wall / 1e9}
        print(f"{name:28s} {wall * 1e3:10.2f} ms  {flops / wall / 1e9:7.1f} GFLOP/s", flush=True)
    sg = results.get("Sgemm_1024x512x512")
    for name in ("Hessian_VmapJacfwdJacrev", "Hessian_VmapHessian", "Hessian_PerPointLoop"):
        if sg and name in results:
            print(f"  {name}: {results[name]['gflops'] / sg['gflops']:.3f} of sgemm 1024x512x512")
    if "Hessian_PerPointLoop" in results and "Hessian_VmapJacfwdJacrev" in results:
        print(f"  vmap(jacfwd(jacrev)) vs per-point loop: "
              f"{results['Hessian_PerPointLoop']['wall_s'] / results['Hessian_VmapJacfwdJacrev']['wall_s']:.1f}x faster")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"label": label, "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
