#!/usr/bin/env python3
"""End-to-end statistical test of mode = "dp" (docs/PRIVACY.md sections 4-6).

A CSV stream generated here (T = 8 triggers, 8 windows, C = 4, values mostly in [0, 1] with some
clamped): 8 "big" keys with 400-3000 distinct users, 24 "probe" keys whose users all arrive at
trigger 0 in numbers around mu + tau_1, and 30 "tail" keys with at most mu users. The job runs once
with mode = "none" (the true running totals after bounding) and then with mode = "dp" under many
test seeds ([privacy] seed; 100 runs at 1 rank, 50 other seeds at more ranks); every window is an
independent replicate (its noise is keyed by the window), so the test sees seeds x 8 replicates.

Value noise. For each released (key, trigger t) the error = released - true running total (for the
sum: the true total on the sum grid printed by budget, i.e. the none-mode total corrected by the
grid rounding of each kept value). The prediction is sd = sigma_col sqrt(v_i), i = t + 1, where
v_i = sum over set bits j of i of 2^j / (2^(j+1) - 1) and sigma_col^2 is replaced by the exact
variance of the discrete Gaussian (equal to sigma^2 to 1e-12 here, sigma >= 2). Per trigger and
column: sum of z^2 against chi-square(n) (two-sided), mean z against N(0, 1/n), the count/sum
correlation and the correlation between windows w and w + 1 (w even) of the same seed against N(0, 1/n)
(independent tree families; window-keyed noise).

Key selection. Deterministic: tail keys (<= mu users) never appear; a key appears at trigger t only
if its round count (distinct users new since the trigger after its previous release) exceeds mu;
a key whose round count exceeds mu + tau_s + 7.5 lambda_s must appear (false failure <= e^-28 per
test by the subgaussian tail); rows are sorted by (window, trigger, key bytes) without duplicates.
Statistical: at trigger 0 a probe key with c users is released iff c + Y > mu + tau_1,
Y ~ N_Z(0, sigma_sel^2): the release counts over all probes and replicates must match the exact
discrete-Gaussian probabilities in location and in scale (Bernstein bound, rigorous).

False failure rate: every statistical check uses alpha = 1e-6 / (number of statistical checks),
so the whole test fails by chance with probability < 1e-6 (chi-square and normal approximations
for the value tests: the noise is a sum of discrete Gaussians with sigma ~ 45 and the sample sizes
are in the hundreds to thousands; exact Bernstein bounds for the selection tests).

Usage: test_dp_accuracy.py --ranks N [--bin build/src/dpstream] [--seeds N] [--first-seed S] [--keep]
"""

import argparse
import csv
import json
import math
import os
import random
import shutil
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dp_reference  # noqa: E402
import harness  # noqa: E402
import reference  # noqa: E402

W = 800  # window seconds; trigger = offset // 100
T = 8
WINDOWS = 8
C = 4
EPSILON = 3.0
DELTA = 1e-9
MU = 10.0
BIG_USERS = [400, 550, 700, 1000, 1300, 1700, 2200, 3000]
N_PROBES = 24
PROBE_Z = [-2.3 + 4.6 * k / (N_PROBES - 1) for k in range(N_PROBES)]  # c = mu + tau_1 + z lambda_1
N_TAIL = 30
DATA_SEED = 20240607
FAMILY_ALPHA = 1e-6
SURE_RELEASE_SIGMAS = 7.5  # P[prefix noise < -7.5 lambda] <= exp(-7.5^2 / 2) = 6e-13 per test


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--bin", default=os.environ.get("DPSTREAM_BIN", harness.DEFAULT_BIN))
    ap.add_argument("--mpirun", default=os.environ.get("MPIRUN", "mpirun"))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seeds", type=int, default=None,
                    help="DP runs (default 100 at 1 rank, 50 at more ranks: mpirun costs more there)")
    ap.add_argument("--first-seed", type=int, default=None,
                    help="first test seed (default 1 + 1000 (ranks - 1): each rank count adds new samples)")
    a = ap.parse_args()
    if a.seeds is None:
        a.seeds = 100 if a.ranks == 1 else 50
    if a.first_seed is None:
        a.first_seed = 1 + 1000 * (a.ranks - 1)
    return a


# ------------------------------------------------------------------------------------------------
# Distributions (stdlib only)


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


def chi2_cdf(x, k):
    return _gamma_p_q(k / 2, x / 2)[0]


def chi2_sf(x, k):
    return _gamma_p_q(k / 2, x / 2)[1]


