#!/usr/bin/python3
"""The C sweep of the core paper's Figure 10: DP-SQLP's utility against the per-user contribution
bound C (keys released, l_inf, l1, l2 at the last trigger, and the share of records dropped by
bounding), as a markdown table, a CSV and a PNG.

  python3 jobs/c_sweep.py --bin build/src/dpstream --out c-sweep            # C = 1..50, sequential
  python3 jobs/c_sweep.py --values 1,8,32 --users 1000000 --out quick       # a quick look

As a SLURM array (one C per task, then one collecting step):
  sbatch --array=0-9 --wrap "python3 jobs/c_sweep.py --out DIR --task \\$SLURM_ARRAY_TASK_ID"
  python3 jobs/c_sweep.py --out DIR --collect
Every task first makes sure the truth run exists (the first task to get there runs it; the others
wait for its summary.json), then runs and evaluates its own C.
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import time

from dpstream_runs import dpstream_run, write_truth_spec

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_VALUES = "1,2,4,6,8,12,16,24,32,40,50"
METRICS = ("keys_released", "linf", "l1", "l2", "dropped_share")
LABELS = ("keys released", "l_inf", "l1", "l2", "dropped share")


def ensure_truth(a, spec):
    truth_dir = os.path.join(a.out, "truth")
    summary = os.path.join(truth_dir, "summary.json")
    if os.path.exists(summary):
        return truth_dir
    lock = os.path.join(a.out, "truth.lock")
    failed = os.path.join(a.out, "truth.failed")  # the truth run's failure: every task stops on it until removed

    def stop_on_failure():
        if os.path.exists(failed):
            with open(failed) as f:
                sys.exit(f"c_sweep: the truth run failed: {f.read().strip()}; fix the cause, remove {failed} and "
                         f"run again")

    stop_on_failure()
    try:
        os.makedirs(lock)  # atomic: one task runs the truth, the others wait for it
    except FileExistsError:
        waited = 0
        while not os.path.exists(summary):
            stop_on_failure()
            if not os.path.exists(lock):  # the runner wrote truth.failed before it freed the lock
                stop_on_failure()
                sys.exit(f"c_sweep: {lock} was removed but {summary} does not exist: run again")
            if waited and waited % 600 == 0:
                print(f"c_sweep: waiting {waited} s for the truth run ({summary}); if no task is running it any more "
                      f"(killed), remove {lock}", file=sys.stderr, flush=True)
            time.sleep(5)
            waited += 5
        return truth_dir
    truth_spec = os.path.join(a.out, "truth.toml")
    try:
        write_truth_spec(spec, truth_spec)
        dpstream_run(a, truth_spec, truth_dir, [])
    except BaseException as e:  # SystemExit from a failed run included: the waiting tasks must not wait forever
        with open(failed, "w") as f:
            f.write(f"{e}\n")
        os.rmdir(lock)
        raise
    return truth_dir


def one(a, spec, C):
    truth_dir = ensure_truth(a, spec)
    out_dir = os.path.join(a.out, f"C={C}")
    wall = dpstream_run(a, spec, out_dir, [f"privacy.max_records_per_user={C}", f"privacy.seed={a.seed}"])
    e = subprocess.run([a.bin, "evaluate", "--truth", truth_dir, "--released", out_dir, "--json"],
                       capture_output=True, text=True)
    if e.returncode != 0:
        sys.exit(f"c_sweep: evaluate failed for C = {C}: {e.stderr.strip()}")
    m = json.loads(e.stdout)
    row = {"C": C, **{k: m[k] for k in METRICS}, "wall_s": round(wall, 1)}
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(row, f)
    print(f"c_sweep: C = {C}: keys {m['keys_released']:,}, l_inf {m['linf']:,.0f}, l1 {m['l1']:,.0f}, "
          f"l2 {m['l2']:,.0f}, dropped {100 * (m['dropped_share'] or 0):.2f}% ({wall:.0f} s)", flush=True)


def collect(a):
    rows = []
    for name in os.listdir(a.out):
        path = os.path.join(a.out, name, "metrics.json")
        if name.startswith("C=") and os.path.exists(path):
            with open(path) as f:
                rows.append(json.load(f))
    if not rows:
        sys.exit(f"c_sweep: no C=*/metrics.json under {a.out}")
    rows.sort(key=lambda r: r["C"])
    with open(os.path.join(a.out, "c_sweep.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    best = {m: (max if m == "keys_released" else min)(rows, key=lambda r: r[m])["C"] for m in METRICS[:4]}
    lines = ["# DP-SQLP against the contribution bound C (core paper, Figure 10)", "",
             f"Job: {a.spec}; {a.users or 'the spec'}'s users; noise seed {a.seed}; metrics at the last trigger.", "",
             "| C | keys released | l_inf | l1 | l2 | dropped by bounding |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['C']} | {r['keys_released']:,} | {r['linf']:,.0f} | {r['l1']:,.0f} | {r['l2']:,.0f} | "
                     f"{100 * (r['dropped_share'] or 0):.2f}% |")
    lines += ["", "Best C: " + ", ".join(f"{lab} at C = {best[m]}" for m, lab in zip(METRICS[:4], LABELS[:4])) + "."]
    with open(os.path.join(a.out, "c_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 5, figsize=(20, 3.8))
        for ax, m, lab in zip(axes, METRICS, LABELS):
            ax.plot([r["C"] for r in rows], [r[m] or 0 for r in rows], "o-")
            ax.set_xlabel("C (records per user per window)")
            ax.set_title(lab)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "c_sweep.png"), dpi=110)
    except ImportError:
        print("c_sweep: matplotlib missing (apt-get install python3-matplotlib): no PNG", file=sys.stderr)
    written = [n for n in ("c_sweep.md", "c_sweep.csv", "c_sweep.png") if os.path.exists(os.path.join(a.out, n))]
    print(f"c_sweep: wrote {', '.join(written)} in {a.out}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.path.join(HERE, "..", "build", "src", "dpstream"))
    p.add_argument("--spec", default=os.path.join(HERE, "paper-table1-t100.toml"))
    p.add_argument("--out", default="c-sweep-out")
    p.add_argument("--values", default=DEFAULT_VALUES)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--users", type=int, default=0)
    p.add_argument("--seed", type=int, default=1, help="noise seed ([privacy] seed: reproducible, not private)")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--task", type=int, help="run only the task-th value (a SLURM array task)")
    p.add_argument("--collect", action="store_true", help="only build the table and plot from finished runs")
    a = p.parse_args()
    try:
        values = [int(v) for v in a.values.split(",")]
    except ValueError:
        p.error(f"--values {a.values!r}: give comma-separated whole numbers, e.g. --values 1,8,32")
    if any(v < 1 for v in values):
        sys.exit("c_sweep: every C must be >= 1")
    os.makedirs(a.out, exist_ok=True)
    if a.collect:
        return collect(a)
    if a.task is not None:
        if not 0 <= a.task < len(values):
            sys.exit(f"c_sweep: --task {a.task} outside 0..{len(values) - 1} (--values has {len(values)})")
        return one(a, a.spec, values[a.task])
    for C in values:
        one(a, a.spec, C)
    collect(a)


if __name__ == "__main__":
    main()
