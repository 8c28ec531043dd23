#!/usr/bin/env python3
"""End-to-end test of the paper's baselines, mode = "baseline-repeated" and "baseline-batch"
(docs/PRIVACY.md section 8, kernels/baseline_release.*), against an independent Python replica.

The contract tested. Contribution bounding is that of mode "none" (each user keeps its first C
records per window in stream order; tests/e2e/reference.py is the bounding reference). At every
trigger t of a window:
  * baseline-repeated: every key with >= 1 user so far in the window is tested; it is released iff
    users_so_far + N_thr > tau, and its row holds count_so_far + N_count ("release_values": "running");
  * baseline-batch: every key with >= 1 kept record in trigger t is tested with users_t = distinct
    users with kept records of the key in trigger t (a user counts again in every trigger where it
    has some); the row holds count_t + N_count ("release_values": "increments").
N_thr ~ N_Z(0, sigma_thr^2), N_count ~ N_Z(0, sigma_count^2) fresh per (key, family, trigger);
sigma_thr, tau and sigma_count are those of `dpstream budget JOB --json`.

Cases:
 1. Exactness at a huge budget (epsilon = 4000, delta = 1e-6, count only, [privacy] seed = 1): a
    hand-made + random CSV (35 users, 15 keys, 2 windows, T = 4, C = 3; users over C, ties in
    timestamp, a key that has 2 users only without bounding, keys with a single user, a key whose
    users are in different triggers, a user back in a later trigger). Budget gives 1 < tau < 2 and
    sigmas <= 0.11, so P[a draw != 0] <= 2 exp(-1 / (2 sigma^2)) <= 1e-18 per draw: with all noise 0
    the rows are exactly the keys with >= 2 users (so far / in the trigger) and their true counts.
    The test computes this bound from the budget and requires < 1e-9 for the whole case (its false
    failure rate). Both modes x composition zcdp and optimal; also summary.json dp.threshold_tests,
    release_rows, noise_draws and keys_released against the replica; byte-identical releases.csv at
    1, --ranks and (repeated, zcdp) 3 ranks (optimal at --ranks only).
 2. Noise scale and threshold (epsilon = 6, delta = 1e-9, C = 4, T = 4, 4 windows = independent
    replicates, the noise being keyed by the window): a CSV with 40 keys x ~115 users per trigger and
    24 "probe" keys with 14..30 fresh users per trigger, runs baseline-batch (zcdp and optimal) and
    baseline-repeated (zcdp). Per run: chi-square test of sum z^2, z = (released - true) / sd, and a
    z-test of the mean (true from the replica); keys with P[release] > 1 - 1e-12 must be released and
    keys with P < 1e-12 must not (union bound over < 1e4 tests: < 1e-8); over the uncertain tests the
    number of releases must match the exact discrete-Gaussian probabilities P[users + N_thr > tau]
    in location and in scale (Bernstein, rigorous). Every statistical check runs at alpha = 1e-6 / 12
    (12 checks): the case fails by chance with probability < 1e-6 (chi-square / normal approximations
    for the value tests, sigma >= 6 and n ~ 800).
 3. Accounting refusals through `run` (exit 2, named cause, no output dir): composition "basic" with a
    baseline; composition "optimal" with mode "dp"; composition "optimal" at epsilon 1e-4, delta 1e-12,
    T = 1000 (optimal composition gives eps0 ~ eps / T, the threshold sigma leaves the sampler's range;
    the same job with "zcdp" is accepted by budget). summary.json of baseline runs: mode,
    release_values, private = false with a seed, privacy = the plan (mode, composition, sigmas, tau
    equal to budget --json).
 4. Checkpoints: [checkpoint] every = 1, synthetic input, each baseline mode killed (SIGKILL by
    DPSTREAM_FAULT=dp_release@<hit>:<rank>) mid-stream, then --resume (at the same rank count, and at
    1 rank for the second kill): releases.csv byte-identical to an uninterrupted run (and the killed
    run's a byte prefix of it, no summary.json), summary.json dp counters equal.

Usage: test_baselines.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import csv
import json
import math
import os
import random
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import reference  # noqa: E402

MODES = ("baseline-repeated", "baseline-batch")


# ------------------------------------------------------------------------------------------------
# Distributions (stdlib only)


def dg_pmf(sigma):
    """{y: P[Y = y]} of the discrete Gaussian N_Z(0, sigma^2) (|y| <= 14 sigma + 2; the rest < 1e-40)."""
    ymax = int(14 * sigma) + 2
    w = {y: math.exp(-y * y / (2 * sigma * sigma)) for y in range(-ymax, ymax + 1)}
    z = math.fsum(w.values())
    return {y: v / z for y, v in w.items()}


def dg_nonzero_bound(sigma):
    """An upper bound on P[Y != 0]: sum_{y != 0} e^(-y^2 / 2 sigma^2) / Z with Z >= 1."""
    return 2 * math.fsum(math.exp(-y * y / (2 * sigma * sigma)) for y in range(1, 60))


class DG:
    def __init__(self, sigma):
        self.sigma = sigma
        self.pmf = dg_pmf(sigma)
        self.var = math.fsum(y * y * p for y, p in self.pmf.items())

    def upper_tail(self, x):
        """P[Y > x]."""
        return math.fsum(p for y, p in self.pmf.items() if y > x)


def _gamma_p_q(a, x):
    """Regularized incomplete gamma (P, Q) for a > 0, x >= 0 (series / Lentz continued fraction)."""
    if x <= 0:
        return 0.0, 1.0
    log_pre = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap_ = a
        for _ in range(100000):
            ap_ += 1
            term *= x / ap_
            total += term
            if abs(term) < abs(total) * 1e-17:
                break
        p = total * math.exp(log_pre)
        return p, 1.0 - p
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 100000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    q = math.exp(log_pre) * h
    return 1.0 - q, q


def _bisect(lo, hi, above, iters=200):
    for _ in range(iters):
        mid = (lo + hi) / 2
        if above(mid):
            hi = mid
        else:
            lo = mid
    return hi


def chi2_interval(k, alpha):
    """[lo, hi] with P[chi2_k < lo] = P[chi2_k > hi] = alpha / 2."""
    top = k + 50 * math.sqrt(2 * k) + 200
    lo = _bisect(0.0, float(k), lambda x: _gamma_p_q(k / 2, x / 2)[0] >= alpha / 2)
    hi = _bisect(float(k), top, lambda x: _gamma_p_q(k / 2, x / 2)[1] <= alpha / 2)
    return lo, hi


def normal_upper_quantile(p):
    """z with P[N(0,1) > z] = p."""
    return _bisect(0.0, 40.0, lambda z: 0.5 * math.erfc(z / math.sqrt(2)) <= p)


def bernstein_radius(variance, alpha):
    """t with 2 exp(-t^2 / (2 (V + t/3))) = alpha: P[|sum of independent centred terms in [-1, 1]| >= t] <= alpha."""
    L = math.log(2 / alpha)
    return L / 3 + math.sqrt(L * L / 9 + 2 * variance * L)


# ------------------------------------------------------------------------------------------------
# Jobs, runs and files


def csv_job_toml(name, csv_path, *, mode, composition, W, T, windows, C, epsilon, delta, seed, aggregations):
    return f"""\
