#!/usr/bin/env bash
# DP cost on the paper workload: the same stream run with mode = "none" and mode = "dp" back to
# back in one invocation; prints wall and engine seconds of each and their ratio.
#   jobs/bench-dp.sh [build/src/dpstream] [ranks] [extra --set args...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../build/src/dpstream}
np=${2:-2}
shift $(( $# >= 2 ? 2 : $# )) || true
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI: more ranks than cores, no binding (other MPIs ignore OMPI_* and neither bind nor refuse by default).
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
threads=$(( $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) / np > 0 ? $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) / np : 1 ))
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for mode in none dp; do
  OMP_NUM_THREADS=$threads mpirun -np "$np" "$bin" run "$here/paper-workload-dp.toml" \
    --set privacy.mode=$mode --progress never --out "$out/$mode" "$@" >/dev/null
done
python3 - "$out" <<'PY'
import json, sys
none, dp = (json.load(open(f"{sys.argv[1]}/{m}/summary.json")) for m in ("none", "dp"))
recs = none["records"]["read"]
for name, j in (("none", none), ("dp", dp)):
    print(f"RESULT mode={name} ranks={j['ranks']} threads={j['threads_per_rank']} records={recs} "
          f"wall_s={j['wall_seconds']:.2f} engine_s={j['engine_path_seconds']:.2f} "
          f"records_per_s={recs / j['wall_seconds']:.0f} dp_release_s={j['stage_seconds_max_over_ranks']['dp_release']:.2f} "
          f"release_rows={j['release_rows']}")
d = dp.get("dp", {})
rel = dp["stage_seconds_max_over_ranks"]["dp_release"]
# mode none writes every changed key (100x the rows of dp); rank 0's writing shows up as waiting in
# the next shuffle on the other ranks, so the DP cost is best read as dp_release over the rest of dp.
print(f"RESULT dp_release_over_rest_of_engine={rel / max(dp['engine_path_seconds'] - rel, 1e-9):.3f} "
      f"dp_over_none wall={dp['wall_seconds'] / none['wall_seconds']:.3f} "
      f"engine={dp['engine_path_seconds'] / none['engine_path_seconds']:.3f} "
      f"keys_released={d.get('keys_released')} release_rows={d.get('release_rows')} noise_draws={d.get('noise_draws')} threshold_tests={d.get('threshold_tests')} "
      f"key_state_bytes_per_tracked_key={d.get('key_state_bytes_per_tracked_key', 0):.1f} distinct_keys={dp['distinct_keys']}")
PY
