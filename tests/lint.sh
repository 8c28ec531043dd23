#!/usr/bin/env bash
# The style and static-analysis gates (ctest "format", label lint, in the default run; ctest "tidy",
# labels lint and extended, run by .ci/run after it):
#  format: clang-format --dry-run -Werror on every C++ file of the project (.clang-format), seconds;
#  tidy:   clang-tidy (.clang-tidy: bugprone, performance, concurrency; warnings are errors) on every
#          translation unit of the project in BUILD_DIR/compile_commands.json, in parallel (about
#          15 s of a core per unit: 20 minutes of a 2-core host);
#  all:    both (the default).
#   bash tests/lint.sh BUILD_DIR [format|tidy|all]
# Fix formatting with: clang-format -i $(git ls-files '*.cpp' '*.hpp')
# Exit codes: 0 clean, 1 findings (listed), 77 skipped: clang-format or clang-tidy not installed.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
build=${1:?usage: lint.sh BUILD_DIR [format|tidy|all]}
mode=${2:-all}
case $mode in
  format) tools=(clang-format) ;;
  tidy) tools=(clang-tidy) ;;
  all) tools=(clang-format clang-tidy) ;;
  *)
    echo "lint: unknown mode '$mode' (format, tidy or all)" >&2
    exit 2
    ;;
esac
for tool in "${tools[@]}"; do
  command -v $tool >/dev/null 2>&1 || { echo "lint: SKIPPED: $tool not found (cmake/install-deps.sh installs it)"; exit 77; }
done
[[ -f $build/compile_commands.json ]] || { echo "lint: $build/compile_commands.json missing (configure first)"; exit 1; }
cd "$root"
mapfile -t sources < <(find common partition shuffle kernels src tools tests -name '*.cpp' -o -name '*.hpp' 2>/dev/null | sort)
fail=0

check_format() {
  if ! clang-format --dry-run -Werror "${sources[@]}" 2>"$build/format.log"; then
    grep -E "error:" "$build/format.log" | cut -d: -f1 | sort | uniq -c | head -30
    echo "lint: FAILED: clang-format would change the files above (run: clang-format -i FILE...)"
    fail=1
  fi
}

check_tidy() {
  # Translation units of the project (not of the build's generated files).
  mapfile -t units < <(python3 - "$build/compile_commands.json" "$root" <<'PY'
import json, os, sys
root = os.path.realpath(sys.argv[2]) + os.sep
seen = sorted({os.path.realpath(e["file"]) for e in json.load(open(sys.argv[1]))})
print("\n".join(f for f in seen if f.startswith(root) and "/build" not in f[len(root) - 1:]))
PY
  )
  local jobs
  jobs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  printf '%s\n' "${units[@]}" | xargs -P "$jobs" -n 4 clang-tidy -p "$build" --quiet >"$build/tidy.log" 2>&1
  if grep -q "error:" "$build/tidy.log"; then
    grep -E "error:" "$build/tidy.log" | sort -u | head -40
    echo "lint: FAILED: clang-tidy findings above (log: $build/tidy.log)"
    fail=1
  fi
}

units=()
t0=$(date +%s)
[[ $mode == tidy ]] || check_format
t1=$(date +%s)
[[ $mode == format ]] || check_tidy
t2=$(date +%s)
((fail)) && exit 1
echo "lint($mode): clean (${#sources[@]} files formatted, ${#units[@]} translation units analysed; format $((t1 - t0)) s, tidy $((t2 - t1)) s)"