[job]
name = "{name}"

[input]
kind = "csv"
path = {json.dumps(csv_path)}
bad_rows = "skip"

[stream]
window_seconds = {W}
triggers = {T}
windows = {windows}

[privacy]
mode = "{mode}"
composition = "{composition}"
max_records_per_user = {C}
clamp_min = 0.0
clamp_max = 1.0
epsilon = {epsilon!r}
delta = {delta!r}
seed = {seed}

[query]
aggregations = {json.dumps(list(aggregations))}

[output]
format = "csv"
progress = "never"
"""


def synthetic_job_toml(name, mode, *, every):
    return f"""\
[job]
name = "{name}"

[input]
kind = "synthetic"
users = 4000
keys = 60
seed = 21

[stream]
window_seconds = 600
triggers = 6
windows = 2

[privacy]
mode = "{mode}"
max_records_per_user = 4
clamp_min = 0.0
clamp_max = 1.0
epsilon = 6.0
delta = 1e-9
seed = 77

[query]
aggregations = ["count", "sum"]

[checkpoint]
every = {every}

[output]
format = "csv"
progress = "never"
"""


def budget_of(dp, job, *sets, cwd=None):
    args = ["budget", job, "--json"]
    for s in sets:
        args += ["--set", s]
    r = dp.run_with(*args, ranks=1, cwd=cwd)
    assert r.returncode == 0, "budget failed\n  " + r.describe()
    j = json.loads(r.stdout)
    cols = {c["name"]: c["sigma"] for c in j["aggregation"]["columns"]}
    return {"json": j, "sigma_thr": j["threshold"]["noise"]["sigma"], "tau": j["threshold"]["tau"],
            "sigma_count": cols.get("count"), "sigma_sum": cols.get("sum")}


def run_job(dp, job, out, *sets, ranks=None, cwd=None, env=None):
    args = ["run", job, "--out", out]
    for s in sets:
        args += ["--set", s]
    r = dp.run_with(*args, ranks=ranks, cwd=cwd, env=env)
    assert r.returncode == 0, f"run failed ({' '.join(sets)})\n  " + r.describe()
    with open(os.path.join(out, "releases.csv"), "rb") as f:
        data = f.read()
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    return data, summary


def parse_releases(data, what):
    """releases.csv bytes -> [(window, trigger, key, count float, sum text)]."""
    text = data.decode("utf-8")
    reader = csv.reader(text.splitlines(), strict=True)
    header = next(reader, None)
    assert header == ["window", "trigger", "key", "count", "sum"], f"{what}: unexpected header {header!r}"
    rows = []
    for n, rec in enumerate(reader, start=2):
        assert len(rec) == 5, f"{what}:{n}: expected 5 fields, got {rec!r}"
        try:
            rows.append((int(rec[0]), int(rec[1]), rec[2], float(rec[3]), rec[4]))
        except ValueError as e:
            raise AssertionError(f"{what}:{n}: {e} in {rec!r}")
    return rows


# ------------------------------------------------------------------------------------------------
# The replica: bounding by the contract (checked against reference.compute), then per-trigger groups


class Truth:
    """Kept records of a CSV input, grouped per (window, trigger, key): records and distinct users."""

    def __init__(self, csv_path, job):
        inp = reference.read_input(csv_path, job)
        assert not inp.bad, f"the test's input has bad rows: {inp.bad[:3]}"
        order = sorted(inp.rows, key=lambda r: (reference.window_of(r.ts, job), reference.trigger_of(r.ts, job), r.ts, r.pos))
        kept = {}
        self.cells = {}  # (w, t, key) -> [records, set of users]
        self.windows = sorted({reference.window_of(r.ts, job) for r in order})
        self.T = job.triggers
        self.kept_total = 0
        for r in order:
            w, t = reference.window_of(r.ts, job), reference.trigger_of(r.ts, job)
            if kept.get((w, r.user), 0) >= job.max_records_per_user:
                continue
            kept[(w, r.user)] = kept.get((w, r.user), 0) + 1
            self.kept_total += 1
            cell = self.cells.setdefault((w, t, r.key), [0, set()])
            cell[0] += 1
            cell[1].add(r.user)
        # Cross-check with the shared bounding reference: the running counts it releases for the keys
        # touched at each trigger must be those of our groups.
        exp = reference.compute(inp, job)
        assert exp.kept == self.kept_total, f"replica keeps {self.kept_total} records, reference.py {exp.kept}"
        run = {}
        problems = []
        for w, t, key, count, _sum in exp.releases:
            want = sum(self.cells[(w, tt, key)][0] for tt in range(t + 1) if (w, tt, key) in self.cells)
            if count != want or (w, t, key) not in self.cells:
                problems.append((w, t, key, count, want))
            run[(w, t, key)] = count
        assert not problems, f"replica's running counts differ from reference.py: {problems[:5]}"
        assert len(run) == len(self.cells), "replica and reference.py disagree on the (window, trigger, key) touched"

    def keys(self, w):
        return sorted({k for (ww, _t, k) in self.cells if ww == w}, key=lambda k: k.encode("utf-8"))

    def tests(self, mode):
        """[(w, t, key, users, count)] of the candidates each trigger tests, in output order:
        repeated = (distinct users so far, running count) of every key seen so far in the window;
        batch = (distinct users, records) of the trigger's keys."""
        out = []
        for w in self.windows:
            users_so_far, count_so_far = {}, {}
            for t in range(self.T):
                for key in self.keys(w):
                    cell = self.cells.get((w, t, key))
                    if cell:
                        users_so_far.setdefault(key, set()).update(cell[1])
                        count_so_far[key] = count_so_far.get(key, 0) + cell[0]
                    if mode == "baseline-repeated":
                        if key in users_so_far:
                            out.append((w, t, key, len(users_so_far[key]), count_so_far[key]))
                    elif cell:
                        out.append((w, t, key, len(cell[1]), cell[0]))
        return out


