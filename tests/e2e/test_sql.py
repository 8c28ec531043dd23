#!/usr/bin/env python3
"""End-to-end test of `dpstream query` (DP SQL, docs/SQL.md) against the independent Python reference
sql_reference.py (noise-free values of every aggregate, the k-group sampling by the keyed sample rank).

  (a) exactness at a huge budget: every aggregate kind, WHERE with AND / OR / IN / NOT, aliases, NULLs,
      negative and out-of-bound values, bad rows skipped, users sampled down to k groups; released
      groups = the reference's groups with users >= the reported threshold;
  (b) rank invariance: result.csv byte-identical at --ranks N and at 1 rank (2 when N = 1);
  (c) noise scale: standardized errors of ANON_SUM / ANON_COUNT have mean 0 and variance 1 (z-test and
      a chi-square-type test, each with false-failure probability <= 1e-6), Gaussian and Laplace noise;
  (d) an adversarial user in 10^3 groups with 10^2 rows each changes at most k groups, each by at most
      the per-group bound (differential run without the user);
  (e) selection: public groups (listed empty group released, unlisted never); a one-user group never
      released by laplace / gaussian / magic selection over 30 seeds at delta = 1e-10;
  (f) bad queries refused before reading data: exit code 2, the message names the token, no output;
  and value fields in strtod syntax ('+7', '.5', '12.') read as numbers, non-finite ones bad.

Usage: test_sql.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import concurrent.futures
import csv
import fcntl
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import sql_reference as ref  # noqa: E402
import dp_reference  # noqa: E402

SEED = 20251126
HUGE = ["--epsilon", "1e5", "--delta", "1e-3"]  # noise negligible next to every tolerance below


# ---------------------------------------------------------------------------------------------
# Helpers

def write_rows(path, header, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(header)
        for r in rows:
            w.writerow([r[c] for c in header])
    return path


def load_result(out_dir):
    """(header, rows as lists of strings, report dict)."""
    path = os.path.join(out_dir, "result.csv")
    assert os.path.exists(path), f"no {path}"
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows, f"{path} is empty (no header)"
    rpath = os.path.join(out_dir, "report.json")
    assert os.path.exists(rpath), f"no {rpath}"
    with open(rpath, encoding="utf-8") as f:
        report = json.load(f)
    return rows[0], rows[1:], report


def field(d, dotted, what="report.json"):
    cur = d
    for part in dotted.split("."):
        if isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            raise AssertionError(f"{what} has no field {dotted} (needed by the test)")
    return cur


def noise_scales(report, n_aggs):
    """[list of noise standard deviations] per aggregate, in SELECT order."""
    aggs = field(report, "aggregates")
    assert isinstance(aggs, list) and len(aggs) == n_aggs, \
        f"report.json aggregates: {len(aggs) if isinstance(aggs, list) else aggs!r} entries, expected {n_aggs}"
    out = []
    for i, a in enumerate(aggs):
        s = field(a, "noise_scale", f"report.json aggregates[{i}]")
        s = s if isinstance(s, list) else [s]
        assert s and all(isinstance(x, (int, float)) and x >= 0 and math.isfinite(x) for x in s), \
            f"aggregates[{i}].noise_scale = {s!r}"
        out.append([float(x) for x in s])
    return out


def is_int_text(s):
    return s.lstrip("-").isdigit()


class Query:
    """One SQL text with its reference description (group columns, aggregates, WHERE predicate)."""

    def __init__(self, sql, groups, aggregates, names, where=None, where_numeric=()):
        self.sql = " ".join(sql.split())
        self.groups = groups  # GROUP BY columns (= the leading SELECT items, same order)
        self.aggregates = aggregates
        self.names = names  # expected output header (None: any name, e.g. the call text)
        self.where = where
        self.where_numeric = where_numeric


def result_by_group(header, rows, q):
    g = len(q.groups)
    assert len(header) == g + len(q.aggregates), f"header {header} has {len(header)} columns, expected " \
                                                  f"{g + len(q.aggregates)}"
    for want, got in zip(q.names, header):
        assert want is None or want == got, f"header {header}: expected column {want!r}, got {got!r}"
    out = {}
    for r in rows:
        assert len(r) == len(header), f"row {r} has {len(r)} fields, header {len(header)}"
        key = tuple(r[:g])
        assert key not in out, f"group {key} appears twice in result.csv"
        vals = []
        for a, text in zip(q.aggregates, r[g:]):
            if a["kind"] in ("count", "count_distinct"):
                assert is_int_text(text), f"group {key}: count {text!r} is not printed as an integer"
                vals.append(int(text))
            else:
                vals.append(float(text))
        out[key] = vals
    keys = [tuple(r[:g]) for r in rows]
    assert keys == sorted(keys, key=ref.sort_key), "result.csv rows are not sorted by the group fields (bytes)"
    return out


def tolerance(a, ref_value, users, sd):
    """Allowed |released - noise-free| for one aggregate at a huge budget, from its noise sd (the
    largest of its DP quantities, conservative) propagated through the result formula."""
    n = max(1, users)
    kind = a["kind"]
    if kind in ("count", "count_distinct"):
        return 6 * sd + 1e-6
    if kind == "sum":
        return 1e-9 * abs(ref_value) + 1e-6 + 6 * sd
    lo, hi = float(a.get("lower", 0)), float(a.get("upper", 0))
    m = (lo + hi) / 2
    h = ((hi - lo) / 2) ** 2
    if kind == "avg":
        return 1e-9 * max(abs(lo), abs(hi)) + 1e-6 + 6 * sd * (1 + abs(ref_value - m)) / n
    if kind in ("var", "stddev"):
        tv = 1e-9 * h + 1e-6 + 6 * sd * (1 + 2 * math.sqrt(h) + 3 * h) / n
        return tv if kind == "var" else math.sqrt(tv) + 1e-9 * math.sqrt(h)
    if kind == "ntile":
        return (hi - lo) / 65536 + 1e-9 * max(1.0, abs(lo), abs(hi))
    raise ValueError(kind)


def compare_groups(label, q, got, want, scales, sel_tau=None):
    """Values of every group in both; returns a list of problems."""
    problems = []
    for g, vals in sorted(got.items(), key=lambda kv: ref.sort_key(kv[0])):
        if g not in want:
            continue  # an empty group: only public selection releases it (the caller checks)
        exp = want[g]
        for i, (a, v) in enumerate(zip(q.aggregates, vals)):
            e = exp["values"][i]
            tol = tolerance(a, e, exp["users"], max(scales[i]))
            if not abs(v - e) <= tol:
                problems.append(f"{label}: group {g} ({exp['users']} users) {q.names[len(q.groups) + i] or i}: "
                                f"dpstream {v!r}, reference {e!r} (tolerance {tol:.3g})")
    return problems


class Env:
    def __init__(self, args, tmp):
        self.args = args
        self.dp = harness.Dpstream(args)
        self.tmp = tmp
        self.dirs = harness.CaseDirs(tmp)

    def query(self, q, csv_path, out_dir, *extra, ranks=None, user="uid"):
        return self.dp.run_with("query", q.sql, "--input", csv_path, "--user-column", user, *extra, "--out", out_dir,
                                ranks=ranks)


# ---------------------------------------------------------------------------------------------
# (a), (b): exactness at a huge budget and rank invariance

REGIONS = ["north", "south", "east", "west", "Nord\u00e9"]
TIERS = ["a", "b", "a,b", 'q"x', "B"]
HEADER_A = ["extra", "tier", "uid", "price", "region", "qty", "note"]


def price_text(rng):
    r = rng.random()
    if r < 0.10:
        return ""  # NULL
    if r < 0.112:
        return rng.choice(["1e300", "-1e16", "123456.75", "-40", "99", "1e-30", "-0", "12.", ".5", "-.5"])
    return f"{rng.uniform(-6, 16):.2f}"


def qty_text(rng):
    r = rng.random()
    if r < 0.06:
        return ""
    if r < 0.10:
        return str(rng.randint(-3, -1))
    if r < 0.13:
        return rng.choice(["15", "100", "7.5", "3e0", "8", "0.25"])
    return str(rng.randint(0, 9))


def generate_a(rng):
    rows = []

    def add(uid, region, tier, price=None, qty=None):
        rows.append({"extra": rng.choice(["", "x,y", "z"]), "tier": tier, "uid": uid,
                     "price": price_text(rng) if price is None else price, "region": region,
                     "qty": qty_text(rng) if qty is None else qty,
                     "note": "vip" if rng.random() < 0.05 else rng.choice(["", "regular"])})

    combos = [(r, t) for r in REGIONS for t in TIERS]
    for i in range(300):
        uid = {7: "u,7", 8: 'u"8', 9: "\u00fc9"}.get(i, f"u{i:03d}")
        if i % 25 == 3:  # heavy: rows in many groups, so k = 3 sampling bites
            groups = rng.sample(combos, rng.randint(8, 15))
            for _ in range(rng.randint(30, 50)):
                add(uid, *rng.choice(groups))
        else:
            groups = [rng.choice(combos[: 6 + i % 19]) for _ in range(rng.randint(1, 2))]
            for _ in range(rng.randint(6, 24)):
                add(uid, *rng.choice(groups))
    # groups of exactly j users (rows always kept by WHERE): around any threshold
    for j in range(1, 11):
        for u in range(j):
            for _ in range(rng.randint(1, 3)):
                add(f"r{j}_{u}", "rare", f"t{j:02d}", qty=str(rng.randint(0, 9)))
    # a group whose first user has only NULL qty and price (kept by NOT price < 3): such a user counts in
    # the N of ANON_AVG / ANON_VAR (docs/SQL.md: N is the selection's user count) but adds nothing else
    for u in range(6):
        for _ in range(2):
            add(f"z{u}", "rare", "t11", price="" if u == 0 else None, qty="" if u == 0 else str(rng.randint(0, 9)))
    rng.shuffle(rows)
    bad = [dict(rows[0], price="abc"), dict(rows[1], qty="1.2.3"), dict(rows[2], qty="nan"), dict(rows[3], uid="")]
    for i, b in enumerate(bad):
        rows.insert(100 + 997 * i, b)
    return rows, len(bad)


def where_a(r):
    q, p = ref.parse_number(r["qty"]), ref.parse_number(r["price"])
    return ((r["region"] in ("north", "south", "east", "rare") and q is not None and q >= -1)
            or r["note"] == "vip" or not (p is not None and p < 3))


QUERY_A = Query(
    """SELECT WITH ANONYMIZATION region, tier AS t,
         ANON_COUNT(*) AS n_rows, ANON_COUNT(*, 3) AS n3, ANON_COUNT(qty, 2) AS n_qty,
         ANON_COUNT(DISTINCT uid) AS users, ANON_SUM(price, -5, 20) AS total, ANON_AVG(price, -2, 10) AS avg_price,
         ANON_VAR(qty, 0, 8), ANON_STDDEV(qty, 0, 8) sd_qty, ANON_NTILE(price, 0.9, -4, 12) AS p90,
         ANON_MIN(qty, 0, 8) AS mn, ANON_MAX(qty, 0, 8) AS mx, ANON_MEDIAN(price, -4, 12) AS med
       FROM orders
       WHERE (region IN ('north', 'south', 'east', 'rare') AND qty >= -1) OR note = 'vip' OR NOT price < 3
       GROUP BY region, tier""",
    ["region", "tier"],
    [{"kind": "count", "column": None, "upper": None},
     {"kind": "count", "column": None, "upper": 3},
     {"kind": "count", "column": "qty", "upper": 2},
     {"kind": "count_distinct"},
     {"kind": "sum", "column": "price", "lower": -5, "upper": 20},
     {"kind": "avg", "column": "price", "lower": -2, "upper": 10},
     {"kind": "var", "column": "qty", "lower": 0, "upper": 8},
     {"kind": "stddev", "column": "qty", "lower": 0, "upper": 8},
     {"kind": "ntile", "column": "price", "p": 0.9, "lower": -4, "upper": 12},
     {"kind": "ntile", "column": "qty", "p": 0.0, "lower": 0, "upper": 8},
     {"kind": "ntile", "column": "qty", "p": 1.0, "lower": 0, "upper": 8},
     {"kind": "ntile", "column": "price", "p": 0.5, "lower": -4, "upper": 12}],
    ["region", "t", "n_rows", "n3", "n_qty", "users", "total", "avg_price", None, "sd_qty", "p90", "mn", "mx",
     "med"],
    where=where_a, where_numeric=("qty", "price"))
K_A, R_A, SEED_A = 3, 2, 7


def args_a(seed=SEED_A):
    return [*HUGE, "--max-groups-per-user", K_A, "--max-rows-per-group", R_A, "--seed", seed, "--bad-rows", "skip"]


def check_exactness(env, state):
    rng = random.Random(SEED)
    rows, n_bad = generate_a(rng)
    d = env.dirs("exactness")
    csv_path = write_rows(os.path.join(d, "orders.csv"), HEADER_A, rows)
    st = ref.RefStats()
    want = ref.reference(rows, "uid", QUERY_A.groups, QUERY_A.aggregates, QUERY_A.where, K_A, R_A, SEED_A,
                         QUERY_A.where_numeric, stats=st)
    assert st.rows_bad == n_bad, f"reference sees {st.rows_bad} bad rows, generator wrote {n_bad}"
    assert st.sampled_away > 0, "the data does not exercise the k-group sampling"
    out = os.path.join(d, "out")
    run = env.query(QUERY_A, csv_path, out, *args_a())
    print(f"     dpstream query at {env.args.ranks} rank(s): {run.seconds:.1f} s, {len(rows)} rows, "
          f"{len(want)} reference groups, {st.sampled_away} (user, group) pairs sampled away")
    assert run.returncode == 0, "dpstream query failed\n  " + run.describe()
    header, out_rows, report = load_result(out)
    state["a"] = dict(csv=csv_path, out=out, rows=rows, want=want, stats=st)
    got = result_by_group(header, out_rows, QUERY_A)
    scales = noise_scales(report, len(QUERY_A.aggregates))
    tau = field(report, "selection.threshold")
    assert isinstance(tau, int) and tau >= 1, f"selection.threshold = {tau!r}"
    problems = []
    # released groups vs the threshold (noise at this budget is far below one user)
    for g, e in want.items():
        if abs(e["users"] - tau) < 2:
            continue
        if e["users"] >= tau and g not in got:
            problems.append(f"group {g} with {e['users']} users >= threshold {tau} not released")
        if e["users"] < tau and g in got:
            problems.append(f"group {g} with {e['users']} users < threshold {tau} released")
    extra = sorted(set(got) - set(want))
    if extra:
        problems.append(f"groups released without any user in the reference: {extra}")
    problems += compare_groups("(a)", QUERY_A, got, want, scales)
    if problems:
        problems += diagnose_a(rows, got, scales)
    # counters (not DP)
    for name, exp in (("not_dp.rows_bad", st.rows_bad), ("not_dp.groups_released", len(out_rows))):
        v = field(report, name)
        if v != exp:
            problems.append(f"report {name} = {v}, expected {exp}")
    rr = field(report, "not_dp.rows_read")
    if rr not in (st.rows_read, st.rows_read - st.rows_bad):
        problems.append(f"report not_dp.rows_read = {rr}, expected {st.rows_read} (or {st.rows_read - st.rows_bad} "
                        f"without the bad rows)")
    for key in ("accounting.epsilon", "accounting.delta", "selection.kind"):
        field(report, key)
    assert not problems, f"{len(problems)} problems:\n  " + "\n  ".join(problems[:40])
    print(f"     {len(got)} groups released (threshold {tau}), all values within tolerance of the reference")


def diagnose_a(rows, got, scales):
    """On a mismatch: which documented alternative the engine matches (messages only)."""
    notes = []
    alt = ref.reference(rows, "uid", QUERY_A.groups, QUERY_A.aggregates, QUERY_A.where, K_A, R_A, SEED_A,
                        QUERY_A.where_numeric, null_users_in_n=False)
    if not compare_groups("alt", QUERY_A, got, alt, scales):
        notes.append("DIAGNOSIS: the engine matches the reference with N = users having a non-NULL value in "
                     "ANON_AVG / ANON_VAR (docs/SQL.md: N = the group's users, shared with selection)")
    ex = ref.reference(rows, "uid", QUERY_A.groups, QUERY_A.aggregates, QUERY_A.where, K_A, R_A, SEED_A,
                       QUERY_A.where_numeric, exact_ntile=True)
    if not compare_groups("exact", QUERY_A, got, ex, scales):
        notes.append("DIAGNOSIS: the engine matches the reference when the NTILE descent is computed in exact "
                     "rationals (a double-rounding tie at a child boundary)")
    nosample = ref.reference(rows, "uid", QUERY_A.groups, QUERY_A.aggregates, QUERY_A.where, 10**9, R_A, SEED_A,
                             QUERY_A.where_numeric)
    if not compare_groups("nosample", QUERY_A, got, nosample, scales):
        notes.append("DIAGNOSIS: the engine matches the reference WITHOUT the k-group sampling")
    return notes


def check_rank_invariance(env, state):
    assert "a" in state, "needs the output of (a)"
    other = 1 if env.args.ranks != 1 else 2
    out = os.path.join(env.dirs(f"ranks-{other}"), "out")
    run = env.query(QUERY_A, state["a"]["csv"], out, *args_a(), ranks=other)
    assert run.returncode == 0, f"dpstream query at {other} rank(s) failed\n  " + run.describe()
    a = harness.read_bytes(os.path.join(state["a"]["out"], "result.csv"))
    b = harness.read_bytes(os.path.join(out, "result.csv"))
    assert a == b, (f"result.csv differs between {env.args.ranks} and {other} rank(s) at byte "
                    f"{harness.first_difference(a, b)}")
    ra, rb = (json.load(open(os.path.join(o, "report.json"), encoding="utf-8")) for o in (state["a"]["out"], out))
    for r in (ra, rb):
        r.get("not_dp", {}).pop("timings_seconds", None)  # wall-clock times differ by nature
    for key in ("selection", "aggregates", "accounting", "not_dp"):
        assert ra.get(key) == rb.get(key), f"report.json {key} differs between {env.args.ranks} and {other} rank(s)"


# ---------------------------------------------------------------------------------------------
# (c) noise scale

N_GROUPS_C = 2000
USERS_C = 8
QUERY_C = Query("SELECT WITH ANONYMIZATION g, ANON_COUNT(*, 3) AS n, ANON_SUM(v, 0, 10) AS s FROM t GROUP BY g",
                ["g"], [{"kind": "count", "column": None, "upper": 3},
                        {"kind": "sum", "column": "v", "lower": 0, "upper": 10}], ["g", "n", "s"])
# Thresholds (n = 2000 groups; z_i = (released - reference) / sd, independent across groups):
#  mean: sqrt(n) * mean(z) ~ N(0, 1) (CLT; kurtosis-free); |.| > 5.0 has probability 5.7e-7.
#  variance: mean(z^2) has mean 1 and variance (kappa - 1) / n, kappa = 3 (Gaussian), 6 (Laplace).
#   Gaussian: n mean(z^2) ~ chi-square(n); +-5.5 sd is, by Wilson-Hilferty, 9e-8 above and 3e-9 below.
#   Laplace (|X| / b exponential, z^2 = E^2 / 2, skewness of mean(z^2) = 0.15): 7 sd above
#   (Cornish-Fisher puts the 1e-6 quantile near 5.3 sd), 5.5 sd below (lighter tail) -> <= 1e-6 each.
Z_MEAN = 5.0
VAR_BOUNDS = {"gaussian": (3.0, 5.5, 5.5), "laplace": (6.0, 5.5, 7.0)}  # kappa, sd below, sd above


def generate_c(rng):
    rows = []
    for gi in range(N_GROUPS_C):
        for u in range(USERS_C):
            uid = f"c{gi}_{u}"
            for _ in range(rng.randint(1, 4)):
                rows.append({"uid": uid, "g": f"g{gi:04d}", "v": str(rng.randint(-8, 60) / 4)})
    return rows


def check_noise_scale(env, state):
    rng = random.Random(SEED + 3)
    rows = generate_c(rng)
    d = env.dirs("noise-scale")
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "g", "v"], rows)
    public = os.path.join(d, "public.csv")
    write_rows(public, ["g"], [{"g": f"g{gi:04d}"} for gi in range(N_GROUPS_C)])
    want = ref.reference(rows, "uid", ["g"], QUERY_C.aggregates, None, 1, 1, 11)
    assert len(want) == N_GROUPS_C
    problems, lines = [], []
    for noise in ("gaussian", "laplace"):
        out = os.path.join(d, f"out-{noise}")
        run = env.query(QUERY_C, csv_path, out, "--epsilon", "1", "--delta", "1e-5", "--max-groups-per-user", "1",
                        "--selection", "public", "--public-groups", public, "--noise", noise, "--seed", "11")
        assert run.returncode == 0, f"dpstream query --noise {noise} failed\n  " + run.describe()
        header, out_rows, report = load_result(out)
        got = result_by_group(header, out_rows, QUERY_C)
        assert set(got) == set(want), f"--noise {noise}: public selection released {len(got)} groups, " \
                                      f"expected all {N_GROUPS_C}"
        scales = noise_scales(report, 2)
        kappa, below, above = VAR_BOUNDS[noise]
        for i, name in enumerate(("ANON_COUNT", "ANON_SUM")):
            assert len(scales[i]) == 1, f"{name} reports {len(scales[i])} noise scales, expected 1"
            sd = scales[i][0]
            assert sd > 1.0, f"--noise {noise} {name}: noise sd {sd} too small for this test"
            z = [(got[g][i] - want[g]["values"][i]) / sd for g in want]
            n = len(z)
            mean = sum(z) / n
            m2 = sum(x * x for x in z) / n
            zm = mean * math.sqrt(n)
            zv = (m2 - 1) / math.sqrt((kappa - 1) / n)
            lines.append(f"--noise {noise} {name}: sd {sd:.4g}, mean z {mean:+.4f} (z {zm:+.2f}), "
                         f"mean z^2 {m2:.4f} ({zv:+.2f} sd)")
            if abs(zm) > Z_MEAN:
                problems.append(f"--noise {noise} {name}: mean standardized error {mean:+.4f} is {zm:+.2f} sd "
                                f"from 0 (bound {Z_MEAN})")
            if not -below <= zv <= above:
                problems.append(f"--noise {noise} {name}: mean squared standardized error {m2:.4f} ({zv:+.2f} sd "
                                f"from 1; bounds -{below}, +{above}): the reported noise_scale {sd:.4g} is not the "
                                f"noise's standard deviation (empirical sd {sd * math.sqrt(m2):.4g})")
    for line in lines:
        print("     " + line)
    assert not problems, "\n  ".join(problems)


# ---------------------------------------------------------------------------------------------
# (d) adversarial user. The attacker has 10^4 groups x 10^5 rows; here 10^3 x 10^2 (10^5 rows)
# keeps CI fast and exercises the same bound (k = 5 groups, each clamped).

N_GROUPS_D = 1000
ROWS_D = 100
K_D = 5
QUERY_D = Query("SELECT WITH ANONYMIZATION g, ANON_COUNT(*, 5) AS n, ANON_SUM(v, -10, 10) AS s, "
                "ANON_COUNT(DISTINCT uid) AS users FROM t GROUP BY g",
                ["g"], [{"kind": "count", "column": None, "upper": 5},
                        {"kind": "sum", "column": "v", "lower": -10, "upper": 10},
                        {"kind": "count_distinct"}], ["g", "n", "s", "users"])
PER_GROUP_BOUND_D = [5, 10, 1]


def check_adversary(env, state):
    rng = random.Random(SEED + 4)
    rows = []
    for gi in range(N_GROUPS_D):
        for u in range(3):
            for _ in range(2):
                rows.append({"uid": f"d{gi}_{u}", "g": f"a{gi:04d}", "v": str(rng.randint(-12, 12))})
    adversary = [{"uid": "mallory", "g": f"a{gi:04d}", "v": "10"} for gi in range(N_GROUPS_D) for _ in range(ROWS_D)]
    full = rows + adversary
    random.Random(SEED + 5).shuffle(full)
    d = env.dirs("adversary")
    public = write_rows(os.path.join(d, "public.csv"), ["g"], [{"g": f"a{gi:04d}"} for gi in range(N_GROUPS_D)])
    results = {}
    refs = {}
    for label, data in (("with", full), ("without", rows)):
        csv_path = write_rows(os.path.join(d, f"{label}.csv"), ["uid", "g", "v"], data)
        out = os.path.join(d, f"out-{label}")
        run = env.query(QUERY_D, csv_path, out, *HUGE, "--max-groups-per-user", K_D, "--selection", "public",
                        "--public-groups", public, "--seed", "5")
        assert run.returncode == 0, f"dpstream query ({label} the adversary) failed\n  " + run.describe()
        header, out_rows, report = load_result(out)
        results[label] = result_by_group(header, out_rows, QUERY_D)
        st = ref.RefStats()
        refs[label] = ref.reference(data, "uid", ["g"], QUERY_D.aggregates, None, K_D, 1, 5, stats=st)
        if label == "with":
            chosen = sorted(g for (g,) in st.user_groups["mallory"])
            scales = noise_scales(report, 3)
        problems = compare_groups(f"(d) {label}", QUERY_D, results[label], refs[label], scales)
        assert not problems, "\n  ".join(problems[:20])
        assert len(results[label]) == N_GROUPS_D, f"{label}: {len(results[label])} groups, expected {N_GROUPS_D}"
    assert len(chosen) == K_D
    # differential: only the adversary's k sampled groups change, each by at most the per-group bound
    changed, totals = [], [0.0, 0.0, 0.0]
    for (g,), a in results["with"].items():
        b = results["without"][(g,)]
        diff = [x - y for x, y in zip(a, b)]
        for i in range(3):
            totals[i] += diff[i]
            tol = 6 * max(scales[i]) + 1e-6
            assert abs(diff[i]) <= PER_GROUP_BOUND_D[i] + tol, \
                f"group {g}: the adversary changes {QUERY_D.names[1 + i]} by {diff[i]} > bound {PER_GROUP_BOUND_D[i]}"
        if any(diff):
            changed.append(g)
    for i in range(3):
        assert abs(totals[i]) <= K_D * PER_GROUP_BOUND_D[i] + 6 * N_GROUPS_D * max(scales[i]) + 1e-6, \
            f"the adversary changes the total {QUERY_D.names[1 + i]} by {totals[i]} > k * bound"
    assert changed == chosen, (f"groups changed by the adversary {changed[:10]} ({len(changed)}) != its k = {K_D} "
                               f"groups of smallest sample rank {chosen}")
    print(f"     adversary ({N_GROUPS_D} groups x {ROWS_D} rows) changes exactly its {K_D} sampled groups; "
          f"totals change by {[round(t, 6) for t in totals]}")


# ---------------------------------------------------------------------------------------------
# (e) selection

QUERY_E = Query("SELECT WITH ANONYMIZATION g, ANON_COUNT(*) AS n FROM t GROUP BY g", ["g"],
                [{"kind": "count", "column": None, "upper": None}], ["g", "n"])
SEEDS_E = 30
SINGLETONS_E = 100
DELTA_E = 1e-10


def check_public_groups(env, state):
    rng = random.Random(SEED + 6)
    listed = ["p1", "p2", "p,3", 'p"4', "p5"]
    rows = [{"uid": f"{g}-{u}", "g": g} for g in listed for u in range(20)]
    rows += [{"uid": f"x{u}", "g": "unlisted"} for u in range(60)]
    rng.shuffle(rows)
    d = env.dirs("public")
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "g"], rows)
    public = write_rows(os.path.join(d, "public.csv"), ["g"], [{"g": g} for g in listed + ["empty1"]])
    out = os.path.join(d, "out")
    run = env.query(QUERY_E, csv_path, out, "--epsilon", "1", "--delta", "1e-5", "--max-groups-per-user", "1",
                    "--selection", "public", "--public-groups", public, "--seed", "3")
    assert run.returncode == 0, "dpstream query --selection public failed\n  " + run.describe()
    header, out_rows, report = load_result(out)
    got = result_by_group(header, out_rows, QUERY_E)
    want = sorted([(g,) for g in listed + ["empty1"]], key=ref.sort_key)
    assert sorted(got, key=ref.sort_key) == want, f"public selection released {sorted(got)}, expected {want}"
    sd = noise_scales(report, 1)[0][0]
    for g in listed:
        assert abs(got[(g,)][0] - 20) <= 6 * sd + 1e-6, f"group {g}: count {got[(g,)][0]}, 20 +- 6 * {sd}"
    assert abs(got[("empty1",)][0]) <= 6 * sd + 1e-6, f"empty group: count {got[('empty1',)][0]}, 0 +- 6 * {sd}"
    assert field(report, "selection.kind") == "public", f"selection.kind = {field(report, 'selection.kind')!r}"
    print(f"     listed empty group released with count {got[('empty1',)][0]} (noise sd {sd:.3g}); unlisted absent")


def check_single_user_groups(env, state):
    # 5 big groups (300 users) and SINGLETONS_E groups of one user; each singleton is released with
    # probability <= delta_k = 1e-10 per run (sql/selection.hpp), so <= 90 * 100 * 1e-10 < 1e-6 in all.
    rows = [{"uid": f"b{g}-{u}", "g": f"big{g}"} for g in range(5) for u in range(300)]
    rows += [{"uid": f"s{i}", "g": f"s{i:03d}"} for i in range(SINGLETONS_E)]
    random.Random(SEED + 7).shuffle(rows)
    d = env.dirs("singletons")
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "g"], rows)
    jobs = [(kind, seed) for kind in ("laplace", "gaussian", "magic") for seed in range(1, SEEDS_E + 1)]

    def one(job):
        kind, seed = job
        out = os.path.join(d, f"out-{kind}-{seed}")
        run = env.query(QUERY_E, csv_path, out, "--epsilon", "1", "--delta", DELTA_E, "--max-groups-per-user", "1",
                        "--selection", kind, "--seed", seed, ranks=1)
        assert run.returncode == 0, f"--selection {kind} --seed {seed} failed\n  " + run.describe()
        header, out_rows, _report = load_result(out)
        got = result_by_group(header, out_rows, QUERY_E)
        return kind, seed, sorted(g for (g,) in got)

    problems, big_missing = [], 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        for kind, seed, groups in pool.map(one, jobs):
            single = [g for g in groups if g.startswith("s")]
            if single:
                problems.append(f"--selection {kind} --seed {seed}: one-user groups released: {single}")
            big_missing += 5 - sum(1 for g in groups if g.startswith("big"))
    assert not problems, "\n  ".join(problems)
    # 300 users are far above every threshold here (tau ~ 25-40 at eps 1, delta 1e-10)
    assert big_missing == 0, f"{big_missing} releases of the 300-user groups missing over {len(jobs)} runs"
    print(f"     {len(jobs)} runs x {SINGLETONS_E} one-user groups: none released; every 300-user group released")


# ---------------------------------------------------------------------------------------------
# (f) bad queries

BAD_QUERIES = [
    ("typo FORM", "SELECT WITH ANONYMIZATION region, ANON_COUNT(*) FORM t GROUP BY region", "FORM"),
    ("bare column not in GROUP BY", "SELECT WITH ANONYMIZATION region, tier, ANON_COUNT(*) FROM t GROUP BY region",
     "tier"),
    ("unknown column", "SELECT WITH ANONYMIZATION region, ANON_SUM(pricee, 0, 10) FROM t GROUP BY region", "pricee"),
    ("COUNT(DISTINCT) of another column",
     "SELECT WITH ANONYMIZATION region, ANON_COUNT(DISTINCT tier) FROM t GROUP BY region", "tier"),
    ("unknown GROUP BY column", "SELECT WITH ANONYMIZATION regio, ANON_COUNT(*) FROM t GROUP BY regio", "regio"),
    ("unknown WHERE column", "SELECT WITH ANONYMIZATION region, ANON_COUNT(*) FROM t WHERE pricee > 5 GROUP BY region",
     "pricee"),
    ("unknown column in a nested WHERE",
     "SELECT WITH ANONYMIZATION region, ANON_COUNT(*) FROM t WHERE NOT (tier = 'a' OR tiers IN ('b')) GROUP BY region",
     "tiers"),
    ("L > U", "SELECT WITH ANONYMIZATION region, ANON_AVG(price, 5, 1) FROM t GROUP BY region",
     ("ANON_AVG", "('1')", "column 54")),
    # Read as a number for the 5, the column made every row bad and the string's branch never held (exit 0).
    ("a column compared with a string and a number",
     "SELECT WITH ANONYMIZATION tier, ANON_COUNT(*) FROM t WHERE region = 'r' OR region = 5 GROUP BY tier",
     "compares region with a number and with a string"),
    ("IN with a string and a number", "SELECT WITH ANONYMIZATION tier, ANON_COUNT(*) FROM t WHERE region IN ('r', 5) "
     "GROUP BY tier", "compares region with a number and with a string"),
]


def check_bad_queries(env, state):
    d = env.dirs("bad-queries")
    # The second line is a bad row: a run that read the data with --bad-rows fail would stop on it
    # (and say so) instead of naming the query's token.
    rows = [{"uid": "u1", "region": "r", "tier": "t", "price": "BADFIELD", "qty": "1"}]
    rows += [{"uid": f"u{i}", "region": "r", "tier": "t", "price": "1", "qty": "1"} for i in range(50)]
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "region", "tier", "price", "qty"], rows)
    problems = []
    for i, (label, sql, token) in enumerate(BAD_QUERIES):
        out = os.path.join(d, f"out{i}")
        run = env.query(Query(sql, [], [], []), csv_path, out, *HUGE, "--bad-rows", "fail", "--seed", "1")
        msg = run.stderr + run.stdout
        if run.returncode != 2:
            problems.append(f"{label}: exit code {run.returncode}, expected 2\n    {run.describe()}")
        tokens = token if isinstance(token, tuple) else (token,)
        if not any(t in msg for t in tokens):
            problems.append(f"{label}: the message does not name {' or '.join(map(repr, tokens))}: "
                            f"{msg.strip()[:300]!r}")
        else:
            state.setdefault("messages", []).append(f"{label}: {msg.strip().splitlines()[0][:160]}")
        if "BADFIELD" in msg:
            problems.append(f"{label}: the data was read before the query was refused: {msg.strip()[:300]!r}")
        if os.path.exists(out) and os.listdir(out):
            problems.append(f"{label}: output written: {sorted(os.listdir(out))}")
    assert not problems, "\n  ".join(problems)
    for m in state.get("messages", []):
        print("     " + m)



# Options that turn a mechanism on with their value: 0, a negative value or NaN must be refused, not taken for "off"
# (the query then made one ordinary release of the whole budget, and exited 0).
BAD_OPTION_VALUES = [(opt, v) for opt in ("--growing", "--target-error") for v in ("-1", "0", "nan", "inf")]


def check_bad_option_values(env, state):
    d = env.dirs("bad-option-values")
    rows = [{"uid": f"u{i}", "region": "r", "ts": str(i)} for i in range(20)]
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "region", "ts"], rows)
    q = Query("SELECT WITH ANONYMIZATION region, ANON_COUNT(*) FROM t GROUP BY region", [], [], [])
    problems = []
    for i, (opt, value) in enumerate(BAD_OPTION_VALUES):
        out = os.path.join(d, f"out{i}")
        extra = ["--window-column", "ts", "--windows", "0:0"] if opt == "--growing" else []
        run = env.query(q, csv_path, out, *HUGE, "--seed", "1", *extra, opt, value)
        if run.returncode != 2 or "finite number > 0" not in run.stderr or opt not in run.stderr:
            problems.append(f"{opt} {value}: expected exit 2 naming {opt} and 'finite number > 0'\n    {run.describe()}")
        if os.path.exists(out) and os.listdir(out):
            problems.append(f"{opt} {value}: output written: {sorted(os.listdir(out))}")
    assert not problems, "\n  ".join(problems)

def check_count_of_text_column(env, state):
    """ANON_COUNT(col, U) of a text column counts its non-NULL rows (every row was bad: the column was read as a
    number); a column that ANON_SUM reads too stays numeric."""
    d = env.dirs("count-text")
    rows = [{"uid": f"u{i}", "g": f"g{i % 2}", "tier": "" if i % 3 == 0 else ("gold" if i % 2 else "a,b"),
             "price": str(i)} for i in range(120)]
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "g", "tier", "price"], rows)
    q = Query("SELECT WITH ANONYMIZATION g, ANON_COUNT(tier, 5) AS n, ANON_COUNT(price, 5) AS m, "
              "ANON_SUM(price, 0, 200) AS s FROM t GROUP BY g", [], [], [])
    out = os.path.join(d, "out")
    run = env.query(q, csv_path, out, *HUGE, "--seed", "1")
    assert run.returncode == 0 and "rows were bad" not in run.stderr, run.describe()
    header, got, report = load_result(out)
    assert header == ["g", "n", "m", "s"], header
    for g, n, m, s in got:
        mine = [r for r in rows if r["g"] == g]
        want = (sum(1 for r in mine if r["tier"]), len(mine), sum(int(r["price"]) for r in mine))
        ok = (round(float(n)), round(float(m))) == want[:2] and abs(float(s) - want[2]) < 20  # the sum's noise: < 1
        assert ok, f"group {g}: {(n, m, s)}, expected {want}"
    assert sorted(r[0] for r in got) == ["g0", "g1"], got
    # With ANON_COUNT(DISTINCT uid) beside it, the text user column is still only counted.
    q = Query("SELECT WITH ANONYMIZATION g, ANON_COUNT(uid, 5) AS n, ANON_COUNT(DISTINCT uid) AS d FROM t GROUP BY g",
              [], [], [])
    run = env.query(q, csv_path, os.path.join(d, "distinct"), *HUGE, "--seed", "1")
    assert run.returncode == 0 and "rows were bad" not in run.stderr, run.describe()
    _, got, _ = load_result(os.path.join(d, "distinct"))
    assert sorted((g, round(float(n)), round(float(u))) for g, n, u in got) == [("g0", 60, 60), ("g1", 60, 60)], got


def check_budget_too_small(env, state):
    """A budget whose noise is beyond the samplers is refused by what to change (it said "internal: lattice sigma
    above 2^24", or the Laplace sampler's own range; epsilon 5e-324 took floor(log2(inf)) to an int)."""
    d = env.dirs("budget-too-small")
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "region"], [{"uid": f"u{i}", "region": "r"} for i in range(9)])
    groups = write_rows(os.path.join(d, "groups.csv"), ["region"], [{"region": "r"}])
    q = Query("SELECT WITH ANONYMIZATION region, ANON_COUNT(*) FROM t GROUP BY region", [], [], [])
    for i, extra in enumerate((["--epsilon", "1e-12", "--delta", "1e-300", "--max-groups-per-user", "1048576"],
                               ["--epsilon", "5e-324", "--delta", "1e-9", "--noise", "laplace"])):
        out = os.path.join(d, f"out{i}")
        run = env.query(q, csv_path, out, *extra, "--selection", "public", "--public-groups", groups)
        assert run.returncode == 2 and "the budget is too small for this query" in run.stderr and \
            "raise --epsilon" in run.stderr, run.describe()
        assert not os.path.exists(out) or not os.listdir(out), f"output written: {sorted(os.listdir(out))}"


