#!/usr/bin/env python3
"""Plots a scaling series written by slurm/scaling.sh (one CSV of RESULT lines) as one PNG:
throughput against ranks (with the ideal line from the first point), milliseconds per trigger by
stage, and bytes per record sent to other ranks with peak memory per rank. Points with more ranks x
threads than cores are drawn hollow and marked oversubscribed.
    /usr/bin/python3 slurm/plot_scaling.py RESULTS/strong.csv --out docs/scaling-strong.png
"""
import argparse
import csv

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STAGES = ["ingest", "partition", "shuffle_user", "bounding", "shuffle_key", "kernels", "output", "checkpoint"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    rows = list(csv.DictReader(open(args.csv)))
    if not rows:
        raise SystemExit(f"{args.csv}: no rows")
    rows.sort(key=lambda r: int(r["ranks"]))
    series = rows[0]["series"]
    ranks = [int(r["ranks"]) for r in rows]
    over = [r["oversubscribed"] == "yes" for r in rows]
    rate = [float(r["records_per_s"]) / 1e6 for r in rows]
    engine = [float(r["engine_records_per_s"]) / 1e6 for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8))

    a = ax[0]
    ideal = [rate[0] * n / ranks[0] for n in ranks]
    a.plot(ranks, ideal, ":", color="grey", label="ideal (linear from the first point)")
    for ys, label, color in ((rate, "whole run (wall)", "C0"), (engine, "engine path", "C1")):
        a.plot(ranks, ys, "-", color=color, label=label)
        a.scatter([n for n, o in zip(ranks, over) if not o], [y for y, o in zip(ys, over) if not o], color=color, zorder=3)
        a.scatter([n for n, o in zip(ranks, over) if o], [y for y, o in zip(ys, over) if o], facecolors="none",
                  edgecolors=color, zorder=3)
    if any(over):
        first = min(n for n, o in zip(ranks, over) if o)
        a.axvspan(first - 0.5, max(ranks) + 0.5, color="red", alpha=0.07, label="oversubscribed (ranks > cores)")
    a.set_xscale("log", base=2)
    a.set_xticks(ranks, [str(n) for n in ranks])
    a.set_xlabel("MPI ranks")
    a.set_ylabel("M records / s")
    speedup = ", ".join(f"{n}: {r / rate[0]:.2f}x" for n, r in zip(ranks, rate))
    a.set_title(f"throughput ({series}); speedup {speedup}", fontsize=9)
    a.legend(fontsize=8)

    a = ax[1]
    bottom = [0.0] * len(rows)
    xs = range(len(rows))
    for i, stage in enumerate(STAGES):
        vals = [float(r[f"ms_per_trigger_{stage}"]) for r in rows]
        a.bar(xs, vals, bottom=bottom, label=stage, color=plt.cm.tab10(i))
        bottom = [b + v for b, v in zip(bottom, vals)]
    a.set_xticks(list(xs), [f"{n}{'*' if o else ''}" for n, o in zip(ranks, over)])
    a.set_xlabel("MPI ranks (* oversubscribed)")
    a.set_ylabel("ms per trigger (max over ranks)")
    a.set_title("time per trigger by stage", fontsize=9)
    a.legend(fontsize=7, ncol=2)

    a = ax[2]
    a.plot(ranks, [float(r["bytes_per_record_to_other_ranks"]) for r in rows], "o-", label="bytes/record to other ranks")
    a.plot(ranks, [float(r["bytes_per_record_sent"]) for r in rows], "s--", label="bytes/record through the shuffles")
    a.set_xscale("log", base=2)
    a.set_xticks(ranks, [str(n) for n in ranks])
    a.set_xlabel("MPI ranks")
    a.set_ylabel("bytes per record")
    b = a.twinx()
    b.plot(ranks, [float(r["peak_rss_mb_max"]) for r in rows], "^-", color="C3", label="peak RSS per rank (MB)")
    b.set_ylabel("peak RSS per rank, MB (max)")
    lines = a.get_legend_handles_labels()
    lines2 = b.get_legend_handles_labels()
    a.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8)
    a.set_title("communication and memory", fontsize=9)

    records = ", ".join(f"{int(r['records']) / 1e6:.1f}M" for r in rows)
    fig.suptitle(args.title or f"dpstream {series} scaling: job {rows[0]['job']}, records per point {records}", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot_scaling.py: wrote {args.out}")


if __name__ == "__main__":
    main()
