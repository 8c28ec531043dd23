#!/usr/bin/env bash
# Installs the Debian packages dpstream needs to build, run and test (run as root on Debian 12).
# Idempotent: installs only what is missing.
set -euo pipefail
packages=(
  build-essential cmake pkg-config git
  libopenmpi-dev openmpi-bin            # MPI
  libhdf5-dev hdf5-tools                # HDF5 (checkpoints) and h5dump
  libboost-serialization-dev            # tests/bench/serialization_bench.cpp (docs/DESIGN-NOTES.md: why the engine does not use it)
  libgtest-dev                          # unit tests
  libcli11-dev libtomlplusplus-dev      # CLI and job specs
  libfmt-dev nlohmann-json3-dev         # formatting and summary.json
  libabsl-dev libxxhash-dev             # flat hash maps, string hashing
  libssl-dev                            # keyed cryptographic PRF for noise
  libsqlite3-dev                        # the budget ledger (transactional admission)
  python3                               # independent reference computations in tests
  slurm-wlm munge                       # the local SLURM cluster of the SLURM test (slurm/local-cluster.sh)
  python3-matplotlib                    # scaling plots (slurm/plot_scaling.py)
  clang libclang-rt-14-dev libomp-dev   # libFuzzer targets built with clang (tests/fuzz/run_fuzz.sh)
  clang-format clang-tidy               # the lint test (tests/lint.sh, .clang-format, .clang-tidy)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "install-deps: all Debian packages present"
fi
