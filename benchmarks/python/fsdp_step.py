"""One FSDP training run in Python PyTorch on Gloo (CPU), the Python peer of
//:trainer's default step (FULL_SHARD, one unit per transformer block plus
the root), with the model, data, schedule and JSON log of ddp_step.py.

Run it with the venv's Python that `tools/setup.sh --with-python` makes
(PY below: ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3),
one process per rank, started by torchrun:

    OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/python/fsdp_step.py --fsdp fsdp2 --steps 60 --check-grads 3 \\
        --log-json /tmp/py.jsonl

or as `$PY benchmarks/python/fsdp_step.py ...` with WORLD_SIZE unset for a
single rank (FSDP over a world of 1). Rank 0 writes one JSON line per step
with the keys of the trainer's --log-json (step, loss, lr, step_time_s,
tokens_per_s), as ddp_step.py does.

--fsdp picks the implementation:
  fsdp1  torch.distributed.fsdp.FullyShardedDataParallel: --sharding full
         (FULL_SHARD), grad_op (SHARD_GRAD_OP) or none (NO_SHARD);
         ModuleWrapPolicy({TransformerBlock}), BACKWARD_PRE prefetch and
         use_orig_params=True, as the trainer's defaults.
  fsdp2  torch.distributed.fsdp.fully_shard on a 1-D CPU DeviceMesh: each
         block, then the root; --sharding full (the blocks
         reshard_after_forward=True, the root PyTorch's default None: it
         keeps its parameters after forward, as the trainer's) or grad_op
         (False for all). FSDP2 has no NO_SHARD.
The MLP model has no blocks: the root is the only unit, as in the trainer.

--device cuda runs on the GPU LOCAL_RANK (NCCL; a world of 1 when started
directly), the peer of the trainer's --device cuda (benchmarks/run_gpu.sh):
the batch is copied from pinned memory without blocking, and each step's
JSON line also carries cuda_peak_allocated_bytes / cuda_peak_reserved_bytes
(torch.cuda.max_memory_allocated / max_memory_reserved, the peaks reset at
the start of every step, as the trainer's --log-json). --mixed-precision
bf16 keeps bf16 parameters for compute and reduces gradients in float32
(fsdp1: MixedPrecision(param_dtype=bf16, reduce_dtype=fp32,
buffer_dtype=fp32); fsdp2: MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)), as the trainer's --mixed-precision bf16. Attention is
F.scaled_dot_product_attention(is_causal=True) as in the trainer (flash or
memory-efficient kernels on CUDA); --optimizer-impl fused / foreach picks
AdamW(fused=True) / (foreach=True).

--check-grads K checks the gradients of the first K steps, before the
optimizer step, against an unsharded single-process reference (the same
initial model, trained on the whole global batch by the same optimizer, on
rank 0): FSDP's reduce-scatter must average the ranks' gradients (PyTorch
issue 162338: FSDP2 on Gloo summed them, gradients world-size times too
large). Rank 0 prints each check; a checked step's JSON line also carries
grad_max_abs_diff (over all parameters, FSDP minus reference) and
grad_norm_ratio (|FSDP grad| / |reference grad|, 1 when averaged, the world
size when summed). With torch 2.15 both fsdp1 and fsdp2 run on CPU over
Gloo and pass it (Gloo's reduce-scatter averages under ReduceOp.AVG, the op
FSDP2 uses for float32). The check's own time (gathering the full gradients, the
reference step) is left out of step_time_s. A failed check makes the exit
status 3, after the run. The process ends with os._exit, as ddp_step.py's
(exit_without_finalizing: Gloo's worker threads can abort the interpreter's
finalization in torch 2.15).
"""

import argparse
import copy
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_step import (MlpLM, TransformerBlock, TransformerLM, add_common_args, forward_backward,  # noqa: E402
                      exit_without_finalizing, make_optimizer,
                      synthetic_batch)

