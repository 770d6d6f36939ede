"""Writes the seed corpus of the formats and state_dict fuzzers (tools/fuzz.sh).

Run from the repository root with the venv's Python that `tools/setup.sh
--with-python` makes (the `torch` wheel the build links, 2.15):

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \
        tools/fuzz/make_seed_corpus.py [--no-project-seeds]

It writes real torch.save files into formats/fuzz/corpus/torch_file/
(state dicts with _metadata, optimizer state dicts, nested containers, views
sharing storage, every dtype, empty and 0-dim tensors) and the expectations
//formats/fuzz:corpus_replay_test checks them against
(formats/fuzz/corpus/python_seeds.txt); a few of them, prefixed with a
selector byte, seed the checkpoint fuzzer (state_dict/fuzz/corpus/checkpoint/).
For the dcp fuzzer it writes the `.metadata` and `__0_0.distcp` of a
1-process torch.distributed.checkpoint save (`dcp.save(..., no_dist=True)`),
prefixed with their selector bytes (state_dict/fuzz/corpus/dcp/).
For the safetensors fuzzer it writes files of Python's safetensors.torch
save_file (every dtype the format shares with torch, bf16 included, empty
and 0-dim tensors, metadata) and, by hand, headers that lie: overlapping,
out-of-range and gapped offsets, a header length past the file or over the
format's limit (formats/fuzz/corpus/safetensors/).
Then, unless --no-project-seeds, it runs //formats/fuzz:write_project_seeds
and //state_dict/fuzz:write_project_seeds (bazel) for the files the project
itself writes (SaveTensorDict, SaveIValue; the fuzzers' template checkpoint
and template DCP directory). Rerunning it
rewrites the same files (the DCP save's random save id and temporary path in
its StorageMeta are replaced by fixed ones).

torch.save of 2.x writes records 1.13 did not (.format_version,
.storage_alignment, byteorder, .data/serialization_id) and writes the
storage records in numeric order (1.13: data/0, data/1, data/10, ...), so
the py_* seeds, made by 2.15 since, carry them.
"""

import argparse
import dataclasses
import io
import os
import pickle
import subprocess
import sys
import tempfile
import warnings
import zipfile

import torch
import torch.distributed.checkpoint as dcp

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
# The file formats' corpora (torch_file, safetensors, python_seeds.txt) and
# state_dict's (checkpoint, dcp).
FORMATS_CORPUS = os.path.join(ROOT, "formats", "fuzz", "corpus")
STATE_DICT_CORPUS = os.path.join(ROOT, "state_dict", "fuzz", "corpus")
CORPUS_OF = {"torch_file": FORMATS_CORPUS, "safetensors": FORMATS_CORPUS,
             "checkpoint": STATE_DICT_CORPUS, "dcp": STATE_DICT_CORPUS}


def corpus(target):
    """The corpus directory of a fuzz target."""
    return os.path.join(CORPUS_OF[target], target)

