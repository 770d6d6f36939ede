#!/bin/bash
# //tools:generate against transformers (the pinned version):
#  - the golden checkpoints' greedy generate() (models/testdata, 8 new
#    tokens) as one batch of two prompts of different lengths, with the cache
#    and without, --output json and ids;
#  - a small Llama made here with the llama3 test tokenizer's vocabulary:
#    text prompts in, ids and decoded text out, equal to transformers'
#    generate() on tokenizers' ids;
#  - --score: the loss of 600 ids under qwen3 (256 positions: three windows)
#    equal to transformers' on the same windows, and of a text file through
#    the tokenizer under the small Llama;
#  - sampling reproducible from --seed, another seed another result;
#  - the trainer's checkpoints (2 steps on 2 ranks, FULL and sharded) give
#    what the same run's --export-hf gives;
#  - a small Llama with a SentencePiece tokenizer.model's vocabulary (Llama
#    2's kind): text prompts encoded as sentencepiece does with the model's
#    BOS first, greedy ids and the decoded continuation equal to
#    transformers' generate() on those ids and sentencepiece's decode;
#  - refusals naming the flag, file or value.
# Usage (Bazel): generate_test.sh GENERATE PYTHON TOKENIZER_JSON MODELS_TESTDATA TRAINER
#                                 SENTENCEPIECE_MODEL
set -euo pipefail
generate=$1 python=$2 tokenizer=$3 testdata=$4 trainer=$5 spm=$6
tmp=${TEST_TMPDIR:-$(mktemp -d)}

# Expected values from transformers, and the small model.
"$python" - "$testdata" "$tokenizer" "$tmp" "$spm" <<'PY'
import json, sys, torch, transformers, tokenizers
testdata, tok_path, tmp, spm_path = sys.argv[1:]
transformers.utils.logging.set_verbosity_error()
expected = {}
g = torch.load(f"{testdata}/llama3_gqa/golden.pt")
expected["golden"] = {k: {"prompt": g[f"generate.prompt_{k}"][0].tolist(),
                          "new": g[f"generate.greedy_{k}"][0, g[f"generate.prompt_{k}"].shape[1]:].tolist()}
                      for k in "ab"}
tok = tokenizers.Tokenizer.from_file(tok_path)
eos = tok.token_to_id("<|end_of_text|>")
config = transformers.LlamaConfig(
    vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    initializer_range=0.5, eos_token_id=eos, bos_token_id=tok.token_to_id("<|begin_of_text|>"),
    pad_token_id=None, tie_word_embeddings=False)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).eval()
model.save_pretrained(f"{tmp}/tiny")
texts = ["Hello, world", "The licence text says that"]
expected["tiny"] = []
for text in texts:
    ids = tok.encode(text).ids
    with torch.no_grad():
        seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=10, do_sample=False, pad_token_id=eos, eos_token_id=eos)
    new = seq[0, len(ids):].tolist()
    expected["tiny"].append({"prompt": ids, "new": new, "text": tok.decode(new)})
# --score of a text file through the tokenizer (its BOS first).
text = "The licence text says that the software is provided as is, without warranty."
open(f"{tmp}/score.txt", "w").write(text)
ids = tok.encode(text).ids
with torch.no_grad():
    loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
expected["score_text"] = {"ids": ids, "loss": loss}
# --score: 600 ids under qwen3 in windows of 256 sharing one token.
qwen = transformers.AutoModelForCausalLM.from_pretrained(f"{testdata}/qwen3").eval()
ids = torch.randint(0, qwen.config.vocab_size, (600,), generator=torch.Generator().manual_seed(3))
losses = []
start = 0
with torch.no_grad():
    while start < len(ids) - 1:
        chunk = ids[start:start + 256]
        logits = qwen(chunk[None, :-1]).logits[0].float()
        losses += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="none").tolist()
        start += 255
json.dump(ids.tolist(), open(f"{tmp}/score_ids.json", "w"))
# The same ids as an llm.c token file (uint16 ids under the GPT-2 header),
# as //tools:tokenize writes it: scored the same.
import struct
header = struct.pack("<256i", 20240520, 1, len(ids), *([0] * 253))
open(f"{tmp}/score_ids.bin", "wb").write(header + struct.pack(f"<{len(ids)}H", *ids.tolist()))
too_big = [1, 2, qwen.config.vocab_size]
open(f"{tmp}/too_big.bin", "wb").write(struct.pack("<256i", 20240520, 1, 3, *([0] * 253)) +
                                       struct.pack("<3H", *too_big))