def check_bad_rows_named(env, state):
    """Skipped rows are reported with the first one's line and reason (a --window-column of dates makes every row bad);
    a table without bad rows gets no warning."""
    d = env.dirs("bad-rows-named")
    rows = [{"uid": f"u{i}", "region": "r", "ts": f"2024-01-{1 + i % 9:02d}"} for i in range(40)]
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "region", "ts"], rows)
    q = Query("SELECT WITH ANONYMIZATION region, ANON_COUNT(*) FROM t GROUP BY region", [], [], [])
    run = env.query(q, csv_path, os.path.join(d, "dates"), *HUGE, "--seed", "1", "--window-column", "ts")
    assert run.returncode == 0, run.describe()
    want = "40 of 40 rows were bad and skipped; the first, line 2: ts is not an integer number of seconds"
    assert want in run.stderr, f"expected {want!r} on stderr\n  " + run.describe()
    assert "2024-01-01" not in run.stderr, "a private query printed a row's value\n  " + run.describe()
    run = env.query(q, csv_path, os.path.join(d, "plain"), *HUGE, "--seed", "1")
    assert run.returncode == 0 and "rows were bad" not in run.stderr, run.describe()
    # A schedule of releases (each reads the same table) warns once, after its last run.
    rows = [{"uid": f"u{i}", "region": "r", "ts": str(i % 2) if i % 4 else "x"} for i in range(40)]
    csv_path = write_rows(os.path.join(d, "mixed.csv"), ["uid", "region", "ts"], rows)
    for name, extra, where in (("growing", ["--windows", "0:1", "--growing", "0.5"], "in every release"),
                               ("target", ["--target-error", "0.5"], "in every attempt")):
        run = env.query(q, csv_path, os.path.join(d, name), *HUGE, "--seed", "1", "--window-column", "ts", *extra)
        want = f"10 of 40 rows were bad and skipped {where}; the first, line 2: ts is not an integer number of seconds"
        assert run.returncode == 0 and run.stderr.count(want) == 1, f"expected {want!r} once\n  " + run.describe()


