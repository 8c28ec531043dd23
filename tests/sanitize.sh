#!/usr/bin/env bash
# Builds the unit and MPI tests with a sanitizer in a build directory of its own and runs them (the
# ctest tests "sanitize_address" and "sanitize_thread", label sanitize).
#   bash tests/sanitize.sh address|thread [BUILD_DIR]   default BUILD_DIR: build-<kind>/ at the project root
# address: AddressSanitizer + UndefinedBehaviorSanitizer on the unit and MPI tests (the statistical
#   tests that only repeat the same code millions of times are left to the Release run).
# thread: ThreadSanitizer on the tests that run the checkpoint I/O thread beside the trigger loop, with
#   one OpenMP thread at most (OMP_THREAD_LIMIT=1, whatever a test asks for): GCC's libgomp is not
#   instrumented, so its barriers would be reported as races. Open MPI talks through shared memory
#   only (its TCP transport takes two locks in both orders inside the library).
# Exit codes: 0 clean, 1 a report, a failed test or a build failure (the log is named).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
kind=${1:?usage: sanitize.sh address|thread [BUILD_DIR]}
build=${2:-$root/build-$kind}
case $kind in
  address)
    option=-DDPSTREAM_SANITIZE=ON
    targets=(test_partition test_kernels test_dp_tree test_key_scan test_shuffle test_core test_engine test_checkpoint)
    tests='^(test_partition|test_kernels|test_dp_tree|test_key_scan|test_shuffle|test_core|test_engine|test_checkpoint)\.np'
    threads=2
    ;;
  thread)
    option=-DDPSTREAM_SANITIZE_THREAD=ON
    targets=(test_engine test_checkpoint)
    tests='^(test_engine|test_checkpoint)\.np[12]$'
    threads=1
    ;;
  *)
    echo "sanitize: unknown kind '$kind' (address or thread)" >&2
    exit 2
    ;;
esac

t0=$(date +%s)
mkdir -p "$build"
echo "sanitize($kind): building ${targets[*]} in $build"
# -O0 -g1 (line tables): the quickest build that still gives the reports' file:line (CI's time).
# Unit tests at -O0 under a sanitizer run several times slower than the default build's 300-s limit allows on a
# loaded 2-core host (test_key_scan took over 300 s under ASan beside other builds).
if ! cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O0 -g1" \
     -DDPSTREAM_UNIT_TEST_TIMEOUT=1200 "$option" >"$build/configure.log" 2>&1; then
  tail -30 "$build/configure.log"
  echo "sanitize($kind): FAILED: configuring (log: $build/configure.log)"
  exit 1
fi
if ! cmake --build "$build" -j"$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" --target "${targets[@]}" \
     >"$build/build.log" 2>&1; then
  grep -E "error|Error" "$build/build.log" | head -40
  echo "sanitize($kind): FAILED: building (log: $build/build.log)"
  exit 1
fi
t1=$(date +%s)

# Open MPI's own allocations at MPI_Init are never freed and are not the project's: no leak check
# (the fuzz targets, which do not start MPI, check leaks).
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$here/tsan.supp"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=$threads
[[ $kind == thread ]] && export OMP_THREAD_LIMIT=1 OMPI_MCA_btl=self,vader
(cd "$build" && ctest -R "$tests" -j"$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" --output-on-failure \
   --timeout 600 >"$build/ctest.log" 2>&1)
rc=$?
t2=$(date +%s)
grep -E "tests passed|tests failed" "$build/ctest.log"
if ((rc != 0)) || grep -qE 'ERROR: (Address|Leak)Sanitizer|runtime error:|WARNING: ThreadSanitizer' "$build/ctest.log"; then
  grep -E -m3 -A30 'ERROR: (Address|Leak)Sanitizer|runtime error:|WARNING: ThreadSanitizer|\*\*\*Failed' "$build/ctest.log" | head -80
  echo "sanitize($kind): FAILED (build $((t1 - t0)) s, tests $((t2 - t1)) s; log: $build/ctest.log)"
  exit 1
fi
echo "sanitize($kind): clean (build $((t1 - t0)) s, tests $((t2 - t1)) s)"
