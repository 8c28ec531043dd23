#!/usr/bin/env python3
"""End-to-end test of contribution bounding: dpstream vs. the independent Python reference.

Generates an adversarial CSV (one heavy user with 10^5 records over many keys and triggers whose
cut-off at C falls inside a group of tied timestamps; values outside the clamp range, negative
and huge; a few hundred normal users, some over the limit; rows shuffled so file order is not
time order; quoted ids and keys with commas and quotes; columns in a non-default order with an
extra column; two windows with windows = 2 and first_window != 0; T not dividing W), runs
dpstream under mpirun at --ranks N and checks:

  (a) releases.csv equals the reference (sums within 1e-6 relative);
  (b) no user is counted more than C times per window, and the heavy user contributes exactly C
      (also checked differentially: a second run without the heavy user);
  (c) every released sum lies within [count * clamp_min, count * clamp_max];
  (d) summary.json counters equal the reference (read, kept, dropped_by_bounding, clamped, ...).

Usage: test_bounding.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import csv
import json
import os
import random
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import reference  # noqa: E402
from reference import Job  # noqa: E402

SEED = 20240611
W = 1000  # window_seconds
T = 7  # triggers: does not divide W, so trigger slices have unequal integer lengths
FIRST_WINDOW = 3
WINDOWS = 2
C = 40
CLAMP_MIN = -0.5
CLAMP_MAX = 2.0
HEAVY = "heavy"
HEAVY_RECORDS = 100_000
NORMAL_USERS = 400

JOB = Job(window_seconds=W, triggers=T, first_window=FIRST_WINDOW, windows=WINDOWS, max_records_per_user=C,
          clamp_min=CLAMP_MIN, clamp_max=CLAMP_MAX)

# Keys that stress CSV quoting and byte-order sorting, besides the plain ones.
SPECIAL_KEYS = ["a,b", 'q"uote', '"', "K", "Z", "k", "k0", "10", "9", "x y", "a,", ",a", "_", "~tilde"]
PLAIN_KEYS = [f"k{i}" for i in range(300)]
ALL_KEYS = PLAIN_KEYS + SPECIAL_KEYS
# Trigger boundaries of T = 7 slices of W = 1000 s: first and last second of every slice.
BOUNDARY_OFFSETS = sorted({(i * W + T - 1) // T for i in range(T)} | {((i + 1) * W + T - 1) // T - 1 for i in range(T)})


def value_text(rng):
    """A value as written in the file: mostly on a coarse grid, some outside the clamp range."""
    r = rng.random()
    if r < 0.55:
        return repr(rng.randint(-8, 24) / 8)  # [-1, 3] in steps of 1/8: some below -0.5, some above 2
    if r < 0.75:
        return f"{rng.randint(-1000, 3000) / 1000:.3f}"  # decimals not on the 2^-20 grid
    if r < 0.80:
        return rng.choice(["2.0", "2", "-0.5", "-.5", "2.", "0", "-0", "1E0", "5e-1", "0.75e+0"])  # at the bounds / odd forms
    if r < 0.90:
        return rng.choice(["-3", "-17.25", "5", "99.5", "-1000", "12345.678"])  # well outside
    return rng.choice(["1e15", "-1e15", "1e300", "-1e300", "3e18", "123456789012345678901234567890"])  # huge


def ts_in(window, offset):
    return window * W + offset


def generate(rng):
    """List of (user, key, value_text, ts) rows in generation order."""
    rows = []
    for wi in range(WINDOWS):
        w = FIRST_WINDOW + wi
        # Heavy user: 25 records in trigger 0, then 30 records all at one timestamp in trigger 1, so
        # that the cut-off (C = 40) falls inside the tie group and file position decides; then the
        # rest spread over the window after that timestamp (all dropped by bounding).
        n_window = HEAVY_RECORDS // WINDOWS
        tie_ts = ts_in(w, 200)
        for _ in range(25):
            rows.append((HEAVY, rng.choice(ALL_KEYS), value_text(rng), ts_in(w, rng.randint(0, 142))))
        for _ in range(30):
            rows.append((HEAVY, rng.choice(ALL_KEYS), value_text(rng), tie_ts))
        for _ in range(n_window - 55):
            off = rng.choice(BOUNDARY_OFFSETS) if rng.random() < 0.05 else rng.randint(200, W - 1)
            rows.append((HEAVY, rng.choice(ALL_KEYS), value_text(rng), ts_in(w, off)))
    for u in range(NORMAL_USERS):
        user = f"u{u:04d}" if u % 50 else f"u,{u}"  # some user ids need quoting
        for wi in range(WINDOWS):
            w = FIRST_WINDOW + wi
            if u % 7 == wi:  # some users are absent from one window
                continue
            if u % 11 == 0:
                n = C  # exactly at the limit
            elif u % 11 == 1:
                n = C + 1  # one over
            else:
                n = rng.randint(1, 2 * C)
            # A user's own ties: a few records share timestamps.
            user_ts = [ts_in(w, rng.choice(BOUNDARY_OFFSETS) if rng.random() < 0.2 else rng.randint(0, W - 1))
                       for _ in range(max(1, n // 3))]
            hot = ALL_KEYS[: 20 + u % 30]  # skewed: low-numbered keys are popular
            for _ in range(n):
                key = rng.choice(hot) if rng.random() < 0.7 else rng.choice(ALL_KEYS)
                rows.append((user, key, value_text(rng), rng.choice(user_ts)))
    return rows


def write_csv(path, rows, rng, blank_lines=3):
    """Writes `rows` in the given order: columns in a non-default order plus an extra column, and
    a few blank lines."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["timestamp", "note", "key", "user_id", "value"])
        blanks = set(rng.sample(range(len(rows)), blank_lines)) if rows else set()
        for i, (user, key, value, ts) in enumerate(rows):
            if i in blanks:
                f.write("\n")
            note = "x,y" if i % 97 == 0 else ""
            w.writerow([ts, note, key, user, value])


