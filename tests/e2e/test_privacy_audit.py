#!/usr/bin/env python3
"""Empirical privacy audit of mode = "dp": a lower bound on epsilon measured from many seeded runs of
the real CLI on neighbouring inputs must stay below the configured epsilon; against a deliberately
broken build (every noise sigma halved) the same audit must find a lower bound ABOVE it, which shows
that the audit can fail.

Neighbours. D: W = 200 windows x K = 1000 keys, every key with n0 users of one record each; T = 1
trigger per window, C = 2, mu = 0, epsilon 3, delta 1e-4, the count column only. D' = D plus, for every
(window, key), one more user with C records on that key. The rows of key k in window w are a function
of that key's records in w and of the noise of its own nodes (keyed by window and key) only: users touch
one key each, bounding is per user, trees and tests are per key. So the (w, k) rows of a D' run are
distributed as the output of D + {u_wk}, a neighbour of D, and the W K pairs of a run are independent
replicates of ONE neighbouring pair (distinct PRF nodes; each run has its own [privacy] seed, hence its
own secret). R runs per side give N = R W K samples of P_D(E) and of P_D'(E) for an event E about one
(window, key). n0 = round(mu + tau_1 - sigma_sel), so that a key of D passes key selection about one
time in six (both the release and the count then carry the user's influence).

Events, fixed from the plan (`dpstream budget --json`) before any run: "released" and "released with
count >= x" (more likely under D'), "not released" and "released with count <= x" (more likely under D),
for every integer x where the event is measurable (>= 10 expected samples on both sides under the
honest or the broken model). For each event E, with P1 the side it favours and P0 the other, and
Clopper-Pearson bounds at level ALPHA / (2 m) each (m events):  eps_lb(E) = ln((P1_lo - delta) / P0_hi).
If the engine is (eps, delta)-DP then P1 <= e^eps P0 + delta for every E, so max_E eps_lb(E) <= eps
except with probability <= ALPHA (union bound over the 2 m bounds): the honest audit fails by chance
with probability below ALPHA = 1e-6. Both directions are reported; the assertion is on the larger.

Broken build. `dpstream_test_hooks` is the same CLI with kernels/dp_release.cpp compiled with
DPSTREAM_TEST_HOOKS (tests/e2e/CMakeLists.txt); there, DPSTREAM_TEST_NOISE_SCALE = 0.5 halves every
noise sigma (the thresholds stay the plan's), which about doubles the true epsilon. The audit asserts
that its lower bound then exceeds epsilon. Expected at the defaults (model, 200 simulated audits):
honest 1.78 (sd 0.03), broken 3.91 (sd 0.06) against epsilon 3. Also checked: the shipped binary does
not contain the variable's name and ignores it (byte-identical output; the honest audit runs with it
set), and the hooks binary without it gives the shipped binary's output byte for byte.

Runs are MPI singletons (no mpirun: faster here), one OpenMP thread each, --jobs at a time.

Usage: test_privacy_audit.py --bin build/src/dpstream --hooks-bin build/tests/e2e/dpstream_test_hooks
                             [--runs R] [--jobs J] [--keep]
"""

import argparse
import concurrent.futures
import csv
import json
import math
import os
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dp_reference  # noqa: E402
import harness  # noqa: E402

EPSILON = 3.0
DELTA = 1e-4
C = 2
WINDOWS = 200
KEYS = 1000
WINDOW_SECONDS = 100
ALPHA = 1e-6
NOISE_SCALE = 0.5  # the broken build's factor on every sigma
HOOK_VARIABLE = "DPSTREAM_TEST_NOISE_SCALE"
MIN_EXPECTED = 10  # an event is used when both sides expect >= this many samples (honest or broken model)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.environ.get("DPSTREAM_BIN", harness.DEFAULT_BIN), help="the shipped dpstream")
    ap.add_argument("--hooks-bin", required=True, help="dpstream_test_hooks (built with DPSTREAM_TEST_HOOKS)")
    ap.add_argument("--runs", type=int, default=20, help="runs per side (D, D') and binary; each gives W K samples")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (one OpenMP thread each)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for one run")
    ap.add_argument("--keep", action="store_true")
    return ap.parse_args()


# ------------------------------------------------------------------------------------------------
# Clopper-Pearson bounds (stdlib: regularized incomplete beta by its continued fraction, bisection)


