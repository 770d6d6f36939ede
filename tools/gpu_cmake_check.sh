#!/usr/bin/env bash
# Builds the GPU machine's CMake path here, as that machine will, and checks
# what it builds: the CMake build cannot drift from the BUILD files unseen,
# and its binaries start without anything of this machine's /usr/lib.
#
#   1. tools/gpu_bundle.sh makes third_party/gpu_deps (Debian's Abseil,
#      gloo headers, libdeflate, tcmalloc, ...), which the GPU machine gets
#      through the device tool's `carry`.
#   2. benchmarks/gpu/CMakeLists.txt against the torch wheel of
#      tools/setup.sh --with-python (the CUDA build: the wheel's
#      libtorch_cuda, the toolkit's headers, NCCL, nvcc for kernels/'s .cu
#      files), building gpu_check and the trainer from
#      benchmarks/gpu/sources.cmake with GCC, in the GPU machine's own
#      configuration (Release, LibTorch's precompiled header): a source that
#      compiles under Bazel (clang) but not there (GCC; the CMake build's
#      include paths, defines and source lists) fails here, and the link
#      finds what a source list or the link line dropped.
#      The precompiled header (TORCHFSDP_PCH, third_party/libtorch_pch.bzl's
#      list) hides a missing include of a header inside it, exactly as it
#      does on the GPU machine (so such a source breaks neither build);
#      includes of anything else (project, Abseil, the standard library,
#      LibTorch headers outside it) are still checked. --no-pch compiles
#      every source from its own includes (the include-what-you-use check,
#      as `bazel build --config=nopch //...` does for everything).
#      Why: GCC spends ~90% of a unit here parsing LibTorch's headers, not
#      optimising (fsdp/internal/clip_grad_norm.cc, one unit alone: -O2 11.0 s,
#      -O0 10.8 s, -fsyntax-only 9.2 s, with the precompiled header 5.4 s,
#      the header itself 30 s once), so the precompiled header is what makes
#      this phase cheaper, and -O0 or compile-only would not. Over all the
#      units the gain is smaller than for that one (many are light, or
#      spend their time instantiating): cold, 2 cores, other builds beside
#      it (2026-11-28), at 9d2c7c0 this script took 321 s (load ~2.1); the
#      same tree with --no-pch compiled the library's objects 28% slower
#      (the 63 both runs finished: 467 s against 332 s, load ~1.8), plus
#      26 s for the header once; at a2ead3f without the header it took
#      777 s (load ~4.4), 478 s with it at 04e2b2c (load ~3.3).
#      The trainer's --tokenizer needs PCRE2, ICU and SentencePiece
#      (tokenizer/), which this machine has and the GPU machine does not:
#      CMake builds it here (TORCHFSDP_WITH_TOKENIZER, found) and the stand-in the GPU machine
#      links instead (trainer/text_data_unavailable.cc: target
#      torchfsdp_no_tokenizer) is compiled beside it, so both sides of that
#      choice compile in the CMake build.
#   3. With LD_LIBRARY_PATH unset, every library either binary loads
#      (ldd) resolves into the wheel's site-packages, the bundle, or the
#      C/C++ runtime every machine has (glibc's libraries, libstdc++, libgcc_s):
#      the GPU machine has no Debian packages, and a library found in
#      /usr/lib here would be missing there. The one exception: PCRE2's,
#      ICU's and SentencePiece's, for the trainer and gpu_check (which
#      links the trainer's loop for trainer_cuda_graphs), when CMake found
#      them (a machine without them builds both without them, so neither
#      loads them there).
#   4. gpu_check --dry-run-on-cpu: the CUDA binary starts, and its CPU-side
#      checks pass (the CUDA cases need a GPU and say NOT RUN).
#   5. The trainer on a text: with the tokenizer, one step on 1 rank from
#      a licence text and the golden Llama 3 tokenizer, then the golden
#      SentencePiece tokenizer.model (it says what it tokenised); without,
#      --tokenizer is refused naming why.
#
# Usage: tools/gpu_cmake_check.sh [--no-pch]   (tools/test.sh runs it as
#        "gpu cmake", without --no-pch)
# Environment: GPU_CMAKE_BUILD_DIR (default ~/.cache/torchfsdp_gpu_cmake/<hash
# of this checkout's path>: a CMake cache belongs to one source tree, and
# CI's $HOME outlives its clones), TORCHFSDP_HOME (where setup.sh put the venv).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

pch=ON
for arg in "$@"; do
  case "$arg" in
    --no-pch) pch=OFF ;;
    *) echo "gpu_cmake_check.sh: unknown argument '$arg' (usage: tools/gpu_cmake_check.sh [--no-pch])" >&2
       exit 2 ;;
  esac
done

checkout_key=$(printf '%s' "$ROOT" | sha1sum | cut -c1-12)
build="${GPU_CMAKE_BUILD_DIR:-${HOME:-/tmp}/.cache/torchfsdp_gpu_cmake/$checkout_key}"
python="${TORCHFSDP_HOME:-${HOME:-/root}/.cache/torchfsdp-cpp}/venv/bin/python3"
[[ -x "$python" ]] || { echo "gpu_cmake_check.sh: no $python: run tools/setup.sh --with-python" >&2; exit 1; }
for tool in cmake; do
  command -v "$tool" >/dev/null || { echo "gpu_cmake_check.sh: $tool not on PATH" >&2; exit 1; }
