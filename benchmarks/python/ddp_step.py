"""One data-parallel training run in Python PyTorch (DistributedDataParallel
on Gloo), built to match //:trainer step for step, for
benchmarks/compare_pytorch.sh.

Run it with the venv's Python that `tools/setup.sh --with-python` makes
(PY below: ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3),
one process per rank, started by torchrun:

    OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/python/ddp_step.py --model transformer --steps 60 \\
        --log-json /tmp/py.jsonl

or by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set for each), or
as `$PY benchmarks/python/ddp_step.py ...` with WORLD_SIZE unset for a
single process. Rank 0 writes one JSON line per step with the keys the
trainer's --log-json uses (step, loss, lr, step_time_s, tokens_per_s).

What matches the trainer (trainer/models.cc, train.cc, data.cc, lr_schedule.cc):
  * TransformerLM: token + learned position embeddings (N(0, 0.02) init),
    pre-LayerNorm blocks  x + attn(ln1(x));  y + fc2(gelu(fc1(ln2(y))))  with
    causal F.scaled_dot_product_attention(is_causal=True) on the parameters
    of an nn.MultiheadAttention (in_proj_weight, in_proj_bias, out_proj: the
    trainer's names), final LayerNorm, output projection tied to the token
    embedding (F.linear with the same tensor).
  * MlpLM: Embedding(vocab, max(1, dim // 4)) over a window of `seq` bytes,
    flattened, Linear-GELU-Linear to vocab logits; predicts the last token.
  * Data: the trainer's synthetic sampler, bit for bit (SplitMix64 hash of
    (seed, step, row, column) mod vocab); rank r of W takes rows
    [r*B/W, (r+1)*B/W) of the global batch.
  * Step: set lr (linear warm-up, then cosine or constant), zero_grad, sample,
    forward + backward (gradients averaged over ranks), all-reduce of the
    loss (mean), optimizer step. step_time_s covers exactly that span, as in
    train.cc.
  * Optimizers: Adam(lr) / AdamW(lr, weight_decay=0.01) / SGD(lr, momentum=0.9),
    PyTorch defaults otherwise (LibTorch's defaults are the same values);
    --optimizer-impl foreach|fused asks for foreach=True / fused=True (the
    trainer's are fused, optim/; the same update to float rounding).

What differs by construction: DDP averages gradients in buckets with
all-reduces that overlap the backward pass; the trainer concatenates all
gradients after backward and runs one all-reduce. Parameter initialisation
draws come from the same generator but in each frontend's own module order,
so the initial weights (and the loss curve after step 1) are not identical.
No grad-accumulation or clipping (the comparison uses neither).
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

MASK64 = (1 << 64) - 1


# --- the trainer's synthetic sampler (trainer/data.cc), vectorised ---------
# uint64 arithmetic on int64 tensors: additions and multiplications wrap the
# same way in two's complement; right shifts must be logical, so mask off the
# sign bits an arithmetic shift drags in.

def _i64(u):
    """A uint64 constant as the int64 with the same bits."""
    u &= MASK64
    return u - (1 << 64) if u >= (1 << 63) else u


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_M1 = _i64(0xBF58476D1CE4E5B9)
_M2 = _i64(0x94D049BB133111EB)


def _shr(x, k):
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x):
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def _mix_int(x):
    """SplitMix64's finaliser on a Python int (for the scalar prefix)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def synthetic_batch(vocab, seed, step, global_batch, row_length, rank, world):
    """int64 [global_batch / world, row_length]: SampleSyntheticBatch."""
    per_rank = global_batch // world
    h = _mix_int(_mix_int(seed) ^ (step & MASK64))  # Mix(Mix(seed) ^ step)
    rows = torch.arange(rank * per_rank, (rank + 1) * per_rank, dtype=torch.int64)
    cols = torch.arange(row_length, dtype=torch.int64)
    hr = _mix(rows ^ _i64(h))                         # Mix(h ^ row)
    hc = _mix(hr.unsqueeze(1) ^ cols.unsqueeze(0))    # Mix(. ^ column)
    # unsigned (hc mod vocab): split off the top bit so the dividend is >= 0.
    lo = hc & ((1 << 63) - 1)
    top = ((hc < 0).to(torch.int64) * ((1 << 63) % vocab))
    return (lo % vocab + top) % vocab


# --- the models (trainer/models.cc) ----------------------------------------

class TransformerBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads)  # sequence-first, as LibTorch's
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def attend(self, h):
        """Causal self-attention of h [B, T, dim] as TransformerBlockImpl::attend:
        nn.MultiheadAttention's projections (in_proj_weight rows [0, dim) q,
        [dim, 2 dim) k, [2 dim, 3 dim) v; out_proj), heads split from dim, and
        F.scaled_dot_product_attention with is_causal=True."""
        b, t, dim = h.shape
        heads = self.attn.num_heads
        q, k, v = F.linear(h, self.attn.in_proj_weight, self.attn.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, heads, dim // heads).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return self.attn.out_proj(out.transpose(1, 2).reshape(b, t, dim))

    def forward(self, x):
        y = x + self.attend(self.ln1(x))
        return y + self.fc2(self.gelu(self.fc1(self.ln2(y))))


class TransformerLM(nn.Module):
    def __init__(self, layers, dim, heads, vocab, seq):
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        with torch.no_grad():
            nn.init.normal_(self.tok_emb.weight, 0.0, 0.02)
            nn.init.normal_(self.pos_emb.weight, 0.0, 0.02)

    def forward(self, batch):
        """Mean cross-entropy on int64 [B, seq + 1] rows (TransformerLM::Loss)."""
        length = batch.shape[1] - 1
        tokens = batch[:, :length]
        positions = torch.arange(length, device=batch.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)  # causal: SDPA's is_causal, as the trainer
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)  # tied
        targets = batch[:, 1:length + 1]
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


