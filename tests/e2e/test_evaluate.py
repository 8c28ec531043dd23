#!/usr/bin/env python3
"""End-to-end test of `dpstream evaluate` (the error of a released histogram stream against the truth).

1. A small synthetic stream (2 windows, T = 8) runs twice: mode "none" without bounding (no
   max_records_per_user: the truth) and mode "dp" with C = 4 and a fixed noise seed. `evaluate --json` (default window and trigger,
   then window 0 / trigger 3 / column sum, and truth against itself) must equal, at every trigger,
   an independent computation here that reads both releases.csv with the csv module and works in
   exact rationals (fractions.Fraction, each value rounded to the engine's 2^-20 grid as the engine
   reads its own text): keys_released, linf, l1, truth_keys, truth_total, truth_max exactly, l2 to
   1e-12 relative, dropped_share from summary.json.
2. Hand-made tiny runs with answers worked out by hand: string keys (one holding a comma, one a
   quote), a released key absent from the truth, a truth key never released, an "increments" run,
   --trigger, --column sum, the text output; and two cases checked against the reference only:
   integer ids that move from the hash map to the direct table, and errors whose sum of squares
   leaves 128 bits.
3. Bad inputs: each exits non-zero (2 for an option that does not fit the data, 3 for bad input)
   with a message naming the problem (and the file line where there is one).

Usage: test_evaluate.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import concurrent.futures
import csv
import json
import math
import os
import sys
from fractions import Fraction

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SCALE = 1 << 20
HEADER = ["window", "trigger", "key", "count", "sum"]


# ---- the independent reference ----

def to_grid(text):
    """The decimal text on the engine's fixed-point grid (2^-20), rounded half away from zero."""
    x = Fraction(text) * SCALE
    n = math.floor(abs(x) + Fraction(1, 2))
    return n if x >= 0 else -n


def read_releases(path):
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows and rows[0] == HEADER, f"{path}: header {rows[:1]}"
    return [(int(w), int(t), key, c, s) for w, t, key, c, s in rows[1:]]


def reference(truth_dir, rel_dir, window=None, trigger=None, column="count"):
    truth_rows = read_releases(os.path.join(truth_dir, "releases.csv"))
    rel_rows = read_releases(os.path.join(rel_dir, "releases.csv"))
    with open(os.path.join(truth_dir, "summary.json"), encoding="utf-8") as f:
        truth_summary = json.load(f)
    with open(os.path.join(rel_dir, "summary.json"), encoding="utf-8") as f:
        rel_summary = json.load(f)

    def kind(summary):
        rr = summary.get("release_values", summary.get("release_rows"))
        return rr if isinstance(rr, str) else "running"

    if window is None:
        window = truth_rows[-1][0]
    per_window = None
    for s in (truth_summary, rel_summary):
        per_window = per_window or (s.get("stream") or {}).get("triggers") \
            or ((s.get("privacy") or {}).get("trees") or {}).get("triggers")
    if trigger is None:
        trigger = per_window - 1 if per_window else max(
            t for w, t, *_ in truth_rows + rel_rows if w == window)
    col = 3 if column == "count" else 4

    def history(rows):
        """[(trigger, key, value)] of the window in file order, values on the grid."""
        return [(r[1], r[2], to_grid(r[col])) for r in rows if r[0] == window]

    truth_h = history(truth_rows)
    rel_h = history(rel_rows)

    def histogram(hist, upto, increments):
        h = {}
        for t, key, v in hist:
            if t <= upto:
                h[key] = h.get(key, 0) + v if increments else v
        return h

    per_trigger = []
    for t in range(trigger + 1):
        th = histogram(truth_h, t, kind(truth_summary) == "increments")
        eh = histogram(rel_h, t, kind(rel_summary) == "increments")
        errs = [eh.get(k, 0) - th.get(k, 0) for k in set(th) | set(eh)]
        per_trigger.append({
            "trigger": t,
            "keys_released": len(eh),
            "linf": Fraction(max([abs(e) for e in errs], default=0), SCALE),
            "l1": Fraction(sum(abs(e) for e in errs), SCALE),
            "l2_squares": sum(e * e for e in errs),  # in grid units squared
        })
    records = rel_summary.get("records") or {}
    acc, drop = records.get("accepted"), records.get("dropped_by_bounding")
    final = per_trigger[-1]
    return {
        "mode": rel_summary["mode"],
        "release_rows": kind(rel_summary),
        "column": column,
        "window": window,
        "trigger": trigger,
        "keys_released": final["keys_released"],
        "linf": final["linf"],
        "l1": final["l1"],
        "l2_squares": final["l2_squares"],
        "truth_keys": sum(1 for v in th.values() if v != 0),
        "truth_total": Fraction(sum(th.values()), SCALE),
        "truth_max": Fraction(max([abs(v) for v in th.values()], default=0), SCALE),
        "dropped_share": (drop / acc) if acc and drop is not None else None,
        "per_trigger": per_trigger,
    }