# A header that promises 5 ids over 3.
open(f"{tmp}/short.bin", "wb").write(struct.pack("<256i", 20240520, 1, 5, *([0] * 253)) +
                                     struct.pack("<3H", 1, 2, 3))
expected["score"] = {"losses": losses, "loss": sum(losses) / len(losses)}
# A small Llama over the SentencePiece model's vocabulary.
import sentencepiece
sp = sentencepiece.SentencePieceProcessor(model_file=spm_path)
config = transformers.LlamaConfig(
    vocab_size=sp.get_piece_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    initializer_range=0.5, eos_token_id=sp.eos_id(), bos_token_id=sp.bos_id(),
    pad_token_id=None, tie_word_embeddings=False)
torch.manual_seed(1)
model = transformers.LlamaForCausalLM(config).eval()
model.save_pretrained(f"{tmp}/tiny_spm")
expected["spm"] = []
for text in ["Hello, world", "The licence text says that"]:
    ids = [sp.bos_id()] + sp.encode(text)
    with torch.no_grad():
        seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=10, do_sample=False, pad_token_id=sp.eos_id(),
                             eos_token_id=sp.eos_id())
    new = seq[0, len(ids):].tolist()
    expected["spm"].append({"prompt": ids, "new": new, "text": sp.decode(new)})
json.dump(expected, open(f"{tmp}/expected.json", "w"))
PY

ids_of() { "$python" -c "import json,sys; e=json.load(open('$tmp/expected.json')); print(json.dumps([e['golden'][k]['prompt'] for k in 'ab']))"; }
golden_ids=$(ids_of)
"$generate" --hf-checkpoint "$testdata/llama3_gqa" --prompt-ids "$golden_ids" --max-new-tokens 8 \
  --output json > "$tmp/golden_cache.jsonl"
"$generate" --hf-checkpoint "$testdata/llama3_gqa" --prompt-ids "$golden_ids" --max-new-tokens 8 \
  --output ids --no-cache > "$tmp/golden_nocache.txt"
"$generate" --hf-checkpoint "$tmp/tiny" --tokenizer "$tokenizer" --prompt "Hello, world" \
  --prompt "The licence text says that" --max-new-tokens 10 --output json > "$tmp/tiny.jsonl"
"$generate" --hf-checkpoint "$tmp/tiny" --tokenizer "$tokenizer" --prompt "Hello, world" \
  --max-new-tokens 10 > "$tmp/tiny.txt"
"$generate" --hf-checkpoint "$tmp/tiny_spm" --tokenizer "$spm" --prompt "Hello, world" \
  --prompt "The licence text says that" --max-new-tokens 10 --output json > "$tmp/tiny_spm.jsonl"
"$generate" --hf-checkpoint "$testdata/qwen3" --score "$tmp/score_ids.json" > "$tmp/score.json"
"$generate" --hf-checkpoint "$testdata/qwen3" --score "$tmp/score_ids.bin" > "$tmp/score_bin.json"
"$generate" --hf-checkpoint "$tmp/tiny" --tokenizer "$tokenizer" --score "$tmp/score.txt" > "$tmp/score_text.json"
sample() {
  "$generate" --hf-checkpoint "$testdata/llama3_gqa" --prompt-ids "$golden_ids" --max-new-tokens 24 \
    --temperature 1.2 --top-k 40 --top-p 0.9 --seed "$1" --output ids
}
sample 1 > "$tmp/seed1a.txt"
sample 1 > "$tmp/seed1b.txt"
sample 2 > "$tmp/seed2.txt"
# The same prompts from a JSON Lines file (ids, an object with ids), greedy
# spelled three ways; bfloat16 runs (its tokens may differ from float32's).
"$python" -c "import json; e=json.load(open('$tmp/expected.json')); print(json.dumps(e['golden']['a']['prompt'])); print(json.dumps({'ids': e['golden']['b']['prompt']}))" \
  > "$tmp/prompts.jsonl"
"$generate" --hf-checkpoint "$testdata/llama3_gqa" --prompts-file "$tmp/prompts.jsonl" --max-new-tokens 8 \
  --greedy > "$tmp/file_greedy.txt"
"$generate" --hf-checkpoint "$testdata/llama3_gqa" --prompts-file "$tmp/prompts.jsonl" --max-new-tokens 8 \
  --temperature 0 --seed 3 > "$tmp/file_t0.txt"
"$generate" --hf-checkpoint "$testdata/llama3_gqa" --prompts-file "$tmp/prompts.jsonl" --max-new-tokens 8 \
  --temperature 0.5 --top-k 1 > "$tmp/file_k1.txt"
