#!/usr/bin/env bash
# Strong- and weak-scaling series on a SLURM cluster: submits one slurm/bench.sbatch job per rank
# count (one after another: --dependency=singleton, so the points never share nodes), waits, and
# collects their RESULT lines into RESULTS_DIR/<series>.csv; then plots them if matplotlib is there.
#   slurm/scaling.sh strong JOB.toml RESULTS_DIR [--ranks "1 2 4 8"] [--users N] [--threads T] [--sbatch "ARGS"] [--set k=v]...
#   slurm/scaling.sh weak   JOB.toml RESULTS_DIR --users N_PER_RANK [same options]
# strong: the same workload at every rank count (--users N overrides the spec's users);
# weak:   users = N_PER_RANK x ranks, so records per rank stay fixed.
# Points with more ranks x threads than the allocation's CPUs are submitted with --overcommit and
# marked oversubscribed: they measure correctness and communication volume, not speed.
# Run it where sbatch works (SLURM_CONF set for a test cluster: slurm/local-cluster.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
usage() { sed -n '2,12p' "$0" >&2; exit 2; }
(($# >= 3)) || usage
series=$1 job=$2 results=$3
shift 3
[[ $series == strong || $series == weak ]] || usage
[[ -f $job ]] || { echo "scaling.sh: job spec $job not found" >&2; exit 2; }
ranks_list="1 2 4 8" users="" threads=1 extra_sbatch="" sets=()
while (($#)); do
  case $1 in
    --ranks) ranks_list=$2; shift 2 ;;
    --users) users=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --sbatch) extra_sbatch=$2; shift 2 ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    *) echo "scaling.sh: unknown option $1" >&2; usage ;;
  esac
done
[[ $series == strong || -n $users ]] || { echo "scaling.sh: weak scaling needs --users N_PER_RANK" >&2; exit 2; }
command -v sbatch >/dev/null || { echo "scaling.sh: sbatch not found: run on a SLURM login node" >&2; exit 2; }
mkdir -p "$results"
results=$(cd "$results" && pwd)
job=$(cd "$(dirname "$job")" && pwd)/$(basename "$job")
cpus=$(sinfo -h -o %c | sort -n | head -1)
name="dpstream-scaling-$series-$$"
ids=()
for np in $ranks_list; do
  point_sets=("${sets[@]}")
  if [[ $series == weak ]]; then
    point_sets+=(--set "input.users=$((users * np))")
  elif [[ -n $users ]]; then
    point_sets+=(--set "input.users=$users")
  fi
  over=()
  if ((np * threads > cpus)) && [[ $extra_sbatch != *"-N"* && $extra_sbatch != *"--nodes"* ]]; then over=(--overcommit); fi
  # shellcheck disable=SC2086
  id=$(cd "$here/.." && sbatch --parsable --job-name="$name" --dependency=singleton -n "$np" -c "$threads" "${over[@]}" \
         --output="$results/$series-np$np.out" $extra_sbatch slurm/bench.sbatch "$job" "$results/$series-np$np-out" \
         "${point_sets[@]}")
  ids+=("${id%%;*}")
  echo "scaling.sh: submitted $series np=$np as job ${id%%;*}${over:+ (oversubscribed: $cpus CPUs per node)}" >&2
done
while [[ -n $(squeue -h -j "$(IFS=,; echo "${ids[*]}")" 2>/dev/null) ]]; do sleep 2; done
csv=$results/$series.csv
python3 - "$csv" "$series" "$results" $ranks_list <<'PY'
import os, sys
csv, series, results, ranks = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
rows = []
for np in ranks:
    path = os.path.join(results, f"{series}-np{np}.out")
    line = next((l for l in open(path) if l.startswith("RESULT ")), None) if os.path.exists(path) else None
    if line is None:
        sys.exit(f"scaling.sh: no RESULT line in {path}: see that file")
    rows.append(dict(kv.split("=", 1) for kv in line.split()[1:]))
cols = ["series"] + list(rows[0])
with open(csv, "w") as f:
    f.write(",".join(cols) + "\n")
    for r in rows:
        f.write(",".join([series] + [r.get(c, "") for c in cols[1:]]) + "\n")
print(f"scaling.sh: wrote {csv}", file=sys.stderr)
PY
cat "$csv"
if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  /usr/bin/python3 "$here/plot_scaling.py" "$csv" --out "$results/scaling-$series.png"
else
  echo "scaling.sh: matplotlib not installed (apt-get install python3-matplotlib): no plot" >&2
fi
