#!/usr/bin/env bash
# Installs what is missing, builds (Release, warnings on) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash cmake/install-deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
cd build
ctest --output-on-failure -j"$(nproc)" --timeout 900
