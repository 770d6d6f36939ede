"""Encoding throughput of Python `tokenizers` and tiktoken on the bytes that
//tokenizer:tokenizer_bench encodes, then that binary itself, and the ratios,
in one run.

    bazel build -c opt //tokenizer:tokenizer_bench
    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \
        tokenizer/tokenizer_bench.py [--tokenizer FILE] [--rounds N] \
        [--bench bazel-out/k8-opt/bin/tokenizer/tokenizer_bench]

tiktoken is not one of the project's dependencies: install it into the venv
for this measurement (`venv/bin/python3 -m pip install tiktoken`).

The corpus is built as tokenizer_bench.cc builds it (licence texts, man pages
to 4 MB, C headers to 8 MB; bytes that are not UTF-8 replaced by U+FFFD),
written to a temporary file and passed to the binary with --corpus, so all
three encode the same bytes, cut into the same documents (at the first line
end after every 8 KiB).

  one thread  `tokenizers`: Tokenizer.encode(doc, add_special_tokens=False)
              for each document; tiktoken: Encoding.encode_ordinary(doc);
              ours: Tokenizer::Encode.
  N threads   `tokenizers`: encode_batch (rayon, one thread per core);
              tiktoken: encode_ordinary_batch(num_threads=cores); ours:
              EncodeBatch with as many threads.

tiktoken runs the same tokenizer: an Encoding made from the tokenizer.json
(the vocabulary's bytes ranked by id, which for a BPE trained by `tokenizers`
is merge order; the Split pattern; the added tokens as special tokens). Its
merge rule (the lowest-ranked concatenation) can differ from `tokenizers`'
(the lowest-ranked merge) on a few words; the script prints how many
documents get the same ids. Each figure is the best of --rounds. The binary
also writes its ids of the corpus (--write_ids), and the script says for how
many documents they equal `tokenizers`' ids.
"""

import argparse
import gzip
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

CORES = os.cpu_count() or 1
os.environ.setdefault("RAYON_NUM_THREADS", str(CORES))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import tokenizers  # noqa: E402  (after RAYON_NUM_THREADS)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAN_PAGES_UP_TO = 4 << 20
HEADERS_UP_TO = 8 << 20
DOCUMENT_BYTES = 8 << 10
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def sorted_files(directory, suffix=""):
    names = sorted(n for n in os.listdir(directory) if n.endswith(suffix))
    return [os.path.join(directory, n) for n in names
            if os.path.isfile(os.path.join(directory, n))]


def machine_corpus():
    """The bytes tokenizer_bench.cc's MachineCorpus() builds."""
    corpus = bytearray()

    def add(data):
        corpus.extend(data.decode("utf-8", "replace").encode("utf-8"))

    for p in sorted_files("/usr/share/common-licenses"):
        with open(p, "rb") as f:
            add(f.read())
    for p in sorted_files("/usr/share/man/man1", ".gz"):
        if len(corpus) >= MAN_PAGES_UP_TO:
            break
        with gzip.open(p, "rb") as f:
            add(f.read())
    for p in sorted_files("/usr/include", ".h"):
        if len(corpus) >= HEADERS_UP_TO:
            break
        with open(p, "rb") as f:
            add(f.read())
    return bytes(corpus)


def documents(corpus):
    docs, start = [], 0
    while start < len(corpus):
        end = start + DOCUMENT_BYTES
        if end >= len(corpus):
            end = len(corpus)
        else:
            newline = corpus.find(b"\n", end)
            end = len(corpus) if newline < 0 else newline + 1
        docs.append(corpus[start:end].decode("utf-8"))
        start = end
    return docs


def best_of(rounds, fn):
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def read_ids(path, n):
    """The ids tokenizer_bench --write_ids wrote: per document an int32 count,
    then the int32 ids."""
    with open(path, "rb") as f:
        data = f.read()
    out, at = [], 0
    for _ in range(n):
        (count,) = struct.unpack_from("<i", data, at)
        at += 4
        out.append(list(struct.unpack_from(f"<{count}i", data, at)))
        at += 4 * count
    assert at == len(data), (at, len(data))
    return out


