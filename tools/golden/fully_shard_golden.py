"""Golden values for fully_shard (issue 37): Python's FSDP2
(torch.distributed.fsdp.fully_shard) on Gloo, CPU, 1-4 ranks.

Run from the repo root with the venv's Python (the `torch` wheel the build
links, 2.15):

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \\
        tools/golden/fully_shard_golden.py

The model is tests/fsdp_test_models.h's Net (in: Linear(6, 8), three
residual blocks x + fc2(tanh(fc1(x))) of Linear(8, 8), out: Linear(8, 3)),
fully_shard applied to each block and then to the root, trained with SGD
(lr 0.1) for STEPS steps on a global batch of 12 rows split evenly over the
ranks, loss mse_loss. For each case it launches the ranks with the venv's
torchrun and records

  init.<p>                      the initial parameters (every case starts
                                from them)
  x.<s>, y.<s>                  the global batch of step s
  <case>.loss.<s>               the loss of step s averaged over the ranks
  <case>.grad.<s>.<p>           the full gradient of p at step s
                                (DTensor.full_tensor(); absent when frozen)
  <case>.param.<s>.<p>          the full parameter p after step s

<case> is "w<W>.raf_<true|false|2>" or "w<W>.<case>" for the other cases
(all with reshard_after_forward true):

  frozen   in.weight frozen
  hsdp     HSDP: a 2-D mesh (replicate 2 x shard 2, mesh_dim_names
           ("replicate", "shard")); gradients reduce-scattered over the shard
           dim, then all-reduced (averaged) over the replicate dim
  bf16     MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)
           on the blocks, and with output_dtype=float32 on the root (a
           block's float32 output would reach the root's own bfloat16
           Linear uncast: cast_forward_inputs casts only a module's own
           forward arguments)
  shard1   shard_placement_fn: Shard(1) for each 2-D parameter whose dim 1
           divides the world size (FSDP2 requires even sharding off dim 0),
           None (Shard(0)) for the others
  ignored  fully_shard(model, ignored_params={out.weight}): out.weight stays
           a plain, unsharded parameter whose gradient is not reduced

A parameter that is not a DTensor (ignored) is recorded as rank 0's local
tensor. Writes tests/testdata/fully_shard_golden.pt ({name: Tensor}, read by
C++ with torch::pickle_load).
"""
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "tests", "testdata", "fully_shard_golden.pt")
STEPS = 3
BATCH = 12
LR = 0.1
CASES = [(1, "true"), (1, "false"), (2, "true"), (2, "false"), (2, "frozen"), (3, "true"),
         (3, "false"), (3, "frozen"), (4, "true"), (4, "false"), (4, "2"), (4, "hsdp"),
         (2, "bf16"), (4, "bf16"), (2, "shard1"), (4, "shard1"), (2, "ignored")]
RAF_CASES = ("true", "false", "2")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        setattr(self, "in", nn.Linear(6, 8))
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = getattr(self, "in")(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def make_inputs():
    torch.manual_seed(37)
    model = Net()
    data = {f"init.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for s in range(STEPS):
        data[f"x.{s}"] = torch.randn(BATCH, 6)
        data[f"y.{s}"] = torch.randn(BATCH, 3)
    return data


def rank_main(inputs_path, case, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = torch.load(inputs_path)
    model = Net()
    model.load_state_dict({k[len("init."):]: v for k, v in inputs.items() if k.startswith("init.")})
    if case == "frozen":
        getattr(model, "in").weight.requires_grad_(False)
    raf = {"true": True, "false": False, "2": 2}.get(case, True)
    if case == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    kwargs = {}
    if case == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    if case == "shard1":
        def placement(p):
            return Shard(1) if p.ndim == 2 and p.size(1) % world == 0 else None
        kwargs["shard_placement_fn"] = placement
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=raf, **kwargs)
    if case == "ignored":
        kwargs["ignored_params"] = {model.out.weight}
    if case == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32,
                                                   output_dtype=torch.float32)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf, **kwargs)

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    n = BATCH // world
    out = {}
    for s in range(STEPS):
        x = inputs[f"x.{s}"][rank * n:(rank + 1) * n]
        y = inputs[f"y.{s}"][rank * n:(rank + 1) * n]
        optim.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out[f"loss.{s}"] = total / world
        for name, p in model.named_parameters():
            if p.grad is not None:
                out[f"grad.{s}.{name}"] = full(p.grad).clone()
        optim.step()
        for name, p in model.named_parameters():
            out[f"param.{s}.{name}"] = full(p.detach()).clone()
    if rank == 0:
        torch.save(out, out_path)
    dist.destroy_process_group()


def main():
    if len(sys.argv) == 4:
        rank_main(*sys.argv[1:])
        return
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    data = make_inputs()
    with tempfile.TemporaryDirectory() as tmp:
        inputs_path = os.path.join(tmp, "inputs.pt")
        torch.save(data, inputs_path)
        for world, case in CASES:
            out_path = os.path.join(tmp, f"w{world}.{case}.pt")
            subprocess.run([torchrun, "--standalone", f"--nproc_per_node={world}",
                            os.path.abspath(__file__), inputs_path, case, out_path],
                           check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            name = f"w{world}.raf_{case}" if case in RAF_CASES else f"w{world}.{case}"
            for key, value in torch.load(out_path).items():
                data[f"{name}.{key}"] = value
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    torch.save(data, OUT)
    print(f"wrote {len(data)} tensors to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
