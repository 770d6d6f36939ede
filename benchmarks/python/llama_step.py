"""The Python peer of `//:trainer --model llama --fsdp fully_shard` on Gloo
(CPU): transformers' LlamaForCausalLM (the pinned version) from the same
Hugging Face checkpoint, fully_shard on each decoder layer and then the root
(PyTorch's FSDP2, as the trainer's --fsdp fully_shard --sharding full), the
trainer's synthetic batches (ddp_step.synthetic_batch, bit-identical), its
loss (cross-entropy of logits[:, :-1] against the next tokens, in float32),
its AdamW (weight decay 0.01) and learning-rate schedule, and its JSON log
(step, loss, lr, step_time_s, tokens_per_s on rank 0).

    PY=${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3
    # once: a random checkpoint both sides load (transformers' init, seeded)
    $PY benchmarks/python/llama_step.py --make-checkpoint /tmp/llama --config config.json
    OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/python/llama_step.py --hf-checkpoint /tmp/llama --steps 20 --seq 128 \\
        --global-batch 8 --log-json /tmp/py.jsonl

benchmarks/run_llama_cpu.sh runs both sides in alternating rounds and prints
the ratio.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_step import (exit_without_finalizing, learning_rate, make_optimizer,  # noqa: E402
                      synthetic_batch)


def make_checkpoint(path, config_path, seed):
    import transformers
    config = transformers.AutoConfig.from_pretrained(config_path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    print(f"llama_step: wrote {path} ({sum(p.numel() for p in model.parameters())} parameters)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-checkpoint")
    p.add_argument("--make-checkpoint", metavar="DIR")
    p.add_argument("--config", help="with --make-checkpoint: the config.json")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="cosine")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--log-json")
    args = p.parse_args()
    args.optimizer, args.optimizer_impl = "adamw", "default"
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint, args.config, args.seed)
        return

    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dist.init_process_group("gloo")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.hf_checkpoint, dtype=torch.float32, attn_implementation="sdpa")
    vocab = model.config.vocab_size
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(args, model.parameters())

    log = open(args.log_json, "w") if args.log_json and rank == 0 else None
    tokens_per_step = args.global_batch * args.seq
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        lr = learning_rate(args, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        batch = synthetic_batch(vocab, args.seed, step, args.global_batch, args.seq + 1, rank,
                                world)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, vocab).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        elapsed = time.perf_counter() - start
        if log:
            log.write(json.dumps({"step": step, "loss": t.item() / world, "lr": lr,
                                  "step_time_s": elapsed,
                                  "tokens_per_s": tokens_per_step / elapsed}) + "\n")
            log.flush()
    if log:
        log.close()
    exit_without_finalizing(0)


if __name__ == "__main__":
    main()
