"""TorchTitan (0.2.2) as the peer of our trainer: the same Llama shape, the
same tokens, one process on one GPU, logged as our trainer logs.

    python3 titan_peer.py --hf-config CONFIG.json --seed S --log-json OUT.jsonl \\
        [--init-hf DIR] [--dry-run] -- <torchtitan.train arguments>
    python3 titan_peer.py --hf-config CONFIG.json --seed S --write-hf DIR

- Model: TorchTitan's own llama3 Transformer, registered as the model
  "llama3_synthetic" with one flavor, "from_config", whose shapes are those
  of a Hugging Face config.json (ours: benchmarks/llama/titan_*.json):
  hidden_size, intermediate_size, layers, heads, kv heads, vocabulary, RMS
  eps, rope theta and Llama 3's rope scaling, which TorchTitan always
  applies (a config without it, or with tied embeddings, which TorchTitan's
  model does not have, is refused: the two models would differ).
- Data: the trainer's synthetic batches for --seed (synthetic_tokens.py),
  step 1, 2, ...: `trainer --data synthetic --seed S` sees the same tokens.
  No tokenizer, no dataset.
- Log (--log-json): one JSON object per step with the trainer's keys
  (step, loss, step_time_s, tokens_per_s, cuda_peak_allocated_bytes,
  cuda_peak_reserved_bytes) so benchmarks/python/gpu_report.py tables both;
  tokens_per_s is TorchTitan's own "tps" (tokens since its last log over the
  time since), so run it with --metrics.log_freq 1 (added when absent).
  Also flops_per_token and mfu_titan: TorchTitan's formula and its figure
  against its nominal peak.
- --dry-run (no GPU needed, run_gpu.sh --cpu): parse the arguments with
  TorchTitan's ConfigManager, build the model on the meta device, print
  "titan: N parameters, F FLOP per token", check the first batch of the
  data loader against synthetic_tokens (and that against the C++'s pinned
  values), import torchao's float8 when a converter asks for it, and print
  "DRY RUN OK". With --init-hf, also the loss of the first batch on DIR's
  weights, computed on the CPU in float32 ("titan: step-1 loss L on DIR"):
  our trainer's first logged loss from --hf-checkpoint DIR is the same
  number (run_gpu.sh --cpu compares them).
- Same weights on both sides (for comparing losses, not only speed):
  --write-hf DIR writes TorchTitan's own initialisation of the shape for
  --seed (on the CPU) as a Hugging Face checkpoint (its state dict adapter's
  to_hf: names and the q/k RoPE permutation; bf16 model.safetensors and
  config.json), which our trainer loads with --hf-checkpoint DIR; --init-hf
  DIR makes TorchTitan start from that checkpoint (after its init_weights,
  every parameter is overwritten by the adapter's from_hf of DIR's tensors,
  through the wrappers compile and activation checkpointing add to the
  names, on the world of 1's whole local tensors). safetensors is read and
  written here without the safetensors package.

The single process is its own world of 1 (RANK=0, WORLD_SIZE=1, a free
MASTER_PORT), as torchrun --nproc_per_node 1 would make it. Where
Hugging Face `datasets` or TensorBoard are not installed, stand-ins that
fail loudly if used take their place (stubs/): TorchTitan imports both at
module level and uses neither here.
"""

import argparse
import dataclasses
import functools
import json
import os
import socket
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import synthetic_tokens  # noqa: E402

MODEL_NAME = "llama3_synthetic"
FLAVOR = "from_config"


def fail(message):
    print(f"titan_peer.py: {message}", file=sys.stderr)
    sys.exit(2)


def install_stand_ins():
    try:
        import datasets  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(HERE, "stubs"))
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        stub = types.ModuleType("torch.utils.tensorboard")

        class SummaryWriter:
            def __init__(self, *args, **kwargs):
                raise RuntimeError("titan_peer.py: TensorBoard is not installed here; "
                                   "do not pass --metrics.enable_tensorboard")

        stub.SummaryWriter = SummaryWriter
        sys.modules["torch.utils.tensorboard"] = stub


