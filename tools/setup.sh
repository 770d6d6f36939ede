#!/usr/bin/env bash
# Installs the Debian packages the build needs; does nothing when they are
# already there. Usage: tools/setup.sh [--with-python]
#
# LibTorch links libblas.so.3, which Debian points at the reference (netlib)
# BLAS unless an optimized one is installed: this installs OpenBLAS, OpenMP
# variant, and makes it the libblas.so.3/liblapack.so.3 alternative. OpenMP,
# not pthread, because it shares LibTorch's libgomp thread pool: with the
# pthread variant a rank running 2 intra-op threads has 2 OpenBLAS threads
# competing with 2 spinning OpenMP threads on 2 cores (benchmarks/RESULTS.md).
# tcmalloc (gperftools) is linked into every binary the project builds.
# libdeflate's CRC-32 checksums the zip records of checkpoint files.
# CLI11 parses the command lines of the trainer, launch and ckpt;
# nlohmann-json writes the trainer's --log-json (both header-only).
#   --with-python  also install python3-torch and python3-matplotlib
#                  (golden-value fixtures, Python interop tests, tools/plot).
set -euo pipefail

packages=(
  g++
  bazel-bootstrap
  libtorch-dev
  libgloo-dev
  libabsl-dev
  libgtest-dev
  libgmock-dev
  libbenchmark-dev
  libopenblas0-openmp
  libgoogle-perftools-dev
  libdeflate-dev
  libcli11-dev
  nlohmann-json3-dev
)
for arg in "$@"; do
  case "$arg" in
    --with-python) packages+=(python3-torch python3-numpy python3-matplotlib) ;;
    *) echo "setup.sh: unknown argument '$arg' (expected --with-python)" >&2; exit 2 ;;
  esac
done

readonly blas_dir=/usr/lib/x86_64-linux-gnu/openblas-openmp

# Points libblas.so.3 / liblapack.so.3 (and libopenblas.so.0) at the OpenMP
# OpenBLAS; a no-op when they already do. Auto mode would prefer the pthread
# variant (priority 100 vs 95) if both are installed.
select_blas() {
  local name
  for name in libblas.so.3 liblapack.so.3 libopenblas.so.0; do
    local link="${name}-x86_64-linux-gnu"
    local current
    current=$(update-alternatives --query "$link" 2>/dev/null | sed -n 's/^Value: //p')
    [[ "$current" == "$blas_dir/$name" ]] && continue
    if [[ $(id -u) -ne 0 ]]; then
      echo "setup.sh: $name points at '${current:-nothing}', not OpenBLAS (libopenblas0-openmp);" >&2
      echo "run as root: update-alternatives --set $link $blas_dir/$name" >&2
      exit 1
    fi
    update-alternatives --quiet --set "$link" "$blas_dir/$name"
    echo "setup.sh: $name -> $blas_dir/$name" >&2
  done
}

missing=()
for pkg in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done

if ((${#missing[@]} == 0)); then
  select_blas
  exit 0
fi

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
select_blas
