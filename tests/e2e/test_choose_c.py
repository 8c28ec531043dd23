#!/usr/bin/env python3
"""End-to-end test of `dpstream choose-c` (docs/CHOOSING-C.md): a DP choice of the contribution
bound C as the q-quantile of the per-user record counts in one window.

1. Synthetic job (200k users, records per user ~ Zipf-Mandelbrot(q=26, s=6.738) on {1..1e5}):
   the true 99th percentile is computed independently in Python from the job's CSV export
   (`dpstream generate`) and checked against the reference file's 33 (+-1). At epsilon 200 (noise
   practically always 0) choose-c returns exactly the empirical quantile and the exact user count;
   at epsilon 1 it is within 3 of it; sigma and rho match the Python plan (dp_reference.rho_tight,
   sampler_sigma); the text and JSON outputs agree; without --seed the run says it is private.
2. Determinism: with --seed, 1, 2 and 3 ranks print identical output (text and JSON).
3. CSV input with known per-user counts (string ids, rows shuffled so that ranks share users, a
   malformed row and an out-of-window row that the job skips), two windows: exact quantiles at
   epsilon 200 for several q, --window 1, and --max-c below the quantile (C = max_c, said so).
4. Refusals: epsilon 0, delta 1, quantile 1.5, max-c 0, a window outside the job, a missing job
   file, a missing CSV file: exit code != 0 (2, or 3 for the CSV) and a message naming the option
   or file; nothing on stdout.

Usage: test_choose_c.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import collections
import json
import math
import os
import random
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dp_reference  # noqa: E402
import harness  # noqa: E402

USERS = 200_000
DELTA = 1e-9
BIG_EPS = 200.0  # sigma ~ 0.05: a nonzero draw among ~1000 bins has probability ~1e-80
REFERENCE = os.path.join(harness.HERE, "..", "reference", "zipf_mandelbrot.json")


def quantile_c(counts, q, max_c):
    """The mechanism's rule on exact counts: smallest c in 1..max_c with #{min(count, max_c+1) <= c}
    >= q n (max_c when none); the same float comparison as the binary (int vs q * n)."""
    hist = collections.Counter(min(c, max_c + 1) for c in counts)
    n = len(counts)
    cdf = 0
    for c in range(1, max_c + 1):
        cdf += hist.get(c, 0)
        if cdf >= q * n:
            return c, False
    return max_c, True


def synthetic_job(path, users):
    return harness.write_job(path, harness.synthetic_job_toml("e2e-choose-c", "none", users, 4, keys=1000, seed=3,
                                                               window_seconds=86400, max_records=32, noise_seed=None))


def csv_job(path, csv_path, windows=2):
    return harness.write_job(path, f"""\
[job]
name = "e2e-choose-c-csv"

[input]
kind = "csv"
path = {json.dumps(csv_path)}

[stream]
window_seconds = 1000
triggers = 4
windows = {windows}

[privacy]
mode = "none"