done
generator=("-G" "Unix Makefiles")
command -v ninja >/dev/null && generator=("-G" "Ninja")

torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
site_packages=$(dirname "$torch_dir")
deps="$ROOT/third_party/gpu_deps"
bash tools/gpu_bundle.sh >/dev/null

mkdir -p "$build"
cmake -S benchmarks/gpu -B "$build" "${generator[@]}" -DTORCH_DIR="$torch_dir" \
  -DGPU_DEPS="$deps" -DTORCHFSDP_PCH="$pch" -DCMAKE_CXX_COMPILER=g++ \
  -DCMAKE_BUILD_TYPE=Release >"$build/configure.log" 2>&1 ||
  { tail -20 "$build/configure.log" >&2; echo "gpu_cmake_check.sh: cmake failed" >&2; exit 1; }
targets=(gpu_check trainer)
with_tokenizer=OFF
grep -q '^TORCHFSDP_WITH_TOKENIZER:INTERNAL=ON$' "$build/CMakeCache.txt" && with_tokenizer=ON
[[ $with_tokenizer == ON ]] && targets+=(torchfsdp_no_tokenizer)
cmake --build "$build" --target "${targets[@]}" -j "$(nproc)" >"$build/build.log" 2>&1 ||
  { grep -m 20 -E "^FAILED:|error|undefined reference" "$build/build.log" >&2 || tail -20 "$build/build.log" >&2
    echo "gpu_cmake_check.sh: the CMake build failed (log: $build/build.log)" >&2; exit 1; }

source tools/gpu_c_runtime.sh
status=0
for binary in gpu_check trainer; do
  while read -r name _ path _; do
    [[ "$name" =~ $C_RUNTIME_SONAMES ]] && continue
    [[ $with_tokenizer == ON && "$name" =~ ^lib(pcre2-8|icuuc|icudata|sentencepiece)\.so\. ]] && continue
    case "$path" in
      "$site_packages"/* | "$deps"/*) ;;
      *) echo "gpu_cmake_check.sh: $binary loads $name from ${path:-nowhere}, not from the wheel ($site_packages) or the bundle ($deps)" >&2
         status=1 ;;
    esac
  done < <(env -u LD_LIBRARY_PATH ldd "$build/$binary" | grep '=>')
done
((status == 0)) || exit 1
echo "gpu_cmake_check.sh: gpu_check and trainer load only the wheel's, the bundle's and the C/C++ runtime's libraries$([[ $with_tokenizer == ON ]] && echo " (and PCRE2's, ICU's and SentencePiece's: TORCHFSDP_WITH_TOKENIZER)")"

env -u LD_LIBRARY_PATH "$build/gpu_check" --dry-run-on-cpu

text_run=$(mktemp -d)
trap 'rm -rf "$text_run"' EXIT
trainer_on_text=(env -u LD_LIBRARY_PATH "$build/trainer" --nproc 1 --steps 1 --seq 16
  --global-batch 2 --vocab 4096 --data /usr/share/common-licenses/BSD
  --tokenizer tokenizer/testdata/llama3/tokenizer.json)
if [[ $with_tokenizer == ON ]]; then
  "${trainer_on_text[@]}" >"$text_run/log" 2>&1 && grep -q "^trainer: tokenised 1 document" "$text_run/log" ||
    { cat "$text_run/log" >&2; echo "gpu_cmake_check.sh: the CMake trainer did not train on a text with --tokenizer" >&2; exit 1; }
  echo "gpu_cmake_check.sh: the trainer (with the tokenizer) trained a step on a text: $(grep "^trainer: tokenised" "$text_run/log")"
  # The same with a SentencePiece tokenizer.model (libsentencepiece).
  "${trainer_on_text[@]:0:${#trainer_on_text[@]}-1}" tokenizer/testdata/sentencepiece/llama2_bpe/tokenizer.model \
    >"$text_run/log" 2>&1 && grep -q "^trainer: tokenised 1 document.*(</s> after it)" "$text_run/log" ||
    { cat "$text_run/log" >&2; echo "gpu_cmake_check.sh: the CMake trainer did not train on a text with a tokenizer.model" >&2; exit 1; }
  echo "gpu_cmake_check.sh: and with a SentencePiece tokenizer.model: $(grep "^trainer: tokenised" "$text_run/log")"
else
  if "${trainer_on_text[@]}" >"$text_run/log" 2>&1 || ! grep -q "built without the tokenizer" "$text_run/log"; then
    cat "$text_run/log" >&2; echo "gpu_cmake_check.sh: the CMake trainer without the tokenizer did not refuse --tokenizer" >&2; exit 1
  fi
  echo "gpu_cmake_check.sh: the trainer (without the tokenizer: PCRE2/ICU/SentencePiece not found) refuses --tokenizer naming why"
fi