class MlpLM(nn.Module):
    def __init__(self, layers, dim, heads, vocab, seq):
        super().__init__()
        self.seq = seq
        width = max(1, dim // 4)
        self.emb = nn.Embedding(vocab, width)
        self.fc1 = nn.Linear(seq * width, dim)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(dim, vocab)

    def forward(self, batch):
        """Mean cross-entropy of the next-token prediction (MlpLM::Loss)."""
        window = batch[:, :self.seq]
        logits = self.fc2(self.gelu(self.fc1(self.emb(window).flatten(1))))
        return F.cross_entropy(logits, batch[:, self.seq])


# --- the loop (trainer/train.cc) --------------------------------------------

def exit_without_finalizing(status=0):
    """Ends the process now, skipping the interpreter's finalization.

    torch 2.15 with Gloo: a ProcessGroupGloo worker thread drops its last
    reference to a finished collective (and so to the Python-visible tensors
    in it) a moment after wait() returns. The process group outlives
    destroy_process_group() while DDP/FSDP objects still refer to it, so
    that drop can come during Py_FinalizeEx; releasing the tensors' Python
    objects then takes the GIL, the finalizing interpreter ends the thread
    with a forced unwind through a noexcept destructor, and the process
    aborts ("terminate called without an active exception", SIGABRT, after
    the last step). Seen here in 6 of 24 two-rank runs of 40 steps with
    tcmalloc preloaded, 0 of 20 without; PyTorch issue 190489. Everything
    this script writes is flushed before.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def learning_rate(args, step):
    if step <= args.warmup_steps:
        return args.lr * step / args.warmup_steps
    if args.lr_schedule == "constant":
        return args.lr
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(args, params):
    # --optimizer-impl: PyTorch's own choice (the for-loop on CPU, foreach on
    # CUDA), or foreach=True / fused=True (the trainer's optimizers are
    # optim::*'s fused ones).
    impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[
        args.optimizer_impl]
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=args.lr, **impl)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, **impl)
    return torch.optim.SGD(params, lr=args.lr, momentum=0.9, **impl)


def forward_backward(args, model, optimizer, step, rank, world):
    """One step's forward and backward with its learning rate set; returns
    (lr, the loss averaged over the ranks)."""
    lr = learning_rate(args, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad()
    batch = synthetic_batch(args.vocab, args.seed, step, args.global_batch,
                            args.seq + 1, rank, world)
    device = getattr(args, "device", "cpu")
    if device != "cpu":  # fsdp_step.py --device cuda: pinned, copied without blocking
        batch = batch.pin_memory().to(device, non_blocking=True)
    loss = model(batch)
    loss.backward()
    global_loss = loss.item()
    if world > 1:
        t = torch.tensor([global_loss], dtype=torch.float64, device=batch.device)
        dist.all_reduce(t)
        global_loss = t.item() / world
    return lr, global_loss


def add_common_args(p):
    """The model, data and optimizer flags every Python peer shares."""
    p.add_argument("--model", choices=["transformer", "mlp"], default="transformer")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adamw")
    p.add_argument("--optimizer-impl", choices=["default", "foreach", "fused"], default="default",
                   help="PyTorch's default, foreach=True or fused=True (issue 36's GPU comparison)")
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="cosine")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--log-json", help="rank 0 writes one JSON object per step here")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.global_batch % world != 0:
        sys.exit(f"ddp_step: --global-batch {args.global_batch} is not a multiple "
                 f"of WORLD_SIZE {world}")
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)

    torch.manual_seed(args.seed)
    cls = TransformerLM if args.model == "transformer" else MlpLM
    model = cls(args.layers, args.dim, args.heads, args.vocab, args.seq)
    num_params = sum(t.numel() for t in model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = make_optimizer(args, ddp.parameters())

    log = open(args.log_json, "w", encoding="utf-8") if args.log_json and rank == 0 else None
    if rank == 0:
        print(f"ddp_step: torch {torch.__version__}, {args.model}, {num_params} parameters, "
              f"{world} rank(s){' (DDP, gloo)' if world > 1 else ''}, global batch "
              f"{args.global_batch}, {args.optimizer}, {torch.get_num_threads()} "
              f"intra-op thread(s) per rank", flush=True)
    tokens_per_step = args.global_batch * args.seq
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        lr, global_loss = forward_backward(args, ddp, optimizer, step, rank, world)
        optimizer.step()
        step_time = time.perf_counter() - start
        if log:
            log.write(json.dumps({"step": step, "loss": global_loss, "lr": lr,
                                  "step_time_s": step_time,
                                  "tokens_per_s": tokens_per_step / step_time}) + "\n")
            log.flush()
    if log:
        log.close()
    if world > 1:
        dist.destroy_process_group()
    exit_without_finalizing(0)


if __name__ == "__main__":
    main()
