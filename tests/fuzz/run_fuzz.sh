#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang into a build directory of their own and runs
# each for a bounded time (the ctest test "fuzz", label fuzz). Every target first replays its seed
# corpus (tests/fuzz/corpus/<target>, which also keeps the inputs of fixed crashes).
#   bash tests/fuzz/run_fuzz.sh [BUILD_DIR]      default BUILD_DIR: build-fuzz/ at the project root
# Environment: DPSTREAM_FUZZ_SECONDS (per target, default 15), CC / CXX (default clang / clang++).
# Exit codes: 0 no crash, 1 a crash, leak, sanitizer report or build failure (the summary names the
# input to replay), 77 skipped: clang or its libFuzzer runtime is not installed (cmake/install-deps.sh).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-$root/build-fuzz}
seconds=${DPSTREAM_FUZZ_SECONDS:-15}
cc=${CC:-clang}
cxx=${CXX:-clang++}
targets=(fuzz_csv fuzz_config fuzz_manifest fuzz_checkpoint_h5)

skip() {
  echo "fuzz: SKIPPED: $*"
  exit 77
}
command -v "$cxx" >/dev/null 2>&1 || skip "$cxx not found; install clang and libclang-rt-14-dev (cmake/install-deps.sh)"
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' >"$probe/p.cpp"
"$cxx" -fsanitize=fuzzer,address,undefined "$probe/p.cpp" -o "$probe/p" >"$probe/log" 2>&1 ||
  skip "$cxx cannot link a libFuzzer target (install libclang-rt-14-dev): $(head -c 300 "$probe/log")"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
t0=$(date +%s)
echo "fuzz: building ${targets[*]} with $cxx in $build"
mkdir -p "$build"
if ! cmake -S "$here" -B "$build" -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" >"$build/configure.log" 2>&1; then
  tail -30 "$build/configure.log"
  echo "fuzz: FAILED: configuring $build (log: $build/configure.log)"
  exit 1
fi
if ! cmake --build "$build" -j"$(nproc)" >"$build/build.log" 2>&1; then
  grep -E "error|Error" "$build/build.log" | head -40
  echo "fuzz: FAILED: building (log: $build/build.log)"
  exit 1
fi
t1=$(date +%s)
echo "fuzz: built in $((t1 - t0)) s"

# LeakSanitizer: libhdf5's own leaks on its error paths are not the project's (lsan.supp).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export LSAN_OPTIONS="suppressions=$here/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TMPDIR="$build/tmp"  # the targets' scratch files (a crashed target leaves its own)
mkdir -p "$TMPDIR"

declare -A dict=([fuzz_csv]=csv [fuzz_config]=toml [fuzz_manifest]=json)
declare -A max_len=([fuzz_csv]=4096 [fuzz_config]=4096 [fuzz_manifest]=8192 [fuzz_checkpoint_h5]=1024)
failed=()
summary=()
for t in "${targets[@]}"; do
  name=${t#fuzz_}
  work="$build/corpus/$name"  # inputs found by earlier runs; the checked-in seeds are only read
  mkdir -p "$work" "$build/artifacts"
  args=(-max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -max_len="${max_len[$t]}" -print_final_stats=1
        -artifact_prefix="$build/artifacts/$t-")
  [[ -n ${dict[$t]:-} ]] && args+=(-dict="$here/dict/${dict[$t]}.dict")
  log="$build/$t.log"
  "$build/$t" "${args[@]}" "$work" "$here/corpus/$name" >"$log" 2>&1
  rc=$?
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$')
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1)
  if ((rc == 0)) && ! grep -qE 'ERROR: (Address|Leak|Undefined)Sanitizer|runtime error:|fuzz property violated' "$log"; then
    summary+=("  $t: ok, ${runs:-?} inputs in ${seconds} s, ${cov:-cov: ?}")
  else
    failed+=("$t")
    artifact=$(grep -oE "Test unit written to [^ ]+" "$log" | tail -1 | sed 's/Test unit written to //')
    grep -E -m1 -A25 'ERROR: |runtime error:|fuzz property violated|==ERROR' "$log" | head -40
    summary+=("  $t: FAILED (exit $rc), input: ${artifact:-see log}; log: $log")
    [[ -n $artifact ]] && summary+=("      replay: $build/$t $artifact")
  fi
done
t2=$(date +%s)
echo "fuzz: summary (build $((t1 - t0)) s, fuzzing $((t2 - t1)) s)"
printf '%s\n' "${summary[@]}"
echo "fuzz: $((${#targets[@]} - ${#failed[@]})) passed, ${#failed[@]} failed"
if ((${#failed[@]})); then
  echo "fuzz: FAILED: ${failed[*]}: fix the bug, then keep the input in tests/fuzz/corpus/<target>/ or add a unit test"
  exit 1
fi
exit 0