cmp -s "$tmp/file_greedy.txt" "$tmp/golden_nocache.txt" || { echo "FAIL: --prompts-file greedy"; exit 1; }
cmp -s "$tmp/file_t0.txt" "$tmp/golden_nocache.txt" || { echo "FAIL: --temperature 0 is not greedy"; exit 1; }
cmp -s "$tmp/file_k1.txt" "$tmp/golden_nocache.txt" || { echo "FAIL: --top-k 1 is not greedy"; exit 1; }
"$generate" --hf-checkpoint "$testdata/llama3_gqa" --prompts-file "$tmp/prompts.jsonl" --max-new-tokens 8 \
  --dtype bfloat16 --output json > "$tmp/bf16.jsonl"
[ "$(grep -c '"stop":"length"' "$tmp/bf16.jsonl")" = 2 ] || { echo "FAIL: bfloat16"; cat "$tmp/bf16.jsonl"; exit 1; }

cmp -s "$tmp/seed1a.txt" "$tmp/seed1b.txt" || { echo "FAIL: --seed 1 twice differs"; exit 1; }
if cmp -s "$tmp/seed1a.txt" "$tmp/seed2.txt"; then echo "FAIL: --seed 1 and 2 agree"; exit 1; fi

"$python" - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
e = json.load(open(f"{tmp}/expected.json"))
rows = [json.loads(l) for l in open(f"{tmp}/golden_cache.jsonl")]
for row, k in zip(rows, "ab"):
    assert row["prompt_ids"] == e["golden"][k]["prompt"], row
    assert row["ids"] == e["golden"][k]["new"], (k, row["ids"], e["golden"][k]["new"])
    assert row["stop"] == "length", row
nocache = [json.loads(l) for l in open(f"{tmp}/golden_nocache.txt")]
assert nocache == [e["golden"][k]["new"] for k in "ab"], nocache
tiny = [json.loads(l) for l in open(f"{tmp}/tiny.jsonl")]
for row, want in zip(tiny, e["tiny"]):
    assert row["prompt_ids"] == want["prompt"], (row, want)
    assert row["ids"] == want["new"], (row["ids"], want["new"])
    assert row["text"] == want["text"], (row["text"], want["text"])
spm = [json.loads(l) for l in open(f"{tmp}/tiny_spm.jsonl")]
assert len(spm) == 2
for row, want in zip(spm, e["spm"]):
    assert row["prompt_ids"] == want["prompt"], ("tokenizer.model", row, want)
    assert row["ids"] == want["new"], ("tokenizer.model", row["ids"], want["new"])
    assert row["text"] == want["text"], ("tokenizer.model", row["text"], want["text"])
text = open(f"{tmp}/tiny.txt").read()
assert text.startswith("Hello, world") and text.rstrip("\n").endswith(e["tiny"][0]["text"]), text
score = json.load(open(f"{tmp}/score.json"))
assert score["tokens"] == 600 and score["predicted"] == 599, score["predicted"]
assert abs(score["loss"] - e["score"]["loss"]) < 1e-4, (score["loss"], e["score"]["loss"])
worst = max(abs(t["loss"] - w) for t, w in zip(score["per_token"], e["score"]["losses"]))
assert worst < 1e-3, worst
score_bin = json.load(open(f"{tmp}/score_bin.json"))
assert score_bin.pop("file").endswith("score_ids.bin") and score.pop("file").endswith(".json")
assert score_bin == score, "a token file scores as its JSON ids"
st = json.load(open(f"{tmp}/score_text.json"))
assert st["tokens"] == len(e["score_text"]["ids"]), st["tokens"]
assert [t["id"] for t in st["per_token"]] == e["score_text"]["ids"][1:]
assert all("token" in t for t in st["per_token"]), st["per_token"][0]
assert abs(st["loss"] - e["score_text"]["loss"]) < 1e-4, (st["loss"], e["score_text"]["loss"])
print("PASS: greedy ids, text and scores equal to transformers (tokenizer.json and tokenizer.model)")
PY