# Relative tolerance of the gradient check: float32 sums over 2 ranks' rows
# in a different order than over the whole batch.
GRAD_RTOL = 1e-4

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def clean_name(name):
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def wrap_fsdp1(model, sharding, device=torch.device("cpu"), bf16=False):
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    strategy = {"full": ShardingStrategy.FULL_SHARD, "grad_op": ShardingStrategy.SHARD_GRAD_OP,
                "none": ShardingStrategy.NO_SHARD}[sharding]
    mp = None
    if bf16:
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                            buffer_dtype=torch.float32)
    return FSDP(model, sharding_strategy=strategy,
                auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE, use_orig_params=True,
                mixed_precision=mp, device_id=device)


def wrap_fsdp2(model, sharding, world, device=torch.device("cpu"), bf16=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if sharding == "none":
        sys.exit("fsdp_step: FSDP2 (fully_shard) has no NO_SHARD: use --sharding full or grad_op")
    mesh = init_device_mesh(device.type, (world,))
    reshard = sharding == "full"
    kwargs = {}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, **kwargs)
    # The root: PyTorch's default (reshard_after_forward=None, i.e. kept
    # after forward) under full; False under grad_op, as every unit.
    if not reshard:
        kwargs["reshard_after_forward"] = False
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def full_gradients(kind, wrapped):
    """{name: full gradient} on every rank (a collective: all ranks call it)."""
    out = {}
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        with FSDP.summon_full_params(wrapped, writeback=False, with_grads=True):
            for name, p in wrapped.named_parameters():
                out[clean_name(name)] = None if p.grad is None else p.grad.detach().clone()
    else:
        from torch.distributed.tensor import DTensor
        for name, p in wrapped.named_parameters():
            g = p.grad
            if isinstance(g, DTensor):
                g = g.full_tensor()
            out[name] = None if g is None else g.detach().clone()
    return out