def check_output_refusals(env, state):
    """Refused before a ledger is charged or a row read (exit 2): an --out that cannot be made, --bad-rows fail in a
    private query (a stop would depend on one row), and an --out that another query holds; nothing is charged."""
    d = env.dirs("output-refusals")
    rows = [{"uid": f"u{i}", "region": "r", "ts": str(i)} for i in range(20)]
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "region", "ts"], rows)
    q = Query("SELECT WITH ANONYMIZATION region, ANON_COUNT(*) FROM t GROUP BY region", [], [], [])
    ledger = os.path.join(d, "l.db")
    init = env.dp.run_with("ledger", "init", ledger, "--epsilon", "10", "--delta", "1e-5", ranks=1)
    assert init.returncode == 0, init.describe()
    a_file = write_rows(os.path.join(d, "a-file"), ["x"], [])
    charged = ["--epsilon", "1", "--delta", "1e-7", "--window-column", "ts", "--windows", "0:0", "--ledger", ledger]
    for out in (a_file, os.path.join(a_file, "sub")):
        run = env.dp.run_with("query", q.sql, "--input", csv_path, "--user-column", "uid", *charged, "--out", out)
        assert run.returncode == 2 and "cannot create output dir" in run.stderr, run.describe()
    show = env.dp.run_with("ledger", "show", ledger, "--json", ranks=1)
    assert show.returncode == 0 and not json.loads(show.stdout)["blocks"], "a refused query charged the ledger\n  " + \
        show.describe()
    out = os.path.join(d, "fail")
    run = env.query(q, csv_path, out, "--epsilon", "1", "--delta", "1e-7", "--bad-rows", "fail")
    assert run.returncode == 2 and "--bad-rows fail" in run.stderr and "--bad-rows skip" in run.stderr, run.describe()
    assert not os.path.exists(out), f"a refused query made {out}"
    # Another process holds --out (as a running query would): refused, and the files it would write are not there.
    held = os.path.join(d, "held")
    os.makedirs(held)
    fd = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        run = env.query(q, csv_path, held, *HUGE, "--seed", "1")
        assert run.returncode == 2 and "in use by another dpstream job" in run.stderr, run.describe()
        assert not os.listdir(held), f"a refused query wrote {os.listdir(held)}"
    finally:
        os.close(fd)
    run = env.query(q, csv_path, held, *HUGE, "--seed", "1")
    assert run.returncode == 0 and sorted(os.listdir(held)) == ["report.json", "result.csv"], run.describe()
    # A stop signal (SLURM's SIGUSR1 or SIGTERM) once the ledger is charged: the query finishes its release and says
    # so (killed by the signal, it had spent the budget and written nothing).
    for sig in ("USR1", "TERM"):
        out = os.path.join(d, "signalled-" + sig)
        run = env.dp.run_with("query", q.sql, "--input", csv_path, "--user-column", "uid", *charged, "--out", out,
                              env={"DPSTREAM_FAULT": f"query_charged@1:0:{sig}"})
        assert run.returncode == 0 and sorted(os.listdir(out)) == ["report.json", "result.csv"], run.describe()
        assert f"the SIG{sig} came while the release ran; it was finished first" in run.stderr, run.describe()