# ------------------------------------------------------------------------------------------------
# Case 1 data: hand-made situations plus a random part


EX_W, EX_T, EX_C, EX_WINDOWS = 400, 4, 3, 2  # trigger = (ts mod 400) // 100


def write_exact_csv(path):
    rng = random.Random(20251122)
    rows = []  # (user, key, ts); the file order is shuffled below (ties are broken by file position)
    keys = [f"k{i}" for i in range(8)]
    for w in range(EX_WINDOWS):
        base = w * EX_W
        for u in range(26):
            for _ in range(rng.choice((1, 1, 2, 3, 4, 5, 6))):  # some users exceed C = 3
                key = keys[min(int(len(keys) * rng.random() ** 1.7), len(keys) - 1)]
                rows.append((f"u{u:02d}", key, base + rng.randrange(EX_W)))
    # Window 0, hand-made:
    rows += [("s1", "solo", 10), ("s1", "solo", 120)]  # one user, two records: never released
    # "bounded": 2 users without bounding, 1 with (b1's 4th record is dropped): never released.
    rows += [("b1", "k0", 5), ("b1", "k1", 6), ("b1", "k0", 7), ("b1", "bounded", 150), ("b2", "bounded", 160)]
    # Ties: x3's four records share ts 210; the first three in file order are kept. Their file order is
    # fixed below (appended after the shuffle): tieA, tieB, tieA, tieB -> tieB keeps 1 record of x3.
    ties = [("x3", "tieA", 210), ("x3", "tieB", 210), ("x3", "tieA", 210), ("x3", "tieB", 210)]
    rows += [("x4", "tieB", 250), ("x4", "tieA", 260)]
    # "split": users in different triggers (repeated releases from trigger 2 on, batch never).
    rows += [("y1", "split", 20), ("y2", "split", 230)]
    # "again": z1 in triggers 0 and 1 (two records there), z2 in trigger 1: batch users = 1, then 2.
    rows += [("z1", "again", 30), ("z1", "again", 130), ("z1", "again", 140), ("z2", "again", 199)]
    # "late": two users in the last trigger only.
    rows += [("y1", "late", 330), ("y2", "late", 399)]
    # Window 1: "bounded" and "split" with one user each (the window's state starts empty).
    rows += [("b2", "bounded", 405), ("y1", "split", 700)]
    # "again" in window 1: the same user in all triggers, never two users.
    rows += [("z1", "again", 400 + 100 * t + 1) for t in range(3)]
    rng.shuffle(rows)
    rows += ties
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("user_id,key,value,timestamp\n")
        for user, key, ts in rows:
            f.write(f"{user},{key},{rng.random():.4f},{ts}\n")
    return len(rows)


