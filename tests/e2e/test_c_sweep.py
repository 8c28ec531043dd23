#!/usr/bin/env python3
"""End-to-end test of jobs/c_sweep.py (docs/EVALUATION.md): a small sweep runs the truth, each C and evaluate,
and writes its table; a truth run that fails stops every task of the sweep with its cause instead of leaving the
others waiting for it forever (helper sweep of 2026-12-07); bad --values are refused with a message.

Usage: test_c_sweep.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import csv
import os
import subprocess
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SWEEP = os.path.join(REPO, "jobs", "c_sweep.py")


def main():
    args = harness.parse_args(__doc__.splitlines()[0])
    results = harness.Results("e2e_c_sweep")
    dps = harness.Dpstream(args)
    env = dps.launch_env(dps.env)  # root and oversubscription settings for the sweep's mpiruns

    def sweep(out, *extra, bin_path=None, timeout=120):
        argv = [sys.executable, SWEEP, "--bin", bin_path or args.bin, "--ranks", str(args.ranks), "--out", out,
                "--users", "3000", "--set", "stream.triggers=4", *extra]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)

    with harness.TempDir(args.keep, "dpstream-c-sweep-") as tmp:
        def small_sweep():
            out = os.path.join(tmp, "small")
            r = sweep(out, "--values", "1,4")
            assert r.returncode == 0, r.stderr[-3000:]
            with open(os.path.join(out, "c_sweep.csv"), newline="") as f:
                rows = list(csv.DictReader(f))
            assert [int(row["C"]) for row in rows] == [1, 4], rows
            # A larger C drops fewer records (the same stream and seed).
            assert float(rows[0]["dropped_share"]) > float(rows[1]["dropped_share"]), rows
            with open(os.path.join(out, "truth.toml")) as f:
                truth = f.read()
            assert 'mode = "none"' in truth and "max_records_per_user" not in truth, truth

        def failed_truth_stops_every_task():
            # Two array tasks at once, the truth run failing (a binary that fails after 2 s, so that the other task
            # is waiting for it by then): both end with its cause, and a later task stops on it at once.
            out = os.path.join(tmp, "failing")
            failing = os.path.join(tmp, "failing-dpstream")
            with open(failing, "w") as f:
                f.write("#!/bin/sh\nsleep 2\nexit 1\n")
            os.chmod(failing, 0o755)
            procs = [subprocess.Popen([sys.executable, SWEEP, "--bin", failing, "--ranks", "1", "--out", out,
                                       "--values", "1,2", "--task", str(t)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env) for t in (0, 1)]
            try:
                outputs = [p.communicate(timeout=60) for p in procs]
            finally:
                for p in procs:  # a task still waiting (the failure this test is for) must not outlive it
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            for p, (_, err) in zip(procs, outputs):
                assert p.returncode != 0 and "failed" in err, (p.returncode, err)
            assert sum("the truth run failed" in err for _, err in outputs) == 1, outputs  # the waiting task's
            later = subprocess.run([sys.executable, SWEEP, "--bin", failing, "--ranks", "1", "--out", out, "--values",
                                    "1,2", "--task", "0"], capture_output=True, text=True, timeout=60, env=env)
            assert later.returncode != 0 and "the truth run failed" in later.stderr, later.stderr
            assert not os.path.exists(os.path.join(out, "truth.lock")), "the lock of a failed truth run was left"
            assert os.path.exists(os.path.join(out, "truth.failed"))

        def bad_values():
            r = sweep(os.path.join(tmp, "bad"), "--values", "1,,2")
            assert r.returncode == 2 and "comma-separated whole numbers" in r.stderr, r.stderr

        results.check("a sweep of C = 1, 4: truth, runs, evaluate, table (fewer records dropped at the larger C)",
                      small_sweep)
        results.check("a failing truth run stops every task with its cause; no lock left", failed_truth_stops_every_task)
        results.check("--values 1,,2 refused with a message", bad_values)
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
