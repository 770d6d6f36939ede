#!/usr/bin/env bash
# Test of //tools:plot: a tiny trainer --log-json file (the keys of
# trainer/json_log.h, two ranks, one step logged twice as after a resume)
# becomes a PNG; a file that is not a trainer log is refused with a message.
# Needs matplotlib in the venv tools/setup.sh --with-python makes (which
# tools/test.sh runs): tools/plot.py starts
# ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3, looking
# in the user's home from /etc/passwd too, as `bazel test` sets HOME to
# the test's temporary directory.
set -euo pipefail

plot="${TEST_SRCDIR}/${TEST_WORKSPACE}/tools/plot"
[[ -x "$plot" ]] || { echo "FAIL: $plot not found in the runfiles"; exit 1; }
dir="${TEST_TMPDIR:-$(mktemp -d)}"
export MPLCONFIGDIR="$dir/mplconfig"  # matplotlib's font cache: a writable place

fail() { echo "FAIL: $*"; exit 1; }

log="$dir/run.jsonl"
cat >"$log" <<'EOF'
{"step": 1, "loss": 5.5451774597167969, "lr": 0.00030000000000000003, "step_time_s": 0.41, "tokens_per_s": 2497.5, "peak_rss_bytes": [412000256, 409923584], "sharded_state_bytes": [1606656, 1606656], "world_size": 2}
{"step": 2, "loss": 5.1021, "lr": 0.0006, "step_time_s": 0.39, "tokens_per_s": 2625.6, "peak_rss_bytes": [412000256, 409923584], "sharded_state_bytes": [1606656, 1606656], "world_size": 2}
{"step": 3, "loss": 4.7702, "lr": 0.0009, "step_time_s": 0.40, "tokens_per_s": 2560.0, "peak_rss_bytes": [413000256, 409923584], "sharded_state_bytes": [1606656, 1606656], "world_size": 2}
{"step": 3, "loss": 4.7701, "lr": 0.0009, "step_time_s": 0.42, "tokens_per_s": 2438.1, "peak_rss_bytes": [413000256, 410923584], "sharded_state_bytes": [1606656, 1606656], "world_size": 2}
{"step": 4, "loss": null, "lr": 0.0012, "step_time_s": 0.38, "tokens_per_s": 2694.7, "peak_rss_bytes": [414000256, 410923584], "sharded_state_bytes": [1606656, 1606656], "world_size": 2}

{"step": 5, "loss": 4.2517, "lr": 0.0015, "step_time_s": 0.40, "tokens_per_s": 2560.0, "peak_rss_bytes": [414000256, 410923584], "sharded_state_bytes": [1606656, 1606656], "world_size": 2}
EOF

# A valid PNG: the 8-byte signature, an IHDR chunk first with a non-zero
# width and height, an IEND chunk, and more than a trivial size.
check_png() {
  local png=$1 size magic ihdr width height
  [[ -f "$png" ]] || fail "$png was not written"
  size=$(stat -c %s "$png")
  ((size > 5000)) || fail "$png is only $size bytes"
  magic=$(od -An -tx1 -N8 "$png" | tr -d ' \n')
  [[ "$magic" == "89504e470d0a1a0a" ]] || fail "$png: signature $magic, expected a PNG's"
  ihdr=$(od -An -c -j12 -N4 "$png" | tr -d ' \n')
  [[ "$ihdr" == "IHDR" ]] || fail "$png: first chunk '$ihdr', expected IHDR"
  width=$((16#$(od -An -tx1 -j16 -N4 "$png" | tr -d ' \n')))
  height=$((16#$(od -An -tx1 -j20 -N4 "$png" | tr -d ' \n')))
  ((width >= 100 && height >= 100)) || fail "$png: ${width}x${height} pixels"
  [[ "$(tail -c 8 "$png" | od -An -c -N4 | tr -d ' \n')" == "IEND" ]] ||
    fail "$png: does not end with an IEND chunk (truncated?)"
  echo "ok: $png, $size bytes, ${width}x${height}"
}

# -o OUT
out=$("$plot" "$log" -o "$dir/chart.png" --title "plot_test" 2>&1) ||
  fail "plot exited with $?: $out"
[[ "$out" == *"wrote $dir/chart.png"* ]] || fail "unexpected output: $out"
check_png "$dir/chart.png"

# Default output: the log's name with .png.
out=$("$plot" "$log" 2>&1) || fail "plot (default output) exited with $?: $out"
check_png "$dir/run.png"

# A run with --eval-every: its val_loss points are drawn (and counted).
vlog="$dir/val.jsonl"
for step in 1 2 3 4 5 6; do
  val=""
  ((step % 2 == 0)) && val=", \"val_loss\": $((7 - step)).25"
  echo "{\"step\": $step, \"loss\": $((8 - step)).5, \"lr\": 0.001, \"step_time_s\": 0.4, \"tokens_per_s\": 2500.0, \"peak_rss_bytes\": [412000256], \"sharded_state_bytes\": [1606656], \"world_size\": 1$val}" >>"$vlog"
done
out=$("$plot" "$vlog" -o "$dir/val.png" 2>&1) || fail "plot (val_loss) exited with $?: $out"
[[ "$out" == *"wrote $dir/val.png (3 validation loss points)"* ]] || fail "unexpected output: $out"
check_png "$dir/val.png"
out=$("$plot" "$log" -o "$dir/chart2.png" 2>&1)
[[ "$out" != *"validation"* ]] || fail "validation points in a log without val_loss: $out"

# Not a trainer log: an error naming the file, line and key; no PNG.
printf '{"step": 1, "loss": 2.0}\n' >"$dir/bad.jsonl"
if out=$("$plot" "$dir/bad.jsonl" 2>&1); then
  fail "plot accepted a log without tokens_per_s: $out"
fi
[[ "$out" == *"bad.jsonl:1: no 'tokens_per_s' key"* ]] || fail "unexpected error: $out"
[[ ! -e "$dir/bad.png" ]] || fail "plot wrote bad.png for a rejected log"
echo "ok: rejected bad.jsonl: $out"

echo "PASS"
