"""Golden values for our C++ Llama-family implementation: small random Hugging
Face checkpoints written by `transformers`, and what `transformers` computes
with them.

Run from the repo root with the venv's Python (torch 2.15, transformers 5.24):

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \
        tools/golden/llama_golden.py

It rewrites models/testdata/<case>/ for every case below (deterministic:
fixed seeds, float32 on the CPU, attn_implementation="sdpa", model.eval()).
Each directory holds the checkpoint exactly as `save_pretrained` writes it
(config.json, model.safetensors or model-0000i-of-0000n.safetensors plus
model.safetensors.index.json; generation_config.json is deleted, nothing needs
it) and golden.pt, a flat {str: Tensor} dict (torch.save; C++ reads it with
torch::pickle_load).

Cases (all 2 layers, SiLU MLP, rms_norm_eps 1e-6, no pad token, bos/eos None):

  llama3_gqa       LlamaForCausalLM, vocab 128, hidden 64, 4 heads / 2 kv heads,
                   head_dim 16, intermediate 96, rope_theta 500000, rope_type
                   llama3 (factor 8, low_freq_factor 1, high_freq_factor 4,
                   original_max_position_embeddings 64, so the wavelength bands
                   are [16, 64]: inv_freq[0] (wavelen 6.3) is below the band and
                   unchanged, inv_freq[1] (wavelen 32.4) lies inside and is
                   smoothed, inv_freq[2..7] are above and divided by 8; the
                   script asserts this), untied. Saved sharded (3 files + index
                   with "metadata": {"total_size", ...}); config.json in
                   transformers 5.x spelling ("rope_parameters", "dtype").
  llama3_gqa_bf16  the llama3_gqa weights saved in bfloat16, single file,
                   "dtype": "bfloat16".
  llama_tied       LlamaForCausalLM, vocab 96, hidden 32, 4 heads (no GQA),
                   head_dim 8, intermediate 64, default RoPE theta 10000,
                   attention_bias and mlp_bias True, tie_word_embeddings True
                   (the file holds only model.embed_tokens.weight). Its
                   config.json is REWRITTEN in the transformers 4.x spelling:
                   top-level "rope_theta", "rope_scaling": null, "torch_dtype":
                   "float32", "transformers_version": "4.57.1", no
                   "rope_parameters" and no "dtype" (from_pretrained of the
                   rewritten directory is checked to give the same logits).
  qwen3            Qwen3ForCausalLM, vocab 112, hidden 32, 4 heads / 2 kv heads,
                   head_dim 16 (!= 32 / 4), intermediate 80, theta 1e6, per-head
                   q_norm / k_norm, tied, use_sliding_window False
                   ("sliding_window": null).
  qwen2            Qwen2ForCausalLM, vocab 120, hidden 48, 4 heads / 2 kv heads,
                   head_dim 12 (not in config.json: hidden / heads), intermediate
                   96, theta 1e6, q/k/v biases (o_proj
                   none), untied, "sliding_window": null.
  mistral          MistralForCausalLM, vocab 100, hidden 48, 6 heads / 2 kv
                   heads, head_dim 8, intermediate 80, theta 50000,
                   "sliding_window": null, untied.

Weights: after construction everything is re-initialised (torch.manual_seed per
case) so that attention is far from uniform: q_proj/k_proj N(0, s^2) with s =
0.28 (hidden 64), 0.4 (hidden 32), 0.32 (hidden 48), i.e. attention scores of
std ~4-5; other linear weights N(0, 1/fan_in); untied embeddings N(0, 1), tied
ones N(0, 0.3^2) (they are also the lm_head); RMSNorm weights 1 + 0.3 N(0,1);
biases N(0, 0.1^2). qwen3's per-head q_norm/k_norm undo the projection scale, so
its q_norm/k_norm weights are 2 + 0.3 N(0,1) instead (with 1 + 0.3 N(0,1) its
attention peak is only 0.43). The script prints each case's attention peak, the
mean over layers/heads/queries of the largest attention probability (eager copy):
0.78-0.82 here, where uniform causal attention over 16 tokens gives 0.21.
Losses: llama3_gqa 5.58, llama_tied 6.27, qwen3 6.21, qwen2 5.61, mistral 5.15.

golden.pt keys (every case but llama3_gqa_bf16):

  batch              int64 [2, 17] random tokens (seeded). Our convention:
                     input = batch[:, :-1], targets = batch[:, 1:].
  logits             float32 [2, 16, vocab]: model(input_ids=batch[:, :-1]).logits
  loss               float32 0-d: F.cross_entropy(logits.flatten(0, 1),
                     batch[:, 1:].flatten()) (mean); asserted equal, to 1e-6, to
                     transformers' own shifted model(input_ids=batch,
                     labels=batch).loss.
  hidden.<i>         float32 [2, 16, hidden], i = 0..num_layers (0..2), from
                     output_hidden_states=True: hidden.0 is the token
                     embeddings (input of layer 0), hidden.<i> for 0 < i <
                     num_layers is the output of decoder layer i-1 (residual
                     stream), and hidden.<num_layers> is the output of the LAST
                     layer AFTER the final model.norm (i.e. last_hidden_state,
                     the lm_head input), not the raw layer output. The script
                     asserts this with a hook.
  inv_freq           float32 [head_dim / 2]: model.model.rotary_emb.inv_freq
                     (llama3-scaled for llama3_gqa).
  cos, sin           float32 [1, 16, head_dim]: rotary_emb(x, position_ids=
                     arange(16)[None]), i.e. cat(freqs, freqs) layout
                     (rotate_half pairing: dim j pairs with j + head_dim/2).
  grad.<name>        the gradient of every parameter (HF names from
                     named_parameters(), e.g. model.layers.0.self_attn.q_proj.weight,
                     lm_head.weight) after loss.backward() of `loss` above. Tied
                     models have no lm_head.weight entry: grad.model.embed_tokens.weight
                     includes both the embedding and the lm_head use.
  after_adamw.<name> every parameter after one torch.optim.AdamW(lr=1e-2,
                     betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                     foreach=False) step on those gradients.
  generate.prompt_a  int64 [1, 5] random prompt;
  generate.greedy_a  int64 [1, 13]: model.generate(prompt_a, max_new_tokens=8,
                     do_sample=False) with an explicit GenerationConfig
                     (eos_token_id None so exactly 8 new tokens come, no
                     repetition penalty, pad_token_id 0, use_cache True).
  generate.prompt_b  int64 [1, 9]; generate.greedy_b int64 [1, 17]: likewise.

llama3_gqa_bf16/golden.pt holds only:

  params.<name>      the bfloat16 values of the file converted to float32 (what a
                     float32 model loading the file must hold; checked against
                     from_pretrained(dtype=torch.float32)).
  logits             float32 [2, 16, 128] of that float32 model on
                     llama3_gqa's batch[:, :-1] (the input is not repeated here).

Sensitivity (asserted > 1e-2, llama3_gqa): each of these mutations of
transformers, applied by monkeypatching on a copy of the model, changes the logits
by far more than 1e-4 (measured max-abs logit change; logits are up to 3.75):
  (a) interleaved RoPE pairing (2i, 2i+1) instead of rotate_half     3.99
  (b) kv heads tiled (repeat: kv 0,1,0,1) instead of repeat_kv
      (repeat_interleave: kv 0,0,1,1), with SDPA's enable_gqa off     4.22
  (c) gate_proj and up_proj swapped in the MLP                       2.41
  (d) llama3 scaling without the smoothing band:
        medium frequency left unscaled                              2.28
        medium frequency fully scaled (divided by factor)           1.77
The bfloat16 rounding of the weights (llama3_gqa_bf16) moves the logits by 0.059.

Tolerance (measured by this script, torch 2.15 on a 2-core x86 CPU; max abs):
  float32 forward, torch.set_num_threads(1) vs the default (2): logits differ by
      exactly 0 in every case (at these sizes).
  float32 vs float64 (same weights; the float64 copy also runs RMSNorm and the
  rotary cos/sin in float64, which transformers would otherwise do in float32):
                 logits   grads    loss     (|logits| max, |grads| max)
    llama3_gqa   8.5e-6   3.8e-7   8.9e-8   (3.75, 0.25)
    llama_tied   1.3e-5   5.4e-6   3.4e-7   (7.19, 0.95)
    qwen3        9.2e-6   5.4e-6   7.9e-7   (8.29, 1.54)
    qwen2        4.5e-6   5.8e-7   4.9e-7   (4.34, 0.19)
    mistral      4.7e-6   1.5e-6   2.7e-7   (3.72, 0.37)
  So a correct float32 implementation should match to ~1e-5: atol 1e-4 on
  logits/hidden states and 5e-5 on gradients (or rtol 1e-4 with a small atol)
  leave a ~10x margin and are still 4 orders of magnitude below the mutations.
  Caveat for after_adamw: AdamW's first step moves each entry by
  lr * g / (|g| + eps), i.e. ~lr * sign(g), so entries whose gradient is within
  float32 noise of 0 (0 < |g| < 1e-5: 15-85 entries per case) can move by up to
  2 * lr = 2e-2 with a gradient that is correct to 1e-6. Compare after_adamw by
  stepping on the golden grad.* (then only float32 rounding remains), or exclude those
  entries. (Exact zero gradients, e.g. embedding rows of unused tokens, give just
  the weight decay.)
"""
import contextlib
import copy
import json
import math
import os
import shutil
from unittest import mock

