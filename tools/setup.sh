#!/usr/bin/env bash
# Installs what the build needs; does nothing when it is already there.
# Usage: tools/setup.sh [--with-python]
#
# - Debian packages: the compilers (clang-14 builds the project, with
#   LibTorch's headers precompiled: third_party/libtorch_pch.bzl; its
#   runtime libraries for --config=asan; g++ for the C++ standard library
#   and the linker), Bazel, Abseil, GoogleTest, Google Benchmark,
#   gperftools' tcmalloc (linked into every binary the project builds),
#   libdeflate (the zip CRC-32 of checkpoint files), CLI11 and nlohmann-json
#   (command lines, --log-json), libgloo-dev (the gloo/ headers that
#   ProcessGroupGloo.hpp includes and the torch wheel does not ship),
#   libpcre2-dev and libicu-dev (the tokenizer's pre-tokenizer regular
#   expressions and its Unicode normalization), libsentencepiece-dev (the
#   tokenizer's SentencePiece tokenizer.model files), and clang-format-14
#   (tools/format.sh, pinned to that version).
# - LibTorch: the pinned `torch` wheel (TORCH_VERSION below), with pip into a
#   virtual environment in the project's prefix,
#   ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv, never into a system
#   Python. The build takes `torch/include` and `torch/lib` from it
#   (third_party/libtorch.bzl) unless TORCHFSDP_LIBTORCH names another
#   LibTorch directory, in which case no wheel is installed for the build.
#   Without --with-python only the wheel itself goes in (--no-deps) plus the
#   two CUDA runtime libraries its libtorch_cpu.so is linked against
#   (libcudart, libcupti: loaded, never used, by CPU programs).
#   --with-python  the wheel with all its dependencies (Python `import torch`,
#                  the CUDA and NCCL libraries --config=cuda links against),
#                  and PYTHON_EXTRAS below (numpy, matplotlib, safetensors,
#                  transformers: the Llama golden checkpoints and the export check;
#                  sentencepiece and protobuf: the tokenizer.model golden files and
#                  //tools:tokenize_test):
#                  golden fixtures, the Python interop tests (safetensors:
#                  //formats:safetensors_test), benchmarks' Python peers,
#                  tools/plot.py.
set -euo pipefail

readonly TORCH_VERSION=2.15.0
# What --with-python installs beside torch. The stamp that records it is named
# after this list, so adding or re-pinning one reinstalls on every machine
# that set up the old list.
readonly PYTHON_EXTRAS=(numpy matplotlib safetensors==0.8.0 transformers==5.24.0
  sentencepiece==0.2.3 protobuf==7.36.2)
readonly prefix="${TORCHFSDP_HOME:-${HOME:-/root}/.cache/torchfsdp-cpp}"
readonly venv="$prefix/venv"

with_python=0
for arg in "$@"; do
  case "$arg" in
    --with-python) with_python=1 ;;
    *) echo "setup.sh: unknown argument '$arg' (expected --with-python)" >&2; exit 2 ;;
  esac
done

packages=(
  g++
  clang-14
  libclang-rt-14-dev
  bazel-bootstrap
  libgloo-dev
  libabsl-dev
  libgtest-dev
  libgmock-dev
  libbenchmark-dev
  libgoogle-perftools-dev
  libdeflate-dev
  libcli11-dev
  nlohmann-json3-dev
  libpcre2-dev
  libicu-dev
  libsentencepiece-dev
  clang-format-14
)
python3 -c 'import ensurepip, venv' 2>/dev/null || packages+=(python3-venv)

missing=()
for pkg in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "setup.sh: installing missing Debian packages: ${missing[*]}" >&2
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup.sh: these packages are missing and installing them needs root:" >&2
    printf '  %s\n' "${missing[@]}" >&2
    echo "run as root: tools/setup.sh $*  (or: apt-get install ${missing[*]})" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  echo "setup.sh: installed ${missing[*]}" >&2
fi

# What is in the venv is recorded in stamp files, so a set-up that is already
# done costs no pip call.
stamp_wheel="$venv/.torchfsdp-torch-$TORCH_VERSION"
extras_id=$(printf '%s\n' "${PYTHON_EXTRAS[@]}" | sha256sum | cut -c1-12)
stamp_python="$venv/.torchfsdp-torch-$TORCH_VERSION-python-$extras_id"
need_wheel=0
[[ -z "${TORCHFSDP_LIBTORCH:-}" && ! -e "$stamp_wheel" ]] && need_wheel=1
need_python=0
((with_python)) && [[ ! -e "$stamp_python" ]] && need_python=1
((need_wheel || need_python)) || exit 0

if [[ ! -x "$venv/bin/python3" ]]; then
  mkdir -p "$prefix"
  # A venv half made by an interrupted run is made again.
  rm -rf "$venv"
  base_python=python3
  python3 -c 'import ensurepip, venv' 2>/dev/null || base_python=/usr/bin/python3
  "$base_python" -m venv "$venv"
fi
pip=("$venv/bin/python3" -m pip install --quiet --disable-pip-version-check)

if ((need_python)); then
  echo "setup.sh: installing torch==$TORCH_VERSION with its dependencies, ${PYTHON_EXTRAS[*]} into $venv" >&2
  "${pip[@]}" "torch==$TORCH_VERSION" "${PYTHON_EXTRAS[@]}"
  rm -f "$venv"/.torchfsdp-torch-*-python*  # the stamps of earlier lists
  touch "$stamp_wheel" "$stamp_python"
elif ((need_wheel)); then
  echo "setup.sh: installing the torch==$TORCH_VERSION wheel (LibTorch) into $venv" >&2
  "${pip[@]}" --no-deps "torch==$TORCH_VERSION"
  # libtorch_cpu.so lists libcudart and libcupti as NEEDED; the wheel's own
  # metadata names the cuda-toolkit release they come from.
  metadata=$(echo "$venv"/lib/python3*/site-packages/torch-"$TORCH_VERSION".dist-info/METADATA)
  toolkit=$(sed -n 's/^Requires-Dist: cuda-toolkit\[[^]]*\]==\([0-9.]*\).*/\1/p' "$metadata" | head -1)
  if [[ -z "$toolkit" ]]; then
    echo "setup.sh: no cuda-toolkit requirement in $metadata; cannot tell which CUDA runtime torch $TORCH_VERSION needs" >&2
    exit 1
  fi
  # pip would list every dependency of torch left out on purpose.
  "${pip[@]}" "cuda-toolkit[cudart,cupti]==$toolkit" 2>&1 |
    grep -v -e "dependency resolver does not currently" -e "^torch $TORCH_VERSION requires" >&2 || true
  ((PIPESTATUS[0] == 0)) || { echo "setup.sh: pip could not install cuda-toolkit[cudart,cupti]==$toolkit" >&2; exit 1; }
  touch "$stamp_wheel"
fi
echo "setup.sh: LibTorch $TORCH_VERSION in $(echo "$venv"/lib/python3*/site-packages/torch)" >&2
