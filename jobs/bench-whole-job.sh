#!/usr/bin/env bash
# Issue 15's whole-job comparison: dpstream's `run` (generation, both shuffles, bounding,
# accumulation, output, checkpoints at the defaults) on 2 ranks against the naive single-threaded
# program tests/bench/naive_job.cpp on a workload of the same distributions, alternating, side by
# side in one run. Prints each wall time and the ratio of the best ones.
#   jobs/bench-whole-job.sh [BUILD_DIR] [USERS] [REPEATS] [RANKS]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
users=${2:-2000000}
repeats=${3:-3}
ranks=${4:-2}
for f in "$build/src/dpstream" "$build/tests/naive_job"; do
  [[ -x $f ]] || { echo "bench-whole-job.sh: $f not found: build first (cmake --build $build)" >&2; exit 2; }
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI's default binding (a core per rank: one OpenMP thread each), as a user's plain mpirun.
export OMPI_MCA_rmaps_base_oversubscribe=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/job.toml" <<T
[input]
kind = "synthetic"
users = $users
keys = 1000000
key_distribution = "zipf-mandelbrot"
seed = 5
[stream]
triggers = 100
[privacy]
mode = "none"
max_records_per_user = 32
clamp_min = 0
clamp_max = 1
[output]
format = "csv"
T
wall() { local s=$EPOCHREALTIME; "$@" >/dev/null; awk -v a="$s" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.3f", b - a }'; }
min() { awk -v a="$1" -v b="$2" 'BEGIN { print (a < b ? a : b) }'; }
best_engine=1e9 best_naive=1e9
for i in $(seq "$repeats"); do
  rm -rf "$work/out"
  e=$(wall mpirun -np "$ranks" "$build/src/dpstream" run "$work/job.toml" --out "$work/out" --progress never)
  n=$(wall "$build/tests/naive_job" "$users" 1000000)
  echo "run $i: dpstream $e s, naive $n s"
  best_engine=$(min "$e" "$best_engine")
  best_naive=$(min "$n" "$best_naive")
done
echo "RESULT users=$users ranks=$ranks dpstream_s=$best_engine naive_s=$best_naive" \
  "speedup=$(awk -v n="$best_naive" -v e="$best_engine" 'BEGIN { printf "%.2f", n / e }')"