OPTIONS_OUT_OF_PLACE = [
    (["--growing", "0.5", "--target-error", "0.1"], "give one"),
    (["--growing-first", "5"], "--growing-first is an option of --growing"),
    (["--target-min-count", "5"], "--target-min-count is an option of --target-error"),
    (["--target-beta", "7"], "--target-beta is an option of --target-error"),
    (["--explain", "--target-error", "0.1"], "drop --explain"),
]


def check_options_out_of_place(env, state):
    """An option that would be ignored is refused (exit 2, nothing written); an OPTIONS(...) number against a text
    option is a disagreement, not a bare 'stod'."""
    d = env.dirs("options-out-of-place")
    rows = [{"uid": f"u{i}", "region": "r", "ts": str(i)} for i in range(20)]
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "region", "ts"], rows)
    q = Query("SELECT WITH ANONYMIZATION region, ANON_COUNT(*) FROM t GROUP BY region", [], [], [])
    problems = []
    windows = ["--window-column", "ts", "--windows", "0:0"]
    for i, (extra, needle) in enumerate(OPTIONS_OUT_OF_PLACE):
        out = os.path.join(d, f"out{i}")
        run = env.query(q, csv_path, out, *HUGE, "--seed", "1", *windows, *extra)
        if run.returncode != 2 or needle not in run.stderr:
            problems.append(f"{extra}: expected exit 2 naming {needle!r}\n    {run.describe()}")
        if os.path.exists(out):
            problems.append(f"{extra}: {out} made: {sorted(os.listdir(out))}")
    q_noise = Query("SELECT WITH ANONYMIZATION OPTIONS(noise = 1) region, ANON_COUNT(*) FROM t GROUP BY region",
                    [], [], [])
    run = env.query(q_noise, csv_path, os.path.join(d, "noise"), *HUGE, "--seed", "1", "--noise", "gaussian")
    if run.returncode != 2 or "disagree" not in run.stderr:
        problems.append(f"OPTIONS(noise = 1) with --noise gaussian: expected 'disagree'\n    {run.describe()}")
    # Refused once rank 0 has made and locked --out (here: --growing needs windows): the empty --out it made is removed.
    out = os.path.join(d, "made-then-refused")
    run = env.query(q, csv_path, out, *HUGE, "--seed", "1", "--growing", "0.5")
    if run.returncode != 2 or os.path.exists(out):
        problems.append(f"--growing without windows: expected exit 2 and no {out}\n    {run.describe()}")
    # --windows beyond int64 or with trailing text: refused, not clamped or cut.
    for value in ("99999999999999999999:1", "1:2x", "1:", "+-1:2"):
        run = env.query(q, csv_path, os.path.join(d, "windows"), *HUGE, "--seed", "1", "--window-column", "ts",
                        "--windows", value)
        if run.returncode != 2 or f"--windows {value}: write A:B" not in run.stderr:
            problems.append(f"--windows {value}: expected exit 2 naming it\n    {run.describe()}")
    # Two spellings of k in OPTIONS: the disagreement names the first one, not an option that was never given.
    q_k = Query("SELECT WITH ANONYMIZATION OPTIONS(max_groups_contributed = 2, kappa = 3) region, ANON_COUNT(*) "
                "FROM t GROUP BY region", [], [], [])
    run = env.query(q_k, csv_path, os.path.join(d, "kappa"), *HUGE, "--seed", "1")
    want = "OPTIONS(kappa = 3) and OPTIONS(max_groups_contributed) = 2 disagree"
    if run.returncode != 2 or want not in run.stderr:
        problems.append(f"two spellings of k: expected {want!r}\n    {run.describe()}")
    # Ignored before: a window length without a window column, a selection share without a selection; seeds that
    # strtoull took for 2^64 - 1 ("-1", 2^64).
    for extra, needle in ((["--window-seconds", "10"], "--window-seconds is the length of --window-column"),
                          (["--selection", "public", "--public-groups", csv_path, "--selection-share", "0.3"],
                           "--selection-share is the budget share"),
                          (["--seed", "-1"], "--seed: must be a whole number"),
                          (["--seed", str(2**64)], "--seed: must be a whole number")):
        run = env.query(q, csv_path, os.path.join(d, "ignored"), *HUGE, *extra)
        if run.returncode != 2 or needle not in run.stderr or os.path.exists(os.path.join(d, "ignored")):
            problems.append(f"{extra}: expected exit 2 naming {needle!r}, nothing made\n    {run.describe()}")
    assert not problems, "\n  ".join(problems)


