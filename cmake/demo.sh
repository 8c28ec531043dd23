#!/usr/bin/env bash
# Installs what is missing, builds in Release and runs the built-in demo as a DP release on 2 ranks:
# the privacy budget it spends, the release, and its error against the truth (an exact run of the
# same stream without contribution bounding). Usage: bash cmake/demo.sh [OUTPUT_DIR]
set -euo pipefail
source "$(dirname "$0")/build.sh"
out=${1:-dpstream-demo-out}
bin=build/src/dpstream
export OMPI_MCA_rmaps_base_oversubscribe=1  # 2 ranks on a 1-core machine too (Open MPI; other MPIs ignore it)
size=(--set input.users=300000 --set input.keys=20000)
dp=(--set 'privacy.mode="dp"' --set privacy.epsilon=6 --set privacy.delta=1e-9)
echo "--- $("$bin" --version)"
echo "--- privacy budget of the demo (dpstream budget: no data read)"
"$bin" budget --demo "${size[@]}" "${dp[@]}" | grep -E '^(privacy budget|mode|total)'
echo "--- DP release (DP-SQLP, user-level eps = 6, delta = 1e-9 per window) into $out/dp"
mpirun -np 2 "$bin" run --demo --fresh --out "$out/dp" --progress never "${size[@]}" "${dp[@]}"
echo "--- first rows of $out/dp/releases.csv (window,trigger,key,count,sum; noisy)"
head -n 6 "$out/dp/releases.csv"
echo "--- the truth for comparison (mode none, nothing dropped: C above every user's record count)"
mpirun -np 2 "$bin" run --demo --fresh --out "$out/truth" --progress never "${size[@]}" \
  --set privacy.max_records_per_user=1000000 >/dev/null
echo "--- error of the DP release against the truth at the last trigger (dpstream evaluate)"
"$bin" evaluate --truth "$out/truth" --released "$out/dp" | sed -n '1,12p'
