"""ATen operators one training step dispatches in Python FSDP, counted with
torch.profiler: the peer of //benchmarks:op_count_bench (issue 36's CPU
goal: ours no more than Python FSDP2's on the same model).

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \\
        benchmarks/python/op_count.py [--fsdp fsdp2|fsdp1] [--optimizer-impl default|foreach|fused]

The model is op_count_bench's (ddp_step.TransformerLM: 8 blocks x 512, 8
heads, vocab 256, seq 32, 2 rows; SDPA attention as the trainer's), wrapped
as fsdp_step.py wraps it (fsdp2: fully_shard on each block, then the root;
fsdp1: FullyShardedDataParallel, FULL_SHARD, one unit per block,
BACKWARD_PRE, use_orig_params) on a Gloo world of 1, with AdamW (lr 3e-3,
weight decay 0.01; --optimizer-impl: PyTorch's default, i.e. the for-loop
on the CPU, or foreach=True / fused=True). One step is fsdp_step.py's:
zero_grad, forward and loss, backward, loss.item(), optimizer.step(). 3
warm-up steps, then 3 profiled ones; per step it prints

    aten_ops   every "aten::" event of the profiler, nested ones included
    top_level  "aten::" events without an "aten::" ancestor on their thread

(op_count_bench's two counts), and with --list the 40 most frequent names.
"""

import argparse
import collections
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_step import TransformerLM, exit_without_finalizing  # noqa: E402
from fsdp_step import wrap_fsdp1, wrap_fsdp2  # noqa: E402

LAYERS, DIM, HEADS, VOCAB, SEQ, ROWS = 8, 512, 8, 256, 32, 2
# --tiny: op_count_bench's --tiny (same structure, negligible compute).
TINY = dict(DIM=16, HEADS=2, VOCAB=32, SEQ=8)
WARMUP, COUNTED, TIMED = 3, 3, 50


def is_aten(event):
    return event.name.startswith("aten::")


def phase_of(event):
    while event is not None:
        if event.name.startswith("phase::"):
            return event.name[len("phase::"):]
        event = event.cpu_parent
    return "other"


def count(events):
    aten = [e for e in events if is_aten(e)]
    top = 0
    phases = collections.Counter()
    for e in aten:
        phases[phase_of(e)] += 1
        parent = e.cpu_parent
        while parent is not None and not is_aten(parent):
            parent = parent.cpu_parent
        if parent is None:
            top += 1
    return len(aten), top, collections.Counter(e.name for e in aten), phases


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fsdp", choices=["fsdp1", "fsdp2", "none"], default="fsdp2",
                   help="none: the model unwrapped (the baseline of FSDP's overhead)")
    p.add_argument("--tiny", action="store_true",
                   help="dim 16, 2 heads, vocab 32, seq 8: a step's time is host time")
    p.add_argument("--optimizer-impl", choices=["default", "foreach", "fused"], default="default")
    p.add_argument("--list", action="store_true")
    args = p.parse_args()
    global DIM, HEADS, VOCAB, SEQ
    if args.tiny:
        DIM, HEADS, VOCAB, SEQ = TINY["DIM"], TINY["HEADS"], TINY["VOCAB"], TINY["SEQ"]

    store_dir = tempfile.TemporaryDirectory(prefix="op_count_")
    store = dist.FileStore(os.path.join(store_dir.name, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = TransformerLM(LAYERS, DIM, HEADS, VOCAB, SEQ)
    num_params = sum(t.numel() for t in model.parameters())
    cpu = torch.device("cpu")
    units = 0 if args.fsdp == "none" else LAYERS + 1
    if args.fsdp == "none":
        wrapped = model
    elif args.fsdp == "fsdp1":
        wrapped = wrap_fsdp1(model, "full", cpu, bf16=False)
    else:
        wrapped = wrap_fsdp2(model, "full", 1, cpu, bf16=False)
    impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[
        args.optimizer_impl]
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=3e-3, weight_decay=0.01, **impl)
    torch.manual_seed(1000)
    batch = torch.randint(VOCAB, (ROWS, SEQ + 1), dtype=torch.int64)

    def step():
        # Each phase in a record_function range, so that its operators can
        # be counted apart (op_count_bench's phases).
        with record_function("phase::zero_grad"):
            optimizer.zero_grad()
        with record_function("phase::forward"):
            loss = wrapped(batch)
        with record_function("phase::backward"):
            loss.backward()
        with record_function("phase::item"):
            value = loss.item()
        with record_function("phase::optimizer"):
            optimizer.step()
        return value

    print(f"op_count.py: torch {torch.__version__}, TransformerLM {num_params} parameters "
          f"({LAYERS} blocks x {DIM}, {HEADS} heads, vocab {VOCAB}, seq {SEQ}, {ROWS} rows), "
          f"{args.fsdp} FULL_SHARD on a Gloo world of 1, AdamW ({args.optimizer_impl})",
          flush=True)
    for _ in range(WARMUP):
        step()
    totals = collections.Counter()
    for s in range(WARMUP + 1, WARMUP + COUNTED + 1):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            value = step()
        aten, top, names, phases = count(prof.events())
        totals.update(names)
        print(f"step {s} phases (aten_ops): " + ", ".join(
            f"{name} {phases[name]}" for name in
            ("zero_grad", "forward", "backward", "item", "optimizer", "other")), flush=True)
        print(f"step {s}: aten_ops {aten}, top_level {top} (loss {value:.4f})", flush=True)
    # Host time: no profiler; TIMED steps one by one, the median, in us.
    times = []
    for _ in range(TIMED):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e6)
    times.sort()
    print(f"RESULT aten_ops_per_step {aten} top_level_per_step {top} "
          f"host_us_per_step {times[len(times) // 2]:.1f} units {units}", flush=True)
    if args.list:
        for name, n in totals.most_common(40):
            print(f"  {n // COUNTED:6d}  {name}")
    dist.destroy_process_group()
    store_dir.cleanup()
    exit_without_finalizing(0)


if __name__ == "__main__":
    main()