def check_input_refusals(env, state):
    """A header naming a column twice (the user column here: which one is the privacy unit?) and an input that is not
    a regular file are refused before any read (exit 3)."""
    d = env.dirs("input-refusals")
    q = Query("SELECT WITH ANONYMIZATION g, ANON_COUNT(*) FROM t GROUP BY g", [], [], [])
    twice = os.path.join(d, "twice.csv")
    with open(twice, "w", encoding="utf-8") as f:
        f.write("uid,g,uid\nu1,a,u2\n")
    run = env.query(q, twice, os.path.join(d, "out1"), *HUGE, "--seed", "1")
    assert run.returncode == 3 and "'uid' twice" in run.stderr, run.describe()
    run = env.query(q, "/dev/zero", os.path.join(d, "out2"), *HUGE, "--seed", "1")
    assert run.returncode == 3 and "not a regular file" in run.stderr, run.describe()
    # Repeated columns the query does not read (two empty names, as some exports write) are no ambiguity.
    unused = os.path.join(d, "unused.csv")
    with open(unused, "w", encoding="utf-8") as f:
        f.write("uid,g,,\nu1,a,x,y\n")
    run = env.query(q, unused, os.path.join(d, "out3"), *HUGE, "--seed", "1")
    assert run.returncode == 0, run.describe()
    # --public-groups and --job that name a directory or nothing: refused by the option's name.
    for extra, code, needle in ((["--selection", "public", "--public-groups", d], 3, "give --public-groups a CSV"),
                                (["--selection", "public", "--public-groups", os.path.join(d, "none.csv")], 3,
                                 "--public-groups"),
                                (["--job", d], 2, f"--job {d} is a directory"),
                                (["--job", os.path.join(d, "none.toml")], 2, "no such file")):
        out = os.path.join(d, "out4")
        run = env.query(q, unused, out, *HUGE, "--seed", "1", *extra)
        assert run.returncode == code and needle in run.stderr and not os.path.exists(out), run.describe()


# ---------------------------------------------------------------------------------------------
# Number syntax of value fields: docs/SQL.md says "a finite number (strtod syntax)".

NUMBER_FORMS = [("+7", 7.0), ("+.5", 0.5), ("12.", 12.0), (".5", 0.5), ("-.5", -0.5), ("1E2", 100.0),
                ("5e-1", 0.5), ("-0", 0.0), ("007", 7.0), ("1e-30", 0.0), ("1e300", 100.0), ("-1e300", -100.0),
                ("2.5e+1", 25.0)]
BAD_NUMBER_FORMS = ["1e400", "nan", "inf", "1,5", "seven", "1.2.3", "--1"]  # not finite / not a number
QUERY_N = Query("SELECT WITH ANONYMIZATION g, ANON_SUM(v, -100, 100) AS s, ANON_COUNT(v, 1) AS n FROM t GROUP BY g",
                ["g"], [{"kind": "sum", "column": "v", "lower": -100, "upper": 100},
                        {"kind": "count", "column": "v", "upper": 1}], ["g", "s", "n"])