[output]
progress = "never"
""")


def write_known_csv(path):
    """Window 0: users u0..u999, user k has 1 + k % 20 records. Window 1: u0..u499 with 1 + k % 7
    and w0..w99 with 3. Rows shuffled; plus a malformed row and an out-of-window row (skipped by
    the job). Returns {window: [count per user]}."""
    rng = random.Random(20240611)
    rows, counts = [], {0: {}, 1: {}}
    def add(window, user, n):
        counts[window][user] = n
        for _ in range(n):
            rows.append(f"{user},k{rng.randrange(50)},{rng.random():.3f},{window * 1000 + rng.randrange(1000)}")
    for k in range(1000):
        add(0, f"u{k}", 1 + k % 20)
    for k in range(500):
        add(1, f"u{k}", 1 + k % 7)
    for k in range(100):
        add(1, f"w{k}", 3)
    rows.append("u5,k1,not-a-number,10")  # malformed: skipped
    rows.append("u7,k1,0.5,999999")       # outside windows 0..1: skipped
    rng.shuffle(rows)
    with open(path, "w", encoding="utf-8") as f:
        f.write("user_id,key,value,timestamp\n" + "\n".join(rows) + "\n")
    return {w: list(c.values()) for w, c in counts.items()}


def parse_json(run):
    assert run.returncode == 0, "choose-c failed\n  " + run.describe()
    try:
        return json.loads(run.stdout)
    except json.JSONDecodeError as e:
        raise AssertionError(f"choose-c --json printed no JSON ({e})\n  " + run.describe())


def main():
    args = harness.parse_args(__doc__)
    dp = harness.Dpstream(args)
    results = harness.Results(f"test_choose_c (ranks={args.ranks})")
    with harness.TempDir(args.keep, "dpstream-e2e-choose-c-") as root:
        case_dir = harness.CaseDirs(root)
        syn_dir = case_dir("synthetic")
        syn_job = synthetic_job(os.path.join(syn_dir, "job.toml"), USERS)
        truth = {}

        def true_quantile():
            csv_path = os.path.join(syn_dir, "stream.csv")
            r = dp.run_with("generate", syn_job, "--csv", csv_path, ranks=1)
            assert r.returncode == 0, "generate failed\n  " + r.describe()
            per_user = collections.Counter()
            with open(csv_path, encoding="utf-8") as f:
                next(f)
                for line in f:
                    per_user[line[:line.index(",")]] += 1
            assert len(per_user) == USERS, f"the export has {len(per_user)} users, want {USERS}"
            truth["counts"] = list(per_user.values())
            truth["c"], _ = quantile_c(truth["counts"], 0.99, 1000)
            want = 33
            if os.path.exists(REFERENCE):
                with open(REFERENCE, encoding="utf-8") as f:
                    ref = json.load(f)
                want = ref["records_per_user"]["support_from_1"]["percentiles_smallest_x_with_cdf_ge"]["0.99"]
            assert abs(truth["c"] - want) <= 1, \
                f"empirical 99th percentile of the export {truth['c']}, the distribution's is {want}"

        results.check("true 99th percentile of the synthetic export (Python) is the reference's 33 +-1", true_quantile)

        def expected_sigma(eps):
            sigma = dp_reference.sampler_sigma(math.sqrt(1 / (2 * dp_reference.rho_tight(eps, DELTA))))
            return sigma, dp_reference.rho_tight(eps, DELTA)

        def check_plan(j, eps):
            sigma, rho_budget = expected_sigma(eps)
            assert math.isclose(j["sigma"], sigma, rel_tol=1e-9), f"sigma {j['sigma']}, want {sigma}"
            assert math.isclose(j["rho_budget"], rho_budget, rel_tol=1e-6), f"rho_budget {j['rho_budget']}, want {rho_budget}"
            assert math.isclose(j["rho"], 1 / (2 * sigma * sigma), rel_tol=1e-12), f"rho {j['rho']} != 1 / (2 sigma^2)"
            assert j["rho"] <= j["rho_budget"] * (1 + 1e-12), f"rho spent {j['rho']} above the budget {j['rho_budget']}"
            assert math.isclose(j["cdf_stderr_at_c"], sigma * math.sqrt(j["c"]), rel_tol=1e-12), "stderr != sigma sqrt(C)"
            for k in ("window", "quantile", "max_c", "epsilon", "delta", "rho", "sigma", "c", "noisy_users",
                      "noisy_share_above_c", "private"):
                assert k in j, f"--json has no field {k}: {j}"

        def large_epsilon():
            assert "c" in truth, "needs the true quantile"
            j = parse_json(dp.run("choose-c", syn_job, "--epsilon", BIG_EPS, "--delta", DELTA, "--seed", 11, "--json"))
            check_plan(j, BIG_EPS)
            assert j["c"] == truth["c"], f"C = {j['c']}, the true 99th percentile is {truth['c']}"
            assert j["noisy_users"] == USERS, f"noisy users {j['noisy_users']}, true {USERS} (noise should be 0)"
            above = sum(c > j["c"] for c in truth["counts"]) / USERS
            assert math.isclose(j["noisy_share_above_c"], above, rel_tol=1e-12), \
                f"share above C {j['noisy_share_above_c']}, true {above}"
            assert j["private"] is False and j["window"] == 0 and j["quantile"] == 0.99 and j["max_c"] == 1000, j
            assert j["c_at_max"] is False, j

        def moderate_epsilon():
            assert "c" in truth, "needs the true quantile"
            j = parse_json(dp.run("choose-c", syn_job, "--epsilon", 1.0, "--delta", DELTA, "--seed", 12, "--json"))
            check_plan(j, 1.0)
            assert abs(j["c"] - truth["c"]) <= 3, f"C = {j['c']} at epsilon 1, the true 99th percentile is {truth['c']}"
            assert abs(j["noisy_users"] - USERS) <= 6 * j["sigma"] * math.sqrt(1001), \
                f"noisy users {j['noisy_users']} too far from {USERS} for sigma {j['sigma']}"

        def text_output_and_os_secret():
            assert "c" in truth, "needs the true quantile"
            r = dp.run("choose-c", syn_job, "--epsilon", BIG_EPS, "--delta", DELTA)
            assert r.returncode == 0, r.describe()
            out = r.stdout
            assert f"C = {truth['c']}:" in out, f"text output lacks 'C = {truth['c']}:'\n{out}"
            assert "NOT PRIVATE" not in out, f"an unseeded run says it is not private\n{out}"
            line = (f"this spends ({BIG_EPS:g}, {DELTA:g}) of the window's budget in addition to the job's own, by "
                    "basic composition, unless window 0 is not released by the job or the input is a separate sample")
            assert line in " ".join(out.split()), f"text output lacks the composition line\n{out}"
            for word in ("epsilon", "delta", "rho", "sigma", "window 0", "max_records_per_user"):
                assert word in out, f"text output lacks {word!r}\n{out}"
            j = parse_json(dp.run("choose-c", syn_job, "--epsilon", BIG_EPS, "--delta", DELTA, "--json"))
            assert j["private"] is True and j["c"] == truth["c"], j
            seeded = dp.run("choose-c", syn_job, "--epsilon", BIG_EPS, "--delta", DELTA, "--seed", 3)
            assert seeded.returncode == 0 and "NOT PRIVATE" in seeded.stdout, seeded.describe()

        results.check("epsilon 200: C is the true 99th percentile, noisy n = n, sigma/rho as the Python plan",
                      large_epsilon)
        results.check("epsilon 1: C within 3 of the true 99th percentile", moderate_epsilon)
        results.check("text output (C, budget line, composition); unseeded run private, seeded says NOT PRIVATE",
                      text_output_and_os_secret)

        # ---- 2. determinism over rank counts ----
        def determinism():
            outs = {}
            for ranks in (1, 2, 3):
                for fmt in ("text", "json"):
                    extra = ["--json"] if fmt == "json" else []
                    r = dp.run_with("choose-c", syn_job, "--epsilon", 0.5, "--delta", DELTA, "--seed", 5,
                                    "--quantile", 0.9, *extra, ranks=ranks)
                    assert r.returncode == 0, f"{ranks} rank(s)\n  " + r.describe()
                    outs[(ranks, fmt)] = r.stdout
            for fmt in ("text", "json"):
                base = outs[(1, fmt)]
                for ranks in (2, 3):
                    assert outs[(ranks, fmt)] == base, \
                        f"{fmt} output differs between 1 and {ranks} rank(s):\n{base}\n---\n{outs[(ranks, fmt)]}"
            other = dp.run("choose-c", syn_job, "--epsilon", 0.5, "--delta", DELTA, "--seed", 6, "--quantile", 0.9,
                           "--json")
            assert parse_json(other)["noisy_users"] != json.loads(outs[(1, "json")])["noisy_users"], \
                "seeds 5 and 6 gave the same noisy user count (is the seed used?)"

        results.check("--seed: identical output on 1, 2 and 3 ranks; another seed, other noise", determinism)

        # ---- 3. CSV input with known counts ----
        csv_dir = case_dir("csv")
        csv_path = os.path.join(csv_dir, "known.csv")
        known = write_known_csv(csv_path)
        cjob = csv_job(os.path.join(csv_dir, "job.toml"), csv_path)

        def csv_exact():
            cases = [(0, 0.99, 1000), (0, 0.9, 1000), (0, 0.5, 1000), (1, 0.5, 1000), (1, 0.99, 1000), (0, 0.99, 10)]
            assert quantile_c(known[0], 0.99, 1000) == (20, False) and quantile_c(known[0], 0.9, 1000) == (18, False)
            for window, q, max_c in cases:
                want_c, want_at_max = quantile_c(known[window], q, max_c)
                j = parse_json(dp.run("choose-c", cjob, "--epsilon", BIG_EPS, "--delta", DELTA, "--seed", 1, "--json",
                                      "--window", window, "--quantile", q, "--max-c", max_c))
                label = f"window {window} q {q} max-c {max_c}"
                assert j["c"] == want_c, f"{label}: C = {j['c']}, want {want_c}"
                assert j["c_at_max"] == want_at_max, f"{label}: c_at_max {j['c_at_max']}, want {want_at_max}"
                assert j["noisy_users"] == len(known[window]), \
                    f"{label}: noisy users {j['noisy_users']}, want {len(known[window])} (skipped rows counted?)"
                assert j["window"] == window and j["max_c"] == max_c, j
            r = dp.run("choose-c", cjob, "--epsilon", BIG_EPS, "--delta", DELTA, "--seed", 1, "--max-c", 10)
            assert r.returncode == 0 and "raise --max-c" in r.stdout, "C = max_c is not said\n  " + r.describe()

        results.check("CSV with known counts: exact quantiles (two windows, several q, C capped by --max-c)", csv_exact)

        # ---- 4. refusals ----
        def refusals():
            missing_csv_job = csv_job(os.path.join(csv_dir, "missing.toml"), os.path.join(csv_dir, "no-such.csv"))
            any_window_job = os.path.join(csv_dir, "any-window.toml")  # windows from the input: any a job can read
            with open(cjob, encoding="utf-8") as f, open(any_window_job, "w", encoding="utf-8") as g:
                g.write(f.read().replace("windows = 2\n", ""))
            base = ["--epsilon", 1, "--delta", DELTA]
            cases = [
                ("epsilon 0", [syn_job, "--epsilon", 0, "--delta", DELTA], 2, "--epsilon"),
                ("epsilon -1", [syn_job, "--epsilon", -1, "--delta", DELTA], 2, "--epsilon"),
                ("delta 1", [syn_job, "--epsilon", 1, "--delta", 1], 2, "--delta"),
                ("delta 0", [syn_job, "--epsilon", 1, "--delta", 0], 2, "--delta"),
                ("quantile 1.5", [syn_job, *base, "--quantile", 1.5], 2, "--quantile"),
                ("quantile 0", [syn_job, *base, "--quantile", 0], 2, "--quantile"),
                ("max-c 0", [syn_job, *base, "--max-c", 0], 2, "--max-c"),
                ("max-c 2e6", [syn_job, *base, "--max-c", 2000000], 2, "--max-c"),
                ("window 1 of a 1-window job", [syn_job, *base, "--window", 1], 2, "--window"),
                ("window -1 of the input's windows", [any_window_job, *base, "--window", -1], 2, "--window -1"),
                ("window 2^20 + 1 of the input's windows", [any_window_job, *base, "--window", 2**20 + 1], 2, "0..1048576"),
                # The input's first window would be chosen, and printed, by the data: one user's row could move it.
                ("no --window, windows from the input", [any_window_job, *base], 2, "give --window W"),
                # An unset shell variable would silently charge nothing.
                ("--ledger ''", [syn_job, *base, "--ledger", ""], 2, "the ledger's path is empty"),
                ("epsilon too large for the sampler", [syn_job, "--epsilon", 1e7, "--delta", DELTA], 2, "--epsilon"),
                ("no --epsilon", [syn_job, "--delta", DELTA], 2, "--epsilon"),
                # An empty number was read as 0, a whole number beyond int64 clamped to 2^63 - 1.
                ("--epsilon ''", [syn_job, "--epsilon", "", "--delta", DELTA], 2, "must be a number"),
                ("--max-c 1e20 as digits", [syn_job, *base, "--max-c", "99999999999999999999"], 2, "whole number"),
                ("missing job file", [os.path.join(csv_dir, "no-such-job.toml"), *base], 2, "no-such-job.toml"),
                ("missing CSV input", [missing_csv_job, *base], 3, "no-such.csv"),
                ("bad --set", [syn_job, *base, "--set", "input.users=-5"], 2, "users"),
                # A stop because of one row would be an output of that row: refused before any row is read.
                ("bad_rows fail", [cjob, *base, "--set", "input.bad_rows=fail"], 2, "bad_rows"),
                # A seeded run is not private: it must not spend a ledger's budget (the ledger need not exist).
                ("--ledger with --seed", [syn_job, *base, "--ledger", os.path.join(csv_dir, "l.db"), "--seed", 3], 2,
                 "--seed"),
            ]
            problems = []
            for label, argv, code, needle in cases:
                r = dp.run("choose-c", *argv)
                if r.returncode != code:
                    problems.append(f"{label}: exit code {r.returncode}, want {code}\n    {r.describe()}")
                elif needle not in r.stderr:
                    problems.append(f"{label}: stderr does not name {needle!r}\n    {r.describe()}")
                elif r.stdout.strip():
                    problems.append(f"{label}: printed to stdout\n    {r.describe()}")
            assert not problems, "\n  ".join(problems)

        results.check("refusals: epsilon, delta, quantile, max-c, window (also outside what a job reads, or none where "
                      "the input sets them), missing files, bad --set, bad_rows fail, --ledger with --seed, empty --ledger",
                      refusals)
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
