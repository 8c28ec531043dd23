#!/usr/bin/env bash
# Installs what is missing, builds (Release, warnings on) and runs the test suite.
#   bash cmake/test.sh               the default suite: unit and MPI tests at 1-4 ranks, end-to-end CLI
#                                    tests, the local SLURM cluster, format and layering (ctest -LE
#                                    extended; under 30 minutes on a 2-core host)
#   bash cmake/test.sh --extended    the default suite, then the slow gates (ctest -L extended):
#                                    clang-tidy, ASan + UBSan and TSan builds, libFuzzer (.ci/run)
set -euo pipefail
extended=0
case "${1:-}" in
  "") ;;
  --extended) extended=1 ;;
  *)
    echo "test.sh: unknown argument '$1' (none, or --extended)" >&2
    exit 2
    ;;
esac
source "$(dirname "$0")/build.sh"
cd build
jobs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
ctest --output-on-failure -j"$jobs" --timeout 900 -LE extended
((extended)) || exit 0
ctest --output-on-failure -j"$jobs" --timeout 2400 -L extended