import torch
import torch.nn.functional as F
import transformers
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)
from transformers.integrations import sdpa_attention
from transformers.models.llama import modeling_llama
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.normpath(os.path.join(HERE, "..", "..", "models", "testdata"))
SEQ = 16  # input length; the batch rows are SEQ + 1 long
SHARD_SIZE = "120KB"  # llama3_gqa's float32 weights (~310 KB) in 3 files
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
COMMON = dict(num_hidden_layers=2, hidden_act="silu", rms_norm_eps=1e-6, pad_token_id=None,
              bos_token_id=None, eos_token_id=None, max_position_embeddings=256,
              attention_dropout=0.0)

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)

# name -> (model class, config, seed, q/k projection std, embedding std, q/k norm mean)
CASES = {
    "llama3_gqa": (LlamaForCausalLM, LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_parameters=dict(LLAMA3_ROPE),
        tie_word_embeddings=False, **COMMON), 1001, 0.28, 1.0, None),
    "llama_tied": (LlamaForCausalLM, LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        attention_bias=True, mlp_bias=True, tie_word_embeddings=True, **COMMON),
        1003, 0.4, 0.3, None),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(
        vocab_size=112, hidden_size=32, intermediate_size=80, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_parameters=dict(rope_type="default",
                                                                 rope_theta=1000000.0),
        use_sliding_window=False, tie_word_embeddings=True, **COMMON), 1004, None, 0.3, 2.0),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(
        vocab_size=120, hidden_size=48, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        use_sliding_window=False, tie_word_embeddings=False, **COMMON), 1005, 0.32, 1.0, None),
    "mistral": (MistralForCausalLM, MistralConfig(
        vocab_size=100, hidden_size=48, intermediate_size=80, num_attention_heads=6,
        num_key_value_heads=2, rope_parameters=dict(rope_type="default", rope_theta=50000.0),
        sliding_window=None, tie_word_embeddings=False, **COMMON), 1006, 0.32, 1.0, None),
}


