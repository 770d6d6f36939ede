#!/bin/bash
# //tools:tokenize against Python's tokenizers (the pinned version): a prompt's
# ids as JSON, and two licence texts plus a JSON Lines file made into a token
# file whose header and ids (each document's, then <|end_of_text|>) are what
# tokenizers gives; an unknown --eos-token and a JSONL line without the field
# are refused naming them. Then the same with a SentencePiece tokenizer.model
# against Python's sentencepiece: a prompt's ids and pieces (its BOS first), a
# token file of two licence texts (<s> ids </s> each), and a file that is
# neither format refused naming it.
# Usage (Bazel): tokenize_test.sh TOKENIZE PYTHON TOKENIZER_JSON TOKENIZER_MODEL
set -euo pipefail
tokenize=$1 python=$2 tokenizer=$3 model=$4
tmp=${TEST_TMPDIR:-$(mktemp -d)}
printf '{"text": "first document"}\n{"text": "second, with digits 12345"}\n' > "$tmp/docs.jsonl"
"$tokenize" --tokenizer "$tokenizer" --text "Hello, world 12345" > "$tmp/prompt.json"
"$tokenize" --tokenizer "$tokenizer" --out "$tmp/files.bin" /usr/share/common-licenses/Apache-2.0 \
  /usr/share/common-licenses/BSD > /dev/null
"$tokenize" --tokenizer "$tokenizer" --out "$tmp/jsonl.bin" --jsonl-field text "$tmp/docs.jsonl" > /dev/null
if "$tokenize" --tokenizer "$tokenizer" --out "$tmp/x.bin" --eos-token "<nope>" "$tmp/docs.jsonl" 2> "$tmp/err1"; then
  echo "FAIL: an unknown --eos-token was accepted"; exit 1
fi
grep -q "<nope>" "$tmp/err1" || { echo "FAIL: the error does not name the token"; cat "$tmp/err1"; exit 1; }
if "$tokenize" --tokenizer "$tokenizer" --out "$tmp/x.bin" --jsonl-field body "$tmp/docs.jsonl" 2> "$tmp/err2"; then
  echo "FAIL: a JSONL line without the field was accepted"; exit 1
fi
grep -q "docs.jsonl:1" "$tmp/err2" || { echo "FAIL: the error does not name the line"; cat "$tmp/err2"; exit 1; }
"$python" - "$tokenizer" "$tmp" <<'PY'
import json, os, sys
import numpy as np
import tokenizers
tok = tokenizers.Tokenizer.from_file(sys.argv[1])
tmp = sys.argv[2]
eos = tok.token_to_id("<|end_of_text|>")
prompt = json.load(open(os.path.join(tmp, "prompt.json")))
assert prompt["ids"] == tok.encode("Hello, world 12345").ids, prompt
def read(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520 and header[1] == 1, header[:3]
    ids = np.fromfile(path, dtype=np.uint16, offset=1024)
    assert len(ids) == header[2]
    return ids.tolist()
files = ["Apache-2.0", "BSD"]
expected = []
for f in files:
    expected += tok.encode(open("/usr/share/common-licenses/" + f, encoding="utf-8").read()).ids + [eos]
assert read(os.path.join(tmp, "files.bin")) == expected, "files.bin differs from tokenizers"
expected = []
for text in ("first document", "second, with digits 12345"):
    expected += tok.encode(text).ids + [eos]
assert read(os.path.join(tmp, "jsonl.bin")) == expected, "jsonl.bin differs from tokenizers"
print("PASS: ids equal to tokenizers", tokenizers.__version__)
PY

"$tokenize" --tokenizer "$model" --text "Hello, world 12345 ☃" > "$tmp/sp_prompt.json"
"$tokenize" --tokenizer "$model" --out "$tmp/sp_files.bin" /usr/share/common-licenses/Apache-2.0 \
  /usr/share/common-licenses/BSD > "$tmp/sp_out.txt"
grep -q "(</s> after each)" "$tmp/sp_out.txt" || { echo "FAIL: not </s> after each document"; cat "$tmp/sp_out.txt"; exit 1; }
printf 'not a tokenizer\n' > "$tmp/notes.txt"
if "$tokenize" --tokenizer "$tmp/notes.txt" --text "x" 2> "$tmp/err3"; then
  echo "FAIL: a text file was accepted as a tokenizer"; exit 1
fi
grep -q "notes.txt: neither a tokenizer.json" "$tmp/err3" || { echo "FAIL: the error does not name the file"; cat "$tmp/err3"; exit 1; }
"$python" - "$model" "$tmp" <<'PY'
import json, os, sys
import numpy as np
import sentencepiece as spm
sp = spm.SentencePieceProcessor(model_file=sys.argv[1])
tmp = sys.argv[2]
prompt = json.load(open(os.path.join(tmp, "sp_prompt.json")))
want = [sp.bos_id()] + sp.encode("Hello, world 12345 ☃")
assert prompt["ids"] == want, (prompt, want)
assert prompt["tokens"] == [sp.id_to_piece(i) for i in want], prompt
header = np.fromfile(os.path.join(tmp, "sp_files.bin"), dtype=np.int32, count=256)
assert header[0] == 20240520 and header[1] == 1, header[:3]
ids = np.fromfile(os.path.join(tmp, "sp_files.bin"), dtype=np.uint16, offset=1024).tolist()
expected = []
for f in ["Apache-2.0", "BSD"]:
    text = open("/usr/share/common-licenses/" + f, encoding="utf-8").read()
    expected += [sp.bos_id()] + sp.encode(text) + [sp.eos_id()]
assert ids == expected, "sp_files.bin differs from sentencepiece"
print("PASS: ids equal to sentencepiece", spm.__version__)
PY