def compare(got, want):
    """Differences between evaluate's JSON and the reference, as readable lines."""
    diffs = []

    def exact(label, g, w):
        if g != w:
            diffs.append(f"{label}: evaluate {g!r}, reference {w!r}")

    def number(label, g, w):  # w a Fraction: the JSON double must be its nearest double
        if not isinstance(g, (int, float)) or g != float(w):
            diffs.append(f"{label}: evaluate {g!r}, reference {float(w)!r} ({w})")

    def l2(label, g, squares):
        w = math.sqrt(squares) / SCALE
        if not isinstance(g, (int, float)) or abs(g - w) > 1e-12 * max(1.0, w):
            diffs.append(f"{label}: evaluate {g!r}, reference {w!r}")

    for k in ("mode", "release_rows", "column", "window", "trigger", "keys_released", "truth_keys"):
        exact(k, got.get(k), want[k])
    for k in ("linf", "l1", "truth_total", "truth_max"):
        number(k, got.get(k), want[k])
    l2("l2", got.get("l2"), want["l2_squares"])
    if want["dropped_share"] is None:
        exact("dropped_share", got.get("dropped_share"), None)
    else:
        number("dropped_share", got.get("dropped_share"), Fraction(want["dropped_share"]))
    gp = got.get("per_trigger") or []
    exact("per_trigger length", len(gp), len(want["per_trigger"]))
    for g, w in zip(gp, want["per_trigger"]):
        t = w["trigger"]
        exact(f"per_trigger[{t}].trigger", g.get("trigger"), t)
        exact(f"per_trigger[{t}].keys_released", g.get("keys_released"), w["keys_released"])
        number(f"per_trigger[{t}].linf", g.get("linf"), w["linf"])
        number(f"per_trigger[{t}].l1", g.get("l1"), w["l1"])
        l2(f"per_trigger[{t}].l2", g.get("l2"), w["l2_squares"])
    return diffs


# ---- hand-made runs ----

def make_run(root, name, rows_text, summary):
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "releases.csv"), "w", encoding="utf-8", newline="") as f:
        f.write("window,trigger,key,count,sum\n" + rows_text)
    with open(os.path.join(d, "summary.json"), "w", encoding="utf-8") as f:
        f.write(summary if isinstance(summary, str) else json.dumps(summary))
    return d


STREAM = {"triggers": 3, "windows": 1, "first_window": 0}
TRUTH_SUMMARY = {"mode": "none", "release_rows": "running", "triggers": 3, "stream": STREAM,
                 "records": {"read": 10, "accepted": 10, "dropped_by_bounding": 0}}
REL_SUMMARY = {"mode": "dp", "release_rows": "running", "triggers": 3, "stream": STREAM,
               "records": {"read": 10, "accepted": 10, "dropped_by_bounding": 3}}

