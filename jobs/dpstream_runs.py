"""Helpers shared by the evaluation drivers (table1.py, c_sweep.py): run a job, write its truth spec."""
import os
import subprocess
import sys
import time


def dpstream_run(a, spec, out_dir, sets):
    """Runs `dpstream run` on a.ranks ranks without checkpoints; returns the wall time (s); exits on failure."""
    cmd = ["mpirun", "-np", str(a.ranks), a.bin] if a.ranks > 1 else [a.bin]
    cmd += ["run", spec, "--fresh", "--out", out_dir, "--set", "checkpoint.every=0", "--set", "output.progress=never"]
    if a.users:
        cmd += ["--set", f"input.users={a.users}"]
    for s in sets + a.set:
        cmd += ["--set", s]
    os.makedirs(out_dir, exist_ok=True)
    log = os.path.join(out_dir, "run.log")
    with open(log, "w") as f:
        t0 = time.monotonic()
        env = dict(os.environ)
        env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")  # Open MPI: ranks > cores; others ignore it
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        sys.exit(f"{os.path.basename(sys.argv[0])}: command failed (exit {rc}), see {log}: {' '.join(cmd)}")
    return time.monotonic() - t0


def write_truth_spec(spec, path):
    """The same job as the true histogram: mode none without contribution bounding (C, the budget and its ledger left
    out: mode none spends none)."""
    with open(spec) as f, open(path, "w") as g:
        for line in f:
            key = line.split("=")[0].strip()
            if key in ("max_records_per_user", "epsilon", "delta", "ledger"):
                continue
            g.write('mode = "none"\n' if key == "mode" else line)
