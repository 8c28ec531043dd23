#!/usr/bin/env bash
# Installs what is missing and builds dpstream in Release into build/ (sourced by demo.sh and test.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash cmake/install-deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
