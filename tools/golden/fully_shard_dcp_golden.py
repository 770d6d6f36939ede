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

The second fixture is the same run with shard_placement_fn (PyTorch's
Shard(d) for d > 0): Sequential(Linear(6, 4), ReLU, Linear(4, 2)) with
torch.manual_seed(1), batches (4 x 6) from torch.manual_seed(8), and

    fully_shard(..., shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)

so the weights (4 x 6 and 2 x 4) are split by columns, 3+3 and 2+2 (each
rank's DCP chunk a [rows, cols / 2] box at column offset rank * cols / 2;
the biases stay on dim 0). It writes

  python_fsdp2_shard1_w2/  the DCP directory after 2 steps
  batches_shard1.pt        {"x1", "x2", "x3"}
  py_after_shard1.pt       the full parameters after the third step

Arguments pick the fixtures to (re)write: `dim0`, `shard1`; none is both.
Only the named fixture's files are removed and rewritten (DCP's .metadata
is not byte-reproducible, so regenerate only what changes).
"""
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "state_dict", "fully_shard", "testdata")


# name: (directory, batches file, params-after file, model seed, batch seed,
#        in, hidden, out, shard dim of the 2-D weights or None for dim 0)
FIXTURES = {
    "dim0": ("python_fsdp2_w2", "batches.pt", "py_after.pt", 0, 7, 5, 7, 3, None),
    "shard1": ("python_fsdp2_shard1_w2", "batches_shard1.pt", "py_after_shard1.pt",
               1, 8, 6, 4, 2, 1),
}


def run(rank, d, fixture):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, StateDictOptions
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    dirname, batches_name, after_name, model_seed, batch_seed, n_in, n_hidden, n_out, dim = (
        FIXTURES[fixture])
    dist.init_process_group("gloo", init_method="file://%s/store" % d, rank=rank, world_size=2)
    torch.manual_seed(model_seed)
    model = torch.nn.Sequential(torch.nn.Linear(n_in, n_hidden), torch.nn.ReLU(),
                                torch.nn.Linear(n_hidden, n_out))
    kwargs = {}
    if dim is not None:
        kwargs["shard_placement_fn"] = lambda p: Shard(dim) if p.dim() == 2 else None
    fully_shard(model[0], **kwargs)
    fully_shard(model[2], **kwargs)
    fully_shard(model, **kwargs)
    if dim is not None:
        assert model[0].weight.placements == (Shard(dim),), model[0].weight.placements
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(batch_seed)
    batches = [torch.randn(4, n_in) for _ in range(3)]

    def step(x):
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    step(batches[0])
    step(batches[1])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(d, dirname))
    step(batches[2])
    full, _ = get_state_dict(model, opt,
                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"x1": batches[0], "x2": batches[1], "x3": batches[2]},
                   os.path.join(d, batches_name))
        torch.save({k: v.detach().clone() for k, v in full.items()}, os.path.join(d, after_name))
    dist.barrier()
    dist.destroy_process_group()
    # Without finalizing: PyTorch issue 190489 (see state_dict/dcp_test.cc).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    import torch.multiprocessing as mp
    names = sys.argv[1:] or list(FIXTURES)
    for fixture in names:
        if fixture not in FIXTURES:
            sys.exit("unknown fixture %r (expected one of %s)" % (fixture, ", ".join(FIXTURES)))
    os.makedirs(OUT, exist_ok=True)
    store = os.path.join(OUT, "store")
    for fixture in names:
        for name in FIXTURES[fixture][:3] + ("store",):
            path = os.path.join(OUT, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
        mp.spawn(run, args=(OUT, fixture), nprocs=2)
        if os.path.exists(store):
            os.remove(store)
        print("wrote", fixture, "in", os.path.normpath(OUT))


if __name__ == "__main__":
    main()
