"""Golden values for fully_shard's float8 all-gather
(fsdp::FullyShardOptions::float8_all_gather_fn): torchao 0.17.0's
enable_fsdp_float8_all_gather under PyTorch's fully_shard (FSDP2), on the
CPU over Gloo, trained for 3 SGD steps.

Needs torchao 0.17.0 on PYTHONPATH, as tools/golden/float8_golden.py does.
From the repo root:

    bash tools/fetch_gpu_peers.sh    # only when third_party/gpu_peers/ is missing
    mkdir -p /tmp/torchao && unzip -qo third_party/gpu_peers/torchao-0.17.0-*.whl -d /tmp/torchao
    PYTHONPATH=/tmp/torchao ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \
        tools/golden/float8_all_gather_golden.py

It starts each case's ranks with torch.distributed.run (this file again,
with the case's name) and rewrites fsdp/testdata/float8_all_gather/golden.pt
(deterministic: fixed seeds, the CPU), a flat {str: Tensor} dict:

  <c>.world                  the number of ranks (int64 scalar)
  <c>.w1, <c>.w2, <c>.gain   the initial parameters, whole: l1.weight [64, 32],
                             l2.weight [48, 64], gain [32] (float32)
  <c>.step<k>.x, .g          step k's input [4, 8, 32] (every rank's) and the
                             gradient fed to the output's backward
  <c>.step<k>.y              the output (rank 0's; every rank's is the same)
  <c>.step<k>.grad.w1, .grad.w2, .grad.gain
                             the gradients after step k's backward, whole
                             (DTensor.full_tensor() of the shards' .grad)

  for <c> in f32_w2 (2 ranks), f32_w4 (4 ranks), bf16_w2
  (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)).

Not uneven shards: on 3 ranks (l1's 64 rows as 22, 22, 20) PyTorch 2.15's
fully_shard with torchao's float8 all-gather aborts in Gloo ("Received data
size doesn't match expected size": the last rank's float8 all-gather input
is not padded to the others'). Ours pads it (float8_all_gather_test checks
3 ranks against the unsharded model).

The model: y = l2(relu(l1(x * gain))), both linears bias-free and
converted with convert_to_float8_training(config=Float8LinearConfig(
enable_fsdp_float8_all_gather=True)), then fully_shard(model) on the world;
SGD lr 0.1 after each step. The script asserts that the shards' local
tensors are torchao's WeightWithDynamicFloat8CastTensor (the float8
all-gather is what ran) and that no scale was precomputed (the dynamic
path: fsdp_pre_all_gather's hp_tensor_to_float8_dynamic with reduce_amax).
"""
import os
import socket
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "fsdp", "testdata", "float8_all_gather", "golden.pt")
CASES = {"f32_w2": (2, None), "f32_w4": (4, None), "bf16_w2": (2, torch.bfloat16)}
STEPS = 3


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.l1 = torch.nn.Linear(32, 64, bias=False)
        self.l2 = torch.nn.Linear(64, 48, bias=False)
        self.gain = torch.nn.Parameter(torch.rand(32) + 0.5)
        with torch.no_grad():
            self.l2.weight[5, 9] = 3.0  # the amax, in one rank's shard only

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x * self.gain)))


def run_case(case, part_path):
    import torch.distributed as dist
    import torchao
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    assert torchao.__version__.startswith("0.17.0"), torchao.__version__
    world, param_dtype = CASES[case]
    dist.init_process_group("gloo")
    assert dist.get_world_size() == world
    model = Mlp()
    out = {f"{case}.world": torch.tensor(world),
           f"{case}.w1": model.l1.weight.detach().clone(),
           f"{case}.w2": model.l2.weight.detach().clone(),
           f"{case}.gain": model.gain.detach().clone()}
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    assert isinstance(model.l1, Float8Linear) and isinstance(model.l2, Float8Linear)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype is not None else MixedPrecisionPolicy()
    fully_shard(model, mp_policy=mp)
    for linear in (model.l1, model.l2):
        local = linear.weight._local_tensor
        assert isinstance(local, WeightWithDynamicFloat8CastTensor), type(local)
        assert local._precomputed_scale is None
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x = torch.randn(4, 8, 32)
        g = torch.randn(4, 8, 48)
        optim.zero_grad()
        y = model(x)
        y.backward(g.to(y.dtype))
        key = f"{case}.step{step}"
        out[f"{key}.x"] = x
        out[f"{key}.g"] = g
        out[f"{key}.y"] = y.detach().clone()
        for name, p in (("w1", model.l1.weight), ("w2", model.l2.weight), ("gain", model.gain)):
            out[f"{key}.grad.{name}"] = p.grad.full_tensor().clone()
        optim.step()
    if dist.get_rank() == 0:
        torch.save(out, part_path)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    golden = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, (world, _) in CASES.items():
            part = os.path.join(tmp, case + ".pt")
            env = dict(os.environ, OMP_NUM_THREADS="1")
            subprocess.run([sys.executable, "-m", "torch.distributed.run",
                            f"--nproc-per-node={world}", f"--master-port={free_port()}",
                            os.path.abspath(__file__), case, part], check=True, env=env)
            golden.update(torch.load(part))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    torch.save(golden, OUT)
    print(f"wrote {len(golden)} tensors to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    if len(sys.argv) == 3:
        run_case(sys.argv[1], sys.argv[2])
    else:
        main()
