"""A DCP directory Python's fully_shard (FSDP2) writes, for
//state_dict/fully_shard:fully_shard_dcp_test (issue 37, item 4).

Run from the repo root with the venv's Python that `tools/setup.sh
--with-python` makes (the `torch` wheel the build links):

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 tools/golden/fully_shard_dcp_golden.py

It spawns 2 ranks (Gloo, CPU), builds Sequential(Linear(5, 7), ReLU,
Linear(7, 3)) with torch.manual_seed(0), applies fully_shard to model[0],
model[2] and the root, and trains 2 Adam steps (lr 0.01) on the loss
model(x).pow(2).sum(), every rank on the same batch. Then

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=...)

writes state_dict/fully_shard/testdata/python_fsdp2_w2/ (the weights'
rows split 4+3 and 2+1 over the 2 ranks, Adam's exp_avg / exp_avg_sq as
DTensors, step as 0-dim tensors), and a third step follows. Beside it:

  batches.pt   {"x1", "x2", "x3"}: the three batches (4 x 5)
  py_after.pt  the full parameters after the third step
               (get_state_dict full_state_dict=True), {"0.weight": ...}

The test loads the directory into our fully_shard on 3 ranks (another world
size), takes the third step on x3 and compares with py_after.pt.
"""
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "state_dict", "fully_shard", "testdata")


def run(rank, d):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, StateDictOptions
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method="file://%s/store" % d, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(7)
    batches = [torch.randn(4, 5) for _ in range(3)]

    def step(x):
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    step(batches[0])
    step(batches[1])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(d, "python_fsdp2_w2"))
    step(batches[2])
    full, _ = get_state_dict(model, opt,
                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"x1": batches[0], "x2": batches[1], "x3": batches[2]},
                   os.path.join(d, "batches.pt"))
        torch.save({k: v.detach().clone() for k, v in full.items()}, os.path.join(d, "py_after.pt"))
    dist.barrier()
    dist.destroy_process_group()
    # Without finalizing: PyTorch issue 190489 (see state_dict/dcp_test.cc).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    import torch.multiprocessing as mp
    os.makedirs(OUT, exist_ok=True)
    for name in ("python_fsdp2_w2", "batches.pt", "py_after.pt", "store"):
        path = os.path.join(OUT, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    mp.spawn(run, args=(OUT,), nprocs=2)
    store = os.path.join(OUT, "store")
    if os.path.exists(store):
        os.remove(store)
    print("wrote", os.path.normpath(OUT))


if __name__ == "__main__":
    main()
