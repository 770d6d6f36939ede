#!/usr/bin/env bash
# Fetches the Python peers benchmarks/run_gpu.sh runs beside our trainer on
# the lent GPU machine, which has torch 2.11 but no network and no
# TorchTitan: TorchTitan 0.2.2 (the last release that runs on torch 2.11;
# 0.3.0 needs newer FSDP names), torchao 0.17.0 (its float8, built for
# 2.11) and what they import that the machine lacks. Wheels only, for the
# machine's Python 3.12, into third_party/gpu_peers/ (git-ignored, ~4 MiB),
# which travels with the device tool's `carry`:
#
#   bash tools/fetch_gpu_peers.sh
#   run(carry=["third_party/gpu_deps", "third_party/gpu_peers"],
#       command="bash benchmarks/run_gpu.sh")
#
# run_gpu.sh unpacks them into a private folder on its PYTHONPATH (nothing
# is installed into the machine's Python). Downloads are cached under
# ${TORCHFSDP_HOME:-~/.cache/torchfsdp-cpp}/gpu_peers.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/third_party/gpu_peers"
CACHE="${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/gpu_peers"
PYTHON_VERSION="${PEER_PYTHON_VERSION:-3.12}"
WHEELS=(
  torchtitan==0.2.2
  torchao==0.17.0
  torchdata==0.11.0
  tyro==1.0.17
  docstring-parser==0.18.0
  typeguard==4.6.1
  typing-extensions==4.16.0
)

python="${PYTHON:-python3}"
mkdir -p "$CACHE"
if ! "$python" -m pip download --quiet --python-version "$PYTHON_VERSION" --only-binary=:all: \
    --no-deps -d "$CACHE" "${WHEELS[@]}"; then
  echo "fetch_gpu_peers.sh: pip download of ${WHEELS[*]} failed (needs PyPI)" >&2
  exit 1
fi
rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp"
for spec in "${WHEELS[@]}"; do
  name="${spec%%==*}"
  version="${spec#*==}"
  # Wheel file names spell the project with underscores.
  wheel="$(ls "$CACHE/${name//-/_}-$version-"*.whl 2>/dev/null | head -1)"
  if [ -z "$wheel" ]; then
    echo "fetch_gpu_peers.sh: no wheel for $spec in $CACHE" >&2
    exit 1
  fi
  cp "$wheel" "$DEST.tmp/"
done
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
echo "fetch_gpu_peers.sh: $(ls "$DEST" | wc -l) wheels, $(du -sh "$DEST" | cut -f1), in $DEST"
