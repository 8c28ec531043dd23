#!/usr/bin/env python3
"""CSV input without [stream] first_window / windows processes every window of the input.

Checks, at the given rank count:
  * a CSV holding days 0, 1 and 3 releases all three by default; each day's rows equal a run of
    that day alone (explicit first_window / windows), so nothing is merged or lost;
  * an explicit range still wins, and the rows it skips are counted on stderr by kind;
  * a malformed row under bad_rows = "skip" is counted on stderr;
  * a kill in the middle (second day) and --resume give byte-identical output, also in DP mode;
  * the same when the kill comes after the last record of its window: the resumed window is not
    skipped as empty (its loaded state would otherwise flow into the next window);
  * a stop signal during the job's last trigger (day 2, which has no record, is skipped) just
    finishes the job: exit 0, the reference rows, summary.json.
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

DAY = 86_400
DAYS = (0, 1, 3)


def write_csv(path, rows_per_day=300, seed=7, day1_span=DAY):
    """`day1_span`: day 1's records lie in its first day1_span seconds."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        f.write("user_id,key,value,timestamp\n")
        for d in DAYS:
            for _ in range(rows_per_day):
                f.write(f"user-{rng.randrange(60)},key-{rng.randrange(6)},{rng.randrange(1, 5)},"
                        f"{d * DAY + rng.randrange(day1_span if d == 1 else DAY)}\n")
        f.write("just,two\n")  # malformed: skipped and counted


def job_text(mode, extra_stream=""):
    privacy = ('mode = "dp"\nepsilon = 50.0\ndelta = 1e-6\nmax_records_per_user = 8\nseed = 5\n'
               'clamp_min = 0.0\nclamp_max = 5.0\n' if mode == "dp" else 'mode = "none"\nmax_records_per_user = 8\n')
    return (f'[job]\nname = "windows-{mode}"\n[input]\nkind = "csv"\npath = "in.csv"\nbad_rows = "skip"\n'
            f'[stream]\ntriggers = 6\n{extra_stream}[privacy]\n{privacy}[checkpoint]\nevery = 1\n')


def rows_by_window(path):
    out = {}
    with open(path, encoding="utf-8") as f:
        header = f.readline()
        for line in f:
            out.setdefault(int(line.split(",", 1)[0]), []).append(line)
    return header, out


def main():
    args = harness.parse_args(__doc__)
    dp = harness.Dpstream(args)
    results = harness.Results(f"windows_from_input (ranks={args.ranks})")
    with harness.TempDir(args.keep, "dpstream-windows-") as tmp:
        cases = harness.CaseDirs(tmp)

        def setup(label, mode="none", extra_stream="", day1_span=DAY):
            d = cases(label)
            write_csv(os.path.join(d, "in.csv"), day1_span=day1_span)
            harness.write_job(os.path.join(d, "job.toml"), job_text(mode, extra_stream))
            return d

        def every_window_by_default():
            d = setup("default")
            r = dp.run("run", "job.toml", "--out", "all", "--progress", "never", cwd=d)
            assert r.returncode == 0, r.describe()
            _, got = rows_by_window(os.path.join(d, "all", "releases.csv"))
            assert sorted(got) == list(DAYS), f"windows released: {sorted(got)}, expected {list(DAYS)}"
            for day in DAYS:
                one = dp.run("run", "job.toml", "--out", f"day{day}", "--progress", "never",
                             "--set", f"stream.first_window={day}", "--set", "stream.windows=1", cwd=d)
                assert one.returncode == 0, one.describe()
                _, alone = rows_by_window(os.path.join(d, f"day{day}", "releases.csv"))
                assert alone.get(day) == got[day], f"window {day}: rows differ from a run of that day alone"
            assert "skipped 1 of 901 input rows: 1 malformed" in r.stderr, r.describe()

        def explicit_range_wins():
            d = setup("explicit")
            r = dp.run("run", "job.toml", "--out", "o", "--progress", "never", "--set", "stream.windows=2", cwd=d)
            assert r.returncode == 0, r.describe()
            _, got = rows_by_window(os.path.join(d, "o", "releases.csv"))
            assert sorted(got) == [0, 1], sorted(got)
            assert "300 outside the job's windows 0..1" in r.stderr, r.describe()

        def kill_and_resume(mode, day1_span=DAY, hit=9):
            def check():
                d = setup(f"resume-{mode}-{hit}", mode, day1_span=day1_span)
                ref = dp.run("run", "job.toml", "--out", "ref", "--progress", "never", cwd=d)
                assert ref.returncode == 0, ref.describe()
                # 6 triggers per window: hits 7-12 of "ingest" are the second window (day 1).
                k = dp.run_with("run", "job.toml", "--out", "o", "--progress", "never",
                                env={"DPSTREAM_FAULT": f"ingest@{hit}:0"}, cwd=d)
                assert k.returncode != 0, "the run was not killed\n  " + k.describe()
                res = dp.run("run", "job.toml", "--out", "o", "--progress", "never", "--resume", cwd=d)
                assert res.returncode == 0, res.describe()
                a = harness.read_bytes(os.path.join(d, "ref", "releases.csv"))
                b = harness.read_bytes(os.path.join(d, "o", "releases.csv"))
                assert a == b, "resumed output differs: " + str(harness.first_difference(a, b))
            return check

        def signal_in_last_trigger():
            d = setup("last-trigger", "dp")
            ref = dp.run("run", "job.toml", "--out", "ref", "--progress", "never", cwd=d)
            assert ref.returncode == 0, ref.describe()
            # Days 0, 1 and 3 are processed (6 triggers each): hit 18 of "ingest" is the job's last trigger.
            r = dp.run_with("run", "job.toml", "--out", "o", "--progress", "never",
                            env={"DPSTREAM_FAULT": "ingest@18:0:TERM"}, cwd=d)
            assert r.returncode == 0, "a stop signal during the job's last trigger must just finish it\n  " + r.describe()
            a = harness.read_bytes(os.path.join(d, "ref", "releases.csv"))
            b = harness.read_bytes(os.path.join(d, "o", "releases.csv"))
            assert a == b, "output differs from the uninterrupted run: " + str(harness.first_difference(a, b))
            assert os.path.exists(os.path.join(d, "o", "summary.json")), "no summary.json"

        results.check("a CSV of days 0, 1, 3 releases every day by default, each as a run of that day alone",
                      every_window_by_default)
        results.check("an explicit window range wins and skipped rows are counted on stderr", explicit_range_wins)
        results.check("kill in the second window and --resume: byte-identical (mode none)", kill_and_resume("none"))
        results.check("kill in the second window and --resume: byte-identical (mode dp)", kill_and_resume("dp"))
        # Day 1's records all in its first 2 of 6 triggers; the kill at its 5th (commits after each).
        for mode in ("none", "dp"):
            results.check(f"kill after the last record of the second window and --resume: byte-identical (mode {mode})",
                          kill_and_resume(mode, day1_span=DAY // 3, hit=11))
        results.check("a stop signal in the job's last trigger (after a skipped window) finishes the job",
                      signal_in_last_trigger)
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
