"""The table benchmarks/run_gpu.sh prints for one model configuration: the
trainer's runs and the Python FSDP peers' runs, read from their --log-json
files (one JSON object per step; the trainer's and fsdp_step.py's share the
keys step, tokens_per_s, step_time_s, and on CUDA cuda_peak_allocated_bytes
/ cuda_peak_reserved_bytes, lists with one entry per rank).

    python3 gpu_report.py --title "152M ..." --params N --peak-tflops P \\
        [--skip 5] ours1=PATH ours_fully_shard1=PATH py:fully_shard/fused=PATH ... ours2=PATH

Each run: the median tokens/s over the steps after --skip (the first steps
include cuBLAS's and the caching allocator's set-up), its ratio to the best
Python run (labels starting "py:"; a SUMMARY line per kind of our run,
labels starting "ours" less their trailing digits), MFU = 6 * N * tokens/s against the peak
measured in the same run (--peak-tflops; 6 N FLOP per token: forward and
backward of every parameter, attention's T^2 terms not counted; or
--flops-per-token's, as TorchTitan counts them, attention included), and the
largest per-step peak allocated / reserved bytes (the caching allocator's:
ours from the trainer's --log-json, Python's from
torch.cuda.max_memory_allocated / max_memory_reserved); "-" where a log has
none (the CPU). The final losses: a SUMMARY line per kind of our run set
against the Python runs' range (their variants differ in numerics only:
eager, compiled, float8, recomputed), where all ran the same steps. A run
whose log is missing or empty prints FAILED. Exit status 0, or 1 when any
run failed.
"""

import argparse
import json
import statistics
import sys


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def peak(steps, key):
    values = [max(s[key]) if isinstance(s[key], list) else s[key]
              for s in steps if s.get(key) is not None]
    return max(values) if values else None


def gib(b):
    return "-" if b is None else f"{b / 2**30:.2f} GiB"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--title", required=True)
    p.add_argument("--params", type=int, required=True, help="N, the model's parameter count")
    p.add_argument("--peak-tflops", type=float, default=0.0)
    p.add_argument("--flops-per-token", type=float, default=0.0,
                   help="FLOP per token for MFU instead of 6N (the Llama runs: TorchTitan's "
                        "formula, 6 (N - embedding) + 12 layers heads head_dim seq)")
    p.add_argument("--skip", type=int, default=5, help="steps left out of the median")
    p.add_argument("runs", nargs="+", metavar="LABEL=PATH")
    args = p.parse_args()

    rows = []
    for spec in args.runs:
        label, _, path = spec.partition("=")
        steps = load(path)
        timed = [s for s in steps if s.get("step", 0) > args.skip] or steps
        if not timed:
            rows.append({"label": label, "failed": True})
            continue
        rows.append({
            "label": label, "failed": False, "steps": len(steps),
            "first": timed[0]["step"], "last": timed[-1]["step"],
            "tok_s": statistics.median(s["tokens_per_s"] for s in timed),
            "alloc": peak(steps, "cuda_peak_allocated_bytes"),
            "reserved": peak(steps, "cuda_peak_reserved_bytes"),
            "loss": steps[-1].get("loss"),
            "final_step": steps[-1].get("step"),
        })
    python = [r for r in rows if r["label"].startswith("py:") and not r["failed"]]
    best = max(python, key=lambda r: r["tok_s"]) if python else None
    flop_per_token = args.flops_per_token or 6 * args.params
    flop_name = "TorchTitan's FLOP/token" if args.flops_per_token else "6N"
    mfu_name = "MFU" if args.flops_per_token else "MFU 6N"
    print(f"== {args.title}: {args.params} parameters, {flop_name} = {flop_per_token / 1e9:.4g} GFLOP/token"
          + (f", measured peak {args.peak_tflops:.4g} TFLOP/s" if args.peak_tflops else ""))
    print(f"{'run':<34} {'tokens/s':>10} {'/best py':>9} {mfu_name:>7} {'peak alloc':>11} "
          f"{'peak reserved':>13} {'final loss':>10}  steps")
    failed = False
    for r in rows:
        if r["failed"]:
            failed = True
            print(f"{r['label']:<34} FAILED (no steps logged)")
            continue
        ratio = f"{r['tok_s'] / best['tok_s']:.3f}x" if best else "-"
        mfu = "-"
        if args.peak_tflops > 0:
            mfu = f"{flop_per_token * r['tok_s'] / 1e12 / args.peak_tflops:.3f}"
        loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
        print(f"{r['label']:<34} {r['tok_s']:>10.0f} {ratio:>9} {mfu:>7} {gib(r['alloc']):>11} "
              f"{gib(r['reserved']):>13} {loss:>10}  median of {r['first']}..{r['last']}")
    # Our runs by what ran, their repeats' trailing digits dropped: "ours1"
    # and "ours2" (the trainer's default, FSDP1) are "ours";
    # "ours_fully_shard1" is "ours_fully_shard".
    # (A digit is a repeat's only where another run shares the rest of the
    # label: "ours_float8" alone keeps its 8.)
    ran = [r for r in rows if r["label"].startswith("ours") and not r["failed"]]
    stems = [r["label"].rstrip("0123456789") for r in ran]
    groups = {}
    for r, stem in zip(ran, stems):
        groups.setdefault(stem if stems.count(stem) > 1 else r["label"], []).append(r)
    best_alloc = min((r["alloc"] for r in python if r["alloc"] is not None), default=None)
    best_res = min((r["reserved"] for r in python if r["reserved"] is not None), default=None)
    for name, ours in groups.items():
        if not best:
            break
        ratios = ", ".join(f"{r['tok_s'] / best['tok_s']:.3f}x" for r in ours)
        print(f"SUMMARY {args.title}: {name} / best Python ({best['label']}, {best['tok_s']:.0f} "
              f"tokens/s) = {ratios}")
        our_alloc = max((r["alloc"] for r in ours if r["alloc"] is not None), default=None)
        our_res = max((r["reserved"] for r in ours if r["reserved"] is not None), default=None)
        if None not in (best_alloc, our_alloc, best_res, our_res):
            print(f"SUMMARY {args.title}: memory {name} / leanest Python: allocated "
                  f"{our_alloc / best_alloc:.3f}x ({gib(our_alloc)} vs {gib(best_alloc)}), "
                  f"reserved {our_res / best_res:.3f}x ({gib(our_res)} vs {gib(best_res)})")
        if any(r["loss"] is not None for r in python):
            print(loss_summary(args.title, name, ours, python))
    return 1 if failed else 0


def loss_summary(title, name, ours, python):
    """Our runs' final losses against the Python runs' range after the same steps."""
    ran = [r for r in ours + python if r["loss"] is not None]
    if not python or len(ran) < len(ours) + len(python):
        return f"SUMMARY {title}: final loss {name}: not compared (a run logged no loss)"
    if len({r["final_step"] for r in ran}) != 1:
        return f"SUMMARY {title}: final loss {name}: not compared (the runs ended at different steps)"
    low = min(r["loss"] for r in python)
    high = max(r["loss"] for r in python)
    parts = []
    for r in ours:
        gap = max(low - r["loss"], r["loss"] - high, 0.0)
        parts.append(f"{r['loss']:.4f}" + (" (inside)" if gap == 0 else
                                           f" ({gap:.4f} = {gap / high:.2%} outside)"))
    return (f"SUMMARY {title}: final loss after step {ran[0]['final_step']}: {name} "
            f"{', '.join(parts)}; Python's {len(python)} runs {low:.4f}..{high:.4f}")


if __name__ == "__main__":
    sys.exit(main())