# torch dtype -> c10::toString name, as the C++ test prints them.
C10_NAMES = {
    torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
    torch.float64: "Double", torch.int8: "Char", torch.uint8: "Byte",
    torch.int16: "Short", torch.int32: "Int", torch.int64: "Long",
    torch.bool: "Bool", torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def value_sum(t):
    """Sum of the elements as float64 (complex: real and imaginary parts)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return float(t.detach().to(torch.float64).sum())


def tensors_in(value):
    """Every tensor in a nested value, depth first, dict values in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def save(obj, name, via_path):
    """torch.save to corpus/torch_file/<name>; by path (archive named after the
    file) or through a buffer (archive named "archive"), as users do both."""
    path = os.path.join(corpus("torch_file"), name)
    if via_path:
        torch.save(obj, path)
    else:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        with open(path, "wb") as f:
            f.write(buffer.getvalue())
    return path


def every_dtype():
    base = torch.arange(-2, 4, dtype=torch.float32)
    out = {}
    for dtype in C10_NAMES:
        if dtype.is_complex:
            out[str(dtype)] = torch.complex(base, base.flip(0)).to(dtype)
        else:
            out[str(dtype)] = base.to(dtype)
    return out


def views_sharing_storage():
    base = torch.arange(30, dtype=torch.float32).reshape(5, 6)
    return {
        "base": base,
        "row_slice": base[1:3],
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "narrowed": base.narrow(1, 2, 3),
        "expanded": torch.arange(3.0).unsqueeze(0).expand(4, 3),
        "diagonal": base.diagonal(),
    }


def adam_after_a_step():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = model(torch.randn(5, 3)).pow(2).mean()
    loss.backward()
    opt.step()
    return opt.state_dict()


def sgd_momentum_after_a_step():
    torch.manual_seed(4)
    weight = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.SGD([weight], lr=0.1, momentum=0.9, nesterov=True)
    weight.sum().backward()
    opt.step()
    return opt.state_dict()


def nested_containers():
    return {
        "list": [torch.ones(2), (torch.zeros(1, dtype=torch.int64), "text", 3), [[1.5, -2]]],
        "tuple": (True, False, None),
        "int_keys": {0: torch.tensor([1, 2], dtype=torch.int32), 7: "seven"},
        "deep": {"a": {"b": {"c": [torch.full((2, 2), 0.25)]}}},
        "big_int": 2**40,
        "negative": -17,
        "float": 1e-300,
        "bytes_like_str": "ünïcødé",
    }


def write_python_seeds(expectations):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    mlp.register_buffer("steps", torch.tensor([3, 4], dtype=torch.int64))
    batch_norm = torch.nn.BatchNorm1d(3)
    batch_norm(torch.randn(4, 3))  # running stats and num_batches_tracked move
    tensor_dicts = {
        "py_state_dict_mlp.pt": (mlp.state_dict(), True),
        "py_state_dict_batch_norm.pt": (batch_norm.state_dict(), False),
        "py_every_dtype.pt": (every_dtype(), False),
        "py_views.pt": (views_sharing_storage(), True),
        "py_empty_and_0dim.pt": ({
            "empty": torch.zeros(0),
            "empty_2d": torch.zeros(3, 0, dtype=torch.float64),
            "scalar": torch.tensor(7.5),
            "int_scalar": torch.tensor(-3, dtype=torch.int64),
            "bool_scalar": torch.tensor(True),
        }, False),
        "py_half_and_bfloat16.pt": ({
            "half": torch.linspace(-2, 2, 9).to(torch.float16),
            "bfloat16": torch.linspace(-3, 3, 7).to(torch.bfloat16).reshape(7, 1),
        }, True),
    }
    for name, (sd, via_path) in tensor_dicts.items():
        save(sd, name, via_path)
        for key, t in sd.items():
            shape = ",".join(str(d) for d in t.shape) or "-"
            expectations.append(f"{name} tensor {key} {C10_NAMES[t.dtype]} {shape} {value_sum(t)!r}")

    # The same state dict re-zipped by Python's zipfile with every record
    # deflated (version record included): torch.load reads such archives.
    plain = os.path.join(corpus("torch_file"), "py_state_dict_mlp.pt")
    deflated = os.path.join(corpus("torch_file"), "py_deflated_records.pt")
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            out = zipfile.ZipInfo(info.filename, date_time=(2020, 1, 1, 0, 0, 0))
            out.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(out, src.read(info.filename))
    assert list(torch.load(deflated).keys()) == list(mlp.state_dict().keys())
    for key, t in mlp.state_dict().items():
        shape = ",".join(str(d) for d in t.shape) or "-"
        expectations.append(
            f"py_deflated_records.pt tensor {key} {C10_NAMES[t.dtype]} {shape} {value_sum(t)!r}")

    values = {
        "py_adam_state_dict.pt": (adam_after_a_step(), False),
        "py_sgd_state_dict.pt": (sgd_momentum_after_a_step(), True),
        "py_nested_containers.pt": (nested_containers(), False),
        "py_top_level_list.pt": ([torch.arange(4), {"x": torch.eye(2)}, 5], True),
    }
    for name, (value, via_path) in values.items():
        save(value, name, via_path)
        tensors = tensors_in(value)
        expectations.append(
            f"{name} value {len(tensors)} {sum(value_sum(t) for t in tensors)!r}")


def write_checkpoint_seeds():
    """Python files standing in for a rank file of the checkpoint fuzzer's
    template (selector byte 1: rank_00000.pt; 5: rank_00001.pt with the
    manifest's checksum of it fixed up; see state_dict/fuzz/harness.h)."""
    for selector, name in ((1, "py_state_dict_mlp.pt"), (5, "py_views.pt")):
        with open(os.path.join(corpus("torch_file"), name), "rb") as f:
            data = f.read()
        with open(os.path.join(corpus("checkpoint"), f"{name}.sel{selector}"), "wb") as f:
            f.write(bytes([selector]) + data)


def write_dcp_seeds():
    """A 1-process dcp.save (no process group) of a dict of a couple of
    tensors and a float: its .metadata (selector byte 0 of the dcp fuzzer)
    and its one data file (selector 1, standing in for __0_0.distcp)."""
    torch.manual_seed(6)
    sd = {
        "weight": torch.randn(3, 4),
        "bias": torch.arange(5, dtype=torch.int64),
        "half": torch.linspace(-1, 1, 6).to(torch.bfloat16).reshape(2, 3),
        "lr": 0.25,
    }
    with tempfile.TemporaryDirectory() as d:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming ... a single process"
            dcp.save(sd, checkpoint_id=d, no_dist=True)
        metadata_path = os.path.join(d, ".metadata")
        with open(metadata_path, "rb") as f:
            metadata = pickle.load(f)
        # The StorageMeta records the directory and a random save id: fixed
        # ones keep the seed the same on every run. Dumped as
        # FileSystemWriter.finish dumps it (pickle.dump, default protocol).
        meta = metadata.storage_meta
        metadata.storage_meta = dataclasses.replace(
            meta, checkpoint_id=type(meta.checkpoint_id)("/checkpoints/py_dcp_save"),
            save_id="00000000-0000-0000-0000-000000000000")
        with open(metadata_path, "wb") as f:
            pickle.dump(metadata, f)
        for selector, name in ((0, ".metadata"), (1, "__0_0.distcp")):
            with open(os.path.join(d, name), "rb") as f:
                data = f.read()
            out = os.path.join(corpus("dcp"), f"py_dcp_save_{name.lstrip('.')}.sel{selector}")
            with open(out, "wb") as f:
                f.write(bytes([selector]) + data)


def write_safetensors_seeds():
    """Python's save_file outputs, and hand-made files whose headers lie."""
    import json
    import struct
    from safetensors.torch import save_file
    out = corpus("safetensors")
    torch.manual_seed(7)
    save_file({"weight": torch.randn(3, 4), "bias": torch.arange(5, dtype=torch.int64),
               "half": torch.linspace(-1, 1, 6).to(torch.bfloat16).reshape(2, 3)},
              os.path.join(out, "py_model.safetensors"), metadata={"format": "pt"})
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]
    save_file({str(dt).replace("torch.", ""): (torch.arange(4) % 2).to(dt) for dt in dtypes},
              os.path.join(out, "py_every_dtype.safetensors"))
    save_file({"empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5)},
              os.path.join(out, "py_empty_and_scalar.safetensors"), metadata={"note": "seed"})

    def raw(name, header, data, length=None):
        text = json.dumps(header).encode()
        with open(os.path.join(out, name), "wb") as f:
            f.write(struct.pack("<Q", len(text) if length is None else length) + text + data)

    eight = bytes(range(8))
    raw("hostile_overlap.safetensors",
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, eight)
    raw("hostile_out_of_range.safetensors",
        {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, eight)
    raw("hostile_gap.safetensors",
        {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, eight)
    raw("hostile_header_past_file.safetensors", {"a": {}}, b"", length=1 << 40)
    raw("hostile_header_over_limit.safetensors", {"a": {}}, b"", length=100_000_001)
    raw("hostile_shape_overflow.safetensors",
        {"a": {"dtype": "F64", "shape": [1 << 62, 1 << 62], "data_offsets": [0, 8]}}, eight)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-project-seeds", action="store_true",
                        help="only the Python-made seeds (no bazel run)")
    args = parser.parse_args()
    for target in ("torch_file", "checkpoint", "dcp", "safetensors"):
        os.makedirs(corpus(target), exist_ok=True)
    expectations = []
    write_python_seeds(expectations)
    write_checkpoint_seeds()
    write_dcp_seeds()
    write_safetensors_seeds()
    with open(os.path.join(FORMATS_CORPUS, "python_seeds.txt"), "w") as f:
        f.write("# Written by tools/fuzz/make_seed_corpus.py; checked by corpus_replay_test.\n")
        f.write("# <file> tensor <key> <dtype> <shape|-> <sum>   (a dict of tensors)\n")
        f.write("# <file> value <number of tensors> <sum of all>  (any value)\n")
        f.write("\n".join(expectations) + "\n")
    if not args.no_project_seeds:
        subprocess.run(
            ["bazel", "run", "//formats/fuzz:write_project_seeds", "--", corpus("torch_file")],
            cwd=ROOT, check=True)
        subprocess.run(
            ["bazel", "run", "//state_dict/fuzz:write_project_seeds", "--",
             corpus("checkpoint"), corpus("dcp")],
            cwd=ROOT, check=True)
    for directory in (FORMATS_CORPUS, STATE_DICT_CORPUS):
        print(f"seed corpus written under {os.path.relpath(directory, ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
