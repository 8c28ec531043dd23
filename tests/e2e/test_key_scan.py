#!/usr/bin/env python3
"""End-to-end test of empty-key release prediction (DP-SQLP Algorithm 4, [engine] key_scan).

A DP job whose Zipf keys range from keys with records at every trigger to keys seen once, so that
hundreds of releases come from noise alone at triggers without records for the key. With a fixed
noise seed, for mu = 0 (every key with a user is tested) and the default mu on trees, and the
default mu on banded-inverse counters:

  * key_scan = "predicted" (default, 2 threads per rank, [engine] trigger_batch = 7: users bounded
    seven triggers at a time) gives a releases.csv byte-identical to key_scan = "full" (1 thread
    per rank, one trigger at a time) at the same rank count, visits fewer keys per trigger, ends
    each window in the same state (summary.json state_digest) and counts releases at predicted
    visits;
  * a predicted run in batches of 7 killed inside key selection in the middle of a batch of its
    second window (checkpoint every trigger: the commits wait for the batches' ends) and resumed at
    another rank count, one trigger at a time, gives the same bytes and state digest again.

Usage: test_key_scan.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import json
import os
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

KILLED_AT_TRIGGER = 70  # the 71st trigger: window 2, trigger 10 of 60, inside its batch of triggers 7-13
BATCH = ("--set", "engine.trigger_batch=7")


def job_toml(mu, banded=False):
    text = harness.synthetic_job_toml("key-scan", "dp", 40000, 60, keys=3000, seed=3, window_seconds=900,
                                      max_records=4, noise_seed=5, windows=2, every=1)
    if mu is not None:
        text = text.replace('mode = "dp"', f'mode = "dp"\nmu = {mu}')
    if banded:  # banded-inverse counters for key selection and the released columns
        text = text.replace('mode = "dp"', 'mode = "dp"\nselection_counter = "banded"\nvalue_counter = "banded"')
    return text


def summary(out):
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        return json.load(f)


def main():
    args = harness.parse_args(__doc__.splitlines()[0])
    dp = harness.Dpstream(args)
    results = harness.Results("e2e key_scan")
    with harness.TempDir(args.keep, "dpstream-key-scan-") as tmp:
        for mu, banded in ((0, False), (None, False), (None, True)):
            label = (f"mu = {mu}" if mu is not None else "default mu") + (", banded counters" if banded else "")
            d = os.path.join(tmp, ("mu0" if mu is not None else "mu-default") + ("-banded" if banded else ""))
            os.makedirs(d)
            job = os.path.join(d, "job.toml")
            harness.write_job(job, job_toml(mu, banded))
            runs = {}

            def run(name, *extra, threads="2", ranks=None, env=None):
                out = os.path.join(d, name)
                r = dp.run_with("run", job, "--out", out, "--fresh", *extra, ranks=ranks,
                                env={"OMP_NUM_THREADS": threads, **(env or {})})
                return r, out

            def full_vs_predicted():
                r, out = run("full", "--set", 'engine.key_scan="full"', "--set", "engine.trigger_batch=1", threads="1")
                assert r.returncode == 0, "full scan failed\n  " + r.describe()
                runs["full"] = out
                r, out = run("predicted", *BATCH)
                assert r.returncode == 0, "predicted scan failed\n  " + r.describe()
                runs["predicted"] = out
                ref = harness.read_bytes(os.path.join(runs["full"], "releases.csv"))
                got = harness.read_bytes(os.path.join(out, "releases.csv"))
                if got != ref:
                    i = harness.first_difference(got, ref)
                    raise AssertionError(f"predicted releases.csv differs from the full scan's at byte {i}:\n"
                                         f"    predicted {got[max(0, i - 80):i + 80]!r}\n    full      {ref[max(0, i - 80):i + 80]!r}")
                full_summary, pred_summary = summary(runs["full"]), summary(out)
                assert full_summary["state_digest"] == pred_summary["state_digest"], \
                    f"state_digest: full {full_summary['state_digest']}, predicted {pred_summary['state_digest']}"
                full, pred = full_summary["dp"], pred_summary["dp"]
                assert (full["key_scan"], pred["key_scan"]) == ("full", "predicted"), (full["key_scan"], pred["key_scan"])
                assert full["threshold_tests"] == pred["threshold_tests"], \
                    f"threshold_tests: full {full['threshold_tests']}, predicted {pred['threshold_tests']}"
                assert pred["predicted_releases"] >= 100, \
                    f"only {pred['predicted_releases']} releases by noise alone: the workload does not test prediction"
                assert full["predicted_releases"] == 0 and full["scheduled_visits"] == 0, full
                fv, pv = full["keys_visited_per_trigger"]["mean"], pred["keys_visited_per_trigger"]["mean"]
                assert pv < 0.9 * fv, f"predicted visits {pv:.0f} keys per trigger, the full scan {fv:.0f}"
                rows = ref.count(b"\n") - 1
                print(f"     {label}: {rows} rows identical; {pred['predicted_releases']} releases at a "
                      f"predicted visit; keys visited per trigger {pv:.0f} vs {fv:.0f}", flush=True)

            def killed_and_resumed():
                assert "full" in runs, "needs the full scan's output"
                last = args.ranks - 1
                r, out = run("resumed", *BATCH, env={"DPSTREAM_FAULT": f"dp_release@{KILLED_AT_TRIGGER + 1}:{last}"})
                assert r.returncode != 0, "the fault did not stop the run\n  " + r.describe()
                other = 1 if args.ranks > 1 else 2
                r2 = dp.run_with("run", job, "--out", out, "--resume", "--set", "engine.trigger_batch=1", ranks=other,
                                 env={"OMP_NUM_THREADS": "1"})
                assert r2.returncode == 0, "resume failed\n  " + r2.describe()
                ref = harness.read_bytes(os.path.join(runs["full"], "releases.csv"))
                got = harness.read_bytes(os.path.join(out, "releases.csv"))
                assert got == ref, f"resumed releases.csv differs at byte {harness.first_difference(got, ref)}"
                want, have = summary(runs["full"])["state_digest"], summary(out)["state_digest"]
                assert have == want, f"resumed state_digest {have}, uninterrupted full scan {want}"

            results.check(f"{label}: predicted == full scan at {args.ranks} rank(s)", full_vs_predicted)
            results.check(f"{label}: killed in key selection at trigger {KILLED_AT_TRIGGER + 1} (inside a batch), "
                          f"resumed at another rank count: identical", killed_and_resumed)
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