def check_number_syntax(env, state):
    rows = [{"uid": f"n{i}", "g": f"f{i:02d}", "v": text} for i, (text, _v) in enumerate(NUMBER_FORMS)]
    rows += [{"uid": f"b{i}", "g": f"bad{i:02d}", "v": text} for i, text in enumerate(BAD_NUMBER_FORMS)]
    d = env.dirs("number-syntax")
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "g", "v"], rows)
    public = write_rows(os.path.join(d, "public.csv"), ["g"], [{"g": r["g"]} for r in rows])
    st = ref.RefStats()
    want = ref.reference(rows, "uid", ["g"], QUERY_N.aggregates, None, 1, 1, 2, stats=st)
    assert st.rows_bad == len(BAD_NUMBER_FORMS), f"reference: {st.rows_bad} bad rows: {st.bad_reasons}"
    for i, (text, v) in enumerate(NUMBER_FORMS):
        assert want[(f"f{i:02d}",)]["values"] == [v, 1], (text, want[(f"f{i:02d}",)])
    out = os.path.join(d, "out")
    run = env.query(QUERY_N, csv_path, out, *HUGE, "--selection", "public", "--public-groups", public, "--seed", "2")
    assert run.returncode == 0, "dpstream query failed\n  " + run.describe()
    header, out_rows, report = load_result(out)
    got = result_by_group(header, out_rows, QUERY_N)
    scales = noise_scales(report, 2)
    problems = []
    for i, (text, v) in enumerate(NUMBER_FORMS):
        s, n = got[(f"f{i:02d}",)]
        if abs(n - 1) > 6 * scales[1][0] + 1e-6 or abs(s - v) > 6 * scales[0][0] + 1e-6:
            problems.append(f"value field {text!r} (strtod: {v}): released sum {s}, count {n}: the row was "
                            f"{'rejected as bad' if abs(n) < 0.5 else 'read differently'}")
    for i, text in enumerate(BAD_NUMBER_FORMS):
        s, n = got[(f"bad{i:02d}",)]
        if abs(n) > 6 * scales[1][0] + 1e-6:
            problems.append(f"value field {text!r} should make the row bad, but it was counted (sum {s})")
    bad = field(report, "not_dp.rows_bad")
    if bad != len(BAD_NUMBER_FORMS):
        problems.append(f"not_dp.rows_bad = {bad}, expected {len(BAD_NUMBER_FORMS)} ({BAD_NUMBER_FORMS})")
    assert not problems, "\n  ".join(problems)


# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# (g) windows: per-window releases, one release over several windows, and the budget ledger

DAY = 86400
QUERY_G = Query("SELECT WITH ANONYMIZATION g, ANON_COUNT(DISTINCT uid) AS users FROM t GROUP BY g", ["g"],
                [{"kind": "count_distinct"}], ["g", "users"])


def windows_table(d):
    """60 users over windows 0..5: user u has rows in windows u % 6 and (u + 1) % 6, groups by u % 3."""
    rows = []
    for u in range(60):
        for w in (u % 6, (u + 1) % 6):
            for j in range(2):
                rows.append({"uid": f"u{u}", "g": f"g{u % 3}", "ts": str(w * DAY + 100 * u + j)})
    return write_rows(os.path.join(d, "t.csv"), ["uid", "g", "ts"], rows), rows


def distinct_users(rows, windows, per_window):
    """Users per (window, group) or per group over `windows` (the reference of ANON_COUNT(DISTINCT uid))."""
    out = {}
    for r in rows:
        w = int(r["ts"]) // DAY
        if w not in windows:
            continue
        key = (str(w), r["g"]) if per_window else (r["g"],)
        out.setdefault(key, set()).add(r["uid"])
    return {k: len(v) for k, v in out.items()}


def check_windows(env, state):
    d = env.dirs("windows")
    csv_path, rows = windows_table(d)
    common = ["--window-column", "ts", "--max-groups-per-user", "10", "--seed", "5", *HUGE]
    for per_window, extra, windows in ((True, ["--per-window"], range(6)),
                                       (False, ["--windows", "1:3"], range(1, 4))):
        out = os.path.join(d, f"out-{per_window}")
        run = env.query(QUERY_G, csv_path, out, *common, *extra)
        assert run.returncode == 0, "windowed query failed\n  " + run.describe()
        header, out_rows, report = load_result(out)
        tau = field(report, "selection.threshold")
        want = {k: v for k, v in distinct_users(rows, set(windows), per_window).items() if v >= tau}
        lead = ["window"] if per_window else []
        assert header == lead + ["g", "users"], f"header {header}"
        got = {tuple(r[:-1]): int(r[-1]) for r in out_rows}
        assert got == want, f"per_window={per_window}: released {got}, reference {want}"
        if per_window:
            order = [(int(r[0]), r[1]) for r in out_rows]
            assert order == sorted(order), f"rows not sorted by (window, group): {order}"
    print(f"     per window: {len(distinct_users(rows, set(range(6)), True))} (window, group) cells exact; "
          "windows 1..3 combined: per-group distinct users over the three windows exact")


def block_epsilon(rho, one_sided, ceiling_eps, ceiling_delta, coupled=0.0):
    """Least eps <= ceiling with cks_delta(rho, eps) + one_sided + (e^eps + 1) coupled <= ceiling_delta (None if
    none): the ledger's zCDP block accounting recomputed independently (need(eps) searched on a grid)."""
    need = lambda e: dp_reference.cks_delta(rho, e) + one_sided + (math.exp(e) + 1) * coupled  # noqa: E731
    grid = [ceiling_eps * i / 2000 for i in range(2001)]
    ok = [e for e in grid if need(e) <= ceiling_delta]
    return min(ok) if ok else None


def check_ledger(env, state):
    d = env.dirs("ledger")
    csv_path, _ = windows_table(d)
    book = os.path.join(d, "budget.ledger")
    ceiling_eps, ceiling_delta = 1.5, 1e-5
    run = env.dp.run_with("ledger", "init", book, "--epsilon", ceiling_eps, "--delta", ceiling_delta, ranks=1)
    assert run.returncode == 0, run.describe()
    args = ["--window-column", "ts", "--windows", "2:4", "--ledger", book, "--epsilon", "0.5", "--delta", "1e-6",
            "--max-groups-per-user", "2"]
    seeded = env.query(QUERY_G, csv_path, os.path.join(d, "seeded"), *args, "--seed", "1")
    assert seeded.returncode == 2 and "seed" in seeded.stderr, "a seeded query was not refused\n  " + seeded.describe()
    no_range = env.query(QUERY_G, csv_path, os.path.join(d, "norange"), "--window-column", "ts", "--ledger", book,
                         "--epsilon", "0.5", "--delta", "1e-6")
    assert no_range.returncode == 2 and "--windows" in no_range.stderr, no_range.describe()
    admitted, report = 0, None
    for i in range(12):
        out = os.path.join(d, f"q{i}")
        run = env.query(QUERY_G, csv_path, out, *args)
        if run.returncode != 0:
            assert run.returncode == 2 and "block 2" in run.stderr, "refusal not as expected\n  " + run.describe()
            assert not os.path.exists(os.path.join(out, "result.csv")), "a refused query wrote its result"
            break
        admitted += 1
        report = load_result(out)[2]
    assert report is not None, "no query was admitted"
    # Independent: the selection is the only noise (COUNT(DISTINCT) reuses it): rho = k / (2 sigma^2).
    sigma, k = field(report, "selection.noise_scale"), 2
    rho = field(report, "accounting.rho_total")
    assert abs(rho - k / (2 * sigma * sigma)) <= 1e-12 * rho, f"rho_total {rho} != k / (2 sigma^2) = {k / (2 * sigma * sigma)}"
    # Windows 2..4 in one release: a block holds part of a user's rows, so each block is charged for a
    # replacement (group privacy 2): 4 rho, and the threshold's delta on both inputs (coupled).
    charge_rho, coupled = 4 * rho, field(report, "accounting.delta_threshold")
    fits = [n for n in range(1, 13)
            if block_epsilon(n * charge_rho, 0.0, ceiling_eps, ceiling_delta, n * coupled) is not None]
    expected = max(fits) if fits else 0
    assert admitted == expected, f"{admitted} queries admitted, the block accounting admits {expected}"
    shown = env.dp.run_with("ledger", "explain", book, "--json", ranks=1)
    assert shown.returncode == 0, shown.describe()
    blocks = {b["block"]: b for b in json.loads(shown.stdout)["blocks"]}
    assert sorted(blocks) == [2, 3, 4], f"charged blocks {sorted(blocks)}, expected [2, 3, 4]"
    for b in blocks.values():
        assert b["charges"] == admitted, f"block {b['block']}: {b['charges']} charges, {admitted} admitted"
        for c in b["charge_list"]:
            assert c["accounting"] == "zcdp" and abs(c["rho"] - charge_rho) <= 1e-12 * charge_rho, \
                f"charge {c} != 4 rho = {charge_rho}"
            assert abs(c["failure_coupled"] - coupled) <= 1e-18 and c["failure_one_sided"] == 0, f"charge {c}"
    rho = charge_rho
    # At a large epsilon the coupled threshold mass costs (e^eps + 1) per query and zCDP cannot fit even one;
    # basic composition of the queries' own (2 eps, (1 + e^eps) delta) fits two: the ledger uses it.
    book2 = os.path.join(d, "basic.ledger")
    run = env.dp.run_with("ledger", "init", book2, "--epsilon", 25, "--delta", 1e-3, ranks=1)
    assert run.returncode == 0, run.describe()
    big = ["--window-column", "ts", "--windows", "2:3", "--ledger", book2, "--epsilon", "5", "--delta", "1e-6",
           "--max-groups-per-user", "2"]
    codes = [env.query(QUERY_G, csv_path, os.path.join(d, f"big{i}"), *big).returncode for i in range(3)]
    assert codes == [0, 0, 2], f"exit codes {codes}: basic composition admits 2 queries of (10, ~1.5e-4) per block"
    shown = env.dp.run_with("ledger", "show", book2, "--json", ranks=1)
    accounting = {b["block"]: b["accounting"] for b in json.loads(shown.stdout)["blocks"]}
    assert accounting == {2: "basic", 3: "basic"}, f"blocks' accounting {accounting}, expected basic"
    print(f"     ceiling ({ceiling_eps}, {ceiling_delta}): {admitted} queries of (0.5, 1e-6) admitted on blocks 2..4 "
          f"(each charged 4 rho = {rho:.4g}, a replacement: the release spans 3 blocks), the next refused; at eps 5 "
          "basic composition admits 2 where zCDP admits none")