JOB_TOML = """\
[job]
name = "e2e-bounding"

[input]
kind = "csv"
path = "{path}"
bad_rows = "fail"

[stream]
window_seconds = {W}
triggers = {T}
first_window = {FW}
windows = {WS}

[privacy]
mode = "none"
max_records_per_user = {C}
clamp_min = {lo}
clamp_max = {hi}

[output]
dir = "{out}"
format = "csv"
progress = "never"
"""


def job_text(csv_path, out_dir):
    return JOB_TOML.format(path=csv_path, W=W, T=T, FW=FIRST_WINDOW, WS=WINDOWS, C=C, lo=CLAMP_MIN, hi=CLAMP_MAX,
                           out=out_dir)


def final_totals(rows):
    """{window: {key: (count, sum)}} from the last row of every key in its window."""
    out = {}
    for w, _t, key, count, s in rows:
        out.setdefault(w, {})[key] = (count, s)
    return out


def main():
    args = harness.parse_args(__doc__)
    dp = harness.Dpstream(args)
    results = harness.Results(f"test_bounding (ranks={args.ranks})")
    rng = random.Random(SEED)
    with harness.TempDir(args.keep, "dpstream-e2e-bounding-") as tmp:
        rows = generate(rng)
        rng.shuffle(rows)  # file order != time order
        csv_path = os.path.join(tmp, "adversarial.csv")
        write_csv(csv_path, rows, rng)
        out_dir = os.path.join(tmp, "out")
        job_path = harness.write_job(os.path.join(tmp, "job.toml"), job_text(csv_path, out_dir))

        inp = reference.read_input(csv_path, JOB)
        exp = reference.compute(inp, JOB)
        state = {}

        def run_dpstream():
            run = dp.run("run", job_path, cwd=tmp)
            print(f"     dpstream at {args.ranks} rank(s): {run.seconds:.1f} s, {len(rows)} rows")
            assert run.returncode == 0, "dpstream failed\n  " + run.describe()
            state["rows"] = reference.read_releases(os.path.join(out_dir, "releases.csv"))
            with open(os.path.join(out_dir, "summary.json"), encoding="utf-8") as f:
                state["summary"] = json.load(f)

        def reference_sanity():
            assert not inp.bad, f"generator produced bad rows: {inp.bad[:3]}"
            assert len(inp.rows) == len(rows), (len(inp.rows), len(rows))
            for (w, user), k in exp.kept_per_user.items():
                assert k <= C, f"reference kept {k} > C records of {user} in window {w}"
                assert k == min(C, exp.accepted_per_user[(w, user)])
            for w in range(FIRST_WINDOW, FIRST_WINDOW + WINDOWS):
                assert exp.kept_per_user[(w, HEAVY)] == C
                heavy = sorted((r.ts, r.pos) for r in inp.rows
                               if r.user == HEAVY and reference.window_of(r.ts, JOB) == w)
                assert heavy[C - 1][0] == heavy[C][0], "the heavy user's cut-off is not inside a timestamp tie"
            assert exp.clamped > 0 and exp.dropped_by_bounding > HEAVY_RECORDS - 2 * C

        def need_output():
            assert "rows" in state, "no dpstream output (the run failed)"
            return state["rows"], state["summary"]

        def releases_equal_reference():
            got, _ = need_output()
            problems = reference.compare_releases(got, exp.releases)
            assert not problems, "releases.csv differs from the reference:\n  " + "\n  ".join(problems)

        def per_user_bound():
            got, _ = need_output()
            fin = final_totals(got)
            for wi in range(WINDOWS):
                w = FIRST_WINDOW + wi
                total = sum(c for c, _ in fin.get(w, {}).values())
                users = exp.distinct_users_per_window[w]
                assert total <= C * users, f"window {w}: {total} kept records > C * users = {C} * {users}"
                want = sum(k for (ww, _u), k in exp.kept_per_user.items() if ww == w)
                assert total == want, f"window {w}: total count at the end of the window {total}, reference {want}"

        def heavy_user_contributes_exactly_c():
            got, _ = need_output()
            light_csv = os.path.join(tmp, "without-heavy.csv")
            # Same file order minus the heavy user: the other users' ties break the same way.
            write_csv(light_csv, [r for r in rows if r[0] != HEAVY], random.Random(SEED + 1))
            light_out = os.path.join(tmp, "out-light")
            light_job = harness.write_job(os.path.join(tmp, "job-light.toml"), job_text(light_csv, light_out))
            run = dp.run("run", light_job, cwd=tmp)
            assert run.returncode == 0, "dpstream failed on the input without the heavy user\n  " + run.describe()
            light = final_totals(reference.read_releases(os.path.join(light_out, "releases.csv")))
            full = final_totals(got)
            heavy_kept = sorted((r for r in inp.rows if r.user == HEAVY),
                                key=lambda r: (reference.window_of(r.ts, JOB), reference.trigger_of(r.ts, JOB), r.ts, r.pos))
            for wi in range(WINDOWS):
                w = FIRST_WINDOW + wi
                dc = sum(c for c, _ in full[w].values()) - sum(c for c, _ in light.get(w, {}).values())
                assert dc == C, f"window {w}: the heavy user adds {dc} to the total count, expected exactly C = {C}"
                mine = [r for r in heavy_kept if reference.window_of(r.ts, JOB) == w][:C]
                want = sum(reference.to_fixed(min(max(r.value, CLAMP_MIN), CLAMP_MAX)) for r in mine) / reference.SCALE
                ds = sum(s for _, s in full[w].values()) - sum(s for _, s in light.get(w, {}).values())
                assert abs(ds - want) <= 1e-6 * max(1.0, abs(want)) + 1e-6 * len(full[w]), \
                    f"window {w}: the heavy user adds {ds} to the total sum, expected {want} (its first C clamped values)"

        def sums_within_clamp_range():
            got, _ = need_output()
            bad = [r for r in got if not (r[3] * CLAMP_MIN - 1e-6 * max(1, abs(r[3] * CLAMP_MIN)) <= r[4]
                                          <= r[3] * CLAMP_MAX + 1e-6 * max(1, abs(r[3] * CLAMP_MAX)))]
            assert not bad, f"{len(bad)} rows with sum outside [count*{CLAMP_MIN}, count*{CLAMP_MAX}], e.g. {bad[:5]}"

        def running_totals_monotone():
            got, _ = need_output()
            last = {}
            for w, t, key, count, _s in got:
                prev = last.get((w, key))
                assert prev is None or (prev[0] < t and prev[1] < count), \
                    f"window {w} key {key!r}: trigger {t} count {count} after trigger {prev[0]} count {prev[1]}"
                last[(w, key)] = (t, count)

        def summary_matches_reference():
            _, summary = need_output()
            want = {
                "records.read": exp.read,
                "records.kept": exp.kept,
                "records.dropped_by_bounding": exp.dropped_by_bounding,
                "records.clamped": exp.clamped,
                "input.malformed": 0,
                "input.non_finite": 0,
                "input.out_of_window": 0,
            }
            diffs = [f"{k}: dpstream {harness.get(summary, k)}, reference {v}" for k, v in want.items()
                     if harness.get(summary, k) != v]
            assert not diffs, "summary.json differs:\n  " + "\n  ".join(diffs)

        def huge_values_clamp_to_max():
            # Pinpoints the clamping of huge values, which the big input also contains: every value
            # here is above clamp_max (or below clamp_min for the negative ones), one user each.
            values = ["3", "1e12", "8796093022207", "8796093022208", "1e15", "3e18", "1e300",
                      "-3", "-8796093022208", "-1e300"]
            small_csv = os.path.join(tmp, "huge.csv")
            with open(small_csv, "w", encoding="utf-8") as f:
                f.write("user_id,key,value,timestamp\n")
                for i, v in enumerate(values):
                    f.write(f"h{i},v={v},{v},{FIRST_WINDOW * W}\n")
            small_out = os.path.join(tmp, "out-huge")
            small_job = harness.write_job(os.path.join(tmp, "job-huge.toml"), job_text(small_csv, small_out))
            run = dp.run("run", small_job, cwd=tmp)
            assert run.returncode == 0, "dpstream failed\n  " + run.describe()
            got = {r[2]: r[4] for r in reference.read_releases(os.path.join(small_out, "releases.csv"))}
            want = {f"v={v}": (CLAMP_MAX if float(v) > 0 else CLAMP_MIN) for v in values}
            wrong = [f"value {k[2:]}: sum {got.get(k)}, expected {want[k]}" for k in want if got.get(k) != want[k]]
            assert not wrong, f"values outside [{CLAMP_MIN}, {CLAMP_MAX}] clamped wrongly:\n  " + "\n  ".join(wrong)

        results.check("dpstream run succeeds", run_dpstream)
        results.check("reference self-consistency", reference_sanity)
        results.check("(a) releases.csv equals the reference", releases_equal_reference)
        results.check("(b) per-window total count <= C * users and equals the reference", per_user_bound)
        results.check("(b) the heavy user contributes exactly C per window (differential run)",
                      heavy_user_contributes_exactly_c)
        results.check("values far outside the clamp range clamp to the nearer bound", huge_values_clamp_to_max)
        results.check("(c) every sum lies in [count*clamp_min, count*clamp_max]", sums_within_clamp_range)
        results.check("running totals grow within each window", running_totals_monotone)
        results.check("(d) summary.json counters equal the reference", summary_matches_reference)
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