# Truth by hand (count / sum), keys 1, "a,b", 7, 'say "hi"':
#   t0: 1 -> 2 / 2,  "a,b" -> 1 / 0.5,  say"hi" -> 1 / 1
#   t1: 1 -> 3 / 2.5
#   t2: "a,b" -> 4 / 1.5,  7 -> 1 / 1
TRUTH_ROWS = "".join(line + "\n" for line in [
    '0,0,1,2,2',
    '0,0,"a,b",1,0.5',
    '0,0,"say ""hi""",1,1',
    '0,1,1,3,2.5',
    '0,2,7,1,1',
    '0,2,"a,b",4,1.5',
])
# Released (running): 1 -> 2.5 / 1 and x9 (not in the truth) -> 1 / 1 at t0; say"hi" -> 1 / 1 at
# t1; "a,b" -> 3.25 / 2 at t2. Key 7 is never released.
REL_ROWS = "".join(line + "\n" for line in [
    '0,0,1,2.5,1',
    '0,0,x9,1,1',
    '0,1,"say ""hi""",1,1',
    '0,2,"a,b",3.25,2',
])
# err(count): t0: 1 +0.5, a,b -1, say -1, x9 +1          -> l0 2, linf 1, l1 3.5, l2 sqrt(3.25)
#             t1: 1 -0.5, a,b -1, say 0,  x9 +1          -> l0 3, linf 1, l1 2.5, l2 sqrt(2.25) = 1.5
#             t2: 1 -0.5, a,b -0.75, say 0, 7 -1, x9 +1  -> l0 4, linf 1, l1 3.25, l2 sqrt(2.8125)
# truth at t2: 4 nonzero keys, total 3 + 4 + 1 + 1 = 9, max 4; dropped_share 3 / 10.
HAND_COUNT = {"keys_released": 4, "linf": 1.0, "l1": 3.25, "l2": math.sqrt(2.8125), "truth_keys": 4,
              "truth_total": 9.0, "truth_max": 4.0, "dropped_share": 0.3,
              "per_trigger": [(0, 2, 1.0, 3.5, math.sqrt(3.25)), (1, 3, 1.0, 2.5, 1.5),
                              (2, 4, 1.0, 3.25, math.sqrt(2.8125))]}
# err(sum) at t2: 1 (1 - 2.5) -1.5, a,b (2 - 1.5) +0.5, say 0, 7 -1, x9 +1 -> linf 1.5, l1 4,
# l2 sqrt(4.5); truth total 2.5 + 1.5 + 1 + 1 = 6, max 2.5.
HAND_SUM = {"linf": 1.5, "l1": 4.0, "l2": math.sqrt(4.5), "truth_total": 6.0, "truth_max": 2.5}
# Increments: the value at t is the sum of the key's rows up to t.
INC_ROWS = "".join(line + "\n" for line in [
    '0,0,1,1,1',
    '0,0,"a,b",0.5,0',
    '0,1,1,1,0',
    '0,2,1,1.5,0',
    '0,2,x9,2,2',
])
# est(count): t0 {1: 1, a,b: 0.5}, t1 {1: 2, a,b: 0.5}, t2 {1: 3.5, a,b: 0.5, x9: 2}
# err: t0: -1, -0.5, say -1         -> l0 2, linf 1, l1 2.5, l2 sqrt(2.25) = 1.5
#      t1: -1, -0.5, say -1         -> l0 2, linf 1, l1 2.5, l2 1.5
#      t2: +0.5, -3.5, say -1, 7 -1, x9 +2 -> l0 3, linf 3.5, l1 8, l2 sqrt(18.5)
HAND_INC = {"keys_released": 3, "linf": 3.5, "l1": 8.0, "l2": math.sqrt(18.5),
            "per_trigger": [(0, 2, 1.0, 2.5, 1.5), (1, 2, 1.0, 2.5, 1.5), (2, 3, 3.5, 8.0, math.sqrt(18.5))]}