def compare_gradients(got, ref_model):
    """(max abs diff, |got| / |ref|, problems) against ref_model's .grad."""
    problems, max_diff, got_sq, ref_sq = [], 0.0, 0.0, 0.0
    ref = {name: p.grad for name, p in ref_model.named_parameters()}
    if set(got) != set(ref):
        problems.append(f"parameter names differ: FSDP {sorted(set(got) - set(ref))}, "
                        f"reference {sorted(set(ref) - set(got))}")
    for name in sorted(set(got) & set(ref)):
        g, r = got[name], ref[name]
        if g is None or r is None:
            if (g is None) != (r is None):
                problems.append(f"{name}: gradient {'missing' if g is None else 'unexpected'}")
            continue
        if g.shape != r.shape:
            problems.append(f"{name}: shape {tuple(g.shape)}, reference {tuple(r.shape)}")
            continue
        diff = (g - r).abs().max().item()
        max_diff = max(max_diff, diff)
        got_sq += g.double().pow(2).sum().item()
        ref_sq += r.double().pow(2).sum().item()
        if diff > GRAD_RTOL * max(r.abs().max().item(), 1e-6):
            problems.append(f"{name}: max |FSDP - reference| {diff:.3g} "
                            f"(reference max |g| {r.abs().max().item():.3g})")
    ratio = (got_sq / ref_sq) ** 0.5 if ref_sq > 0 else float("nan")
    return max_diff, ratio, problems


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fsdp", choices=["fsdp1", "fsdp2"], default="fsdp1")
    p.add_argument("--sharding", choices=["full", "grad_op", "none"], default="full")
    p.add_argument("--check-grads", type=int, default=0, metavar="K",
                   help="check the gradients of the first K steps against an unsharded reference")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: NCCL, the GPU LOCAL_RANK (benchmarks/run_gpu.sh)")
    p.add_argument("--mixed-precision", choices=["none", "bf16"], default="none",
                   help="bf16: bf16 parameters for compute, float32 gradient reduction")
    add_common_args(p)
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.global_batch % world != 0:
        sys.exit(f"fsdp_step: --global-batch {args.global_batch} is not a multiple "
                 f"of WORLD_SIZE {world}")
    if args.device == "cuda":
        if args.check_grads:
            sys.exit("fsdp_step: --check-grads is for --device cpu")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    store_dir = None
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world)
    else:  # one rank, started directly: FSDP still needs a process group
        store_dir = tempfile.TemporaryDirectory(prefix="fsdp_step_")
        store = dist.FileStore(os.path.join(store_dir.name, "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)

    torch.manual_seed(args.seed)
    cls = TransformerLM if args.model == "transformer" else MlpLM
    model = cls(args.layers, args.dim, args.heads, args.vocab, args.seq)
    num_params = sum(t.numel() for t in model.parameters())
    reference = ref_optimizer = None
    if args.check_grads > 0 and rank == 0:
        reference = copy.deepcopy(model)
        ref_optimizer = make_optimizer(args, reference.parameters())
    bf16 = args.mixed_precision == "bf16"
    if args.fsdp == "fsdp1":
        wrapped = wrap_fsdp1(model, args.sharding, device, bf16)
    else:
        wrapped = wrap_fsdp2(model, args.sharding, world, device, bf16)
    optimizer = make_optimizer(args, wrapped.parameters())

    log = open(args.log_json, "w", encoding="utf-8") if args.log_json and rank == 0 else None
    if rank == 0:
        what = ("FullyShardedDataParallel" if args.fsdp == "fsdp1" else "fully_shard")
        print(f"fsdp_step: torch {torch.__version__}, {args.model}, {num_params} parameters, "
              f"{world} rank(s) ({args.fsdp}: {what}, sharding {args.sharding}, {backend}, "
              f"{device}, mixed precision {args.mixed_precision}), "
              f"global batch {args.global_batch}, {args.optimizer} ({args.optimizer_impl}), "
              f"{torch.get_num_threads()} intra-op thread(s) per rank", flush=True)
    tokens_per_step = args.global_batch * args.seq
    failures = []
    on_cuda = device.type == "cuda"
    for step in range(1, args.steps + 1):
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        lr, global_loss = forward_backward(args, wrapped, optimizer, step, rank, world)

        check = {}
        check_s = 0.0
        if step <= args.check_grads:
            check_start = time.perf_counter()
            grads = full_gradients(args.fsdp, wrapped)
            if rank == 0:
                for group in ref_optimizer.param_groups:
                    group["lr"] = lr
                ref_optimizer.zero_grad()
                whole = synthetic_batch(args.vocab, args.seed, step, args.global_batch,
                                        args.seq + 1, 0, 1)
                ref_loss = reference(whole)
                ref_loss.backward()
                max_diff, ratio, problems = compare_gradients(grads, reference)
                ref_optimizer.step()
                check = {"grad_max_abs_diff": max_diff, "grad_norm_ratio": ratio}
                print(f"fsdp_step: step {step} gradient check against the unsharded reference: "
                      f"max |FSDP - reference| {max_diff:.3g}, |FSDP| / |reference| {ratio:.6f}, "
                      f"loss {global_loss:.6f} vs reference {ref_loss.item():.6f}: "
                      f"{'FAILED' if problems else 'ok'}", flush=True)
                for line in problems[:8]:
                    print(f"  {line}", flush=True)
                if problems:
                    failures.append(step)
            check_s = time.perf_counter() - check_start

        optimizer.step()
        step_time = time.perf_counter() - start - check_s
        if log:
            record = {"step": step, "loss": global_loss, "lr": lr, "step_time_s": step_time,
                      "tokens_per_s": tokens_per_step / step_time}
            record.update(check)
            if on_cuda:
                record["cuda_peak_allocated_bytes"] = [torch.cuda.max_memory_allocated(device)]
                record["cuda_peak_reserved_bytes"] = [torch.cuda.max_memory_reserved(device)]
            log.write(json.dumps(record) + "\n")
            log.flush()
    if log:
        log.close()
    dist.destroy_process_group()
    if store_dir:
        store_dir.cleanup()
    if failures:
        print(f"fsdp_step: gradient check FAILED at step(s) {failures}", file=sys.stderr)
    # Not sys.exit: see exit_without_finalizing (an abort at exit otherwise).
    exit_without_finalizing(3 if failures else 0)


if __name__ == "__main__":
    main()
