#!/usr/bin/env bash
# Issue 16's ratio: the paper workload with DP (jobs/paper-workload-dp.toml) at T = 100 and T = 1000
# triggers per window, alternating, side by side in one run. Each pair's runs follow each other, so
# their ratio is what a shared, noisy host measures best; prints every run, then the median of the
# pairs' ratios and the ratio of the best runs.
#   jobs/bench-trigger-ratio.sh [BUILD_DIR] [USERS] [PAIRS] [RANKS]
# The noise secret is fixed (privacy.seed), so runs draw the same noise: a benchmark, not a release.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
users=${2:-2000000}
pairs=${3:-3}
ranks=${4:-2}
bin="$build/src/dpstream"
[[ -x $bin ]] || { echo "bench-trigger-ratio.sh: $bin not found: build first (cmake --build $build)" >&2; exit 2; }
for arg in "USERS=$users" "PAIRS=$pairs" "RANKS=$ranks"; do
  [[ ${arg#*=} =~ ^[1-9][0-9]*$ ]] || { echo "bench-trigger-ratio.sh: ${arg%%=*} must be a positive integer, not '${arg#*=}'" >&2; exit 2; }
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI: more ranks than cores, no binding (other MPIs ignore OMPI_* and neither bind nor refuse by default).
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
threads=$(( cores / ranks > 0 ? cores / ranks : 1 ))
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq "$pairs"); do
  order="100 1000"
  (( i % 2 == 0 )) && order="1000 100"  # whichever runs first in a pair alternates
  for T in $order; do
    out="$work/p$i-t$T"
    OMP_NUM_THREADS=$threads mpirun -np "$ranks" "$bin" run "$here/paper-workload-dp.toml" \
      --set "input.users=$users" --set "stream.triggers=$T" --set privacy.seed=5 \
      --progress never --out "$out" >/dev/null
  done
done
python3 - "$work" "$pairs" "$users" "$ranks" "$threads" <<'PY'
import json, statistics, sys
work, pairs, users, ranks, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
def run(i, t):
    j = json.load(open(f"{work}/p{i}-t{t}/summary.json"))
    d = j["dp"]
    print(f"pair {i} T={t}: wall {j['wall_seconds']:.2f} s, dp_release {j['stage_seconds_max_over_ranks']['dp_release']:.2f} s, "
          f"noise draws {d['noise_draws']}, keys visited per trigger {d['keys_visited_per_trigger']['mean']:.0f} "
          f"(tracked {j['distinct_keys']}), rank CPUs {j.get('main_cpu_per_rank', {}).get('cpu', '?')}")
    return j["wall_seconds"]
walls = {t: [] for t in (100, 1000)}
for i in range(1, pairs + 1):
    for t in (100, 1000):
        walls[t].append(run(i, t))
ratios = [b / a for a, b in zip(walls[100], walls[1000])]
print(f"RESULT users={users} ranks={ranks} threads={threads} pairs={pairs} "
      f"t100_best_s={min(walls[100]):.2f} t1000_best_s={min(walls[1000]):.2f} "
      f"ratio_median={statistics.median(ratios):.2f} ratio_best={min(walls[1000]) / min(walls[100]):.2f}")
PY
