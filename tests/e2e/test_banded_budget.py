#!/usr/bin/env python3
"""End-to-end test of the banded-inverse counters' plan (docs/PRIVACY.md section 5) against an
independent computation in exact rational arithmetic (Python fractions).

For jobs with selection_counter = value_counter = "banded" over T = 1, 7, 100 and 1000 triggers, band
widths 1, 4 and 8, C = 1 and 32, count and sum, both threshold tails, `dpstream budget --json
--thresholds` must satisfy, from the band it prints (m_k, multiples of 2^-30, exact in a double):
  * ||C e_1||^2 = sum_{k<T} c_k^2 with c the power-series inverse of the band, computed exactly: the
    engine's value is an upper bound within 1e-8 relative;
  * every partial sum M_j >= 0 (the thresholds' union bound needs a monotone prefix noise);
  * key selection: sigma = sqrt(C ||C e_1||^2 / (2 rho_sel)) rounded up to a multiple of 2^-32 (by less
    than 2^-32), rho_sel = C ||C e_1||^2 / (2 sigma^2) <= the share of rho it was given;
  * lambda_s = sigma sqrt(sum_{j<s} M_j^2) (exact) and tau_s = lambda_s z + 2^-20 at every step;
  * columns: sigma = C L ||C e_1|| sqrt(m / (2 rho_agg)) rounded up likewise, rho = (C L)^2 ||C e_1||^2 / (2 sigma^2);
  * the total within the budget, and the threshold tail reported as proven.
The default is banded counters of band 8; with trees the budget has no band and reports levels(T).

Usage: test_banded_budget.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import json
import math
import os
import sys
from fractions import Fraction

import harness

REL = 1e-9
GRID_SIGMA = Fraction(1, 2**32)


def job(T, b, C, tail, aggregations):
    return f"""[job]
