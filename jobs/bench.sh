#!/usr/bin/env bash
# Engine-path benchmark on the paper workload: one RESULT line per rank count and thread count.
# The naive program's side-by-side comparison is jobs/bench-whole-job.sh.
#   jobs/bench.sh [build/src/dpstream] [extra --set args...]
# Example (smaller): jobs/bench.sh build/src/dpstream --set input.users=1000000
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../build/src/dpstream}
shift || true
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI: more ranks than cores, no binding (other MPIs ignore OMPI_* and neither bind nor refuse by default).
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
for np in 1 2; do
  threads=$(( cores / np > 0 ? cores / np : 1 ))
  for th in 1 "$threads"; do
    OMP_NUM_THREADS=$th mpirun -np "$np" "$bin" bench "$here/paper-workload.toml" \
      --progress never "$@" | grep '^RESULT'
    [[ $th == 1 && $threads == 1 ]] && break
  done
done