def _betacf(a, b, x):
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1, a - 1
    c, d = 1.0, 1 - qab * x / qap
    d = 1 / (tiny if abs(d) < tiny else d)
    h = d
    for m in range(1, 1000000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1 + aa * d
        d = 1 / (tiny if abs(d) < tiny else d)
        c = 1 + aa / c
        c = tiny if abs(c) < tiny else c
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1 + aa * d
        d = 1 / (tiny if abs(d) < tiny else d)
        c = 1 + aa / c
        c = tiny if abs(c) < tiny else c
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            return h
    raise ArithmeticError("incomplete beta: no convergence")


def betainc(a, b, x):
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1 - math.exp(log_front) * _betacf(b, a, 1 - x) / b


def binom_cdf(k, n, p):
    """P[Bin(n, p) <= k] = I_{1-p}(n - k, k + 1)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return betainc(n - k, k + 1, 1 - p)


def cp_upper(k, n, level):
    """Smallest p with P[Bin(n, p) <= k] <= level (returned from above): P[p > cp_upper] <= level."""
    if k >= n:
        return 1.0
    return dp_reference._bisect(k / n, 1.0, lambda p: binom_cdf(k, n, p) <= level)[1]


def cp_lower(k, n, level):
    """Largest p with P[Bin(n, p) >= k] <= level (returned from below): P[p < cp_lower] <= level."""
    if k <= 0:
        return 0.0
    return dp_reference._bisect(0.0, k / n, lambda p: 1 - binom_cdf(k - 1, n, p) >= level)[0]


def self_test_statistics():
    """The Clopper-Pearson bounds against exact binomial sums (small n) and their defining equations."""
    def exact_cdf(k, n, p):
        return math.fsum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))
    for n, k, p in [(20, 3, 0.1), (50, 0, 0.02), (50, 50, 0.9), (200, 17, 0.05), (1000, 400, 0.41)]:
        got, want = binom_cdf(k, n, p), exact_cdf(k, n, p)
        if abs(got - want) > 1e-12 * max(1.0, want) + 1e-300:
            raise AssertionError(f"binom_cdf({k}, {n}, {p}) = {got}, exact {want}")
    for n, k, level in [(1000, 0, 1e-3), (1000, 7, 1e-8), (10 ** 6, 150, 1e-8), (3 * 10 ** 6, 12000, 1e-8)]:
        hi, lo = cp_upper(k, n, level), cp_lower(k, n, level)
        if not (lo <= k / n <= hi):
            raise AssertionError(f"CP interval [{lo}, {hi}] misses {k}/{n}")
        if abs(binom_cdf(k, n, hi) - level) > 1e-6 * level:
            raise AssertionError(f"cp_upper({k}, {n}): cdf {binom_cdf(k, n, hi)} != {level}")
        if k > 0 and abs((1 - binom_cdf(k - 1, n, lo)) - level) > 1e-6 * level:
            raise AssertionError(f"cp_lower({k}, {n}): tail {1 - binom_cdf(k - 1, n, lo)} != {level}")


# ------------------------------------------------------------------------------------------------
# The job, the data and the model


def job_toml(csv_path, seed):
    return f"""\
[job]
name = "privacy-audit"

[input]
kind = "csv"
path = "{csv_path}"

[stream]
window_seconds = {WINDOW_SECONDS}
triggers = 1
windows = {WINDOWS}

[privacy]
mode = "dp"
selection_counter = "tree"  # the model below is the discrete Gaussian's
value_counter = "tree"
max_records_per_user = {C}
epsilon = {EPSILON}
delta = {DELTA}
mu = 0
seed = {seed}

[query]
aggregations = ["count"]

[checkpoint]
every = 0

[output]
progress = "never"
"""


def write_data(path, n0, neighbour):
    """Every (window, key): n0 users with one record; the neighbour adds one user with C records."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("user_id,key,value,timestamp\n")
        for w in range(WINDOWS):
            base = w * WINDOW_SECONDS
            lines = []
            for k in range(KEYS):
                for i in range(n0):
                    lines.append(f"u{w}.{k}.{i},k{k},1,{base + i % WINDOW_SECONDS}\n")
                if neighbour:
                    for j in range(C):
                        lines.append(f"x{w}.{k},k{k},1,{base + (n0 + j) % WINDOW_SECONDS}\n")
            f.write("".join(lines))


def tail_above(pmf, x):
    """P[Y > x]."""
    return math.fsum(p for y, p in pmf.items() if y > x)


class Model:
    """Event probabilities of one (window, key) for D and D' at noise scale `scale`: released iff
    users + Y_sel > mu + tau_1; then count = records + Y_count (T = 1: one leaf, integer noise)."""

    def __init__(self, plan, n0, scale):
        sel = dp_reference.discrete_gaussian_pmf(plan["sigma_sel"] * scale)
        self.count_pmf = dp_reference.discrete_gaussian_pmf(plan["sigma_count"] * scale)
        bar = plan["mu"] + plan["tau"]
        self.released = [tail_above(sel, bar - n0), tail_above(sel, bar - n0 - 1)]  # [D, D']
        self.records = [n0, n0 + C]

    def prob(self, event, side):
        kind, x = event
        r = self.released[side]
        if kind == "released":
            return r
        if kind == "not released":
            return 1 - r
        y = x - self.records[side]  # count >= x  <=>  Y >= y
        if kind == ">=":
            return r * math.fsum(p for v, p in self.count_pmf.items() if v >= y)
        return r * math.fsum(p for v, p in self.count_pmf.items() if v <= y)


def favours(event):
    """The side (0 = D, 1 = D') that the event is more likely under."""
    return 1 if event[0] in ("released", ">=") else 0


def lower_bound(event, k, n, level):
    """eps_lb of one event from its counts k[side] out of n samples per side."""
    one = favours(event)
    p1_lo = cp_lower(k[one], n, level)
    p0_hi = cp_upper(k[1 - one], n, level)
    if p1_lo - DELTA <= 0:
        return -math.inf
    return math.log((p1_lo - DELTA) / p0_hi)


def expected_lower_bound(model, event, n, level):
    k = [round(model.prob(event, side) * n) for side in (0, 1)]
    return lower_bound(event, k, n, level)


def users_per_key(plan):
    """n0 = round(mu + tau_1 - sigma_sel): a key of D passes key selection about one time in six, so both
    the release and the count carry the user's influence. (At the defaults the honest audit's expected
    bound is within 0.03 of its best over n0, and with halved noise keys are still released often.)"""
    return max(1, round(plan["mu"] + plan["tau"] - plan["sigma_sel"]))


def candidate_events(plan, n0, n_samples):
    """Every event whose probability is measurable (>= MIN_EXPECTED / N on both sides) under the honest
    or the broken model: released / not released and the count thresholds."""
    models = [Model(plan, n0, 1.0), Model(plan, n0, NOISE_SCALE)]
    s = plan["sigma_count"]
    events = [("released", None), ("not released", None)]
    for x in range(int(n0 - 8 * s), int(n0 + C + 8 * s) + 1):
        events += [(">=", x), ("<=", x)]
    keep = []
    for e in events:
        if any(min(m.prob(e, 0), m.prob(e, 1)) * n_samples >= MIN_EXPECTED for m in models):
            keep.append(e)
    return keep


def describe(event):
    kind, x = event
    return kind if x is None else f"released, count {kind} {x}"


# ------------------------------------------------------------------------------------------------
# Runs


class Runner:
    def __init__(self, args, work):
        self.args = args
        self.work = work
        self.env = dict(os.environ)
        self.env["OMP_NUM_THREADS"] = "1"
        self.env.pop(HOOK_VARIABLE, None)
        self.env.pop("DPSTREAM_FAULT", None)
        self.seconds = 0.0

    def run(self, binary, csv_path, seed, env=None, label="run"):
        """One `dpstream run` (a singleton MPI process); returns (releases.csv bytes, stderr)."""
        d = os.path.join(self.work, f"{label}-{seed}")
        os.makedirs(d)
        job = harness.write_job(os.path.join(d, "job.toml"), job_toml(csv_path, seed))
        out = os.path.join(d, "out")
        full_env = dict(self.env)
        full_env.update(env or {})
        t0 = time.monotonic()
        proc = subprocess.run([binary, "run", job, "--out", out], capture_output=True, text=True, env=full_env,
                              timeout=self.args.timeout)
        self.seconds += time.monotonic() - t0
        if proc.returncode != 0:
            raise AssertionError(f"{binary} run {job} (seed {seed}) exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        with open(os.path.join(out, "releases.csv"), "rb") as f:
            data = f.read()
        if not self.args.keep:
            for name in os.listdir(out):
                os.remove(os.path.join(out, name))
        return data, proc.stderr


def count_events(data, events):
    """Per event, how many (window, key) pairs of one run it holds."""
    released = {}
    reader = csv.reader(data.decode("utf-8").splitlines())
    header = next(reader)
    if header != ["window", "trigger", "key", "count", "sum"]:
        raise AssertionError(f"unexpected releases.csv header {header}")
    for window, trigger, key, count, _sum in reader:
        if trigger != "0":
            raise AssertionError(f"trigger {trigger} in a T = 1 job")
        pair = (int(window), key)
        if pair in released:
            raise AssertionError(f"{pair} released twice")
        released[pair] = float(count)
    total = WINDOWS * KEYS
    if len(released) > total:
        raise AssertionError(f"{len(released)} released pairs > {total}")
    counts = []
    for kind, x in events:
        if kind == "released":
            counts.append(len(released))
        elif kind == "not released":
            counts.append(total - len(released))
        elif kind == ">=":
            counts.append(sum(1 for c in released.values() if c >= x))
        else:
            counts.append(sum(1 for c in released.values() if c <= x))
    return counts


def audit(runner, pool, binary, env, data_paths, events, first_seed, label):
    """k[event][side] over args.runs runs per side; seeds first_seed.. (D), first_seed + runs.. (D')."""
    runs = runner.args.runs
    futures = []
    for side in (0, 1):
        for r in range(runs):
            seed = first_seed + side * runs + r
            futures.append((side, pool.submit(runner.run, binary, data_paths[side], seed, env, f"{label}-{side}")))
    k = [[0, 0] for _ in events]
    stderr_lines = set()
    for side, fut in futures:
        data, err = fut.result()
        stderr_lines.update(line for line in err.splitlines() if HOOK_VARIABLE in line)
        for i, c in enumerate(count_events(data, events)):
            k[i][side] += c
    return k, stderr_lines


def report(label, events, k, n, level, model):
    rows = []
    for e, ke in zip(events, k):
        lb = lower_bound(e, ke, n, level)
        rows.append((lb, e, ke))
    rows.sort(key=lambda r: r[0], reverse=True)
    print(f"{label}: N = {n} samples per side, {len(events)} events, CP level {level:.2g} per bound")
    for lb, e, ke in rows[:6]:
        one = favours(e)
        print(f"  {describe(e):26s} towards {'D' + chr(39) if one else 'D '}: k_D = {ke[0]:8d}  k_D' = {ke[1]:8d}"
              f"  model {model.prob(e, 0):.3e} / {model.prob(e, 1):.3e}  eps_lb = {lb:.3f}")
    best = {}
    for lb, e, _ in rows:
        best.setdefault(favours(e), lb)
    return max(best.values()), best


def main():
    args = parse_args()
    results = harness.Results("test_privacy_audit")
    for path in (args.bin, args.hooks_bin):
        if not os.access(path, os.X_OK):
            sys.exit(f"binary not found or not executable: {path}")
    results.check("Clopper-Pearson bounds against exact binomial sums", self_test_statistics)

    with harness.TempDir(args.keep, "dpstream-audit-") as work:
        runner = Runner(args, work)
        probe = harness.write_job(os.path.join(work, "probe.toml"), job_toml("unused.csv", 1))
        proc = subprocess.run([args.bin, "budget", probe, "--json"], capture_output=True, text=True, env=runner.env)
        if proc.returncode != 0:
            sys.exit(f"dpstream budget failed: {proc.stderr}")
        b = json.loads(proc.stdout)
        plan = {"sigma_sel": b["key_selection"]["tree"]["sigma"], "sigma_count": b["aggregation"]["columns"][0]["sigma"],
                "tau": b["key_selection"]["tau_first"], "mu": b["key_selection"]["mu"]}
        n = args.runs * WINDOWS * KEYS
        n0 = users_per_key(plan)
        events = candidate_events(plan, n0, n)
        level = ALPHA / (2 * len(events))
        honest_model, broken_model = Model(plan, n0, 1.0), Model(plan, n0, NOISE_SCALE)
        print(f"plan: eps {EPSILON}, delta {DELTA}, C {C}, T 1, mu {plan['mu']}, sigma_sel {plan['sigma_sel']:.4f}, "
              f"sigma_count {plan['sigma_count']:.4f}, tau_1 {plan['tau']:.4f}; n0 = {n0} users per key, "
              f"{args.runs} runs x {WINDOWS} windows x {KEYS} keys per side")
        print(f"expected lower bounds: honest {max(expected_lower_bound(honest_model, e, n, level) for e in events):.3f}, "
              f"broken {max(expected_lower_bound(broken_model, e, n, level) for e in events):.3f} (epsilon {EPSILON})")

        t0 = time.monotonic()
        paths = [os.path.join(work, "D.csv"), os.path.join(work, "D-prime.csv")]
        write_data(paths[0], n0, False)
        write_data(paths[1], n0, True)
        print(f"data: {os.path.getsize(paths[0]) >> 20} MB / {os.path.getsize(paths[1]) >> 20} MB ({time.monotonic() - t0:.1f} s)")

        def shipped_binary_has_no_hook():
            with open(args.bin, "rb") as f:
                if HOOK_VARIABLE.encode() in f.read():
                    raise AssertionError(f"{args.bin} contains {HOOK_VARIABLE}: the shipped binary must not have the test hook")
            plain, _ = runner.run(args.bin, paths[1], 7, None, "plain")
            hooked_env, err = runner.run(args.bin, paths[1], 7, {HOOK_VARIABLE: str(NOISE_SCALE)}, "ignores")
            if plain != hooked_env or HOOK_VARIABLE in err:
                raise AssertionError(f"the shipped binary reacts to {HOOK_VARIABLE}")
            same, _ = runner.run(args.hooks_bin, paths[1], 7, None, "hooks-off")
            if same != plain:
                raise AssertionError("dpstream_test_hooks without the variable differs from the shipped binary")
            broken, err = runner.run(args.hooks_bin, paths[1], 7, {HOOK_VARIABLE: str(NOISE_SCALE)}, "hooks-on")
            if broken == plain or HOOK_VARIABLE not in err:
                raise AssertionError(f"dpstream_test_hooks ignored {HOOK_VARIABLE} (stderr {err.strip()[-500:]!r})")
        results.check("the shipped binary has no test hook; the hooks binary differs only when asked", shipped_binary_has_no_hook)

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            def honest():
                t = time.monotonic()
                k, lines = audit(runner, pool, args.bin, {HOOK_VARIABLE: str(NOISE_SCALE)}, paths, events, 1000, "honest")
                if lines:
                    raise AssertionError(f"the shipped binary printed {lines}")
                lb, per_side = report("honest (shipped dpstream, with the hook variable set)", events, k, n, level, honest_model)
                print(f"  eps lower bound {lb:.3f} (towards D' {per_side.get(1, -math.inf):.3f}, towards D "
                      f"{per_side.get(0, -math.inf):.3f}) vs epsilon {EPSILON}; {time.monotonic() - t:.1f} s")
                if not lb < EPSILON:
                    raise AssertionError(f"measured eps lower bound {lb:.3f} >= epsilon {EPSILON}: the released stream is "
                                         f"less private than its budget (false failure probability < {ALPHA})")

            def broken():
                t = time.monotonic()
                k, lines = audit(runner, pool, args.hooks_bin, {HOOK_VARIABLE: str(NOISE_SCALE)}, paths, events, 5000, "broken")
                if not lines:
                    raise AssertionError(f"dpstream_test_hooks did not announce {HOOK_VARIABLE}")
                lb, per_side = report(f"broken (dpstream_test_hooks, {HOOK_VARIABLE} = {NOISE_SCALE})", events, k, n, level,
                                      broken_model)
                print(f"  eps lower bound {lb:.3f} (towards D' {per_side.get(1, -math.inf):.3f}, towards D "
                      f"{per_side.get(0, -math.inf):.3f}) vs epsilon {EPSILON}; {time.monotonic() - t:.1f} s")
                if not lb > EPSILON:
                    raise AssertionError(f"with the noise scaled by {NOISE_SCALE} the lower bound {lb:.3f} stays <= epsilon "
                                         f"{EPSILON}: the audit has no power")

            results.check(f"honest: eps lower bound < {EPSILON}", honest)
            results.check(f"broken (noise x {NOISE_SCALE}): eps lower bound > {EPSILON}", broken)
        print(f"dpstream runs: {runner.seconds:.1f} s of process time")
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