def build(cls, config, seed, qk_std, emb_std, qk_norm_mean):
    """The model with our re-initialisation (see the docstring)."""
    config = copy.deepcopy(config)
    model = cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 2)
            if name.endswith("embed_tokens.weight"):
                p.normal_(0.0, emb_std)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(qk_norm_mean + 0.3 * torch.randn_like(p))
            elif "norm" in leaf[-2]:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith(("q_proj.weight", "k_proj.weight")) and qk_norm_mean is None:
                p.normal_(0.0, qk_std)
            else:
                assert p.dim() == 2, name
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    model.eval()
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def generation_config():
    return GenerationConfig(do_sample=False, max_new_tokens=8, min_new_tokens=8, num_beams=1,
                            eos_token_id=None, bos_token_id=None, pad_token_id=0,
                            repetition_penalty=1.0, no_repeat_ngram_size=0, temperature=None,
                            top_k=None, top_p=None, use_cache=True)


def logits_of(model, batch):
    with torch.no_grad():
        return model(input_ids=batch[:, :-1]).logits


def attention_peak(model, batch):
    """Mean over layers/heads/queries of the largest attention probability."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        out = eager(input_ids=batch[:, :-1], output_attentions=True)
    return torch.stack([a.amax(-1).mean() for a in out.attentions]).mean().item()


def golden(model, batch, gen):
    """The golden dict of one case (model is left with its gradients)."""
    cfg = model.config
    out = {"batch": batch}
    inp, tgt = batch[:, :-1], batch[:, 1:]

    # The last hidden state is the final layer's output after model.norm: check.
    last_layer = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, args, o: last_layer.__setitem__("out", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        hs = model(input_ids=inp, output_hidden_states=True).hidden_states
    hook.remove()
    assert len(hs) == cfg.num_hidden_layers + 1
    with torch.no_grad():
        assert torch.equal(hs[-1], model.model.norm(last_layer["out"]))
    for i, h in enumerate(hs):
        out[f"hidden.{i}"] = h.detach().clone()

    rot = model.model.rotary_emb
    out["inv_freq"] = rot.inv_freq.detach().clone()
    x = torch.zeros(1, SEQ, cfg.hidden_size)
    cos, sin = rot(x, position_ids=torch.arange(SEQ)[None])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert cos.shape == (1, SEQ, head_dim) and cos.dtype == torch.float32
    out["cos"], out["sin"] = cos.detach().clone(), sin.detach().clone()

    with torch.no_grad():
        hf_loss = model(input_ids=batch, labels=batch).loss
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=inp).logits
    loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
    assert abs(loss.item() - hf_loss.item()) <= 1e-6, (loss.item(), hf_loss.item())
    out["logits"] = logits.detach().clone()
    out["loss"] = loss.detach().clone()
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in names
    for name, p in model.named_parameters():
        out[f"grad.{name}"] = p.grad.detach().clone()

    for k, prompt in gen.items():
        with torch.no_grad():
            seq = model.generate(prompt, generation_config=generation_config())
        assert seq.shape == (1, prompt.shape[1] + 8), seq.shape
        assert torch.equal(seq[:, :prompt.shape[1]], prompt)
        out[f"generate.prompt_{k}"] = prompt
        out[f"generate.greedy_{k}"] = seq.clone()

    stepped = copy.deepcopy(model)
    # deepcopy does not carry .grad (Parameter.__deepcopy__ copies the data
    # alone): the step's gradients are set from the recorded ones.
    for name, p in stepped.named_parameters():
        p.grad = out[f"grad.{name}"].clone()
    opt = torch.optim.AdamW(stepped.parameters(), **ADAMW)
    opt.step()
    for name, p in stepped.named_parameters():
        out[f"after_adamw.{name}"] = p.detach().clone()
    return out


def to_float64(model):
    """A float64 copy computing everything in float64. transformers' RMSNorm and rotary
    embedding compute in float32 even in a .double() model: their forwards are replaced
    (inv_freq stays the float32 buffer the golden holds, widened)."""
    m64 = copy.deepcopy(model).double()
    for mod in m64.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm"):
            def norm(x, mod=mod):
                return mod.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                     + mod.variance_epsilon))
            mod.forward = norm
        elif name.endswith("RotaryEmbedding"):
            def rope(x, position_ids, mod=mod):
                freqs = position_ids[..., None].double() * mod.inv_freq.double()
                emb = torch.cat((freqs, freqs), dim=-1)
                return emb.cos() * mod.attention_scaling, emb.sin() * mod.attention_scaling
            mod.forward = rope
    return m64


def tolerance(model, batch):
    """Thread-count and float32-vs-float64 differences (printed)."""
    inp, tgt = batch[:, :-1], batch[:, 1:]
    n = torch.get_num_threads()
    ref = logits_of(model, batch)
    torch.set_num_threads(1)
    try:
        one = logits_of(model, batch)
    finally:
        torch.set_num_threads(n)
    m64 = to_float64(model)
    m64.zero_grad(set_to_none=True)
    l64 = m64(input_ids=inp).logits
    loss64 = F.cross_entropy(l64.flatten(0, 1), tgt.flatten())
    loss64.backward()
    m32 = copy.deepcopy(model)
    m32.zero_grad(set_to_none=True)
    l32 = m32(input_ids=inp).logits
    loss32 = F.cross_entropy(l32.flatten(0, 1), tgt.flatten())
    loss32.backward()
    g = max((p32.grad.double() - p64.grad).abs().max().item()
            for p32, p64 in zip(m32.parameters(), m64.parameters()))
    gmax = max(p.grad.abs().max().item() for p in m32.parameters())
    res = dict(threads=(one - ref).abs().max().item(),
               logits64=(l32.detach().double() - l64.detach()).abs().max().item(),
               grads64=g, loss64=abs(loss32.item() - loss64.item()),
               max_logit=ref.abs().max().item(), max_grad=gmax)
    print(f"  tolerance: 1 vs {n} threads logits {res['threads']:.2g}; f32 vs f64: logits "
          f"{res['logits64']:.2g}, grads {res['grads64']:.2g}, loss {res['loss64']:.2g} "
          f"(|logits| <= {res['max_logit']:.3g}, |grads| <= {res['max_grad']:.3g})")
    return res


# ---------------------------------------------------------------- mutations (llama3_gqa)

def _interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    """RoPE rotating pairs (2i, 2i+1) by inv_freq[i]: the GPT-J / Meta layout."""
    half = cos.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    sin = sin[..., :half].repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)

    def rot(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _tiled_repeat_kv(h, n_rep):
    return h if n_rep == 1 else h.repeat(1, n_rep, 1, 1)  # kv heads 0,1,0,1 instead of 0,0,1,1


def _swapped_mlp(self, x):
    return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


def _llama3_unsmoothed(medium):
    """llama3 inv_freq where the medium band is 'unscaled' or 'scaled' instead of smoothed."""
    def fn(config, device=None, seq_len=None, layer_type=None):
        p = config.rope_parameters
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                         .float() / head_dim))
        wavelen = 2 * math.pi / inv
        low = p["original_max_position_embeddings"] / p["low_freq_factor"]
        high = p["original_max_position_embeddings"] / p["high_freq_factor"]
        threshold = high if medium == "scaled" else low
        return torch.where(wavelen > threshold, inv / p["factor"], inv), 1.0
    return fn


def sensitivity(model, batch):
    ref = logits_of(model, batch)
    changes = {}

    def run(name, patches, fresh=False):
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            m = copy.deepcopy(model)
            if fresh:  # rebuild so the rotary embedding is recomputed under the patch
                m = type(model)._from_config(model.config, attn_implementation="sdpa",
                                             dtype=torch.float32)
                m.load_state_dict(model.state_dict())
                m.eval()
            changes[name] = (logits_of(m, batch) - ref).abs().max().item()

    run("a_interleaved_rope", [mock.patch.object(modeling_llama, "apply_rotary_pos_emb",
                                                 _interleaved_rope)])
    run("b_kv_heads_tiled", [mock.patch.object(sdpa_attention, "use_gqa_in_sdpa",
                                               lambda *a, **k: False),
                             mock.patch.object(sdpa_attention, "repeat_kv", _tiled_repeat_kv),
                             mock.patch.object(modeling_llama, "repeat_kv", _tiled_repeat_kv)])
    run("c_gate_up_swapped", [mock.patch.object(modeling_llama.LlamaMLP, "forward",
                                                _swapped_mlp)])
    for medium in ("unscaled", "scaled"):
        run(f"d_llama3_medium_{medium}",
            [mock.patch.dict(ROPE_INIT_FUNCTIONS, {"llama3": _llama3_unsmoothed(medium)})],
            fresh=True)
    # Control for (b): SDPA without enable_gqa but with the right repeat_kv agrees.
    run("control_repeat_kv", [mock.patch.object(sdpa_attention, "use_gqa_in_sdpa",
                                                lambda *a, **k: False)])
    assert changes.pop("control_repeat_kv") < 1e-5
    # Sanity: the patches are undone and the unmutated copy reproduces the logits exactly.
    assert torch.equal(logits_of(copy.deepcopy(model), batch), ref)
    for name, d in changes.items():
        print(f"  mutation {name}: max |d logits| = {d:.4g}")
        assert d > 1e-2, (name, d)
    return changes


def check_llama3_bands(model):
    p = model.config.rope_parameters
    hd = model.config.head_dim
    base = 1.0 / (p["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    wavelen = 2 * math.pi / base
    low = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high = p["original_max_position_embeddings"] / p["high_freq_factor"]
    inv = model.model.rotary_emb.inv_freq
    below, above = wavelen < high, wavelen > low
    inside = ~below & ~above
    assert below.any() and above.any() and inside.any(), wavelen
    assert torch.equal(inv[below], base[below])
    assert torch.allclose(inv[above], base[above] / p["factor"])
    scaled_in = inv[inside]
    assert ((scaled_in < base[inside]) & (scaled_in > base[inside] / p["factor"])).all()
    print(f"  llama3 bands [{high:g}, {low:g}]: wavelen {[round(w, 1) for w in wavelen.tolist()]};"
          f" below {below.sum().item()}, inside {inside.sum().item()}, above "
          f"{above.sum().item()}")


# ---------------------------------------------------------------- saving

def fresh_dir(case):
    d = os.path.join(OUT, case)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    return d


def save(model, d, **kwargs):
    model.save_pretrained(d, **kwargs)
    gc = os.path.join(d, "generation_config.json")
    if os.path.exists(gc):
        os.remove(gc)


def reload_logits(cls, d, batch, **kwargs):
    m = cls.from_pretrained(d, attn_implementation="sdpa", **kwargs)
    m.eval()
    return m, logits_of(m, batch)


def make_batch(config, seed):
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, config.vocab_size, (2, SEQ + 1), generator=g)
    gen = {"a": torch.randint(0, config.vocab_size, (1, 5), generator=g),
           "b": torch.randint(0, config.vocab_size, (1, 9), generator=g)}
    return batch, gen


def to_4x_spelling(d):
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters")
    assert rope["rope_type"] == "default", rope
    cfg.pop("dtype")
    new = {}
    for k, v in cfg.items():
        new[k] = v
        if k == "num_key_value_heads":  # keep a plausible key order
            new["rope_theta"] = rope["rope_theta"]
            new["rope_scaling"] = None
    new["torch_dtype"] = "float32"
    new["transformers_version"] = "4.57.1"
    with open(path, "w") as f:
        json.dump(new, f, indent=2, sort_keys=True)
        f.write("\n")


def main():
    torch.use_deterministic_algorithms(True)
    os.makedirs(OUT, exist_ok=True)
    summary = {}
    for case, (cls, config, seed, qk_std, emb_std, qk_norm) in CASES.items():
        print(f"{case}: {cls.__name__}")
        model = build(cls, config, seed, qk_std, emb_std, qk_norm)
        batch, gen = make_batch(model.config, seed + 1)
        ref = logits_of(model, batch)
        print(f"  attention peak {attention_peak(model, batch):.3f}")
        if case == "llama3_gqa":
            check_llama3_bands(model)
        d = fresh_dir(case)
        if case == "llama3_gqa":
            save(model, d, max_shard_size=SHARD_SIZE)
            with open(os.path.join(d, "model.safetensors.index.json")) as f:
                index = json.load(f)
            assert "total_size" in index["metadata"], index.keys()
            files = sorted(set(index["weight_map"].values()))
            assert len(files) >= 2 and all(os.path.exists(os.path.join(d, f)) for f in files)
            assert set(index["weight_map"]) == set(model.state_dict()), index["weight_map"]
            print(f"  sharded into {files}")
        else:
            save(model, d)
            assert os.path.exists(os.path.join(d, "model.safetensors"))
        if case == "llama_tied":
            to_4x_spelling(d)
        reloaded, got = reload_logits(cls, d, batch)
        assert torch.equal(got, ref), (got - ref).abs().max()
        assert type(reloaded.config) is type(model.config)
        if case == "llama_tied":
            assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
            assert reloaded.config.rope_parameters["rope_theta"] == 10000.0

        out = golden(model, batch, gen)
        assert torch.equal(out["logits"], ref)
        summary[case] = dict(loss=out["loss"].item(), tol=tolerance(model, batch))
        print(f"  loss {out['loss'].item():.4f}; greedy_a {out['generate.greedy_a'].tolist()}")
        torch.save(out, os.path.join(d, "golden.pt"))

        if case == "llama3_gqa":
            summary["mutations"] = sensitivity(model, batch)
            # llama3_gqa_bf16: the same weights in bfloat16, single file.
            d16 = fresh_dir("llama3_gqa_bf16")
            save(copy.deepcopy(model).to(torch.bfloat16), d16)
            with open(os.path.join(d16, "config.json")) as f:
                assert json.load(f)["dtype"] == "bfloat16"
            m32, logits32 = reload_logits(cls, d16, batch, dtype=torch.float32)
            out16 = {}
            for name, p in model.named_parameters():
                rounded = p.detach().to(torch.bfloat16).float()
                assert torch.equal(dict(m32.named_parameters())[name], rounded), name
                out16[f"params.{name}"] = rounded
            assert torch.equal(m32.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
            out16["logits"] = logits32
            print(f"  llama3_gqa_bf16: max |logits(bf16 weights) - logits| = "
                  f"{(logits32 - ref).abs().max().item():.3g}")
            torch.save(out16, os.path.join(d16, "golden.pt"))

    total = 0
    for root, _, files in os.walk(OUT):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    print(f"wrote {os.path.relpath(OUT)} ({total / 1024:.0f} KiB; torch {torch.__version__}, "
          f"transformers {transformers.__version__})")
    tol = [s["tol"] for k, s in summary.items() if k != "mutations"]
    print("max over cases: threads {:.2g}, f32-vs-f64 logits {:.2g}, grads {:.2g}".format(
        max(t["threads"] for t in tol), max(t["logits64"] for t in tol),
        max(t["grads64"] for t in tol)))


if __name__ == "__main__":
    main()
