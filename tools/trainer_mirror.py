"""The trainer's model, data and schedule in Python, for runs that move
between Python FSDP and the C++ trainer through torch.distributed.checkpoint.

It mirrors //trainer (models.cc, data.cc, lr_schedule.cc, train.cc) for
`--model transformer --data synthetic --optimizer adamw`, with the model,
data, schedule and optimizer of the benchmarks' Python peer
(benchmarks/python/ddp_step.py) and its FSDP wrappers (fsdp_step.py): the same parameter
names (a DCP checkpoint's keys: model.<fqn>, optim.state.<fqn>.<entry>), the
same initial parameters for a seed (the modules are built, and draw from
torch's generator, in the trainer's order), the same batch of every
(seed, step), the same learning rate per step, AdamW(weight_decay=0.01,
betas (0.9, 0.999), eps 1e-8), the mean cross-entropy of next-token
predictions. The flags are the trainer's, with its defaults. A checkpoint is

    dcp.save({"model": msd, "optim": osd,
              "trainer": {"step": step, "seed": seed}}, checkpoint_id=dir)

(msd, osd = get_state_dict(model, optimizer)), which the trainer reads with
`--import-dcp dir` and writes with `--export-dcp dir`.

    # 2 ranks, FSDP2, steps 1-3, then a DCP checkpoint:
    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/trainer_mirror.py \
        --layers 2 --dim 32 --heads 4 --seq 16 --global-batch 6 --lr-schedule constant \
        --steps 3 --export-dcp /tmp/py_step3
    # on in C++ on 3 ranks, steps 4-6 (--steps is the whole run's length):
    bazel run //trainer:trainer -- --nproc 3 --model transformer --data synthetic \
        --layers 2 --dim 32 --heads 4 --seq 16 --global-batch 6 --lr-schedule constant \
        --steps 6 --import-dcp /tmp/py_step3 --export-dcp /tmp/cpp_step6
    # and back, steps 7-9:
    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/trainer_mirror.py \
        --layers 2 --dim 32 --heads 4 --seq 16 --global-batch 6 --lr-schedule constant \
        --steps 9 --import-dcp /tmp/cpp_step6 --export-dcp /tmp/py_step9

(`python` is the one with the torch the build uses: tools/setup.sh's venv,
~/.cache/torchfsdp-cpp/venv/bin/python3. --lr-schedule constant: the cosine
schedule depends on --steps, the run's length, so a run split into parts
follows the whole run's schedule only with the constant one.)
//trainer:trainer_dcp_roundtrip_test runs these three and checks the end
against an uninterrupted run of this script, and that against the trainer.

Rank 0 prints "step N loss X" per step (the ranks' mean, 17 digits, as the
trainer's --log-json has it). --save-params FILE: the full parameters at the
end, torch.save'd by rank 0. Runs on CPU with Gloo (torch.distributed.run,
or a single process without it). --fsdp chooses fully_shard (FSDP2, the
default; torch 2.15's averages gradients correctly on Gloo, unlike the
version of PyTorch issue 162338) or FullyShardedDataParallel (FSDP1,
use_orig_params, one unit per block).
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                                "python"))
from ddp_step import (TransformerLM, add_common_args, exit_without_finalizing,  # noqa: E402
                      forward_backward, make_optimizer)
from fsdp_step import wrap_fsdp1, wrap_fsdp2  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)  # the trainer's model, data and optimizer flags
    p.add_argument("--fsdp", choices=["fsdp2", "fsdp1"], default="fsdp2")
    p.add_argument("--import-dcp", default="", help="continue from this DCP checkpoint")
    p.add_argument("--export-dcp", default="", help="DCP checkpoint after the last step")
    p.add_argument("--save-params", default="", help="rank 0: full parameters at the end (torch.save)")
    args = p.parse_args()
    if args.model != "transformer":
        sys.exit(f"trainer_mirror: --model {args.model}: only the transformer is mirrored")

    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    import torch.distributed.checkpoint as dcp

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = TransformerLM(args.layers, args.dim, args.heads, args.vocab, args.seq)
    # One unit per block and the root, FULL_SHARD, as the trainer wraps.
    wrapped = wrap_fsdp2(model, "full", world) if args.fsdp == "fsdp2" else wrap_fsdp1(model, "full")
    opt = make_optimizer(args, wrapped.parameters())

    first = 1
    if args.import_dcp:
        msd, osd = get_state_dict(wrapped, opt)
        state = {"model": msd, "optim": osd, "trainer": {"step": 0, "seed": 0}}
        dcp.load(state, checkpoint_id=args.import_dcp)
        set_state_dict(wrapped, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if state["trainer"]["seed"] != args.seed:
            raise SystemExit(f"--seed={args.seed}: --import-dcp='{args.import_dcp}' was trained "
                             f"with seed {state['trainer']['seed']}")
        first = int(state["trainer"]["step"]) + 1
        if first > args.steps:
            raise SystemExit(f"--steps={args.steps}: --import-dcp='{args.import_dcp}' is at step "
                             f"{first - 1}: expected a step below --steps (the whole run's length)")

    for step in range(first, args.steps + 1):
        # Through the wrapper (FSDP1 gathers in its forward); the loss is
        # the ranks' float32 losses averaged in float64, as the trainer logs it.
        _, loss = forward_backward(args, wrapped, opt, step, rank, world)
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss:.17g}", flush=True)

    if args.export_dcp:
        msd, osd = get_state_dict(wrapped, opt)
        dcp.save({"model": msd, "optim": osd, "trainer": {"step": args.steps, "seed": args.seed}},
                 checkpoint_id=args.export_dcp)
    if args.save_params:
        full, _ = get_state_dict(wrapped, opt, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
        if rank == 0:
            torch.save(full, args.save_params)
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalizing(0)  # PyTorch issue 190489 (see ddp_step.py)


if __name__ == "__main__":
    main()
