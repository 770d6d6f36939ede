"""DCP directories Python FSDP writes, for //tools:ckpt_test (issue 38).

Run from the repo root with the venv's Python that `tools/setup.sh
--with-python` makes (the `torch` wheel the build links):

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 tools/golden/dcp_fixtures.py

It starts itself on 2 ranks with that Python's torchrun (Gloo, CPU), trains
a small MLP (Linear 4->6, ReLU, Linear 6->3) one AdamW step, and saves
dcp.save({"model": msd, "optim": osd}) — no "trainer" entry, as most Python
runs save — twice:

  tools/testdata/dcp_fsdp1/  FSDP1 (FullyShardedDataParallel, use_orig_params)
                             under StateDictType.SHARDED_STATE_DICT:
                             model.state_dict(), FSDP.optim_state_dict(...)
  tools/testdata/dcp_fsdp2/  FSDP2 (fully_shard), get_state_dict(model, opt)

For each, rank 0 then runs Python's own converter,
torch.distributed.checkpoint.format_utils.dcp_to_torch_save, flattens what it
gives with DCP's dotted keys ("optim.state.0.weight.exp_avg",
"optim.param_groups.0.lr") and writes:

  <dir>.expected.txt  one line per entry: "tensor KEY DTYPE [SHAPE]" (DTYPE
                      in c10's spelling, Float/Long) or "object KEY"
  <dir>.expected.pt   the tensors, {KEY: tensor} (torch.save), for values
"""
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "testdata")
C10 = {"torch.float32": "Float", "torch.int64": "Long", "torch.float64": "Double",
       "torch.bfloat16": "BFloat16"}


def flatten(prefix, value, out):
    """DCP's flattening (flatten_state_dict): dicts and lists that hold a
    container are traversed; a list of plain values (a param group's
    "params") is one value."""
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        for i, v in enumerate(value):
            flatten(f"{prefix}.{i}", v, out)
    else:
        out[prefix] = value


def model_and_opt():
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    return model


def step(model, opt):
    import torch
    torch.manual_seed(1)
    x = torch.randn(8, 4)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()


def save(kind, directory):
    import torch
    import torch.distributed.checkpoint as dcp
    model = model_and_opt()
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
        wrapped = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        step(wrapped, opt)
        with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
            msd = wrapped.state_dict()
            osd = FSDP.optim_state_dict(wrapped, opt)
    else:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step(model, opt)
        msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)


def expected(directory):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    full_pt = directory + ".full.tmp"
    dcp_to_torch_save(directory, full_pt)
    flat = {}
    flatten("", torch.load(full_pt, weights_only=False), flat)
    os.remove(full_pt)
    lines, tensors = [], {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            shape = ", ".join(str(d) for d in value.shape)
            lines.append(f"tensor {key} {C10[str(value.dtype)]} [{shape}]")
            tensors[key] = value.detach().clone().contiguous()
        else:
            lines.append(f"object {key}")
    with open(directory + ".expected.txt", "w") as f:
        f.write("\n".join(sorted(lines)) + "\n")
    torch.save(tensors, directory + ".expected.pt")


def rank_main():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    for kind in ("fsdp1", "fsdp2"):
        directory = os.path.join(OUT, "dcp_" + kind)
        save(kind, directory)
        dist.barrier()
        if dist.get_rank() == 0:
            expected(directory)
        dist.barrier()
    dist.destroy_process_group()


def main():
    if "RANK" in os.environ:
        rank_main()
        return
    os.makedirs(OUT, exist_ok=True)
    for kind in ("fsdp1", "fsdp2"):
        shutil.rmtree(os.path.join(OUT, "dcp_" + kind), ignore_errors=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", os.path.abspath(__file__)], check=True)
    print("wrote", ", ".join(sorted(os.listdir(OUT))))


if __name__ == "__main__":
    main()