name = "banded-budget"
[input]
kind = "synthetic"
users = 1000
keys = 100
[stream]
window_seconds = 86400
triggers = {T}
[privacy]
mode = "dp"
max_records_per_user = {C}
epsilon = 6.0
delta = 1e-9
clamp_min = -1.0
clamp_max = 2.0
threshold = "{tail}"
selection_counter = "banded"
value_counter = "banded"
counter_band = {b}
[query]
aggregations = {json.dumps(aggregations)}
"""


def inverse_norm2(band, T):
    """sum_{k<T} c_k^2, c = 1 / m(x) as a power series, exactly."""
    c, total = [], Fraction(0)
    for k in range(T):
        v = Fraction(1 if k == 0 else 0)
        for i in range(1, min(len(band), k + 1)):
            v -= band[i] * c[k - i]
        c.append(v)
        total += v * v
    return total


def close(got, want, rel=REL):
    return abs(got - want) <= rel * max(abs(want), 1e-300)


def check_plan(j, T, b, C, aggregations):
    counters = j["counters"]
    assert (counters["selection"], counters["values"]) == ("banded", "banded"), counters
    band = [Fraction(x) for x in counters["band"]]
    assert len(band) == b and band[0] == 1, band
    assert all((x * 2**30).denominator == 1 for x in band), "band off the 2^-30 grid"
    M, acc = [], Fraction(0)
    for x in band:
        acc += x
        M.append(acc)
    assert all(m >= 0 for m in M), f"a partial sum of the band is negative: {M}"
    exact = inverse_norm2(band, T)
    norm2 = counters["band_sensitivity_squared"]
    assert norm2 >= float(exact) * (1 - 1e-15) and close(norm2, float(exact), 1e-8), (norm2, float(exact))

    ks = j["key_selection"]
    sel = ks["tree"]
    rho_sel_target = j["total"]["rho"] * 0.5  # one zCDP ledger, selection share 0.5
    formula = math.sqrt(C * norm2 / (2 * rho_sel_target))
    sigma = sel["sigma"]
    assert (Fraction(sigma) / GRID_SIGMA).denominator == 1, f"sigma {sigma} off the 2^-32 grid"
    assert formula <= sigma < formula + 2**-32 + formula * 1e-15, (sigma, formula)
    assert close(sel["rho"], C * norm2 / (2 * sigma * sigma)), (sel["rho"], C * norm2 / (2 * sigma * sigma))
    assert sel["rho"] <= rho_sel_target * (1 + 1e-12), (sel["rho"], rho_sel_target)

    rows = ks["thresholds"]
    assert len(rows) == T
    z = ks["tail_z"]
    sq = Fraction(0)
    for s, row in enumerate(rows, start=1):
        sq += M[min(s - 1, b - 1)] ** 2
        lam = sigma * math.sqrt(float(sq))
        assert close(row["lambda"], lam), (s, row["lambda"], lam)
        assert close(row["tau"], lam * z + 2**-20), (s, row["tau"], lam * z + 2**-20)

    ag = j["aggregation"]
    m = len(aggregations)
    assert len(ag["columns"]) == m
    for col in ag["columns"]:
        L = 1.0 if col["name"] == "count" else ag["clamp_bound"]
        quantum = 1.0 if col["name"] == "count" else ag["sum_grid"]
        want = C * L * math.sqrt(norm2) * math.sqrt(m / (2 * ag["rho"]))
        # the sum's sigma is rounded on its grid (sigma / quantum on the 2^-32 grid)
        got = col["sigma"]
        assert want <= got * (1 + 1e-12) and got <= want + quantum * 2**-32 + want * 1e-12, (col["name"], got, want)
        assert close(col["rho"], (C * L) ** 2 * norm2 / (2 * got * got)), col
    assert j["total"]["within_budget"] and j["total"]["epsilon"] <= 6 * (1 + 1e-9)
    assert j["threshold_proven"] is True


def main():
    args = harness.parse_args(__doc__.splitlines()[0])
    dp = harness.Dpstream(args)
    results = harness.Results("e2e banded budget")
    with harness.TempDir(args.keep, "dpstream-banded-budget-") as tmp:
        cases = [(1, 8, 32, "subgaussian", ["count"]), (7, 4, 1, "subgaussian", ["count", "sum"]),
                 (100, 8, 32, "gaussian-quantile", ["count"]), (100, 1, 32, "subgaussian", ["sum"]),
                 (1000, 8, 32, "subgaussian", ["count", "sum"])]
        for T, b, C, tail, aggs in cases:
            def case(T=T, b=b, C=C, tail=tail, aggs=aggs):
                path = os.path.join(tmp, f"job-{T}-{b}-{C}.toml")
                harness.write_job(path, job(T, b, C, tail, aggs))
                r = dp.run_with("budget", path, "--json", "--thresholds", ranks=1)
                assert r.returncode == 0, r.describe()
                check_plan(json.loads(r.stdout), T, b, C, aggs)
            results.check(f"T = {T}, b = {b}, C = {C}, {tail}, {'+'.join(aggs)}: the plan matches exact arithmetic", case)

        def defaults_and_trees():
            banded = job(100, 8, 32, "subgaussian", ["count"])
            spelled = 'selection_counter = "banded"\nvalue_counter = "banded"\ncounter_band = 8\n'
            plans = {}
            for label, text in (("explicit", banded), ("default", banded.replace(spelled, "")),
                                ("tree", banded.replace(spelled, 'selection_counter = "tree"\nvalue_counter = "tree"\n'))):
                path = os.path.join(tmp, f"{label}.toml")
                harness.write_job(path, text)
                r = dp.run_with("budget", path, "--json", ranks=1)
                assert r.returncode == 0, r.describe()
                plans[label] = json.loads(r.stdout)
            assert plans["default"] == plans["explicit"], "the default must be banded counters of band 8"
            c = plans["tree"]["counters"]
            assert (c["selection"], c["values"], c["band"]) == ("tree", "tree", []), c
            assert plans["tree"]["trees"]["levels"] == 7
        results.check("default: banded counters, b = 8; trees when asked, with no band", defaults_and_trees)
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