def chi2_interval(k, alpha):
    """[lo, hi] with P[chi2_k < lo] = P[chi2_k > hi] = alpha / 2."""
    top = k + 50 * math.sqrt(2 * k) + 200
    lo = dp_reference._bisect(0.0, float(k), lambda x: chi2_cdf(x, k) >= alpha / 2)[1]
    hi = dp_reference._bisect(float(k), top, lambda x: chi2_sf(x, k) <= alpha / 2)[1]
    return lo, hi


def bernstein_radius(variance, alpha):
    """t with 2 exp(-t^2 / (2 (V + t/3))) = alpha: P[|sum of independent centred terms in [-1, 1]| >= t] <= alpha."""
    L = math.log(2 / alpha)
    return L / 3 + math.sqrt(L * L / 9 + 2 * variance * L)


# ------------------------------------------------------------------------------------------------
# Data


class Data:
    """The generated stream and everything true about it."""

    def __init__(self, tau1, lam1):
        rng = random.Random(DATA_SEED)
        self.big = [f"B{k}" for k in range(len(BIG_USERS))]
        self.probe_users = [max(int(MU) + 1, round(MU + tau1 + z * lam1)) for z in PROBE_Z]
        self.probes = [f"P{k:02d}" for k in range(N_PROBES)]
        self.tail = [f"t{k:02d}" for k in range(N_TAIL)]
        self.tail_users = [1 + k % int(MU) for k in range(N_TAIL)]  # 1..mu distinct users each
        rows = []  # (ts, tiebreak, user, key, value)

        def value():
            r = rng.random()
            if r < 0.05:
                return round(rng.uniform(1.0, 2.0), 6)  # clamped to 1
            if r < 0.10:
                return round(rng.uniform(-1.0, 0.0), 6)  # clamped to 0
            return round(rng.random(), 6)

        for w in range(WINDOWS):
            base = w * W
            for k, n in enumerate(BIG_USERS):
                for i in range(n):
                    user = f"b{k}u{i}"
                    for _ in range(rng.choice((1, 1, 2, 2, 3, 4, 5, 6, 7))):  # some users exceed C
                        rows.append((base + rng.randrange(W), rng.random(), user, self.big[k], value()))
                    if rng.random() < 0.1:  # a second key for 10% of the users
                        rows.append((base + rng.randrange(W), rng.random(), user, self.big[(k + 1 + rng.randrange(7)) % 8],
                                     value()))
            for k, n in enumerate(self.probe_users):
                for i in range(n):
                    rows.append((base + rng.randrange(100), rng.random(), f"q{k}u{i}", self.probes[k], value()))
            for k, n in enumerate(self.tail_users):
                for i in range(n):
                    # Half the tail users are also big-key users (their tail record may be bounded away).
                    user = f"b{i % 8}u{k}" if i % 2 else f"t{k}u{i}"
                    for _ in range(rng.choice((1, 2, 3))):
                        rows.append((base + rng.randrange(W), rng.random(), user, self.tail[k], value()))
        rows.sort()
        self.rows = rows

    def write(self, path):
        with open(path, "w", encoding="utf-8") as f:
            f.write("user_id,key,value,timestamp\n")
            for ts, _tb, user, key, v in self.rows:
                f.write(f"{user},{key},{v!r},{ts}\n")

    def truth(self, quantum):
        """Per (window, key): lists over triggers of running kept count, running sum in 2^-20 units with
        and without the sum grid, running distinct users. The file is in stream order."""
        kept_per_user = {}
        first_touch = set()
        inc = {}  # (w, key) -> [[count, sum_fine, sum_grid, users] per trigger]
        for ts, _tb, user, key, v in self.rows:  # already in stream order (timestamp, file position)
            w, t = ts // W, (ts % W) * T // W
            if kept_per_user.get((w, user), 0) >= C:
                continue
            kept_per_user[(w, user)] = kept_per_user.get((w, user), 0) + 1
            fixed = dp_reference.to_fixed(min(max(v, 0.0), 1.0))
            cell = inc.setdefault((w, key), [[0, 0, 0, 0] for _ in range(T)])[t]
            cell[0] += 1
            cell[1] += fixed
            cell[2] += dp_reference.quantize(fixed, quantum)
            if (w, user, key) not in first_touch:
                first_touch.add((w, user, key))
                cell[3] += 1
        out = {}
        for wk, cells in inc.items():
            run = [0, 0, 0, 0]
            series = []
            for cell in cells:
                run = [a + b for a, b in zip(run, cell)]
                series.append(tuple(run))
            out[wk] = series
        self.distinct_users = sum(len({u for (w2, u) in kept_per_user if w2 == w}) for w in range(WINDOWS))
        return out