# Refusals: each names what is wrong.
expect_error() {
  local pattern=$1; shift
  if "$generate" "$@" > "$tmp/out" 2> "$tmp/err"; then
    echo "FAIL: accepted: $*"; exit 1
  fi
  grep -qF -- "$pattern" "$tmp/err" || { echo "FAIL: '$pattern' not in the error of $*:"; cat "$tmp/err"; exit 1; }
}
expect_error "$tmp/nope/config.json" --hf-checkpoint "$tmp/nope" --prompt-ids "[[1]]"
expect_error "id 128 at index 1" --hf-checkpoint "$testdata/llama3_gqa" --prompt-ids "[[1, 2], [1, 128]]"
expect_error "max_position_embeddings 256" --hf-checkpoint "$testdata/llama3_gqa" \
  --prompt-ids "[[1, 2, 3]]" --max-new-tokens 254
expect_error "more than the model's vocab_size 128" --hf-checkpoint "$testdata/llama3_gqa" \
  --tokenizer "$tokenizer" --prompt "Hello"
expect_error "--tokenizer" --hf-checkpoint "$testdata/llama3_gqa" --prompt "Hello"
expect_error "--prompt-ids: not JSON" --hf-checkpoint "$testdata/llama3_gqa" --prompt-ids "[[1,"
expect_error "--greedy and --temperature 1" --hf-checkpoint "$testdata/llama3_gqa" --prompt-ids "[[1]]" \
  --greedy --temperature 1
printf '[1, 2]\n{"tokens": [1]}\n' > "$tmp/bad.jsonl"
expect_error "bad.jsonl:2: expected a string" --hf-checkpoint "$testdata/llama3_gqa" --prompts-file "$tmp/bad.jsonl"
expect_error "needs --model-config" --checkpoint-dir "$tmp" --prompt-ids "[[1]]"
expect_error "neither a step directory" --checkpoint-dir "$tmp" \
  --model-config "$testdata/llama3_gqa/config.json" --prompt-ids "[[1]]"
expect_error "--score $tmp/missing.json: cannot be read" --hf-checkpoint "$testdata/qwen3" \
  --score "$tmp/missing.json"
expect_error "--score $tmp/too_big.bin: id" --hf-checkpoint "$testdata/qwen3" \
  --score "$tmp/too_big.bin"
expect_error "at index 2 is outside the model's vocabulary" --hf-checkpoint "$testdata/qwen3" \
  --score "$tmp/too_big.bin"
expect_error "--score='$tmp/short.bin': llm.c" --hf-checkpoint "$testdata/qwen3" \
  --score "$tmp/short.bin"
echo "PASS: refusals"

echo "$golden_ids" | "$python" -c "import json,sys; print(json.dumps(sum(json.load(sys.stdin), [])))" \
  > "$tmp/golden_ids.json"
"$generate" --hf-checkpoint "$testdata/llama3_gqa" --score "$tmp/golden_ids.json" > "$tmp/score_start.json"
for format in full sharded; do
  "$trainer" --model llama --hf-checkpoint "$testdata/llama3_gqa" --data synthetic --steps 2 --nproc 2 \
    --global-batch 2 --seq 16 --checkpoint-dir "$tmp/run_$format" --checkpoint-format $format \
    --export-hf "$tmp/export_$format" > "$tmp/trainer_$format.log" 2>&1 ||
    { echo "FAIL: the trainer run ($format)"; cat "$tmp/trainer_$format.log"; exit 1; }
  "$generate" --hf-checkpoint "$tmp/export_$format" --prompt-ids "$golden_ids" --max-new-tokens 8 \
    --temperature 1 --seed 5 --output ids > "$tmp/from_export.txt"
  "$generate" --hf-checkpoint "$tmp/export_$format" --score "$tmp/golden_ids.json" >> "$tmp/from_export.txt"
  # The root (its newest step) and the step directory itself.
  for dir in "$tmp/run_$format" "$tmp/run_$format/step_2"; do
    "$generate" --checkpoint-dir "$dir" --model-config "$testdata/llama3_gqa/config.json" \
      --prompt-ids "$golden_ids" --max-new-tokens 8 --temperature 1 --seed 5 --output ids \
      > "$tmp/from_checkpoint.txt"
    "$generate" --checkpoint-dir "$dir" --model-config "$testdata/llama3_gqa/config.json" \
      --score "$tmp/golden_ids.json" >> "$tmp/from_checkpoint.txt"
    cmp -s "$tmp/from_export.txt" "$tmp/from_checkpoint.txt" ||
      { echo "FAIL: --checkpoint-dir $dir differs from the run's --export-hf"; exit 1; }
  done
  # The trained model is not the checkpoint it started from.
  if grep -qF "$(cat "$tmp/score_start.json")" "$tmp/from_export.txt"; then
    echo "FAIL: the trained model scores as the initial one"; exit 1
  fi
done
echo "PASS: trainer checkpoints, FULL and sharded"
