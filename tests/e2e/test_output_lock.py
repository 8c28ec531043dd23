#!/usr/bin/env python3
"""End-to-end test of one job at a time in an output directory.

A job (A) runs with checkpoints into an output directory and is held mid-run: DPSTREAM_FAULT stops its
rank 0 with SIGSTOP at a trigger (the job then holds the directory, as a job that a scheduler requeued
while it still runs would). While A is held, a second job into the same directory must be refused with
exit code 2 and a message that the directory is in use, whether it asks for --resume, --fresh or
neither, and must leave the directory as it found it (without the lock, such a second job
interleaved its commits and rows with A's and both exited 0 with a releases.csv of duplicate,
out-of-order and torn rows). Then A continues (SIGCONT) and must finish with releases.csv
byte-identical to an uninterrupted run's. Once A has ended, --resume finds the job complete: the lock
died with A.

Usage: test_output_lock.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import os
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

EXIT_CONFIG = 2
IN_USE = "is in use by another dpstream job"
HOLD_TIMEOUT = 60.0


def stopped_ranks(out_dir):
    """Pids of stopped (state T) dpstream processes whose command line names out_dir."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError):
            continue
        if state == "T" and any(a.endswith(b"dpstream") for a in argv) and out_dir.encode() in argv:
            pids.append(int(name))
    return pids


def main():
    args = harness.parse_args(__doc__)
    dps = harness.Dpstream(args)
    results = harness.Results(f"e2e_output_lock (ranks={args.ranks})")
    with harness.TempDir(args.keep, "dpstream-e2e-output-lock-") as tmp:
        job = harness.write_job(os.path.join(tmp, "job.toml"), harness.synthetic_job_toml(
            "e2e-lock", "none", 20000, 12, keys=2000, seed=3, window_seconds=86400, max_records=8, noise_seed=0,
            every=1))
        ref_dir, out = os.path.join(tmp, "ref"), os.path.join(tmp, "out")
        state = {}

        def reference():
            r = dps.run("run", job, "--out", ref_dir)
            assert r.returncode == 0, "uninterrupted run failed\n  " + r.describe()
            state["ref"] = harness.read_bytes(os.path.join(ref_dir, "releases.csv"))
            assert state["ref"], "the uninterrupted run wrote no rows"

        def hold_first_job():
            argv = [dps.mpirun, "-np", str(args.ranks), dps.bin, "run", job, "--out", out]
            env = dps.launch_env(dict(dps.env, DPSTREAM_FAULT="shuffle_user@5:0:STOP"))
            state["a"] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, encoding="utf-8",
                                          errors="replace", env=env, start_new_session=True)
            deadline = time.monotonic() + HOLD_TIMEOUT
            while not stopped_ranks(out):
                assert state["a"].poll() is None, f"job A ended (exit {state['a'].returncode}) before it was held"
                assert time.monotonic() < deadline, f"job A's rank 0 did not stop within {HOLD_TIMEOUT} s"
                time.sleep(0.05)
            assert os.path.isdir(os.path.join(out, "checkpoint")), "job A was held before its first commit"
            # The other ranks' checkpoint threads may still finish a segment of the last commit: wait until the
            # directory stops changing, so that the refusals below compare it with itself.
            previous = harness.snapshot_tree(out)
            while True:
                time.sleep(0.3)
                current = harness.snapshot_tree(out)
                if current == previous:
                    break
                assert time.monotonic() < deadline, "job A's output dir kept changing while A was held"
                previous = current

        def refused(*flags):
            def check():
                before = harness.snapshot_tree(out)
                r = dps.run_with("run", job, "--out", out, *flags, timeout=60)
                assert r.returncode == EXIT_CONFIG, f"expected exit code {EXIT_CONFIG}\n  " + r.describe()
                assert IN_USE in r.stderr, f"stderr does not say '{IN_USE}'\n  " + r.describe()
                after = harness.snapshot_tree(out)
                assert after == before, "the refused job changed the output dir: " + \
                    harness.describe_tree_change(before, after)
            return check

        def first_job_finishes():
            for pid in stopped_ranks(out):
                os.kill(pid, signal.SIGCONT)
            a = state["a"]
            try:
                _, err = a.communicate(timeout=HOLD_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(a.pid, signal.SIGKILL)
                raise AssertionError("job A did not finish after SIGCONT")
            assert a.returncode == 0, f"job A failed after SIGCONT: exit {a.returncode}\n  stderr: {err[-2000:]!r}"
            got = harness.read_bytes(os.path.join(out, "releases.csv"))
            assert got == state["ref"], f"job A's releases.csv ({len(got or b'')} bytes) differs from the " \
                f"uninterrupted run's ({len(state['ref'])} bytes) at byte {harness.first_difference(got or b'', state['ref'])}"

        def lock_gone_with_the_job():
            r = dps.run("run", job, "--out", out, "--resume")
            assert r.returncode == 0, "--resume after job A ended failed\n  " + r.describe()
            assert "already complete" in r.stderr + r.stdout, "--resume did not find the job complete\n  " + r.describe()
            assert harness.read_bytes(os.path.join(out, "releases.csv")) == state["ref"], "releases.csv changed"

        try:
            results.check("uninterrupted run (reference)", reference)
            results.check("job A held at a trigger, its checkpoint begun", hold_first_job)
            if "a" in state and state["a"].poll() is None:
                results.check("a second job with --resume is refused while A runs", refused("--resume"))
                results.check("a second job with --fresh is refused while A runs", refused("--fresh"))
                results.check("a second job without a flag is refused while A runs", refused())
                results.check("A continues and finishes = reference", first_job_finishes)
                results.check("--resume once A ended: complete, the lock gone with A", lock_gone_with_the_job)
        finally:
            a = state.get("a")
            if a is not None and a.poll() is None:
                for pid in stopped_ranks(out):
                    os.kill(pid, signal.SIGCONT)
                os.killpg(a.pid, signal.SIGKILL)
                a.communicate()
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
