#!/usr/bin/env bash
# Checkpoint cost on the paper workload (DP, T = 100, a commit after every trigger: every = 1 with one trigger
# a bounding batch, trigger_batch = 1; the default time-based cadence commits far less often): the run without
# checkpoints and with them, side by side, then the same job killed right after commit K and resumed. Prints RESULT lines with seconds per
# commit, checkpoint time over the rest of the run, bytes per tracked key and per active user,
# and the resume (load) time.
#   jobs/bench-checkpoint.sh [build/src/dpstream] [ranks] [kill-after-commit] [extra --set args...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../build/src/dpstream}
np=${2:-2}
kill_at=${3:-50}
shift $(( $# >= 3 ? 3 : $# )) || true
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI: more ranks than cores, no binding (other MPIs ignore OMPI_* and neither bind nor refuse by default).
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none OMPI_MCA_odls_base_sigkill_timeout=0
threads=$(( $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) / np > 0 ? $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) / np : 1 ))
out=${BENCH_OUT:-$(mktemp -d)}
[ -n "${BENCH_OUT:-}" ] || trap 'rm -rf "$out"' EXIT
run() { OMP_NUM_THREADS=$threads mpirun -np "$np" "$bin" run "$here/paper-workload-dp.toml" --set privacy.seed=1 \
          --set checkpoint.every=1 --set engine.trigger_batch=1 --progress never "$@"; }
run --out "$out/none" --set checkpoint.every=0 "$@" >/dev/null   # the same run without checkpoints
run --out "$out/full" "$@" >/dev/null
du -sb "$out/full/checkpoint" | awk '{print "checkpoint_dir_bytes_at_end=" $1}' > "$out/du.txt"
# Kill rank 0 right after commit K (the manifest is durable, the rows not yet published), then resume.
set +e
DPSTREAM_FAULT="committed@$kill_at:0" run --out "$out/killed" "$@" >/dev/null 2>&1
set -e
ls "$out/killed/checkpoint/w0" | wc -l | awk '{print "segment_files_at_kill=" $1}' >> "$out/du.txt"
du -sb "$out/killed/checkpoint" | awk '{print "checkpoint_dir_bytes_at_kill=" $1}' >> "$out/du.txt"
t0=$(date +%s.%N)
run --out "$out/killed" --resume "$@" >/dev/null
t1=$(date +%s.%N)
cmp -s "$out/full/releases.csv" "$out/killed/releases.csv" && same=yes || same=NO
python3 - "$out" "$(echo "$t1 - $t0" | bc)" "$same" "$kill_at" <<'PY'
import json, sys
out, resume_wall, same, kill_at = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
full = json.load(open(f"{out}/full/summary.json"))
none = json.load(open(f"{out}/none/summary.json"))
res = json.load(open(f"{out}/killed/summary.json"))
extra = dict(line.strip().split("=") for line in open(f"{out}/du.txt"))
st, ck = full["stage_seconds_max_over_ranks"], full["checkpoint"]
rest = full["wall_seconds"] - st["checkpoint"]
users, keys = full["distinct_users"], full["distinct_keys"]
print(f"RESULT ranks={full['ranks']} threads={full['threads_per_rank']} records={full['records']['read']} "
      f"commits={ck['commits']} wall_s={full['wall_seconds']:.2f} checkpoint_s={st['checkpoint']:.2f} "
      f"seconds_per_commit={st['checkpoint'] / ck['commits']:.4f} checkpoint_over_rest={st['checkpoint'] / rest:.3f} "
      f"segment_bytes_written={ck['segment_bytes_written']} "
      f"user_state_bytes_per_active_user={ck['user_state_bytes_written'] / users:.1f} "
      f"key_state_bytes_per_tracked_key={ck['key_state_bytes_written'] / keys:.1f} "
      f"file_bytes_per_record={ck['segment_bytes_written'] / full['records']['read']:.2f} "
      f"active_users={users} tracked_keys={keys} {' '.join(f'{k}={v}' for k, v in extra.items())}")
print(f"RESULT wall_without_checkpoints_s={none['wall_seconds']:.2f} wall_with_s={full['wall_seconds']:.2f} "
      f"with_over_without={full['wall_seconds'] / none['wall_seconds']:.3f}")
print(f"RESULT resume_after_commit={kill_at} resume_wall_s={resume_wall:.2f} "
      f"resume_load_s={res['checkpoint']['load_seconds_max_over_ranks']:.2f} "
      f"resumed_run_wall_s={res['wall_seconds']:.2f} identical_releases={same}")
PY
