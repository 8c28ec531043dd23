#!/usr/bin/env bash
# Installs what is missing, builds in Release and runs the built-in demo job on 2 ranks.
set -euo pipefail
source "$(dirname "$0")/build.sh"
out=${1:-dpstream-demo-out}
mpirun --oversubscribe -np 2 build/src/dpstream run --demo --out "$out" --progress never
echo "--- first rows of $out/releases.csv"
head -n 6 "$out/releases.csv"
echo "--- counts from $out/summary.json"
grep -E '"(read|kept|dropped_by_bounding|distinct_users|distinct_keys|release_rows)"' "$out/summary.json"
