#!/usr/bin/env bash
# Installs what is missing, builds in Release and runs the built-in demo job on 2 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash cmake/install-deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
out=${1:-dpstream-demo-out}
mpirun --oversubscribe -np 2 build/src/dpstream run --demo --out "$out" --progress never
echo "--- first rows of $out/releases.csv"
head -n 6 "$out/releases.csv"
echo "--- counts from $out/summary.json"
grep -E '"(read|kept|dropped_by_bounding|distinct_users|distinct_keys|release_rows)"' "$out/summary.json"