def check_hand(got, want):
    diffs = []
    for k, v in want.items():
        if k == "per_trigger":
            g = [(p["trigger"], p["keys_released"], p["linf"], p["l1"], p["l2"]) for p in got["per_trigger"]]
            ok = len(g) == len(v) and all(a[:2] == b[:2] and all(abs(x - y) <= 1e-12 for x, y in zip(a[2:], b[2:]))
                                          for a, b in zip(g, v))
            if not ok:
                diffs.append(f"per_trigger: evaluate {g}, by hand {v}")
        elif isinstance(v, float):
            if not isinstance(got.get(k), (int, float)) or abs(got[k] - v) > 1e-12:
                diffs.append(f"{k}: evaluate {got.get(k)!r}, by hand {v!r}")
        elif got.get(k) != v:
            diffs.append(f"{k}: evaluate {got.get(k)!r}, by hand {v!r}")
    return diffs


def main():
    args = harness.parse_args(__doc__)
    dp = harness.Dpstream(args)
    results = harness.Results(f"test_evaluate (ranks={args.ranks})")
    with harness.TempDir(args.keep, "dpstream-e2e-evaluate-") as tmp:
        case = harness.CaseDirs(tmp)
        state = {}

        def evaluate(*opts):
            return dp.run("evaluate", *opts, cwd=tmp)

        def evaluate_json(*opts):
            run = evaluate(*opts, "--json")
            assert run.returncode == 0, "evaluate failed\n  " + run.describe()
            try:
                return json.loads(run.stdout)
            except ValueError as e:
                raise AssertionError(f"evaluate --json printed no JSON object ({e})\n  " + run.describe())

        # -- 1. a truth run and a DP run of one synthetic stream --
        def runs():
            for mode, c in (("none", None), ("dp", 4)):
                d = case(f"run-{mode}")
                text = harness.synthetic_job_toml(f"e2e-evaluate-{mode}", mode, 20000, 8, keys=200, seed=5,
                                                  window_seconds=800, max_records=c, noise_seed=11, windows=2)
                if c is None:  # the truth: no contribution bounding
                    text = "\n".join(line for line in text.splitlines() if not line.startswith("max_records_per_user"))
                job = harness.write_job(os.path.join(d, "job.toml"), text)
                run = dp.run("run", job, "--out", os.path.join(d, "out"), cwd=tmp)
                assert run.returncode == 0, f"dpstream run ({mode}) failed\n  " + run.describe()
                state[mode] = os.path.join(d, "out")
            with open(os.path.join(state["none"], "summary.json"), encoding="utf-8") as f:
                assert json.load(f)["records"]["dropped_by_bounding"] == 0, "the truth run dropped records"
            released = read_releases(os.path.join(state["dp"], "releases.csv"))
            assert {w for w, *_ in released} == {0, 1}, "the DP run released nothing in some window"

        def need(mode):
            assert mode in state, "no runs (the dpstream runs failed)"
            return state[mode]

        def dp_default():
            truth, rel = need("none"), need("dp")
            got = evaluate_json("--truth", truth, "--released", rel)
            want = reference(truth, rel)
            assert want["window"] == 1 and want["trigger"] == 7 and want["keys_released"] > 0
            assert want["l1"] > 0 and want["dropped_share"] > 0
            diffs = compare(got, want)
            assert not diffs, "evaluate differs from the reference:\n  " + "\n  ".join(diffs)
            exact_keys = ["truth", "released", "mode", "release_rows", "column", "window", "trigger", "keys_released",
                          "linf", "l1", "l2", "truth_keys", "truth_total", "truth_max", "dropped_share", "per_trigger"]
            assert list(got) == exact_keys, f"JSON keys {list(got)}, expected {exact_keys}"
            assert got["truth"] == truth and got["released"] == rel

        def dp_window0_sum():
            truth, rel = need("none"), need("dp")
            got = evaluate_json("--truth", truth, "--released", rel, "--window", "0", "--trigger", "3",
                                "--column", "sum")
            want = reference(truth, rel, window=0, trigger=3, column="sum")
            diffs = compare(got, want)
            assert not diffs, "evaluate differs from the reference:\n  " + "\n  ".join(diffs)

        def truth_against_itself():
            truth = need("none")
            got = evaluate_json("--truth", truth, "--released", truth, "--window", "0")
            want = reference(truth, truth, window=0)
            diffs = compare(got, want)
            assert not diffs, "evaluate differs from the reference:\n  " + "\n  ".join(diffs)
            assert got["l1"] == 0 and got["linf"] == 0 and got["l2"] == 0 and got["keys_released"] == got["truth_keys"]

        def dp_text():
            run = evaluate("--truth", need("none"), "--released", need("dp"), "--per-trigger")
            assert run.returncode == 0, run.describe()
            for word in ("window 1", "trigger 7", "mode dp", "keys_released", "linf", "l1", "l2", "truth_total",
                         "dropped_share"):
                assert word in run.stdout, f"text output lacks {word!r}:\n{run.stdout}"
            table = [line.split() for line in run.stdout.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
            assert [int(r[0]) for r in table] == list(range(8)), f"--per-trigger table rows: {table}"

        # -- 2. hand-made runs --
        hand = case("hand")
        truth_dir = make_run(hand, "truth", TRUTH_ROWS, TRUTH_SUMMARY)
        rel_dir = make_run(hand, "released", REL_ROWS, REL_SUMMARY)
        inc_dir = make_run(hand, "increments", INC_ROWS, dict(REL_SUMMARY, mode="baseline-batch",
                                                              release_rows="increments"))

        def reference_matches_hand():  # the reference itself, on the worked-out answers
            want = reference(truth_dir, rel_dir)
            assert float(want["l1"]) == 3.25 and want["l2_squares"] == int(2.8125 * SCALE * SCALE)
            assert want["keys_released"] == 4 and float(want["truth_total"]) == 9.0
            want = reference(truth_dir, inc_dir)
            assert float(want["l1"]) == 8.0 and float(want["linf"]) == 3.5

        def hand_count():
            got = evaluate_json("--truth", truth_dir, "--released", rel_dir)
            diffs = check_hand(got, HAND_COUNT) + compare(got, reference(truth_dir, rel_dir))
            assert got["window"] == 0 and got["trigger"] == 2 and got["mode"] == "dp"
            assert not diffs, "\n  ".join(diffs)

        def hand_sum():
            got = evaluate_json("--truth", truth_dir, "--released", rel_dir, "--column", "sum")
            diffs = check_hand(got, HAND_SUM) + compare(got, reference(truth_dir, rel_dir, column="sum"))
            assert not diffs, "\n  ".join(diffs)

        def hand_trigger():
            got = evaluate_json("--truth", truth_dir, "--released", rel_dir, "--trigger", "1")
            want = {"trigger": 1, "keys_released": 3, "linf": 1.0, "l1": 2.5, "l2": 1.5, "truth_total": 5.0,
                    "truth_max": 3.0, "truth_keys": 3,
                    "per_trigger": [(0, 2, 1.0, 3.5, math.sqrt(3.25)), (1, 3, 1.0, 2.5, 1.5)]}
            diffs = check_hand(got, want)
            assert not diffs, "\n  ".join(diffs)

        def hand_increments():
            # Both spellings: a string "release_rows", and the engine's "release_values" next to its
            # row count "release_rows".
            engine_style = make_run(hand, "increments-engine", INC_ROWS,
                                    dict(REL_SUMMARY, mode="baseline-batch", release_values="increments", release_rows=5))
            for d in (inc_dir, engine_style):
                got = evaluate_json("--truth", truth_dir, "--released", d)
                assert got["release_rows"] == "increments" and got["mode"] == "baseline-batch", got
                diffs = check_hand(got, HAND_INC) + compare(got, reference(truth_dir, d))
                assert not diffs, d + ":\n  " + "\n  ".join(diffs)

        def hand_text():
            run = evaluate("--truth", truth_dir, "--released", rel_dir)
            assert run.returncode == 0, run.describe()
            for word in ("window 0", "trigger 2", "release_rows running", "3.25", "1.677050983"):
                assert word in run.stdout, f"text output lacks {word!r}:\n{run.stdout}"

        def moved_ids_and_huge_errors():
            # Ids 300000 (hash map), 200000 and 262150 (the direct table grows over 300000 and
            # takes it over), a string key; then 40 keys off by 8e12 (sum of squares > 2^128).
            summ = {"mode": "none", "triggers": 2}
            t_rows = "0,0,300000,5,5\n0,0,zz,1,1\n0,1,200000,2,2\n0,1,262150,3,3\n0,1,300000,6,6\n"
            r_rows = "0,0,300000,4.5,0\n0,1,200000,1.5,0\n0,1,262150,3,0\n0,1,300000,6,0\n0,1,zz,1,0\n"
            d = case("moved")
            t = make_run(d, "truth", t_rows, summ)
            r = make_run(d, "released", r_rows, dict(summ, mode="dp"))
            got = evaluate_json("--truth", t, "--released", r)
            want = reference(t, r)
            assert [p["linf"] for p in want["per_trigger"]] == [1, Fraction(1, 2)]  # linf goes down
            diffs = compare(got, want)
            assert not diffs, "ids moving to the direct table:\n  " + "\n  ".join(diffs)
            # linf over several blocks of keys: the largest error goes away, then the next one.
            n = 3000
            t_rows = "".join(f"0,0,{k},10,1\n" for k in range(1, n + 1)) + "".join(f"0,0,s{k},10,1\n" for k in range(n))
            r_rows = ("".join(f"0,0,{k},{100 if k == 5 else 50 if k == 2500 else 10},1\n" for k in range(1, n + 1))
                      + "".join(f"0,0,s{k},{45 if k == 7 else 10},1\n" for k in range(n))
                      + "0,1,5,10,1\n0,2,2500,10,1\n0,3,s7,10,1\n")
            t = make_run(d, "truth-blocks", t_rows, dict(summ, triggers=4))
            r = make_run(d, "released-blocks", r_rows, dict(summ, mode="dp", triggers=4))
            got = evaluate_json("--truth", t, "--released", r, "--trigger", "3")
            want = reference(t, r, trigger=3)
            assert [p["linf"] for p in want["per_trigger"]] == [90, 40, 35, 0]
            diffs = compare(got, want)
            assert not diffs, "linf across blocks:\n  " + "\n  ".join(diffs)
            big_t = "".join(f"0,0,{k},1,1\n" for k in range(40))
            big_r = "".join(f"0,0,{k},{-8000000000000 if k % 2 else 8000000000000},1\n" for k in range(40))
            summ = {"mode": "none", "triggers": 1}
            t = make_run(d, "truth-big", big_t, summ)
            r = make_run(d, "released-big", big_r, dict(summ, mode="dp"))
            got = evaluate_json("--truth", t, "--released", r)
            want = reference(t, r)
            assert want["l2_squares"] >= 1 << 128
            diffs = compare(got, want)
            assert not diffs, "huge errors:\n  " + "\n  ".join(diffs)

        # -- 3. bad inputs --
        def expect_failure(label, opts, code, *needles):
            run = evaluate(*opts)
            assert run.returncode == code, f"{label}: exit code {run.returncode}, expected {code}\n  " + run.describe()
            for n in needles:
                assert n in run.stderr, f"{label}: stderr lacks {n!r}\n  " + run.describe()
            assert "fatal" not in run.stderr, f"{label}: an unexpected failure\n  " + run.describe()

        def bad_inputs():
            bad = case("bad")
            ok_t, ok_r = truth_dir, rel_dir
            cases = []

            def attempt(label, opts, code, *needles):  # run below, 4 at a time (mostly MPI start-up)
                cases.append((label, opts, code, needles))

            def with_rows(name, rows, summary=REL_SUMMARY):
                return make_run(bad, name, rows, summary)

            attempt("missing dir", ["--truth", os.path.join(bad, "nope"), "--released", ok_r], 3, "no such directory")
            os.makedirs(os.path.join(bad, "empty"))
            attempt("no releases.csv", ["--truth", ok_t, "--released", os.path.join(bad, "empty")], 3,
                    "releases.csv: not found")
            no_summary = with_rows("no-summary", REL_ROWS)
            os.remove(os.path.join(no_summary, "summary.json"))
            attempt("no summary.json", ["--truth", ok_t, "--released", no_summary], 3, "summary.json: not found")
            attempt("summary not JSON", ["--truth", ok_t, "--released", with_rows("bad-json", REL_ROWS, "{oops")], 3,
                    "not valid JSON")
            d = with_rows("bad-header", "")
            with open(os.path.join(d, "releases.csv"), "w", encoding="utf-8") as f:
                f.write("window,trigger,key,count\n0,0,1,1\n")
            attempt("bad header", ["--truth", ok_t, "--released", d], 3, "line 1", "header")
            attempt("unquoted comma", ["--truth", ok_t, "--released", with_rows("comma", "0,0,1,1,1\n0,1,a,b,1,1\n")],
                    3, "line 3", "more than 5 fields")
            attempt("too few fields", ["--truth", ok_t, "--released", with_rows("few", "0,0,1,1\n")], 3, "line 2",
                    "expected 5")
            attempt("bad number", ["--truth", ok_t, "--released", with_rows("number", "0,0,1,1,1\n0,0,2,1x,1\n")], 3,
                    "line 3", "not a number")
            attempt("NaN", ["--truth", ok_t, "--released", with_rows("nan", "0,0,1,nan,1\n")], 3, "line 2", "NaN")
            attempt("inf", ["--truth", ok_t, "--released", with_rows("inf", "0,1,1,-inf,1\n")], 3, "line 2", "infinity")
            attempt("trigger out of range", ["--truth", ok_t, "--released", with_rows("trig", "0,3,1,1,1\n")], 3,
                    "line 2", "trigger 3 is out of range")
            attempt("bad trigger", ["--truth", ok_t, "--released", with_rows("trig2", "0,-1,1,1,1\n")], 3, "line 2",
                    "trigger")
            attempt("rows out of order", ["--truth", ok_t, "--released",
                                          with_rows("order", "0,1,1,1,1\n0,0,2,1,1\n")], 3, "line 3", "out of order")
            attempt("duplicate key", ["--truth", ok_t, "--released", with_rows("dup", "0,0,1,1,1\n0,0,1,2,1\n")], 3,
                    "line 3", "appears twice")
            attempt("different triggers", ["--truth", ok_t, "--released",
                                           with_rows("other-stream", REL_ROWS,
                                                     dict(REL_SUMMARY, triggers=4, stream=dict(STREAM, triggers=4)))],
                    3, "not of the same stream")
            attempt("different records", ["--truth", ok_t, "--released",
                                          with_rows("other-records", REL_ROWS,
                                                    dict(REL_SUMMARY, records={"read": 11, "accepted": 11}))],
                    3, "not of the same stream", "records.read")
            attempt("truth is a DP run", ["--truth", rel_dir, "--released", rel_dir], 3, "mode \"dp\"")
            attempt("truth dropped records", ["--truth", with_rows("truth-bounded", TRUTH_ROWS,
                                                                   dict(TRUTH_SUMMARY, records={"read": 10, "accepted": 10,
                                                                                                "dropped_by_bounding": 2})),
                                              "--released", ok_r], 3, "max_records_per_user")
            clamped = with_rows("truth-clamped", TRUTH_ROWS,
                                dict(TRUTH_SUMMARY, records={"read": 10, "accepted": 10, "dropped_by_bounding": 0,
                                                             "clamped": 2}))
            attempt("truth clamped values, --column sum", ["--truth", clamped, "--released", ok_r, "--column", "sum"],
                    3, "clamped 2 values", "--column count")
            # Summaries that do not state the triggers per window: the largest --trigger is refused at once (it was
            # walked to, a histogram a trigger: std::bad_alloc and MPI_Abort).
            no_t = {k: v for k, v in TRUTH_SUMMARY.items() if k != "stream"}
            no_t_rel = {k: v for k, v in REL_SUMMARY.items() if k != "stream"}
            attempt("--trigger 2^32 - 1, triggers per window unknown",
                    ["--truth", with_rows("no-t-truth", TRUTH_ROWS, no_t), "--released",
                     with_rows("no-t-rel", REL_ROWS, no_t_rel), "--trigger", str(2**32 - 1)], 2,
                    "beyond the last trigger with rows in window 0 (2)")
            attempt("bad release_rows", ["--truth", ok_t, "--released",
                                         with_rows("rr", REL_ROWS, dict(REL_SUMMARY, release_rows="sometimes"))], 3,
                    "release_rows")
            attempt("row count only, baseline mode", ["--truth", ok_t, "--released",
                                                      with_rows("rr-count", INC_ROWS,
                                                                dict(REL_SUMMARY, mode="baseline-batch", release_rows=5))],
                    3, "release_values")
            attempt("trigger beyond the window", ["--truth", ok_t, "--released", ok_r, "--trigger", "3"], 2,
                    "--trigger 3", "0..2")
            attempt("empty --trigger (was the default)", ["--truth", ok_t, "--released", ok_r, "--trigger", ""], 2,
                    "--trigger", "whole number")
            attempt("window not in the runs", ["--truth", ok_t, "--released", ok_r, "--window", "1"], 2, "--window 1")
            nosum = with_rows("no-sum", "0,0,1,2.5,\n")
            attempt("empty column", ["--truth", ok_t, "--released", nosum, "--column", "sum"], 2, "line 2",
                    "--column count")
            attempt("unknown column", ["--truth", ok_t, "--released", ok_r, "--column", "users"], 2, "column")
            attempt("missing --released", ["--truth", ok_t], 2, "--released")

            def one(c):
                try:
                    expect_failure(c[0], c[1], c[2], *c[3])
                except AssertionError as e:
                    return str(e)
                return None

            with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
                fails = [f for f in pool.map(one, cases) if f]
            assert not fails, f"{len(fails)} of {len(cases)} cases:\n" + "\n".join(fails)

        results.check("dpstream run: truth (mode none) and dp of one stream", runs)
        results.check("dp: default window and trigger equal the reference at every trigger", dp_default)
        results.check("dp: --window 0 --trigger 3 --column sum equal the reference", dp_window0_sum)
        results.check("truth against itself: zero error, every key released", truth_against_itself)
        results.check("dp: text output with --per-trigger", dp_text)
        results.check("reference on the hand-made runs", reference_matches_hand)
        results.check("hand-made: count (string keys, comma, quote, unreleased and extra keys)", hand_count)
        results.check("hand-made: --column sum", hand_sum)
        results.check("hand-made: --trigger 1", hand_trigger)
        results.check("hand-made: increments", hand_increments)
        results.check("hand-made: text output", hand_text)
        results.check("ids moving to the direct table; errors past 128 bits", moved_ids_and_huge_errors)
        results.check("bad inputs: non-zero exit and a message naming the problem", bad_inputs)
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
