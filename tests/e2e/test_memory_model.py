#!/usr/bin/env python3
"""End-to-end test of jobs/memory_model.py (docs/SCALE.md) against measured runs.

The billion-key spec at 2e4 and 3e5 users (uniform keys over 1e9, DP, 2 ranks by default): the model,
calibrated on the small run, must predict the large run's tracked keys within 1%, its bytes per
active user and per tracked key (the hash tables' geometry, computed from the workload) within 3%,
and its peak RSS within 35% (base and per-record terms are fitted on one small run); its table must
say that one 24-GiB node cannot hold the full workload and that 64 such nodes can, with the compute
time per trigger falling as nodes are added.

Usage: test_memory_model.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import json
import os
import re
import subprocess
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SPEC = os.path.join(REPO, "jobs", "paper-billion.toml")
MODEL = os.path.join(REPO, "jobs", "memory_model.py")


def model(*args):
    proc = subprocess.run([sys.executable, MODEL, "--job", SPEC, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"memory_model.py exited {proc.returncode}:\n{proc.stderr}"
    return proc.stdout


def main():
    args = harness.parse_args(__doc__.splitlines()[0])
    dps = harness.Dpstream(args)
    results = harness.Results("e2e_memory_model")
    with harness.TempDir(args.keep, "dpstream-model-") as tmp:
        runs = {}
        for users in (20000, 300000):
            out = os.path.join(tmp, f"u{users}")
            run = dps.run("run", SPEC, "--out", out, "--set", f"input.users={users}", "--set", "privacy.seed=7",
                          "--progress", "never")
            assert run.returncode == 0, run.describe()
            runs[users] = os.path.join(out, "summary.json")

        def check_prediction():
            text = model("--calibration", runs[20000], "--check", runs[300000])
            measured = json.load(open(runs[300000]))
            m = re.search(r"tracked keys model (\S+) measured (\d+); B/user model (\S+) measured (\S+); "
                          r"B/key model (\S+) measured (\S+); peak RSS/rank model (\S+) GiB measured (\S+) GiB", text)
            assert m, text
            keys_model, keys_got = float(m[1]), int(m[2])
            assert keys_got == measured["distinct_keys"], (keys_got, measured["distinct_keys"])
            assert abs(keys_model - keys_got) <= 0.01 * keys_got, text
            for lo, hi in ((3, 4), (5, 6)):
                assert abs(float(m[lo]) - float(m[hi])) <= 0.03 * float(m[hi]), text
            assert abs(float(m[7]) - float(m[8])) <= 0.35 * float(m[8]), text
            print(text.strip())
        results.check("calibrated on 2e4 users, predicts the 3e5-user run", check_prediction)

        def check_table():
            text = model("--calibration", runs[20000], "--nodes", "1", "64", "--memory-per-node-gib", "24")
            rows = [line.split() for line in text.splitlines() if re.match(r"^\s+\d+\s+\d+\s", line)]
            assert [r[0] for r in rows] == ["1", "64"], text
            assert rows[0][8] == "NO" and rows[1][8] == "yes", text
            assert float(rows[1][9]) < float(rows[0][9]), text
        results.check("the full workload: not on one 24-GiB node, on 64 yes", check_table)
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
