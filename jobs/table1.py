#!/usr/bin/python3
"""Reproduces the core paper's Table 1 (section 5.1): DP-SQLP against its two baselines on the
synthetic workload (10M users, 1M keys, COUNT, C = 32, eps = 6, delta = 1e-9) at 100 and 1000
micro-batches, each configuration run several times, evaluated against the true histogram with
`dpstream evaluate`, written side by side with the paper's numbers as markdown, CSV and PNG.

  python3 jobs/table1.py --bin build/src/dpstream --out table1-out            # the full table
  python3 jobs/table1.py --triggers 100 --runs 1 --users 1000000 --out quick  # a quick look

Configurations (--configs): dp (DP-SQLP, one zCDP ledger, banded counters), dp-tree (the same with the
paper's binary trees), dp-basic (DP-SQLP with the paper's
split accounting), b1-zcdp / b1-optimal (baseline 1: repeated one-shot query, zCDP or the paper's
optimal composition), b2-zcdp / b2-optimal (baseline 2: one-shot query per micro-batch).
Run r uses the noise seed r ([privacy] seed: reproducible, not private); --os-secret draws fresh
secrets instead. Data variants (--variants): inferred (records per user 1 + X, X on {0..1e5}, the
data behind the paper's totals) and stated (X on {1..1e5}, as the paper's text says).
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

from dpstream_runs import dpstream_run, write_truth_spec

HERE = os.path.dirname(os.path.abspath(__file__))

# The paper's Table 1: (keys, l_inf, l1, l2) per (T, column).
PAPER = {
    100: {"DP-SQLP": (28338, 1391, 17741225, 50039), "Baseline 1": (435, 18077, 50835203, 430547),
          "Baseline 2": (191, 21913, 58551587, 576425)},
    1000: {"DP-SQLP": (22280, 1563, 19395721, 58237), "Baseline 1": (0, 25497, 59052062, 594382),
           "Baseline 2": (0, 25497, 59052062, 594382)},
}
CONFIGS = {  # name: (paper column, --set overrides)
    "dp": ("DP-SQLP", ["privacy.mode=dp", "privacy.composition=zcdp"]),  # the defaults: banded counters
    "dp-basic": ("DP-SQLP", ["privacy.mode=dp", "privacy.composition=basic"]),
    # DP-SQLP with the paper's trees (Honaker, discrete Gaussian) for both counter kinds, with banded
    # key selection and tree values, and with banded counters spelled out (docs/PRIVACY.md section 4)
    "dp-tree": ("DP-SQLP", ["privacy.mode=dp", "privacy.composition=zcdp", 'privacy.selection_counter="tree"',
                            'privacy.value_counter="tree"']),
    "dp-banded-sel": ("DP-SQLP", ["privacy.mode=dp", "privacy.composition=zcdp", 'privacy.selection_counter="banded"',
                                  'privacy.value_counter="tree"']),
    "dp-banded": ("DP-SQLP", ["privacy.mode=dp", "privacy.composition=zcdp", 'privacy.selection_counter="banded"',
                              'privacy.value_counter="banded"']),
    "b1-zcdp": ("Baseline 1", ["privacy.mode=baseline-repeated", "privacy.composition=zcdp"]),
    "b1-optimal": ("Baseline 1", ["privacy.mode=baseline-repeated", "privacy.composition=optimal"]),
    "b2-zcdp": ("Baseline 2", ["privacy.mode=baseline-batch", "privacy.composition=zcdp"]),
    "b2-optimal": ("Baseline 2", ["privacy.mode=baseline-batch", "privacy.composition=optimal"]),
}
VARIANTS = {"inferred": "input.records_per_user_min=0", "stated": "input.records_per_user_min=1"}
METRICS = ("keys_released", "linf", "l1", "l2")
LABELS = ("Keys", "l_inf", "l1", "l2")


def evaluate(a, truth, released):
    out = subprocess.run([a.bin, "evaluate", "--truth", truth, "--released", released, "--json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"table1: evaluate failed for {released}: {out.stderr.strip()}")
    return json.loads(out.stdout)


def fmt(x):
    return f"{x:,.0f}"


def cell(values):
    mean = statistics.fmean(values)
    if len(values) < 2:
        return fmt(mean)
    return f"{fmt(mean)} ± {fmt(statistics.stdev(values))}"


def write_markdown(a, rows, truths, path):
    lines = ["# Table 1: DP-SQLP and the baselines (core paper, section 5.1)", "",
             f"eps = 6, delta = 1e-9 per window, C = 32, COUNT, {a.users or 10_000_000:,} users, 1M keys; "
             f"{a.runs} run(s) per configuration (mean ± sd), {a.ranks} rank(s). Errors over the whole key space "
             "(a key never released counts 0). `paper` = the paper's Table 1.", ""]
    for variant in a.variants:
        for T in a.triggers:
            truth = truths[(variant, T)]
            lines += [f"## {variant} data, T = {T} micro-batches", "",
                      f"Truth: {truth['truth_total']:,.0f} records, {truth['truth_keys']:,} keys, top key "
                      f"{truth['truth_max']:,.0f}, l2 of the histogram {truth['l2']:,.0f} (paper: 59,052,062 / 25,497 / 594,382); "
                      f"records per user "
                      f"{truth['truth_total'] / (a.users or 10_000_000):.4g}.", ""]
            configs = [c for c in a.configs]
            header = "| metric | paper DP-SQLP | " + " | ".join(configs) + " | paper B1 | paper B2 |"
            lines += [header, "|" + "---|" * (len(configs) + 4)]
            for m, label in zip(METRICS, LABELS):
                cells = []
                for c in configs:
                    vals = [r[m] for r in rows if r["variant"] == variant and r["T"] == T and r["config"] == c]
                    cells.append(cell(vals) if vals else "-")
                i = METRICS.index(m)
                lines.append(f"| {label} | {fmt(PAPER[T]['DP-SQLP'][i])} | " + " | ".join(cells) +
                             f" | {fmt(PAPER[T]['Baseline 1'][i])} | {fmt(PAPER[T]['Baseline 2'][i])} |")
            drop = [r["dropped_share"] for r in rows if r["variant"] == variant and r["T"] == T and r["dropped_share"] is not None]
            if drop:
                lines += ["", f"Records dropped by contribution bounding (C = 32): {100 * statistics.fmean(drop):.2f}%."]
            lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_png(a, rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("table1: matplotlib missing (apt-get install python3-matplotlib): no PNG", file=sys.stderr)
        return
    panels = [(v, T) for v in a.variants for T in a.triggers]
    fig, axes = plt.subplots(len(panels), 4, figsize=(16, 3.6 * len(panels)), squeeze=False)
    for pi, (variant, T) in enumerate(panels):
        for mi, (m, label) in enumerate(zip(METRICS, LABELS)):
            ax = axes[pi][mi]
            names, means, errs = [], [], []
            for c in a.configs:
                vals = [r[m] for r in rows if r["variant"] == variant and r["T"] == T and r["config"] == c]
                if vals:
                    names.append(c)
                    means.append(statistics.fmean(vals))
                    errs.append(statistics.stdev(vals) if len(vals) > 1 else 0)
            names += ["paper DP-SQLP", "paper B1", "paper B2"]
            means += [PAPER[T][k][METRICS.index(m)] for k in ("DP-SQLP", "Baseline 1", "Baseline 2")]
            errs += [0, 0, 0]
            colors = ["tab:blue" if n.startswith("dp") else "tab:orange" if n.startswith("b") else "tab:gray" for n in names]
            ax.bar(range(len(names)), [max(x, 0.5) for x in means], yerr=errs, color=colors)
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
            ax.set_yscale("log")
            ax.set_title(f"{label} ({variant}, T = {T})" + ("  higher is better" if m == "keys_released" else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.path.join(HERE, "..", "build", "src", "dpstream"))
    p.add_argument("--out", default="table1-out")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--triggers", default="100,1000")
    p.add_argument("--variants", default="inferred")
    p.add_argument("--configs", default="dp,dp-basic,b1-zcdp,b1-optimal,b2-zcdp,b2-optimal")
    p.add_argument("--users", type=int, default=0, help="override the 10M users (quick looks)")
    p.add_argument("--os-secret", action="store_true", help="fresh secrets from the OS instead of seeds 1..runs")
    p.add_argument("--set", action="append", default=[], help="extra section.key=value for every DP run")
    a = p.parse_args()
    a.triggers = [int(t) for t in a.triggers.split(",")]
    a.variants = a.variants.split(",")
    a.configs = a.configs.split(",")
    for v in a.variants:
        if v not in VARIANTS:
            sys.exit(f"table1: unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    for c in a.configs:
        if c not in CONFIGS:
            sys.exit(f"table1: unknown config {c!r} (known: {', '.join(CONFIGS)})")
    for T in a.triggers:
        if T not in PAPER:
            sys.exit(f"table1: the paper has T = 100 and 1000, not {T}")
    os.makedirs(a.out, exist_ok=True)
    started = time.monotonic()
    rows, truths = [], {}
    for variant in a.variants:
        for T in a.triggers:
            spec = os.path.join(HERE, f"paper-table1-t{T}.toml")
            base = os.path.join(a.out, f"{variant}-t{T}")
            truth_dir = os.path.join(base, "truth")
            # The true histogram: mode none without contribution bounding (max_records_per_user left out).
            os.makedirs(base, exist_ok=True)
            truth_spec = os.path.join(base, "truth.toml")
            write_truth_spec(spec, truth_spec)
            wall = dpstream_run(a, truth_spec, truth_dir, [VARIANTS[variant]])
            # The truth's own norms: its errors against a run that releases nothing.
            empty_dir = os.path.join(base, "nothing-released")
            os.makedirs(empty_dir, exist_ok=True)
            with open(os.path.join(empty_dir, "releases.csv"), "w") as f:
                f.write("window,trigger,key,count,sum\n")
            with open(os.path.join(empty_dir, "summary.json"), "w") as f:
                json.dump({"mode": "none", "release_values": "running"}, f)
            truths[(variant, T)] = evaluate(a, truth_dir, empty_dir)
            print(f"table1: {variant} T={T} truth in {wall:.0f} s: {truths[(variant, T)]['truth_total']:,.0f} records",
                  flush=True)
            for c in a.configs:
                for r in range(1, a.runs + 1):
                    out_dir = os.path.join(base, f"{c}-run{r}")
                    sets = [VARIANTS[variant]] + CONFIGS[c][1] + ([] if a.os_secret else [f"privacy.seed={r}"])
                    wall = dpstream_run(a, spec, out_dir, sets)
                    e = evaluate(a, truth_dir, out_dir)
                    row = {"variant": variant, "T": T, "config": c, "paper_column": CONFIGS[c][0], "run": r,
                           "wall_s": round(wall, 1), "dropped_share": e.get("dropped_share")}
                    row.update({m: e[m] for m in METRICS})
                    rows.append(row)
                    print(f"table1: {variant} T={T} {c} run {r}: keys {e['keys_released']:,}, l_inf {e['linf']:,.0f}, "
                          f"l1 {e['l1']:,.0f}, l2 {e['l2']:,.0f} ({wall:.0f} s)", flush=True)
    with open(os.path.join(a.out, "runs.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    write_markdown(a, rows, truths, os.path.join(a.out, "table1.md"))
    write_png(a, rows, os.path.join(a.out, "table1.png"))
    written = [n for n in ("table1.md", "table1.png", "runs.csv") if os.path.exists(os.path.join(a.out, n))]
    print(f"table1: wrote {', '.join(written)} in {a.out} in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