# ------------------------------------------------------------------------------------------------


def toml_job(csv_path, out_dir):
    return f"""[job]
name = "e2e-dp-accuracy"

[input]
kind = "csv"
path = {json.dumps(csv_path)}

[stream]
window_seconds = {W}
triggers = {T}
windows = {WINDOWS}

[privacy]
mode = "dp"
selection_counter = "tree"  # dp_reference.py's Honaker variances; the banded counters' draws: test_privacy_properties
value_counter = "tree"
max_records_per_user = {C}
clamp_min = 0.0
clamp_max = 1.0
epsilon = {EPSILON!r}
delta = {DELTA!r}
mu = {MU!r}

[query]
aggregations = ["count", "sum"]

[output]
dir = {json.dumps(out_dir)}
progress = "never"
"""


def read_rows(path):
    """releases.csv rows as (window, trigger, key, count, sum); DP counts are reals (noisy, 2^-20 grid)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, strict=True)
        header = next(reader, None)
        assert header == ["window", "trigger", "key", "count", "sum"], f"{path}: unexpected header {header!r}"
        rows = []
        for n, rec in enumerate(reader, start=2):
            assert len(rec) == 5, f"{path}:{n}: expected 5 fields, got {rec!r}"
            try:
                rows.append((int(rec[0]), int(rec[1]), rec[2], float(rec[3]), float(rec[4])))
            except ValueError as e:
                raise AssertionError(f"{path}:{n}: {e} in {rec!r}")
    return rows


class Stats:
    def __init__(self):
        self.z = {}  # (column, trigger) -> list of z
        self.pairs = {}  # trigger -> list of (z_count, z_sum)
        self.by_rep = {}  # (seed, window, key, trigger) -> (z_count, z_sum)
        self.probe_released = [0] * N_PROBES
        self.replicates = 0
        self.deterministic = []  # violations, human readable
        self.sure_tests = 0
        self.gate_tests = 0


def main():
    args = parse_args()
    dp = harness.Dpstream(args)
    results = harness.Results(f"test_dp_accuracy (ranks={args.ranks}, seeds={args.seeds})")
    t_start = time.monotonic()
    with harness.TempDir(args.keep, "dpstream-e2e-dp-accuracy-") as root:
        csv_path = os.path.join(root, "in.csv")
        job = harness.write_job(os.path.join(root, "job.toml"), toml_job(csv_path, os.path.join(root, "out")))
        state = {}

        # ---- the plan: engine vs reference, and what the statistics need ----
        def plan():
            r = dp.run("budget", job, "--json", "--thresholds", cwd=root)
            assert r.returncode == 0, r.describe()
            j = json.loads(r.stdout)
            ref = dp_reference.make_plan(dp_reference.Job(epsilon=EPSILON, delta=DELTA, C=C, T=T, mu=MU))
            cols = {c["name"]: c for c in j["aggregation"]["columns"]}
            got = {"sigma_sel": j["key_selection"]["tree"]["sigma"], "sigma_count": cols["count"]["sigma"],
                   "sigma_sum": cols["sum"]["sigma"], "sum_grid": j["aggregation"]["sum_grid"]}
            want = {"sigma_sel": ref.sigma_sel, "sigma_count": ref.column("count").sigma,
                    "sigma_sum": ref.column("sum").sigma, "sum_grid": ref.sum_grid}
            bad = {k: (got[k], want[k]) for k in got if abs(got[k] - want[k]) > 1e-6 * want[k]}
            assert not bad, f"budget differs from dp_reference: {bad}"
            taus = [row["tau"] for row in j["key_selection"]["thresholds"]]
            lams = [row["lambda"] for row in j["key_selection"]["thresholds"]]
            for s in range(1, T + 1):
                assert abs(taus[s - 1] - ref.tau[s]) <= 1e-6 * ref.tau[s], f"tau_{s}: {taus[s - 1]} vs {ref.tau[s]}"
            assert got["sigma_count"] >= 2 and got["sigma_sum"] >= 2, "the test assumes sigma >= 2"
            state.update(got)
            state["tau"] = [0.0] + taus
            state["lam"] = [0.0] + lams
            state["quantum"] = round(got["sum_grid"] * reference.SCALE)
            # Exact variance of the discrete Gaussian (slightly below sigma^2; equal to 1e-12 here).
            state["var_count"] = dp_reference.discrete_gaussian_variance(got["sigma_count"] )
            state["var_sum_grid"] = dp_reference.discrete_gaussian_variance(got["sigma_sum"] / got["sum_grid"])
            state["var_sum"] = state["var_sum_grid"] * got["sum_grid"] ** 2

        results.check("budget of the test job matches dp_reference", plan)
        if "tau" not in state:
            return results.finish()

        # ---- data and the truth ----
        def data_and_truth():
            data = Data(state["tau"][1], state["lam"][1])
            data.write(csv_path)
            truth = data.truth(state["quantum"])
            state["data"], state["truth"] = data, truth
            # Probe keys: release probability at trigger 0 = P[Y > mu + tau_1 - c], Y ~ N_Z(0, sigma_sel^2).
            state["p_probe"] = [dp_reference.discrete_gaussian_upper_tail(state["sigma_sel"], MU + state["tau"][1] - c)
                                for c in data.probe_users]
            out = os.path.join(root, "none")
            r = dp.run("run", job, "--set", 'privacy.mode="none"', "--out", out, cwd=root)
            assert r.returncode == 0, "mode = \"none\" run failed\n  " + r.describe()
            rows = read_rows(os.path.join(out, "releases.csv"))
            with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
                summary = json.load(f)
            # The true totals come from the none run; our replica of bounding must agree with it exactly.
            latest = {}
            for w, t, key, cnt, sm in rows:
                latest[(w, key, t)] = (cnt, sm)
            problems = []
            for (w, key), series in truth.items():
                for t in range(T):
                    if (w, key, t) in latest:
                        cnt, sm = latest[(w, key, t)]
                        if cnt != series[t][0] or abs(sm - series[t][1] / reference.SCALE) > 1e-6:
                            problems.append(f"window {w} key {key} trigger {t}: none run ({cnt}, {sm}), "
                                            f"replica ({series[t][0]}, {series[t][1] / reference.SCALE})")
            n_changed = sum(1 for series in truth.values() for t in range(T)
                            if series[t][0] != (series[t - 1][0] if t else 0))
            if n_changed != len(rows):
                problems.append(f"none run has {len(rows)} rows, the replica expects {n_changed}")
            if summary.get("distinct_users") != data.distinct_users:
                problems.append(f"summary distinct_users {summary.get('distinct_users')}, replica {data.distinct_users}")
            assert not problems, "the bounding replica disagrees with the none run:\n  " + "\n  ".join(problems[:20])
            shutil.rmtree(out, ignore_errors=True)
            for k, (c, p) in enumerate(zip(data.probe_users, state["p_probe"])):
                assert 0.005 < p < 0.995, f"probe {k} with {c} users has release probability {p}: bad design"

        results.check("CSV stream, mode = \"none\" truth equals the bounding replica", data_and_truth)
        if "truth" not in state:
            return results.finish()

        # ---- the DP runs ----
        st = Stats()
        data, truth = state["data"], state["truth"]
        known = set(data.big) | set(data.probes) | set(data.tail)
        tail = set(data.tail)
        sd_count = [0.0] + [math.sqrt(state["var_count"] * dp_reference.prefix_variance_factor(i)) for i in range(1, T + 1)]
        sd_sum = [0.0] + [math.sqrt(state["var_sum"] * dp_reference.prefix_variance_factor(i)) for i in range(1, T + 1)]

        def one_run(seed):
            out = os.path.join(root, f"dp-{seed}")
            r = dp.run("run", job, "--set", f"privacy.seed={seed}", "--out", out, cwd=root)
            assert r.returncode == 0, f"seed {seed}: run failed\n  " + r.describe()
            rows = read_rows(os.path.join(out, "releases.csv"))
            shutil.rmtree(out, ignore_errors=True)
            return rows

        def analyse(seed, rows):
            bad = st.deterministic
            prev = None
            released = {}  # (w, key) -> set of triggers
            for row in rows:
                w, t, key, cnt, sm = row
                order = (w, t, key.encode("utf-8"))
                if prev is not None and not prev < order:
                    bad.append(f"seed {seed}: rows not strictly sorted by (window, trigger, key): {prev} then {order}")
                prev = order
                if not (0 <= w < WINDOWS and 0 <= t < T) or key not in known:
                    bad.append(f"seed {seed}: unexpected row {row}")
                    continue
                if key in tail:
                    bad.append(f"seed {seed}: tail key {key} (<= mu users) released: {row}")
                released.setdefault((w, key), set()).add(t)
                tc, _fine, tgrid, _users = truth[(w, key)][t]
                zc = (cnt - tc) / sd_count[t + 1]
                zs = (sm - tgrid / reference.SCALE) / sd_sum[t + 1]
                st.z.setdefault(("count", t), []).append(zc)
                st.z.setdefault(("sum", t), []).append(zs)
                st.pairs.setdefault(t, []).append((zc, zs))
                st.by_rep[(seed, w, key, t)] = (zc, zs)
            # Selection: walk every key's rounds.
            for (w, key), series in truth.items():
                rel = released.get((w, key), set())
                round_start, base_users = 0, 0
                for t in range(T):
                    round_users = series[t][3] - base_users
                    s = t - round_start + 1
                    if round_users <= MU:
                        st.gate_tests += 1  # a closed gate: the key must not appear
                    if t in rel and round_users <= MU:
                        bad.append(f"seed {seed}: window {w} key {key} released at trigger {t} with round count "
                                   f"{round_users} <= mu = {MU} (never tested keys must never be released)")
                    if round_users > MU + state["tau"][s] + SURE_RELEASE_SIGMAS * state["lam"][s]:
                        st.sure_tests += 1
                        if t not in rel:
                            bad.append(f"seed {seed}: window {w} key {key} not released at trigger {t} although its "
                                       f"round count {round_users} exceeds mu + tau_{s} + {SURE_RELEASE_SIGMAS} lambda_{s} "
                                       f"= {MU + state['tau'][s] + SURE_RELEASE_SIGMAS * state['lam'][s]:.1f}")
                    if t in rel:
                        round_start, base_users = t + 1, series[t][3]
            for k, key in enumerate(data.probes):
                for w in range(WINDOWS):
                    st.probe_released[k] += 0 in released.get((w, key), set())
            st.replicates += WINDOWS

        def runs():
            t0 = time.monotonic()
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                analyse(seed, one_run(seed))
            state["run_seconds"] = time.monotonic() - t0
            print(f"     {args.seeds} DP runs in {state['run_seconds']:.1f} s; "
                  f"{sum(len(v) for k, v in st.z.items() if k[0] == 'count')} released (key, trigger) values", flush=True)

        results.check(f"{args.seeds} seeded DP runs complete (seeds {args.first_seed}..{args.first_seed + args.seeds - 1})",
                      runs)
        if "run_seconds" not in state:
            return results.finish()

        results.check("deterministic selection invariants: sorted rows, no tail key, a key only released "
                      "when its round count > mu, always released far above the threshold", lambda: (
                          _assert_no(st.deterministic, f"{st.gate_tests} (key, trigger) with round count <= mu, none released; "
                                                     f"{st.sure_tests} far above the threshold, all released")))

        # ---- statistics ----
        n_value_tests = 2 * T * 3 + T  # per column/trigger: variance, mean, window correlation; per trigger: count-sum
        n_tests = n_value_tests + 2
        alpha = FAMILY_ALPHA / n_tests
        z_crit = dp_reference.normal_upper_quantile(alpha / 2)
        print(f"     {n_tests} statistical checks, each at alpha = {alpha:.2e} (two-sided z {z_crit:.2f}); "
              f"family false-failure rate < {FAMILY_ALPHA:g}", flush=True)

        def variance_and_mean(column):
            def check():
                lines, problems = [], []
                for t in range(T):
                    zs = st.z.get((column, t), [])
                    n = len(zs)
                    if n < 50:
                        problems.append(f"trigger {t}: only {n} releases (test design)")
                        continue
                    s2 = math.fsum(z * z for z in zs)
                    lo, hi = chi2_interval(n, alpha)
                    mean_z = math.fsum(zs) / math.sqrt(n)
                    lines.append(f"t={t} n={n} var={s2 / n:.4f} [{lo / n:.4f}, {hi / n:.4f}] mean z={mean_z:+.2f}")
                    if not lo <= s2 <= hi:
                        problems.append(f"trigger {t} (leaf {t + 1}, v = {dp_reference.prefix_variance_factor(t + 1):.4f}): "
                                        f"empirical variance of standardized errors {s2 / n:.4f} outside "
                                        f"[{lo / n:.4f}, {hi / n:.4f}] (n = {n})")
                    if abs(mean_z) > z_crit:
                        problems.append(f"trigger {t}: mean error {math.fsum(zs) / n:+.4f} sd, z = {mean_z:+.2f} "
                                        f"beyond +-{z_crit:.2f} (n = {n})")
                print("     " + "\n     ".join(lines), flush=True)
                assert not problems, f"{column} noise does not match sigma_{column} sqrt(v_i):\n  " + "\n  ".join(problems)

            return check

        def correlations():
            problems = []
            for t in range(T):
                pairs = st.pairs.get(t, [])
                if len(pairs) >= 50:
                    zc = math.fsum(a * b for a, b in pairs) / math.sqrt(len(pairs))
                    if abs(zc) > z_crit:
                        problems.append(f"trigger {t}: count and sum errors correlated, z = {zc:+.2f} (n = {len(pairs)})")
                for col, idx in (("count", 0), ("sum", 1)):
                    prods = []
                    for (seed, w, key, tt), v in st.by_rep.items():
                        if tt == t and w % 2 == 0 and (seed, w + 1, key, t) in st.by_rep:
                            prods.append(v[idx] * st.by_rep[(seed, w + 1, key, t)][idx])
                    if len(prods) >= 50:
                        zw = math.fsum(prods) / math.sqrt(len(prods))
                        if abs(zw) > z_crit:
                            problems.append(f"trigger {t}: {col} errors of windows w and w+1 (same seed, key) "
                                            f"correlated, z = {zw:+.2f} (n = {len(prods)})")
            assert not problems, "\n  ".join(problems)

        def probes():
            p = state["p_probe"]
            R = st.replicates
            x = st.probe_released
            var = math.fsum(R * q * (1 - q) for q in p)
            radius = bernstein_radius(var, alpha)
            loc = math.fsum(x) - math.fsum(R * q for q in p)
            scale = math.fsum((1 if q < 0.5 else -1) * (xi - R * q) for xi, q in zip(x, p))
            detail = "  ".join(f"{c}:{xi}/{R}~{q:.3f}" for c, xi, q in zip(data.probe_users, x, p))
            print(f"     probes (users: released/replicates ~ predicted): {detail}", flush=True)
            print(f"     location {loc:+.1f}, scale {scale:+.1f}, Bernstein radius {radius:.1f}", flush=True)
            assert abs(loc) <= radius, (f"probe keys released {math.fsum(x):.0f} times at trigger 0, the exact "
                                        f"discrete-Gaussian rule predicts {math.fsum(R * q for q in p):.1f} "
                                        f"(+-{radius:.1f}): threshold mu + tau_1 or the selection noise's centre is off")
            assert abs(scale) <= radius, (f"probe release frequencies are {'flatter' if scale > 0 else 'steeper'} than "
                                          f"N_Z(0, sigma_sel^2) predicts (statistic {scale:+.1f}, radius {radius:.1f}): "
                                          f"the selection noise's scale is off")

        results.check("count errors: per-trigger variance = sigma_count^2 v_i (chi-square) and mean 0 (z)",
                      variance_and_mean("count"))
        results.check("sum errors: per-trigger variance = sigma_sum^2 v_i (chi-square) and mean 0 (z)",
                      variance_and_mean("sum"))
        results.check("count/sum errors uncorrelated; windows of one seed uncorrelated", correlations)
        results.check("probe keys: release frequency at trigger 0 = P[c + N_Z(0, sigma_sel^2) > mu + tau_1]", probes)

        if args.ranks > 1:
            def rank_invariance():
                # Noise is a pure function of (secret, window, key, family, round, node): a seeded run gives
                # the same releases at 1 rank and at N ranks.
                one = harness.Dpstream(argparse.Namespace(bin=args.bin, ranks=1, mpirun=args.mpirun,
                                                          timeout=args.timeout))
                outs = []
                for d, name in ((one, "np1"), (dp, f"np{args.ranks}")):
                    out = os.path.join(root, f"inv-{name}")
                    r = d.run("run", job, "--set", "privacy.seed=4242", "--out", out, cwd=root)
                    assert r.returncode == 0, r.describe()
                    with open(os.path.join(out, "releases.csv"), encoding="utf-8") as f:
                        outs.append(f.read())
                assert outs[0] == outs[1], f"seeded DP releases differ between 1 and {args.ranks} ranks"

            results.check(f"seeded DP releases identical at 1 and {args.ranks} ranks", rank_invariance)
    print(f"     total {time.monotonic() - t_start:.1f} s")
    return results.finish()


def _assert_no(violations, summary):
    assert not violations, f"{len(violations)} violation(s) ({summary}):\n  " + "\n  ".join(violations[:30])
    print(f"     {summary}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
