#!/usr/bin/env bash
# Formats the project's own C++ (*.cc, *.h) with clang-format 14 and the
# root .clang-format.
#
#   tools/format.sh [FILE...]          format in place (default: every file)
#   tools/format.sh --check [FILE...]  change nothing; list the files that
#                                      differ (with the number of lines
#                                      clang-format would change) and exit 1
#
# Every file: git's tracked and untracked-but-not-ignored *.cc / *.h (so not
# bazel-*, third_party/gpu_deps), without third_party/ and fuzz corpus data.
# clang-format is pinned to major version 14 (Debian 12's clang-format-14,
# which tools/setup.sh installs): other versions format some constructs
# differently, and a check has to give the same answer on every machine.
# CLANG_FORMAT=/path/to/clang-format overrides the binary (it must be 14.x).
set -euo pipefail
cd "$(dirname "$0")/.."

readonly REQUIRED_MAJOR=14

check=0
files=()
for arg in "$@"; do
  case "$arg" in
    --check) check=1 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "format.sh: unknown option '$arg' (expected --check or files)" >&2; exit 2 ;;
    *) files+=("$arg") ;;
  esac
done

clang_format=${CLANG_FORMAT:-}
if [[ -z "$clang_format" ]]; then
  for candidate in "clang-format-$REQUIRED_MAJOR" clang-format; do
    if command -v "$candidate" >/dev/null; then clang_format=$candidate; break; fi
  done
fi
if [[ -z "$clang_format" ]]; then
  echo "format.sh: clang-format-$REQUIRED_MAJOR not found: apt-get install clang-format-$REQUIRED_MAJOR" \
       "(tools/setup.sh installs it)" >&2
  exit 2
fi
version=$("$clang_format" --version)
if [[ ! "$version" =~ version\ $REQUIRED_MAJOR\. ]]; then
  echo "format.sh: $clang_format is '$version': expected clang-format $REQUIRED_MAJOR.x" \
       "(apt-get install clang-format-$REQUIRED_MAJOR, or CLANG_FORMAT=/path/to/it)" >&2
  exit 2
fi

if ((${#files[@]} == 0)); then
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    mapfile -t files < <(git ls-files --cached --others --exclude-standard -- '*.cc' '*.h' |
                         sort -u)
  else
    mapfile -t files < <(find . -path ./.git -prune -o -path './bazel-*' -prune \
                           -o -type f \( -name '*.cc' -o -name '*.h' \) -print |
                         sed 's|^\./||' | sort)
  fi
  kept=()
  for f in "${files[@]}"; do
    case "$f" in
      third_party/*|bazel-*|*/corpus/*|*/regressions/*) ;;
      *) [[ -f "$f" ]] && kept+=("$f") ;;  # a deleted file git still lists
    esac
  done
  files=("${kept[@]}")
fi

if ((check == 0)); then
  printf '%s\0' "${files[@]}" | xargs -0 -r -n 20 -P "$(nproc)" "$clang_format" -i --style=file
  echo "format.sh: formatted ${#files[@]} files with $version"
  exit 0
fi

differing=0
changed_lines=0
for f in "${files[@]}"; do
  # Lines clang-format would remove or add (a diff's < and > lines).
  n=$("$clang_format" --style=file "$f" | diff -- "$f" - | grep -c '^[<>]' || true)
  if ((n > 0)); then
    echo "$f: $n lines differ"
    differing=$((differing + 1))
    changed_lines=$((changed_lines + n))
  fi
done
if ((differing > 0)); then
  echo "format.sh --check: $differing of ${#files[@]} files are not formatted" \
       "($changed_lines diff lines); run tools/format.sh to format them"
  exit 1
fi
echo "format.sh --check: ${#files[@]} files formatted ($version)"