def check_is_null(env, state):
    """WHERE col IS NULL / IS NOT NULL: rows counted per group against a direct count (huge budget)."""
    rng = random.Random(SEED + 9)
    rows = [{"uid": f"u{rng.randrange(80)}", "g": f"g{rng.randrange(3)}",
             "price": "" if rng.random() < 0.3 else f"{rng.uniform(0, 9):.2f}"} for _ in range(3000)]
    d = env.dirs("isnull")
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "g", "price"], rows)
    for negated in (False, True):
        q = Query(f"SELECT WITH ANONYMIZATION g, ANON_COUNT(*, 1000) AS n FROM t WHERE price IS "
                  f"{'NOT ' if negated else ''}NULL GROUP BY g", ["g"],
                  [{"kind": "count", "column": None, "upper": 1000}], ["g", "n"])
        out = os.path.join(d, f"out-{negated}")
        run = env.query(q, csv_path, out, *HUGE, "--seed", "2", "--max-groups-per-user", "3")
        assert run.returncode == 0, run.describe()
        header, out_rows, report = load_result(out)
        sd = noise_scales(report, 1)[0][0]  # U = 1000 leaves some noise even at this budget
        want = {}
        for r in rows:
            if (r["price"] == "") != negated:
                want[r["g"]] = want.get(r["g"], 0) + 1
        got = {r[0]: int(r[1]) for r in out_rows}
        assert sorted(got) == sorted(want) and all(abs(got[g] - want[g]) <= 6 * sd + 0.5 for g in want), \
            f"IS {'NOT ' if negated else ''}NULL: released {got}, direct count {want} (noise sd {sd:.3g})"
    print(f"     IS NULL and IS NOT NULL row counts within noise of a direct count on {len(rows)} rows")


def check_job_spec(env, state):
    """--job FILE's [query] table gives the same release as the options; the command line wins; bad keys refused."""
    d = env.dirs("jobspec")
    csv_path, _ = windows_table(d)
    spec = os.path.join(d, "q.toml")
    with open(spec, "w", encoding="utf-8") as f:
        f.write(f'[query]\nsql = "{QUERY_G.sql}"\ninput = "{csv_path}"\nuser_column = "uid"\nepsilon = 2.0\n'
                f'delta = 1e-6\nmax_groups_per_user = 3\nwindow_column = "ts"\nwindows = [1, 4]\n')
    by_spec = env.dp.run_with("query", "--job", spec, "--seed", "4", "--out", os.path.join(d, "a"))
    by_cli = env.query(QUERY_G, csv_path, os.path.join(d, "b"), "--epsilon", "2", "--delta", "1e-6",
                       "--max-groups-per-user", "3", "--window-column", "ts", "--windows", "1:4", "--seed", "4")
    assert by_spec.returncode == 0 and by_cli.returncode == 0, by_spec.describe() + "\n  " + by_cli.describe()
    a = open(os.path.join(d, "a", "result.csv"), encoding="utf-8").read()
    b = open(os.path.join(d, "b", "result.csv"), encoding="utf-8").read()
    assert a == b, "the spec and the same options on the command line released different results"
    over = env.dp.run_with("query", "--job", spec, "--epsilon", "0.5", "--seed", "4", "--out", os.path.join(d, "c"))
    assert over.returncode == 0, over.describe()
    assert field(load_result(os.path.join(d, "c"))[2], "options.epsilon") == 0.5, "--epsilon did not win over the spec"
    # OPTIONS(...) in the text fill options too, and must agree with the command line.
    opts_sql = QUERY_G.sql.replace("ANONYMIZATION", "ANONYMIZATION OPTIONS(epsilon = 2, max_groups_contributed = 3)")
    by_options = env.dp.run_with("query", opts_sql, "--input", csv_path, "--user-column", "uid", "--delta", "1e-6",
                                 "--window-column", "ts", "--windows", "1:4", "--seed", "4", "--out",
                                 os.path.join(d, "o"))
    assert by_options.returncode == 0, by_options.describe()
    assert open(os.path.join(d, "o", "result.csv"), encoding="utf-8").read() == a, "OPTIONS(...) released otherwise"
    clash = env.dp.run_with("query", opts_sql, "--input", csv_path, "--user-column", "uid", "--delta", "1e-6",
                            "--epsilon", "1", "--out", os.path.join(d, "o2"))
    assert clash.returncode == 2 and "disagree" in clash.stderr, clash.describe()
    # A refusal of a value the spec gave names the spec's key, not only the option it stands for.
    reversed_spec = os.path.join(d, "reversed.toml")
    with open(spec, encoding="utf-8") as f, open(reversed_spec, "w", encoding="utf-8") as g:
        g.write(f.read().replace("windows = [1, 4]", "windows = [4, 1]"))
    reversed_run = env.dp.run_with("query", "--job", reversed_spec, "--seed", "4", "--out", os.path.join(d, "r"))
    assert reversed_run.returncode == 2 and "A <= B" in reversed_run.stderr and \
        "reversed.toml: [query] windows" in reversed_run.stderr, reversed_run.describe()
    with open(spec, "a", encoding="utf-8") as f:
        f.write("epsilom = 1\n")
    bad = env.dp.run_with("query", "--job", spec, "--out", os.path.join(d, "e"))
    assert bad.returncode == 2 and "epsilom" in bad.stderr, bad.describe()
    print("     [query] spec == OPTIONS(...) == command line (byte-identical result.csv); --epsilon overrides the "
          "spec, a disagreeing OPTIONS is refused; unknown key refused; a refused spec value named by its key")


def growing_windows(gamma, first, last, first_length):
    """The schedule's windows, recomputed: L_i = max(L_{i-1} + 1, ceil(L_0 (1 + gamma)^i)) while it fits."""
    out, length, i = [], 0, 0
    while True:
        length = max(length + 1, math.ceil(first_length * (1 + gamma) ** i - 1e-9))
        if length > last - first + 1:
            return out
        out.append((first, first + length - 1))
        i += 1


def check_growing(env, state):
    """--growing: releases over windows A .. A + L_i - 1, rho_i = rho w_i with sum w_i = 1 (independent
    arithmetic here), each release exact against the reference at a huge budget."""
    d = env.dirs("growing")
    csv_path, rows = windows_table(d)
    gamma, eps, delta = 0.5, 1e5, 1e-3
    out = os.path.join(d, "out")
    run = env.query(QUERY_G, csv_path, out, "--window-column", "ts", "--windows", "0:5", "--growing", gamma,
                    "--max-groups-per-user", "10", "--seed", "6", "--epsilon", eps, "--delta", delta)
    assert run.returncode == 0, run.describe()
    with open(os.path.join(out, "schedule.json"), encoding="utf-8") as f:
        schedule = json.load(f)
    want_windows = growing_windows(gamma, 0, 5, 1)
    got_windows = [tuple(r["windows"]) for r in schedule["releases"]]
    assert got_windows == want_windows, f"releases over {got_windows}, expected {want_windows}"
    rho = schedule["rho_schedule"]
    assert dp_reference.cks_delta(rho, eps) <= delta / 2 * (1 + 1e-9), f"rho {rho} is not ({eps}, {delta}/2)-DP"
    x = 1 / (1 + gamma) ** 2
    weights = [(i + 1) ** 2 * x ** i * (1 - x) ** 3 / (1 + x) for i in range(2000)]
    assert abs(sum(weights) - 1) < 1e-9, f"the weights sum to {sum(weights)}, not 1"
    for r in schedule["releases"]:
        i = r["release"]
        assert abs(r["rho"] - rho * weights[i]) <= 1e-12 * rho, f"release {i}: rho {r['rho']} != {rho * weights[i]}"
        assert r["rho_spent"] <= r["rho"] * (1 + 1e-12), f"release {i} spends {r['rho_spent']} > {r['rho']}"
        assert abs(r["delta_selection"] - delta / 2 / 2 ** (i + 1)) <= 1e-18, f"release {i}: delta {r}"
        header, out_rows, report = load_result(os.path.join(out, f"release-{i}"))
        tau = field(report, "selection.threshold")
        lo, hi = r["windows"]
        want = {k: v for k, v in distinct_users(rows, set(range(lo, hi + 1)), False).items() if v >= tau}
        got = {tuple(row[:-1]): int(row[-1]) for row in out_rows}
        assert got == want, f"release {i} over windows {lo}..{hi}: {got}, reference {want}"
    print(f"     gamma {gamma}: {len(got_windows)} releases over {got_windows}; rho_i = rho w_i "
          f"(w = {', '.join(f'{w:.3f}' for w in weights[:len(got_windows)])}); each release exact")


def check_adaptive(env, state):
    """--target-error: attempts double the budget until z sd / m <= r; over seeded runs the claim (every
    released group of true count >= m within r of it) holds in at least 1 - beta of them."""
    d = env.dirs("adaptive")
    sizes = [150, 300, 600, 900, 1400, 2000, 3000]
    rows = [{"uid": f"{g}-{u}", "g": f"g{g}"} for g, n in enumerate(sizes) for u in range(n)]
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "g"], rows)
    truth = {f"g{g}": n for g, n in enumerate(sizes)}
    r, m, beta, eps, seeds = 0.06, 600, 0.05, 1.0, 20  # met at the 4th attempt (half the budget spent)
    failures, stops, shares = 0, {}, []
    for seed in range(seeds):
        out = os.path.join(d, f"out{seed}")
        run = env.query(QUERY_G, csv_path, out, "--epsilon", eps, "--delta", "1e-6", "--seed", 100 + seed,
                        "--target-error", r, "--target-min-count", m, "--target-beta", beta)
        assert run.returncode == 0, run.describe()
        with open(os.path.join(out, "adaptive.json"), encoding="utf-8") as f:
            a = json.load(f)
        assert a["spent"]["rho"] <= a["budget"]["rho"] * (1 + 1e-12), f"spent {a['spent']} above {a['budget']}"
        last = a["attempts"][-1]
        assert last["met"] == a["stopped"].startswith("target met"), f"stop reason {a['stopped']} vs {last}"
        stops[a["stopped"]] = stops.get(a["stopped"], 0) + 1
        shares.append(a["spent"]["share"])
        if not last["met"]:
            continue
        header, out_rows, _ = load_result(last["dir"] if os.path.isabs(last["dir"]) else os.path.join(out, f"attempt-{last['attempt']}"))
        bad = [(row[0], int(row[1])) for row in out_rows
               if truth[row[0]] >= m and abs(int(row[1]) - truth[row[0]]) > r * truth[row[0]]]
        failures += bool(bad)
    # P[Binomial(20, 0.05) >= 6] < 4e-4: the claim is a union bound, failures are rarer still.
    assert failures <= 5, f"the claim failed in {failures} of {seeds} runs (beta {beta})"
    assert any(k.startswith("target met") for k in stops), f"the target was never met: {stops}"
    print(f"     {seeds} seeded runs: stops {stops}; budget share spent mean {sum(shares) / len(shares):.3f}; "
          f"claim violated in {failures} runs (allowed by beta = {beta}: <= 5)")


