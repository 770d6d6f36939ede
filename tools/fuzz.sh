#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan + LeakSanitizer) and
# fuzzes each for a bounded time, starting from the committed corpus and
# regressions: torch_file and safetensors (the torch.save and safetensors
# loaders, formats/fuzz/), checkpoint and dcp (state_dict's checkpoint loader
# and torch.distributed.checkpoint reader, state_dict/fuzz/) and rendezvous
# (comm's TCPStore client against a peer's replies, comm/fuzz/). Exits
# non-zero on a crash, an oracle violation, a leak, a timeout or an
# out-of-memory input; the input is kept under the build directory's
# artifacts/ and the last lines of the fuzzer's log are printed.
#
# Usage: tools/fuzz.sh [--seconds N] [--target torch_file|checkpoint|dcp|safetensors|rendezvous]
#   --seconds N   fuzzing time per target (default 50)
#   --target T    only this target (default: all five)
#   --help        this text
# Environment: FUZZ_BUILD_DIR (objects, binaries, the growing working corpus
# and artifacts; default ~/.cache/torchfsdp_fuzz).
#
# clang-14 and its runtime libraries (libclang-rt-14-dev, which has
# libFuzzer) are installed when missing, which needs root. The build is
# tools/fuzz/Makefile: libFuzzer's and the sanitizers' flags on every unit,
# LibTorch's included, is not a configuration Bazel's targets are built in.
set -uo pipefail
cd "$(dirname "$0")/.."

seconds=50
targets=(torch_file checkpoint dcp safetensors rendezvous)
while (($#)); do
  case "$1" in
    --seconds) seconds="${2:?--seconds needs a number}"; shift 2 ;;
    --target) targets=("${2:?--target needs torch_file, checkpoint, dcp, safetensors or rendezvous}"); shift 2 ;;
    -h | --help) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "fuzz.sh: unknown argument '$1' (expected --seconds N, --target T)" >&2; exit 2 ;;
  esac
done
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds < 1)); then
  echo "fuzz.sh: --seconds must be a positive integer, got '$seconds'" >&2
  exit 2
fi
for t in "${targets[@]}"; do
  [[ "$t" == torch_file || "$t" == checkpoint || "$t" == dcp || "$t" == safetensors ||
     "$t" == rendezvous ]] ||
    { echo "fuzz.sh: unknown target '$t' (expected torch_file, checkpoint, dcp, safetensors or rendezvous)" >&2; exit 2; }
done
# Where a target's committed corpus/ and regressions/ live.
fuzz_dir() {
  case "$1" in
    rendezvous) echo comm/fuzz ;;
    torch_file | safetensors) echo formats/fuzz ;;
    *) echo state_dict/fuzz ;;
  esac
}

missing=()
for pkg in clang-14 libclang-rt-14-dev; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "fuzz.sh: missing ${missing[*]}; run as root: apt-get install ${missing[*]}" >&2
    exit 1
  fi
  echo "fuzz.sh: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null ||
    { echo "fuzz.sh: could not install ${missing[*]}" >&2; exit 1; }
fi

build="${FUZZ_BUILD_DIR:-${HOME:-/tmp}/.cache/torchfsdp_fuzz}"
mkdir -p "$build" || exit 1
# The LibTorch of the Bazel build (third_party/libtorch.bzl finds and checks
# it): its repository links include/ and lib/ to the real directories.
if ! bazel build @libtorch//:libtorch >"$build/libtorch.log" 2>&1; then
  tail -20 "$build/libtorch.log" >&2
  echo "fuzz.sh: no LibTorch for the fuzzers (see above; run tools/setup.sh)" >&2
  exit 1
fi
libtorch=$(bazel info output_base 2>/dev/null)/external/libtorch
libtorch=$(cd "$libtorch/lib/.." 2>/dev/null && cd "$(readlink -f "$libtorch/lib")/.." && pwd)
echo "fuzz.sh: building the fuzzers in $build against LibTorch in $libtorch" >&2
# Only the targets asked for: one target's build does not wait on another's
# sources.
binaries=()
for t in "${targets[@]}"; do binaries+=("$build/${t}_fuzzer"); done
if ! make -s -f tools/fuzz/Makefile BUILD="$build" LIBTORCH="$libtorch" -j2 "${binaries[@]}" \
    >"$build/make.log" 2>&1; then
  tail -40 "$build/make.log" >&2
  echo "fuzz.sh: the fuzzers did not build (log: $build/make.log)" >&2
  exit 1
fi

# The harness writes each input to a file: a tmpfs keeps that off the disk.
scratch_base=/tmp
[[ -d /dev/shm && -w /dev/shm ]] && scratch_base=/dev/shm
scratch=$(mktemp -d "$scratch_base/torchfsdp_fuzz.XXXXXX") || exit 1
trap 'rm -rf "$scratch"' EXIT

failed=0
for target in "${targets[@]}"; do
  work="$build/corpus/$target"
  artifacts="$build/artifacts/$target"
  log="$build/$target.log"
  mkdir -p "$work" "$artifacts"
  dir=$(fuzz_dir "$target")
  seeds=("$dir/corpus/$target")
  [[ -d $dir/regressions/$target ]] && seeds+=("$dir/regressions/$target")
  before=$(find "$artifacts" -type f | wc -l)
  # LeakSanitizer runs after every input whose mallocs and frees do not
  # balance (-detect_leaks=1, libFuzzer's default with ASan).
  TMPDIR="$scratch" ASAN_OPTIONS="detect_leaks=1:abort_on_error=0" \
    UBSAN_OPTIONS="print_stacktrace=1" \
    "$build/${target}_fuzzer" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=2048 \
      -detect_leaks=1 -print_final_stats=1 -artifact_prefix="$artifacts/" \
      "$work" "${seeds[@]}" >"$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  leaks=$(grep -c 'ERROR: LeakSanitizer' "$log")
  after=$(find "$artifacts" -type f | wc -l)
  echo "fuzz $target: ${execs:-0} inputs in ${seconds}s, exit $rc, $((after - before)) new artifacts, $leaks leak reports"
  if ((rc != 0 || leaks > 0 || after > before)); then
    failed=1
    tail -60 "$log" >&2
    echo "fuzz.sh: $target FAILED; inputs kept in $artifacts (log: $log)." >&2
    echo "  Reproduce: $build/${target}_fuzzer <input>; keep it as a regression in" >&2
    echo "  $dir/regressions/$target/ once fixed." >&2
  fi
done
exit "$failed"
