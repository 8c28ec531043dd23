#!/usr/bin/env python3
"""A burst of release rows early in a long window, with checkpoints on.

Rank 0 holds a commit's rows in one buffer and reserves it ahead at the current trigger's size for
the window's remaining triggers. Here 200,000 keys are all released at the first of 50,000 triggers
(about 3 MB of rows), so an unbounded reservation would ask for about 160 GB, which the kernel refuses
(std::bad_alloc, the job lost). Checks, at the given rank count, that the job finishes and that
releases.csv holds exactly one row per key, with the count and sum of its single record, all at
trigger 0 (computed here from the input).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

KEYS = 200_000
TRIGGERS = 50_000


def main():
    args = harness.parse_args(__doc__)
    dp = harness.Dpstream(args)
    results = harness.Results(f"release_burst (ranks={args.ranks})")
    with harness.TempDir(args.keep, "dpstream-burst-") as tmp:

        def burst_finishes():
            values = {}
            with open(os.path.join(tmp, "in.csv"), "w", encoding="utf-8") as f:
                f.write("user_id,key,value,timestamp\n")
                for i in range(KEYS):
                    values[i] = i % 2  # one record per user and key, at the window's first second
                    f.write(f"u{i},{i},{values[i]},0\n")
            harness.write_job(os.path.join(tmp, "job.toml"),
                              '[job]\nname = "burst"\n[input]\nkind = "csv"\npath = "in.csv"\n'
                              f'[stream]\nwindow_seconds = 86400\ntriggers = {TRIGGERS}\n'
                              '[privacy]\nmode = "none"\nmax_records_per_user = 32\nclamp_min = 0\nclamp_max = 1\n')
            r = dp.run_with("run", "job.toml", "--out", "out", "--progress", "never", cwd=tmp, timeout=300)
            assert r.returncode == 0, r.describe()
            assert os.path.isdir(os.path.join(tmp, "out", "checkpoint")), "the job made no checkpoint"
            with open(os.path.join(tmp, "out", "releases.csv"), encoding="utf-8") as f:
                assert f.readline() == "window,trigger,key,count,sum\n"
                got = [line.rstrip("\n").split(",") for line in f]
            want = [["0", "0", str(k), "1", str(values[k])] for k in sorted(values, key=str)]  # CSV keys: by name
            assert got == want, (f"{len(got)} rows, expected {len(want)}; first difference: "
                                 f"{next(((g, w) for g, w in zip(got, want) if g != w), None)}")

        results.check(f"{KEYS} keys released at the first of {TRIGGERS} triggers: the job finishes, one row each",
                      burst_finishes)
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