def tiktoken_encoding(path):
    import tiktoken
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    pre = j["pre_tokenizer"]
    steps = pre["pretokenizers"] if pre["type"] == "Sequence" else [pre]
    splits = [s["pattern"]["Regex"] for s in steps if s["type"] == "Split"]
    splits += [GPT2_PATTERN for s in steps if s["type"] == "ByteLevel" and s.get("use_regex", True)]
    if len(splits) != 1:
        raise ValueError(f"tiktoken takes one pattern; {path} has {len(splits)}")
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
                 + list(range(0xAE, 0x100)))
    char_to_byte, n = {}, 0
    for b in range(256):
        if b in printable:
            char_to_byte[chr(b)] = b
        else:
            char_to_byte[chr(256 + n)] = b
            n += 1
    assert set(char_to_byte) == set(alphabet)
    ranks = {}
    for token, i in j["model"]["vocab"].items():
        if all(c in char_to_byte for c in token):
            ranks[bytes(char_to_byte[c] for c in token)] = i
    special = {t["content"]: t["id"] for t in j["added_tokens"]}
    return tiktoken.Encoding("bench", pat_str=splits[0], mergeable_ranks=ranks,
                             special_tokens=special)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer",
                        default=os.path.join(REPO, "tokenizer/testdata/llama3/tokenizer.json"))
    # bazel-out/k8-opt: bazel-bin follows the last build's configuration.
    parser.add_argument("--bench",
                        default=os.path.join(REPO, "bazel-out/k8-opt/bin/tokenizer/tokenizer_bench"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    corpus = machine_corpus()
    docs = documents(corpus)
    mb = len(corpus) / 1e6
    print(f"corpus: {len(corpus)} bytes, {len(docs)} documents; tokenizer {args.tokenizer}; "
          f"{CORES} cores; tokenizers {tokenizers.__version__}", flush=True)
    results = {}

    tok = tokenizers.Tokenizer.from_file(args.tokenizer)
    hf_ids = [tok.encode(d, add_special_tokens=False).ids for d in docs]  # warm-up
    results["tokenizers", 1] = mb / best_of(
        args.rounds, lambda: [tok.encode(d, add_special_tokens=False) for d in docs])
    results["tokenizers", CORES] = mb / best_of(
        args.rounds, lambda: tok.encode_batch(docs, add_special_tokens=False))

    try:
        enc = tiktoken_encoding(args.tokenizer)
        import tiktoken
        tt_ids = [enc.encode_ordinary(d) for d in docs]
        same = sum(a == b for a, b in zip(tt_ids, hf_ids))
        print(f"tiktoken {tiktoken.__version__}: same ids as tokenizers for {same} of "
              f"{len(docs)} documents", flush=True)
        results["tiktoken", 1] = mb / best_of(
            args.rounds, lambda: [enc.encode_ordinary(d) for d in docs])
        results["tiktoken", CORES] = mb / best_of(
            args.rounds, lambda: enc.encode_ordinary_batch(docs, num_threads=CORES))
    except ImportError:
        print("tiktoken is not installed: venv/bin/python3 -m pip install tiktoken")
    except ValueError as e:
        print(f"tiktoken left out: {e}")

    with tempfile.TemporaryDirectory() as tmp:
        corpus_path = os.path.join(tmp, "corpus.txt")
        ids_path = os.path.join(tmp, "ids.bin")
        with open(corpus_path, "wb") as f:
            f.write(corpus)
        out = subprocess.run(
            [args.bench, f"--tokenizer={args.tokenizer}", f"--corpus={corpus_path}",
             f"--write_ids={ids_path}", "--benchmark_format=json",
             f"--benchmark_repetitions={args.rounds}", "--benchmark_filter=BM_Encode"],
            check=True, capture_output=True, text=True)
        ours_ids = read_ids(ids_path, len(docs))
    same = sum(a == b for a, b in zip(ours_ids, hf_ids))
    print(f"ours: same ids as tokenizers for {same} of {len(docs)} documents", flush=True)
    report = json.loads(out.stdout)
    for b in report["benchmarks"]:
        if b.get("run_type") != "iteration":
            continue
        threads = 1 if b["name"].startswith("BM_EncodeOneThread") else int(
            b["name"].split("/")[1])
        key = ("ours", threads)
        results[key] = max(results.get(key, 0), b["bytes_per_second"] / 1e6)

    print(f"\n{'encoder':<12} {'threads':>7} {'MB/s':>8} {'ours / it':>10}")
    for (name, threads), rate in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ours = results.get(("ours", threads))
        ratio = f"{ours / rate:.2f}x" if ours and name != "ours" else ""
        print(f"{name:<12} {threads:>7} {rate:>8.1f} {ratio:>10}")


if __name__ == "__main__":
    sys.exit(main())