def model_args_from_config(path):
    """TorchTitan's TransformerModelArgs with the shapes of a config.json."""
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    try:
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"--hf-config='{path}': {e}")
    if c.get("tie_word_embeddings", False):
        fail(f"--hf-config='{path}': tie_word_embeddings=true; expected false (TorchTitan's "
             "llama3 has a separate output projection: the models would differ)")
    scaling = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        fail(f"--hf-config='{path}': rope scaling {scaling!r}; expected Llama 3's "
             "(rope_type llama3), which TorchTitan always applies")
    dim, hidden = c["hidden_size"], c["intermediate_size"]
    heads = c["num_attention_heads"]
    if c.get("head_dim", dim // heads) != dim // heads:
        fail(f"--hf-config='{path}': head_dim {c['head_dim']}; expected hidden_size / heads = "
             f"{dim // heads} (TorchTitan derives it)")
    # TorchTitan's FFN width: int(2 * 4 * dim / 3) rounded up to multiple_of
    # (ffn_dim_multiplier unset); multiple_of = intermediate_size gives
    # exactly intermediate_size whenever that is at least int(8 * dim / 3).
    if int(8 * dim / 3) > hidden:
        fail(f"--hf-config='{path}': intermediate_size {hidden} < 8 * hidden_size / 3 = "
             f"{int(8 * dim / 3)}: TorchTitan's rounding cannot give it")
    return TransformerModelArgs(
        dim=dim, n_layers=c["num_hidden_layers"], n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads", heads), vocab_size=c["vocab_size"],
        multiple_of=hidden, ffn_dim_multiplier=None, norm_eps=c.get("rms_norm_eps", 1e-5),
        rope_theta=scaling.get("rope_theta", c.get("rope_theta", 10000.0)),
        rope_scaling_args=RoPEScalingArgs(
            scaling_factor=scaling["factor"],
            low_freq_factor=scaling.get("low_freq_factor", 1.0),
            high_freq_factor=scaling.get("high_freq_factor", 4.0),
            original_max_position_embeddings=scaling.get("original_max_position_embeddings",
                                                         8192)))


# safetensors' dtype names.
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def write_safetensors(path, tensors):
    """The safetensors format: u64 header length, JSON header, raw bytes."""
    import torch
    names = {getattr(torch, v): k for k, v in SAFETENSORS_DTYPES.items()}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        blob = t.view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_hf_tensors(directory):
    """Every tensor of DIR's *.safetensors files (float32, bf16, float16)."""
    import torch
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        fail(f"--init-hf='{directory}': no .safetensors file there")
    out = {}
    for name in files:
        with open(os.path.join(directory, name), "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            data = bytearray(f.read())  # the tensors are views of it: no copy each
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if info["dtype"] not in SAFETENSORS_DTYPES:
                fail(f"--init-hf='{directory}': {key} has dtype {info['dtype']}; expected one of "
                     f"{sorted(SAFETENSORS_DTYPES)}")
            begin, end = info["data_offsets"]
            dtype = getattr(torch, SAFETENSORS_DTYPES[info["dtype"]])
            count = (end - begin) // dtype.itemsize
            out[key] = torch.frombuffer(data, dtype=dtype, count=count, offset=begin).reshape(
                info["shape"])
    return out


def adapter_for(model_args):
    from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter
    return Llama3StateDictAdapter(model_args, None)


def write_hf(hf_config, seed, directory):
    """TorchTitan's initialisation of the shape, as a Hugging Face checkpoint."""
    import shutil
    import torch
    from torchtitan.models.llama3 import Transformer

    model_args = model_args_from_config(hf_config)
    torch.manual_seed(seed)
    model = Transformer(model_args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    hf = adapter_for(model_args).to_hf(
        {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "freqs_cis"})
    os.makedirs(directory, exist_ok=True)
    write_safetensors(os.path.join(directory, "model.safetensors"), hf)
    shutil.copyfile(hf_config, os.path.join(directory, "config.json"))
    print(f"titan: wrote {len(hf)} tensors ({sum(t.numel() for t in hf.values())} parameters, "
          f"bf16) of TorchTitan's initialisation for seed {seed} to {directory}")


def load_hf_into(model, model_args, directory):
    """Overwrites every parameter of `model` (TorchTitan's llama3, possibly
    wrapped by compile, activation checkpointing and FSDP on a world of 1)
    with DIR's weights through the adapter's from_hf."""
    import torch
    from torch.distributed.tensor import DTensor

    state = adapter_for(model_args).from_hf(read_hf_tensors(directory))
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = name.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")
            if key not in state:
                fail(f"--init-hf='{directory}': nothing for TorchTitan's parameter {key}")
            source = state.pop(key)
            local = param.to_local() if isinstance(param, DTensor) else param
            if tuple(local.shape) != tuple(source.shape):
                fail(f"--init-hf='{directory}': {key} is {tuple(source.shape)} there and "
                     f"{tuple(local.shape)} here (a world of 1 holds whole tensors)")
            local.copy_(source)
    if state:
        fail(f"--init-hf='{directory}': tensors TorchTitan's model lacks: {sorted(state)[:4]}")


def start_from_hf(directory, model_args):
    """TorchTitan's init_weights, then DIR's weights over every parameter."""
    from torchtitan.models.llama3 import Transformer

    original = Transformer.init_weights

    def init_weights(self, *args, **kwargs):
        original(self, *args, **kwargs)
        load_hf_into(self, model_args, directory)
        print(f"titan: parameters from {directory}", flush=True)

    Transformer.init_weights = init_weights


def synthetic_loader_class():
    from torchtitan.components.dataloader import BaseDataLoader

    class SyntheticDataLoader(BaseDataLoader):
        """The trainer's synthetic batches, step 1, 2, ... (no end)."""

        def __init__(self, seed, vocab, local_batch, seq_len, dp_rank, dp_world_size):
            self.seed, self.vocab = seed, vocab
            self.local_batch, self.seq_len = local_batch, seq_len
            self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
            self.step = 0

        def batch(self, step):
            import torch
            rows = torch.from_numpy(synthetic_tokens.synthetic_rows(
                self.seed, step, self.vocab, self.local_batch * self.dp_world_size,
                self.seq_len + 1, self.dp_rank, self.dp_world_size))
            return {"input": rows[:, :-1].contiguous()}, rows[:, 1:].contiguous()

        def __iter__(self):
            while True:
                self.step += 1
                yield self.batch(self.step)

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, state_dict):
            self.step = state_dict["step"]

    return SyntheticDataLoader


def register(hf_config, seed):
    from torchtitan.models import llama3
    from torchtitan.protocols.train_spec import register_train_spec

    model_args = model_args_from_config(hf_config)
    loader = synthetic_loader_class()

    def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
        return loader(seed, model_args.vocab_size, job_config.training.local_batch_size,
                      job_config.training.seq_len, dp_rank, dp_world_size)

    spec = dataclasses.replace(llama3.get_train_spec(), model_args={FLAVOR: model_args},
                               build_dataloader_fn=build_dataloader, build_tokenizer_fn=None,
                               build_validator_fn=None)
    register_train_spec(MODEL_NAME, spec)
    return spec


def log_steps_to(path):
    """Wraps TorchTitan's MetricsProcessor.log to append one line per step."""
    import torch
    from torchtitan.components import metrics

    original = metrics.MetricsProcessor.log
    out = open(path, "w", encoding="utf-8")

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        seconds = time.perf_counter() - self.time_last_log
        tps = self.ntokens_since_last_log / (seconds * self.parallel_dims.non_data_parallel_size)
        record = {"step": int(step), "loss": float(global_avg_loss), "step_time_s": seconds,
                  "tokens_per_s": tps, "flops_per_token": self.num_flops_per_token,
                  "mfu_titan": 100 * self.num_flops_per_token * tps / self.gpu_peak_flops}
        if torch.cuda.is_available():
            # TorchTitan resets the peaks after each log: these are the step's.
            record["cuda_peak_allocated_bytes"] = [torch.cuda.max_memory_allocated()]
            record["cuda_peak_reserved_bytes"] = [torch.cuda.max_memory_reserved()]
        out.write(json.dumps(record) + "\n")
        out.flush()
        return original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    metrics.MetricsProcessor.log = log


def dry_run(titan_args, init_hf):
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    config = ConfigManager().parse_args(titan_args)
    spec = get_train_spec(config.model.name)
    model_args = spec.model_args[config.model.flavor]
    model_args.update_from_config(config)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    params, flops = model_args.get_nparams_and_flops(model, config.training.seq_len)
    print(f"titan: {params} parameters, {flops} FLOP per token (seq {config.training.seq_len})")
    synthetic_tokens.self_check()
    loader = spec.build_dataloader_fn(dp_world_size=1, dp_rank=0, tokenizer=None,
                                      job_config=config)
    inputs, labels = next(iter(loader))
    want = (config.training.local_batch_size, config.training.seq_len)
    if tuple(inputs["input"].shape) != want or tuple(labels.shape) != want:
        fail(f"dry run: batch {tuple(inputs['input'].shape)} / labels {tuple(labels.shape)}; "
             f"expected {want}")
    if not torch.equal(inputs["input"][:, 1:], labels[:, :-1]):
        fail("dry run: the labels are not the inputs shifted by one")
    if any("float8" in c for c in config.model.converters):
        import torchao.float8  # noqa: F401
        print("titan: torchao.float8 imports")
    if init_hf:
        # The model on the CPU in float32, from DIR's weights: the first
        # batch's loss (TorchTitan's cross_entropy_loss over the tokens).
        model = spec.model_cls(model_args)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        load_hf_into(model, model_args, init_hf)
        with torch.no_grad():
            pred = model(inputs["input"])
            loss = spec.build_loss_fn(config)(pred, labels) / labels.numel()
        print(f"titan: step-1 loss {loss.item():.9g} on {init_hf}")
    print("DRY RUN OK")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-config", required=True, help="the Llama shape: a config.json")
    p.add_argument("--seed", type=int, default=0, help="the trainer's --seed (the tokens)")
    p.add_argument("--log-json", help="one JSON object per step")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--init-hf", metavar="DIR",
                   help="start from DIR's weights (a checkpoint --write-hf wrote)")
    p.add_argument("--write-hf", metavar="DIR",
                   help="write TorchTitan's initialisation for --seed to DIR, then exit")
    p.add_argument("titan_args", nargs="*", help="after --: torchtitan.train's arguments")
    args = p.parse_args()
    for flag in ("--model.name", "--model.flavor"):
        if any(a == flag or a.startswith(flag + "=") for a in args.titan_args):
            fail(f"{flag}: set by titan_peer.py ({MODEL_NAME} / {FLAVOR}); expected it absent")
    titan_args = args.titan_args + ["--model.name", MODEL_NAME, "--model.flavor", FLAVOR]
    if not any(a.startswith("--metrics.log_freq") for a in titan_args):
        titan_args += ["--metrics.log_freq", "1"]

    install_stand_ins()
    if args.write_hf:
        write_hf(args.hf_config, args.seed, args.write_hf)
        return
    spec = register(args.hf_config, args.seed)
    if args.dry_run:
        dry_run(titan_args, args.init_hf)
        return
    if args.init_hf:
        start_from_hf(args.init_hf, spec.model_args[FLAVOR])
    if not args.log_json:
        fail("--log-json: expected a path (where the per-step figures go)")
    log_steps_to(args.log_json)
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torchtitan.train
    from torchtitan.config import ConfigManager

    # parse_args's default (sys.argv[1:]) was bound when its module loaded.
    parse_args = ConfigManager.parse_args
    ConfigManager.parse_args = lambda self, args=None: parse_args(self, titan_args)
    sys.argv = ["torchtitan.train"] + titan_args
    torchtitan.train.main(torchtitan.train.Trainer)


if __name__ == "__main__":
    main()