def expected_rows(truth, mode, min_users):
    """Rows with zero noise: every tested key with users >= min_users, with its count."""
    return [(w, t, key, float(count), "") for w, t, key, users, count in truth.tests(mode) if users >= min_users]


# ------------------------------------------------------------------------------------------------
# Case 2 data


NS_W, NS_T, NS_C, NS_WINDOWS = 400, 4, 4, 4
NS_BIG_KEYS, NS_USERS = 40, 6000
NS_PROBES = 24
NS_PROBE_USERS = [14 + (16 * k) // (NS_PROBES - 1) for k in range(NS_PROBES)]  # 14..30 per trigger


def write_noise_csv(path):
    rng = random.Random(424242)
    rows = []
    for w in range(NS_WINDOWS):
        base = w * NS_W
        for u in range(NS_USERS):
            for _ in range(rng.choice((1, 2, 2, 3, 3, 4, 5, 7))):
                rows.append((f"u{u}", f"b{rng.randrange(NS_BIG_KEYS):02d}", base + rng.randrange(NS_W)))
        for k, c in enumerate(NS_PROBE_USERS):
            for t in range(NS_T):
                for i in range(c):  # fresh users, one record each, in trigger t
                    rows.append((f"q{k}t{t}i{i}", f"p{k:02d}", base + 100 * t + rng.randrange(100)))
    rows.sort(key=lambda r: r[2])
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("user_id,key,value,timestamp\n")
        for user, key, ts in rows:
            f.write(f"{user},{key},0.5,{ts}\n")
    return len(rows)


# ------------------------------------------------------------------------------------------------


def expect_refusal(r, needles, out_dir, what):
    assert r.returncode == 2, f"{what}: expected exit 2, got {r.returncode}\n  " + r.describe()
    err = r.stderr
    missing = [n for n in needles if n.lower() not in err.lower()]
    assert not missing, f"{what}: the error message lacks {missing}:\n  {err.strip()[:1500]!r}"
    assert not os.path.exists(out_dir), f"{what}: a refused run created its output dir {out_dir}"


def main():
    args = harness.parse_args(__doc__)
    dp = harness.Dpstream(args)
    results = harness.Results(f"test_baselines (ranks={args.ranks})")
    t_start = time.monotonic()
    with harness.TempDir(args.keep, "dpstream-e2e-baselines-") as root:
        case_dir = harness.CaseDirs(root)

        # ---------------- 1. exactness at a huge budget ----------------
        ex_csv = os.path.join(root, "exact.csv")
        write_exact_csv(ex_csv)
        ex_ref_job = reference.Job(EX_W, EX_T, 0, EX_WINDOWS, EX_C, 0.0, 1.0)
        ex_state = {}

        def exact_truth():
            ex_state["truth"] = Truth(ex_csv, ex_ref_job)
            tr = ex_state["truth"]
            # The test design: the hand-made situations are there and the bounding matters.
            cell = tr.cells
            assert ("b1" not in cell.get((0, 1, "bounded"), [0, set()])[1]) and len(cell[(0, 1, "bounded")][1]) == 1, \
                "design: b1's 'bounded' record must be dropped by bounding"
            assert cell[(0, 2, "tieB")][1] == {"x3", "x4"} and cell[(0, 2, "tieA")][0] == 3, \
                f"design: tie handling ({cell[(0, 2, 'tieA')]}, {cell[(0, 2, 'tieB')]})"
            for mode in MODES:
                rel = expected_rows(tr, mode, 2)
                assert len(rel) >= 30 and any(u == 1 for *_x, u, _c in tr.tests(mode)), f"design: {mode} too few rows"

        results.check("exactness: replica of bounding agrees with reference.py; the input has the designed cases",
                      exact_truth)

        def exact_case(mode, composition):
            def check():
                tr = ex_state["truth"]
                d = case_dir(f"exact {mode} {composition}")
                job = harness.write_job(os.path.join(d, "job.toml"), csv_job_toml(
                    "e2e-baseline-exact", ex_csv, mode=mode, composition=composition, W=EX_W, T=EX_T,
                    windows=EX_WINDOWS, C=EX_C, epsilon=4000.0, delta=1e-6, seed=1, aggregations=["count"]))
                b = budget_of(dp, job, cwd=d)
                assert 1.0 < b["tau"] < 2.0, f"design: tau = {b['tau']} must lie in (1, 2)"
                tests = tr.tests(mode)
                want = expected_rows(tr, mode, 2)
                draws = len(tests) + len(want)
                p_any = len(tests) * dg_nonzero_bound(b["sigma_thr"]) + len(want) * dg_nonzero_bound(b["sigma_count"])
                assert p_any < 1e-9, (f"design: sigmas (thr {b['sigma_thr']}, count {b['sigma_count']}) give P[some noise "
                                      f"!= 0] <= {p_any:.3g}, not small enough for an exact comparison")
                outputs = {}
                # 3 ranks once (repeated, zcdp); optimal differs by its sigmas only: --ranks alone.
                counts = ([1, args.ranks] if composition == "zcdp" else [args.ranks]) + \
                    ([3] if composition == "zcdp" and mode == MODES[0] else [])
                counts = sorted(set(counts))
                for ranks in counts:
                    data, summary = run_job(dp, job, os.path.join(d, f"np{ranks}"), ranks=ranks, cwd=d)
                    outputs[ranks] = data
                    got = parse_releases(data, f"{mode}/{composition} np{ranks}")
                    if got != want:
                        gs, ws = set(got), set(want)
                        raise AssertionError(
                            f"{mode} ({composition}, {ranks} rank(s)): {len(got)} rows, expected {len(want)} "
                            f"(P[some noise != 0] <= {p_any:.2g});\n    only in dpstream: {sorted(gs - ws)[:8]}\n"
                            f"    only expected: {sorted(ws - gs)[:8]}"
                            + ("\n    (same rows, different order)" if gs == ws else ""))
                    released_keys = len({(w, k) for w, _t, k, *_r in want})
                    dpj = harness.get(summary, "dp")
                    want_dp = {"threshold_tests": len(tests), "release_rows": len(want), "noise_draws": draws,
                               "keys_released": released_keys}
                    bad = {k: (dpj.get(k), v) for k, v in want_dp.items() if dpj.get(k) != v}
                    assert not bad, f"{mode} ({composition}, np{ranks}): summary.json dp (got, expected): {bad}"
                    assert summary.get("release_rows") == len(want), \
                        f"summary release_rows {summary.get('release_rows')}, expected {len(want)}"
                first = outputs[counts[0]]
                differ = [r for r in counts if outputs[r] != first]
                assert not differ, f"releases.csv differs between {counts[0]} and {differ} rank(s)"
                print(f"     {len(want)} rows, {len(tests)} threshold tests, ranks {counts} identical; "
                      f"tau {b['tau']:.4f}, P[some noise != 0] <= {p_any:.2g}", flush=True)

            return check

        if "truth" in ex_state:
            for mode in MODES:
                for composition in ("zcdp", "optimal"):
                    results.check(f"exactness: {mode}, composition {composition}: rows = keys with >= 2 users "
                                  f"({'so far' if mode == MODES[0] else 'in the trigger'}) with their true counts",
                                  exact_case(mode, composition))

        # ---------------- 2. noise scale and threshold ----------------
        ns_csv = os.path.join(root, "noise.csv")
        ns_state = {}
        ns_runs = [("baseline-batch", "zcdp"), ("baseline-repeated", "zcdp"), ("baseline-batch", "optimal")]
        n_stat_checks = 4 * len(ns_runs)
        alpha = 1e-6 / n_stat_checks
        z_crit = normal_upper_quantile(alpha / 2)
        sure = 1e-12

        def noise_truth():
            n = write_noise_csv(ns_csv)
            ns_state["truth"] = Truth(ns_csv, reference.Job(NS_W, NS_T, 0, NS_WINDOWS, NS_C, 0.0, 1.0))
            print(f"     {n} input rows; {n_stat_checks} statistical checks at alpha = {alpha:.2e} each "
                  f"(two-sided z {z_crit:.2f}): false-failure rate < 1e-6", flush=True)

        results.check("noise scale: input written, replica of bounding agrees with reference.py", noise_truth)

        def noise_case(mode, composition):
            def check():
                tr = ns_state["truth"]
                d = case_dir(f"noise {mode} {composition}")
                job = harness.write_job(os.path.join(d, "job.toml"), csv_job_toml(
                    "e2e-baseline-noise", ns_csv, mode=mode, composition=composition, W=NS_W, T=NS_T,
                    windows=NS_WINDOWS, C=NS_C, epsilon=6.0, delta=1e-9, seed=3, aggregations=["count"]))
                b = budget_of(dp, job, cwd=d)
                thr, cnt = DG(b["sigma_thr"]), DG(b["sigma_count"])
                tau = b["tau"]
                data, summary = run_job(dp, job, os.path.join(d, "out"), cwd=d)
                got = parse_releases(data, f"{mode}/{composition}")
                tests = tr.tests(mode)
                truth = {(w, t, k): (u, c) for w, t, k, u, c in tests}
                problems = []
                zs = []
                released = set()
                for w, t, key, count, _s in got:
                    if (w, t, key) not in truth:
                        problems.append(f"row for an untested (window, trigger, key) {(w, t, key)}")
                        continue
                    released.add((w, t, key))
                    zs.append((count - truth[(w, t, key)][1]) / math.sqrt(cnt.var))
                # Threshold: exact release probabilities.
                p_unsure, x_unsure = [], []
                n_sure_in = n_sure_out = 0
                big_sure = 0
                for (w, t, key), (u, _c) in truth.items():
                    p = thr.upper_tail(tau - u)
                    rel = (w, t, key) in released
                    if p > 1 - sure:
                        n_sure_in += 1
                        big_sure += key.startswith("b")
                        if not rel:
                            problems.append(f"{(w, t, key)} with {u} users (P[release] = 1 - {1 - p:.1e}) not released")
                    elif p < sure:
                        n_sure_out += 1
                        if rel:
                            problems.append(f"{(w, t, key)} with {u} users (P[release] = {p:.1e}) released")
                    else:
                        p_unsure.append(p)
                        x_unsure.append(1 if rel else 0)
                assert not problems, f"{mode} ({composition}), tau {tau:.3f}:\n  " + "\n  ".join(problems[:20])
                if mode == "baseline-batch" and composition == "zcdp":  # test design: every big key is a sure release in the batches
                    assert big_sure == NS_BIG_KEYS * NS_T * NS_WINDOWS, f"design: only {big_sure} sure big-key releases"
                assert len(p_unsure) >= 60, f"design: only {len(p_unsure)} uncertain threshold tests (tau {tau})"
                # Value noise.
                n = len(zs)
                s2 = math.fsum(z * z for z in zs)
                lo, hi = chi2_interval(n, alpha)
                mean_z = math.fsum(zs) / math.sqrt(n)
                # Release counts over the uncertain tests: location and scale (as test_dp_accuracy).
                var = math.fsum(p * (1 - p) for p in p_unsure)
                radius = bernstein_radius(var, alpha)
                loc = math.fsum(x_unsure) - math.fsum(p_unsure)
                scale = math.fsum((1 if p < 0.5 else -1) * (x - p) for x, p in zip(x_unsure, p_unsure))
                print(f"     sigma_count {b['sigma_count']:.3f}, sigma_thr {b['sigma_thr']:.3f}, tau {tau:.3f}; "
                      f"{n} rows: var(z) {s2 / n:.4f} in [{lo / n:.4f}, {hi / n:.4f}], mean z {mean_z:+.2f}; "
                      f"{n_sure_in} sure releases, {n_sure_out} sure non-releases, {len(p_unsure)} uncertain: "
                      f"{sum(x_unsure)} released ~ {math.fsum(p_unsure):.1f} (loc {loc:+.1f}, scale {scale:+.1f}, "
                      f"radius {radius:.1f})", flush=True)
                assert lo <= s2 <= hi, (f"count noise variance {s2 / n * cnt.var:.3f} = {s2 / n:.4f} sigma_count^2, "
                                        f"outside [{lo / n:.4f}, {hi / n:.4f}] (n = {n}): not sigma_count "
                                        f"{b['sigma_count']} of budget --json")
                assert abs(mean_z) <= z_crit, f"count noise mean z = {mean_z:+.2f} beyond +-{z_crit:.2f} (n = {n})"
                assert abs(loc) <= radius, (f"{sum(x_unsure)} uncertain keys released, P[users + N_thr > tau] predicts "
                                            f"{math.fsum(p_unsure):.1f} +- {radius:.1f}: tau or the threshold noise's centre is off")
                assert abs(scale) <= radius, (f"release frequencies {'flatter' if scale > 0 else 'steeper'} than N_Z(0, "
                                              f"sigma_thr^2) predicts (statistic {scale:+.1f}, radius {radius:.1f})")
                assert harness.get(summary, "dp.keys_released") == len({(w, k) for w, _t, k in released}), \
                    f"dp.keys_released {harness.get(summary, 'dp.keys_released')}, rows show {len({(w, k) for w, _t, k in released})}"
                assert harness.get(summary, "dp.threshold_tests") == len(tests), \
                    f"dp.threshold_tests {harness.get(summary, 'dp.threshold_tests')}, expected {len(tests)}"

            return check

        if "truth" in ns_state:
            for mode, composition in ns_runs:
                results.check(f"noise scale: {mode}, {composition}: count noise variance = sigma_count^2, threshold "
                              f"P[users + N > tau]", noise_case(mode, composition))

        # ---------------- 3. accounting refusals and summary.json ----------------
        def refusals():
            d = case_dir("refusals")
            job = harness.write_job(os.path.join(d, "job.toml"), csv_job_toml(
                "e2e-baseline-refuse", ex_csv, mode="baseline-repeated", composition="zcdp", W=86400, T=4,
                windows=1, C=3, epsilon=1.0, delta=1e-6, seed=1, aggregations=["count"]))
            out = os.path.join(d, "out")
            for mode in MODES:
                r = dp.run_with("run", job, "--out", out, "--set", f'privacy.mode="{mode}"', "--set",
                                'privacy.composition="basic"', cwd=d)
                expect_refusal(r, ["composition", "basic"], out, f"{mode} with composition basic")
            r = dp.run_with("run", job, "--out", out, "--set", 'privacy.mode="dp"', "--set",
                            'privacy.composition="optimal"', cwd=d)
            expect_refusal(r, ["composition", "optimal"], out, "mode dp with composition optimal")
            small = ["--set", "privacy.epsilon=1e-4", "--set", "privacy.delta=1e-12", "--set", "stream.triggers=1000"]
            for mode in MODES[:1]:  # the plan of "optimal" is the same for both modes
                r = dp.run_with("run", job, "--out", out, "--set", f'privacy.mode="{mode}"', "--set",
                                'privacy.composition="optimal"', *small, cwd=d)
                expect_refusal(r, ["sigma", "epsilon"], out, f"{mode}, optimal, eps 1e-4 over T = 1000")
            # The same budget under zcdp is accepted (the refusal is the composition's).
            r = dp.run_with("budget", job, *small, cwd=d, ranks=1)
            assert r.returncode == 0, "the same job with composition zcdp is refused\n  " + r.describe()

        results.check("refusals: basic with a baseline, optimal with dp, optimal with eps too small for T = 1000",
                      refusals)

        def summaries():
            d = case_dir("summaries")
            for mode, composition in (("baseline-repeated", "optimal"), ("baseline-batch", "zcdp")):
                job = harness.write_job(os.path.join(d, f"{mode}-{composition}.toml"), csv_job_toml(
                    "e2e-baseline-summary", ex_csv, mode=mode, composition=composition, W=EX_W, T=EX_T,
                    windows=EX_WINDOWS, C=EX_C, epsilon=2.0, delta=1e-6, seed=5, aggregations=["count", "sum"]))
                b = budget_of(dp, job, cwd=d)
                _data, s = run_job(dp, job, os.path.join(d, f"out-{mode}-{composition}"), cwd=d)
                want = {"mode": mode, "release_values": "increments" if mode == "baseline-batch" else "running",
                        "private": False}
                bad = {k: (s.get(k), v) for k, v in want.items() if s.get(k) != v}
                assert not bad, f"{mode}: summary.json (got, expected): {bad}"
                p = harness.get(s, "privacy")
                assert p.get("mode") == mode and p.get("composition") == composition and p.get("private") is False, \
                    f"{mode}: summary.json privacy: mode {p.get('mode')}, composition {p.get('composition')}, private {p.get('private')}"
                assert p == b["json"], f"{mode}: summary.json privacy differs from budget --json:\n  {p}\n  {b['json']}"

        results.check("summary.json of baseline runs: mode, release_values, private false with a seed, privacy = budget",
                      summaries)

        # ---------------- 4. checkpoint, kill, resume ----------------
        def kill_resume(mode, fault, resume_ranks):
            def check():
                d = case_dir(f"ckpt {mode}")
                job = harness.write_job(os.path.join(d, "job.toml"), synthetic_job_toml("e2e-baseline-ckpt", mode, every=1))
                ref_data, ref_summary = run_job(dp, job, os.path.join(d, "ref"), cwd=d)
                ref_lines = ref_data.count(b"\n")
                assert ref_lines > 100, f"design: the reference run has only {ref_lines} lines"
                out = os.path.join(d, "killed")
                r = dp.run_with("run", job, "--out", out, env={"DPSTREAM_FAULT": fault}, timeout=60, cwd=d)
                assert r.returncode != 0, f"DPSTREAM_FAULT={fault}: the run was not killed\n  " + r.describe()
                both = r.stdout + r.stderr
                assert r.returncode == 137 or "signal 9" in both or "Killed" in both, \
                    f"DPSTREAM_FAULT={fault}: the run failed, but not by the fault's SIGKILL\n  " + r.describe()
                part = harness.read_bytes(os.path.join(out, "releases.csv")) or b""
                assert ref_data.startswith(part), "the killed run's releases.csv is not a byte prefix of the reference"
                assert len(part) < len(ref_data), "the killed run's releases.csv is complete: killed too late"
                assert not os.path.exists(os.path.join(out, "summary.json")), "the killed run left summary.json"
                r = dp.run_with("run", job, "--out", out, "--resume", ranks=resume_ranks, cwd=d)
                assert r.returncode == 0, "resume failed\n  " + r.describe()
                got = harness.read_bytes(os.path.join(out, "releases.csv"))
                if got != ref_data:
                    i = harness.first_difference(got, ref_data)
                    raise AssertionError(f"resumed releases.csv ({len(got)} bytes) differs from the uninterrupted run's "
                                         f"({len(ref_data)} bytes) at byte {i}:\n    got {got[max(0, i - 80):i + 80]!r}\n"
                                         f"    ref {ref_data[max(0, i - 80):i + 80]!r}")
                with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
                    s = json.load(f)
                keys = ("keys_released", "release_rows", "threshold_tests", "noise_draws")
                bad = {k: (s["dp"].get(k), ref_summary["dp"].get(k)) for k in keys if s["dp"].get(k) != ref_summary["dp"].get(k)}
                assert not bad, f"summary.json dp after resume (resumed, uninterrupted): {bad}"
                assert s.get("release_rows") == ref_summary.get("release_rows"), "summary release_rows differ"
                print(f"     killed with {fault}: {len(part)} of {len(ref_data)} bytes; resumed at {resume_ranks or args.ranks} "
                      f"rank(s); keys_released {s['dp']['keys_released']}", flush=True)

            return check

        last = args.ranks - 1
        results.check("checkpoint: baseline-batch killed at dp_release of trigger 3 (rank 0), resumed: identical",
                      kill_resume("baseline-batch", "dp_release@3:0", None))
        results.check(f"checkpoint: baseline-repeated killed at dp_release in window 2 (rank {last}), resumed at 1 rank: "
                      f"identical", kill_resume("baseline-repeated", f"dp_release@8:{last}", 1))
    print(f"     total {time.monotonic() - t_start:.1f} s")
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
