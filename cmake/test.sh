#!/usr/bin/env bash
# Installs what is missing, builds (Release, warnings on) and runs the whole test suite.
set -euo pipefail
source "$(dirname "$0")/build.sh"
cd build
ctest --output-on-failure -j"$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" --timeout 900
