#!/usr/bin/env bash
# Issue #13's headlines and the machine limits they are held to, measured in
# one run (one after the other, nothing else on the machine): the numbers
# benchmarks/RESULTS.md quotes as fractions of the hardware.
#
#   benchmarks/run_hardware_fractions.sh [--out DIR] [--skip-python]
#
#   1. //benchmarks:hardware_limits_bench  sgemm at the workloads' shapes,
#      256 MiB memory copy, 64 MiB over loopback TCP.
#   2. The trainer's default run (README line 1): tokens/s and losses. (The
#      run on Debian's reference BLAS is gone: the torch wheel's
#      libtorch_cpu carries its own MKL and links no libblas.so.3.)
#   3. //benchmarks:trainer_bench at a compute-bound configuration
#      (TRAINER_BENCH_ROWS=8 TRAINER_BENCH_SEQ=128: 1024 tokens per rank and
#      step): 1 rank (NoFSDP, FULL_SHARD; 2 threads), 1 rank at 1 thread
#      (NoFSDP: the compute of one rank of a 2-rank run), 2 ranks (DDP,
#      FULL_SHARD; 1 thread each). MFU = model_FLOP/s_per_rank / sgemm peak.
#   4. //benchmarks:comm_bench (collectives' bus bandwidth, 1 KiB .. 64 MiB).
#   5. //benchmarks:transforms_bench and //benchmarks:functional_bench.
#   6. benchmarks/compare_pytorch.sh (per-sample gradients, batched Hessians,
#      DDP steps against Python on the same set-up; the venv's Python that
#      tools/setup.sh --with-python makes) unless --skip-python.
#
# Writes every tool's output to DIR (default: a new temporary directory,
# printed at the end). Takes ~20-25 minutes on 2 cores after the build.
set -euo pipefail

out=""
python=1
while (($#)); do
  case "$1" in
    --out) out="${2:?--out needs a DIR}"; shift 2 ;;
    --skip-python) python=0; shift ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_hardware_fractions.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$out" && "$out" != /* ]] && out="$PWD/$out"
cd "$(dirname "$0")/.."
py="${TORCHFSDP_PYTHON:-${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3}"
if ((python)) && [[ ! -x "$py" ]]; then
  echo "run_hardware_fractions.sh: $py missing (compare_pytorch.sh needs it): run" >&2
  echo "  tools/setup.sh --with-python, or pass --skip-python" >&2
  exit 1
fi
out=${out:-$(mktemp -d /tmp/hardware_fractions.XXXXXX)}
mkdir -p "$out"

bazel build //benchmarks:hardware_limits_bench //benchmarks:trainer_bench //benchmarks:comm_bench \
  //benchmarks:transforms_bench //benchmarks:functional_bench //:trainer >&2
bin=$(bazel info bazel-bin 2>/dev/null)
unset OMP_NUM_THREADS MKL_NUM_THREADS

step() { echo "== $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg): $*" >&2; }

step "hardware limits"
"$bin/benchmarks/hardware_limits_bench" --benchmark_out="$out/hardware_limits.json" \
  --benchmark_out_format=json >"$out/hardware_limits.txt" 2>&1

step "trainer default run"
"$bin/trainer/trainer" >"$out/trainer_default.txt" 2>&1

mfu() {  # name nproc filter [env...]
  local name=$1 nproc=$2 filter=$3; shift 3
  step "trainer_bench $name"
  env TRAINER_BENCH_ROWS=8 TRAINER_BENCH_SEQ=128 TRAINER_BENCH_NPROC="$nproc" "$@" \
    "$bin/benchmarks/trainer_bench" --benchmark_filter="$filter" \
    --benchmark_out="$out/trainer_bench_$name.json" --benchmark_out_format=json \
    >"$out/trainer_bench_$name.txt" 2>&1
}
mfu 1rank 1 '^BM_Step/(NoFSDP|FULL_SHARD)/'
mfu 1rank_1thread 1 '^BM_Step/NoFSDP/' OMP_NUM_THREADS=1
mfu 2ranks 2 '^BM_Step/(DDP|FULL_SHARD)/'

step "comm_bench"
"$bin/benchmarks/comm_bench" --benchmark_out="$out/comm_bench.json" --benchmark_out_format=json \
  >"$out/comm_bench.txt" 2>&1
step "transforms_bench"
"$bin/benchmarks/transforms_bench" --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true >"$out/transforms_bench.txt" 2>&1
step "functional_bench"
"$bin/benchmarks/functional_bench" --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true >"$out/functional_bench.txt" 2>&1

if ((python)); then
  step "compare_pytorch"
  benchmarks/compare_pytorch.sh --out "$out/compare_pytorch.md" >"$out/compare_pytorch.log" 2>&1
fi
step "done"
echo "$out"