def run_as_nobody(env, d, argv_tail):
    """`dpstream query ...` as a user who cannot write a directory that root made read-only (root writes anyway): as
    uid 65534 through setpriv when root (the binary copied where that user may run it), as itself otherwise; one rank.
    None when root lacks setpriv."""
    if os.geteuid() != 0:
        return env.dp.run_with(*argv_tail, ranks=1)
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    binary = os.path.join(d, "dpstream")
    shutil.copy2(env.dp.bin, binary)
    os.chmod(binary, 0o755)
    argv = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", binary, *map(str, argv_tail)]
    proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=env.args.timeout,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": d})
    return harness.Run(argv, proc, 0.0)


def check_unwritable_out(env, state):
    """An --out that exists but cannot be written is refused before the ledger is charged (it was found when
    result.csv was written, with the block's budget spent)."""
    d = tempfile.mkdtemp(prefix="dpstream-e2e-unwritable-")  # beside the test's own (mode 700: uid 65534 stops there)
    try:
        os.chmod(d, 0o755)
        refused_before_charge(env, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def refused_before_charge(env, d):
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "region", "ts"],
                          [{"uid": f"u{i}", "region": "r", "ts": str(i)} for i in range(20)])
    os.chmod(csv_path, 0o644)
    ledger_dir = os.path.join(d, "ledger")
    os.makedirs(ledger_dir)
    os.chmod(ledger_dir, 0o777)  # the query may charge it: a refusal, not a permission, must keep it unspent
    ledger = os.path.join(ledger_dir, "l.db")
    init = env.dp.run_with("ledger", "init", ledger, "--epsilon", "10", "--delta", "1e-5", ranks=1)
    assert init.returncode == 0, init.describe()
    os.chmod(ledger, 0o666)
    out = os.path.join(d, "read-only")
    os.makedirs(out)
    os.chmod(out, 0o555)
    q = "SELECT WITH ANONYMIZATION region, ANON_COUNT(*) FROM t GROUP BY region"
    run = run_as_nobody(env, d, ["query", q, "--input", csv_path, "--user-column", "uid", "--epsilon", "1",
                                 "--delta", "1e-7", "--window-column", "ts", "--windows", "0:0", "--ledger", ledger,
                                 "--out", out])
    if run is None:
        print("     skipped: running as root without setpriv, no user for whom a directory is read-only")
        return
    assert run.returncode == 2 and f"output dir {out} is not writable" in run.stderr, run.describe()
    show = env.dp.run_with("ledger", "show", ledger, "--json", ranks=1)
    assert show.returncode == 0 and not json.loads(show.stdout)["blocks"], \
        "a query refused for its --out charged the ledger\n  " + show.describe()


def check_schedule_outputs(env, state):
    """--growing and --target-error: every file they would write is looked for before the first run spends
    anything (an existing one failed the schedule after earlier runs had spent their shares, and schedule.json or
    adaptive.json was replaced); a multi-line alias and an --out of non-UTF-8 bytes finish with their summary."""
    d = env.dirs("schedule-outputs")
    csv_path, _ = windows_table(d)
    growing = ["--window-column", "ts", "--windows", "0:5", "--growing", "0.5", "--seed", "6", *HUGE]
    target = ["--target-error", "0.5", "--seed", "6", *HUGE]
    for name, extra, planted in (("growing", growing, os.path.join("release-2", "result.csv")),
                                 ("target", target, os.path.join("attempt-1", "report.json")),
                                 ("growing-summary", growing, "schedule.json"),
                                 ("target-summary", target, "adaptive.json")):
        out = os.path.join(d, name)
        os.makedirs(os.path.dirname(os.path.join(out, planted)), exist_ok=True)
        with open(os.path.join(out, planted), "w", encoding="utf-8") as f:
            f.write("precious\n")
        run = env.query(QUERY_G, csv_path, out, *extra)
        assert run.returncode == 2 and f"{os.path.join(out, planted)} exists already" in run.stderr, run.describe()
        written = sorted(os.path.relpath(os.path.join(r, f), out) for r, _, fs in os.walk(out) for f in fs)
        assert written == [planted], f"{name}: a refused schedule wrote {written}"
        with open(os.path.join(out, planted), encoding="utf-8") as f:
            assert f.read() == "precious\n", f"{name}: {planted} was overwritten"
    q = Query('SELECT WITH ANONYMIZATION g AS "a\nb,c\nd", ANON_COUNT(DISTINCT uid) AS n FROM t GROUP BY g',
              [], [], [])
    for name, extra, summary in (("alias", target, "adaptive.json"), ("o\udcff-target", target, "adaptive.json"),
                                 ("o\udcff-growing", growing, "schedule.json")):
        out = os.path.join(d, name)
        run = env.query(q if name == "alias" else QUERY_G, csv_path, out, *extra)
        assert run.returncode == 0, run.describe()
        with open(os.path.join(out, summary), encoding="utf-8") as f:
            json.load(f)


def check_temporary_is_made_fresh(env, state):
    """A symbolic link planted where an output's temporary file goes is replaced, not written through."""
    d = env.dirs("planted-link")
    rows = [{"uid": f"u{i}", "region": "r"} for i in range(20)]
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "region"], rows)
    victim = os.path.join(d, "victim.txt")
    with open(victim, "w", encoding="utf-8") as f:
        f.write("untouched\n")
    out = os.path.join(d, "out")
    os.makedirs(out)
    for name in ("report.json.tmp", "result.csv.tmp"):
        os.symlink(victim, os.path.join(out, name))
    q = Query("SELECT WITH ANONYMIZATION region, ANON_COUNT(*) FROM t GROUP BY region", [], [], [])
    run = env.query(q, csv_path, out, *HUGE, "--seed", "1")
    assert run.returncode == 0, run.describe()
    with open(victim, encoding="utf-8") as f:
        assert f.read() == "untouched\n", "the query wrote through a planted link"
    for name in ("report.json", "result.csv"):
        assert not os.path.islink(os.path.join(out, name)), f"{name} is a link"
    assert sorted(os.listdir(out)) == ["report.json", "result.csv"], sorted(os.listdir(out))


def check_syntax_error_before_required_options(env, state):
    """A syntax error is reported even when OPTIONS(...) was to give the budget (it said "--epsilon is required")."""
    d = env.dirs("syntax-first")
    csv_path = write_rows(os.path.join(d, "t.csv"), ["uid", "region"], [{"uid": "u1", "region": "r"}])
    for sql, want in (("SELECT WITH ANONYMIZATION OPTIONS(epsilon=1, delta=1e-6) ANON_COUNT(*) FORM t", "'FORM'"),
                      ("SELECT WITH ANONYMIZATION OPTIONS(epsilon=1, delta=1e-6, Epsilon=2) ANON_COUNT(*) FROM t",
                       "epsilon")):
        out = os.path.join(d, "out")
        run = env.dp.run_with("query", sql, "--input", csv_path, "--user-column", "uid", "--out", out)
        assert run.returncode == 2 and want in run.stderr and "is required" not in run.stderr, run.describe()
        assert not os.path.exists(out), f"a refused query made {out}"


def main():
    args = harness.parse_args(__doc__)
    results = harness.Results(f"test_sql (ranks={args.ranks})")
    with harness.TempDir(args.keep, "dpstream-e2e-sql-") as tmp:
        env = Env(args, tmp)
        state = {}
        results.check("reference self-check (SipHash, ids, secret, fixed point)", ref.self_check)
        results.check("(a) exactness at a huge budget: every aggregate vs the reference",
                      lambda: check_exactness(env, state))
        results.check(f"(b) result.csv identical at {args.ranks} and {1 if args.ranks != 1 else 2} rank(s)",
                      lambda: check_rank_invariance(env, state))
        results.check("(c) noise scale: standardized errors have mean 0, variance 1",
                      lambda: check_noise_scale(env, state))
        results.check("(d) adversarial user changes at most k groups by the per-group bound",
                      lambda: check_adversary(env, state))
        results.check("(e) public groups: listed empty group released, unlisted never",
                      lambda: check_public_groups(env, state))
        results.check("(e) one-user groups never released (laplace, gaussian, magic; 30 seeds each)",
                      lambda: check_single_user_groups(env, state))
        results.check("value fields: signed decimals ('+7', '.5', '12.', '1e300' clamped; '1e400', 'nan' bad)",
                      lambda: check_number_syntax(env, state))
        results.check("(f) bad queries refused before reading data (exit 2, token named, no output)",
                      lambda: check_bad_queries(env, state))
        results.check("WHERE col IS NULL / IS NOT NULL against a direct count", lambda: check_is_null(env, state))
        results.check("options that would be ignored are refused (exit 2); OPTIONS(noise = 1) against --noise",
                      lambda: check_options_out_of_place(env, state))
        results.check("refused before a read: a header naming a column twice, /dev/zero as the input (exit 3)",
                      lambda: check_input_refusals(env, state))
        results.check("refused before a charge: an --out that cannot be made, --bad-rows fail, an --out in use; "
                      "a stop signal after the charge finishes the release",
                      lambda: check_output_refusals(env, state))
        results.check("refused before a charge: an --out that exists but cannot be written (as uid 65534 when root)",
                      lambda: check_unwritable_out(env, state))
        results.check("--growing / --target-error: existing outputs refused before the first run; a multi-line "
                      "alias and a non-UTF-8 --out finish", lambda: check_schedule_outputs(env, state))
        results.check("a link planted at an output's temporary file is not written through",
                      lambda: check_temporary_is_made_fresh(env, state))
        results.check("ANON_COUNT(col, U) of a text column counts its non-NULL rows",
                      lambda: check_count_of_text_column(env, state))
        results.check("a budget whose noise is beyond the samplers is refused by what to change",
                      lambda: check_budget_too_small(env, state))
        results.check("a syntax error is named before a missing --epsilon that OPTIONS(...) was to give",
                      lambda: check_syntax_error_before_required_options(env, state))
        results.check("skipped rows: the first one's line and reason on stderr (dates in --window-column)",
                      lambda: check_bad_rows_named(env, state))
        results.check("--growing and --target-error refuse 0, negative, NaN and infinite values (exit 2)",
                      lambda: check_bad_option_values(env, state))
        results.check("(g) windows: per-window and multi-window releases against the reference",
                      lambda: check_windows(env, state))
        results.check("(h) growing stream: schedule, budget weights and releases against the reference",
                      lambda: check_growing(env, state))
        results.check("(i) accuracy-targeted release: stopping rule and claim over seeded runs",
                      lambda: check_adaptive(env, state))
        results.check("--job FILE with a [query] table", lambda: check_job_spec(env, state))
        results.check("(g) ledger: a multi-window query charges each block; admissions match the block accounting",
                      lambda: check_ledger(env, state))
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
