#!/usr/bin/env bash
# The same job gives byte-identical releases.csv and the same state at each window's end
# (summary.json state_digest) at 1, 2, 3, 4 ranks and 1 or 2 threads, with exact releases
# (mode "none") and with DP releases under a fixed noise seed (mode "dp").
set -euo pipefail
bin=$1
mpiexec=${2:-mpirun}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMPI_MCA_rmaps_base_oversubscribe=1  # more ranks than cores (Open MPI; other MPIs ignore it)
run() {  # ranks threads dir [extra args]
  local np=$1 th=$2 dir=$3
  shift 3
  OMP_NUM_THREADS=$th "$mpiexec" -np "$np" "$bin" run --demo --progress never --out "$dir" "$@" >/dev/null
}
digest() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["state_digest"])' "$1/summary.json"; }
fail=0
for spec in "zipf" "uniform" "dp"; do
  extra=(--set input.users=30000 --set stream.triggers=12 --set stream.windows=2 --set privacy.max_records_per_user=5)
  [[ $spec == uniform ]] && extra+=(--set input.key_distribution=uniform --set input.keys=100000)
  [[ $spec == dp ]] && extra+=(--set privacy.mode=dp --set privacy.epsilon=4 --set privacy.delta=1e-7 --set privacy.mu=3
                               --set privacy.seed=99 --set input.users=60000)
  run 1 1 "$tmp/$spec-ref" "${extra[@]}"
  rows=$(($(wc -l <"$tmp/$spec-ref/releases.csv") - 1))
  if ((rows < 10)); then echo "FAIL $spec: only $rows release rows, the comparison would prove little"; fail=1; fi
  for np in 1 2 3 4; do
    for th in 1 2; do
      [[ $np == 1 && $th == 1 ]] && continue
      run "$np" "$th" "$tmp/$spec-$np-$th" "${extra[@]}"
      want=$(digest "$tmp/$spec-ref") got=$(digest "$tmp/$spec-$np-$th")
      if ! cmp -s "$tmp/$spec-ref/releases.csv" "$tmp/$spec-$np-$th/releases.csv"; then
        echo "FAIL $spec ranks=$np threads=$th differs from ranks=1 threads=1"
        fail=1
      elif [[ $got == "$want" ]]; then
        echo "ok   $spec ranks=$np threads=$th ($rows rows identical, state digest $got)"
      else
        echo "FAIL $spec ranks=$np threads=$th: state_digest $got, ranks=1 threads=1 $want"
        fail=1
      fi
    done
  done
done
exit $fail
