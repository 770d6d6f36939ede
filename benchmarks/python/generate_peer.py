"""transformers' generate beside //tools:generate (benchmarks/run_generation_cpu.sh).

  generate_peer.py --make-checkpoint DIR --hidden 512 --layers 4 --vocab 4096
      a random float32 LlamaForCausalLM (seeded), saved with save_pretrained.
  generate_peer.py --hf-checkpoint DIR --prompt-ids '[1, 2, ...]' --max-new-tokens 512
      greedy generate(do_sample=False) with the cache, every new token kept
      (no EOS stop); one JSON line: the new ids, tokens/s and the per-token
      time at several depths (a streamer's callback timestamps each token).
  generate_peer.py --read-bandwidth
      this machine's single-thread memory read bandwidth: ATen's vectorised
      sum over 256 MiB (8x the L3), best of 5, in GB/s; the floor of a decode
      step that reads every weight once.
"""
import argparse
import json
import time

import torch


def make_checkpoint(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate or 4 * args.hidden, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(args.make_checkpoint)
    print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))


def read_bandwidth():
    torch.set_num_threads(1)
    x = torch.ones(64 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    print(json.dumps({"read_gb_per_s": x.numel() * 4 / best / 1e9}))


class Stamps:
    """A streamer: generate() calls put() with the prompt, then each token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def generate(args):
    from transformers import LlamaForCausalLM
    torch.set_num_threads(args.threads)
    model = LlamaForCausalLM.from_pretrained(args.hf_checkpoint, dtype=torch.float32,
                                             attn_implementation="sdpa").eval()
    ids = torch.tensor([json.loads(args.prompt_ids)])
    kwargs = dict(do_sample=False, max_new_tokens=args.max_new_tokens,
                  min_new_tokens=args.max_new_tokens, use_cache=True, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **dict(kwargs, max_new_tokens=8, min_new_tokens=8))  # warm-up
        stamps = Stamps()
        start = time.perf_counter()
        out = model.generate(ids, streamer=stamps, **kwargs)
        seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    # stamps.times[0]: the prompt handed over; [i]: new token i - 1 chosen.
    steps = [b - a for a, b in zip(stamps.times, stamps.times[1:])]
    depth = {}
    for start_token in (16, 64, 128, 256, 496):
        window = steps[start_token:start_token + 16]
        if len(window) == 16:
            depth[str(start_token)] = 1e3 * sum(window) / 16
    print(json.dumps({"ids": new, "seconds": seconds, "tokens_per_s": len(new) / seconds,
                      "ms_per_token_at": depth}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--make-checkpoint")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=0)
    p.add_argument("--hf-checkpoint")
    p.add_argument("--prompt-ids")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--read-bandwidth", action="store_true")
    args = p.parse_args()
    if args.make_checkpoint:
        make_checkpoint(args)
    elif args.read_bandwidth:
        read_bandwidth()
    else:
        generate(args)


if __name__ == "__main__":
    main()
