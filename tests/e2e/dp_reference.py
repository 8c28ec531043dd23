#!/usr/bin/env python3
"""Independent plain-Python reference of dpstream's privacy plan (docs/PRIVACY.md), stdlib only.

Written from docs/PRIVACY.md, not from the C++ sources:

  zCDP -> (eps, delta), tight (Canonne, Kamath & Steinke 2020, Prop. 12 / Cor. 13):
      delta(rho, eps) = inf_{a>1} exp((a-1)(a rho - eps)) / (a-1) * (1 - 1/a)^a
    log of the bracket is convex in a; its minimiser is the root of
    (2a - 1) rho - eps + ln(1 - 1/a) = 0, found here by bisection on a.
    eps(rho, delta) = smallest eps with delta(rho, eps) <= delta;
    rho(eps, delta) = largest rho with delta(rho, eps) <= delta (both by bisection, safe end).
  simple (Bun & Steinke 2016): eps = rho + 2 sqrt(rho ln(1/delta)).

  split: eps_sel = eps * share_e, delta_sel = delta * share_d, eps_agg = eps - eps_sel,
         delta_agg = delta - delta_sel;
         beta (default) = delta_sel / (2 (e^eps_sel + 1) C T),
         delta_beta = (e^eps_sel + 1) C T beta, delta_conv = delta_sel - delta_beta (must be > 0);
  levels = floor(log2 T) + 1;
  key selection: rho_sel = rho(eps_sel, delta_conv), sigma_sel = sqrt(levels C / (2 rho_sel));
  aggregation:   rho_agg = rho(eps_agg, delta_agg),
                 sigma_col = C L_col sqrt(m levels / (2 rho_agg)), L_count = 1, L_sum = L;
  every sigma is what the exact sampler uses: sigma^2 rounded UP to n / 2^k, n in [2^51, 2^52);
  sum grid: the finest power-of-two multiple g of 2^-20 with sigma_sum <= 2^22 g (PRIVACY.md
    section 5 says "coarsest"; the example there, g = 2^-14 at sigma_sum = 250, is the finest);
    clamp bounds rounded to g (half away from zero), L = max |rounded bound|, sum noise drawn as
    sampler_sigma(sigma_sum / g) grid units;
  Honaker prefix variance factor v_s = sum over set bits j of s of 2^j / (2^(j+1) - 1);
  thresholds: lambda_s = sigma_sel sqrt(v_s),
              tau_s = lambda_s sqrt(2 ln(1/beta)) + popcount(s) 2^-20        ("subgaussian")
              tau_s = lambda_s Phi^-1(1 - beta) + popcount(s) 2^-20          ("gaussian-quantile");
  mu (when the job does not set it) = floor(min_s tau_s / 4);
  reported eps of each part = eps_tight(rho actually used, that part's conversion delta);
  total = basic composition of the two parts.

Usable as a library (tests import it) or from the command line, printing the plan as JSON:

  python3 dp_reference.py --epsilon 6 --delta 1e-9 --C 32 --T 100 [--count] [--sum] ...
  python3 dp_reference.py --self-test     # checks against ../shared/reference/*.json when present
"""

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from fractions import Fraction

FRAC_BITS = 20
SCALE = 1 << FRAC_BITS
SUM_GRID_MAX_SIGMA_UNITS = 2.0 ** 22  # sum noise: at most 2^22 grid steps
SAMPLER_MIN_SIGMA = 2.0 ** -10
SAMPLER_MAX_SIGMA = 2.0 ** 24


# ------------------------------------------------------------------------------------------------
# zCDP accounting


def _bisect(lo, hi, above):
    """Shrinks [lo, hi] with above(lo) False and above(hi) True until no float lies between."""
    for _ in range(2000):
        mid = lo + (hi - lo) / 2
        if mid <= lo or mid >= hi:
            break
        if above(mid):
            hi = mid
        else:
            lo = mid
    return lo, hi


def _log_bracket(a, rho, eps):
    """log of exp((a-1)(a rho - eps)) / (a-1) * (1 - 1/a)^a."""
    return (a - 1) * (a * rho - eps) - math.log(a - 1) + a * math.log1p(-1 / a)


def cks_delta(rho, eps):
    """delta(rho, eps) = inf_{a > 1} of the CKS bracket, clipped to [0, 1]."""
    if rho < 0 or eps < 0 or not math.isfinite(rho) or not math.isfinite(eps):
        raise ValueError(f"cks_delta: need finite rho, eps >= 0, got {rho}, {eps}")
    if rho == 0:
        return 0.0

    def slope_nonneg(a):  # d/da of the log bracket is (2a-1) rho - eps + ln(1 - 1/a), increasing
        return (2 * a - 1) * rho - eps + math.log1p(-1 / a) >= 0

    lo = 1.0 + 1e-12
    if slope_nonneg(lo):
        a = lo
    else:
        hi = 2.0
        while not slope_nonneg(hi):
            hi *= 2
        lo, a = _bisect(lo, hi, slope_nonneg)
    # Any a > 1 gives a valid bound: take the better of the two ends of the final bracket.
    best = min(_log_bracket(a, rho, eps), _log_bracket(lo, rho, eps) if lo > 1 else math.inf)
    return math.exp(min(best, 0.0))


def eps_simple(rho, delta):
    return rho + 2 * math.sqrt(rho * math.log(1 / delta))


def eps_tight(rho, delta):
    """Smallest eps >= 0 with cks_delta(rho, eps) <= delta (the safe, upper end)."""
    if not 0 < delta < 1:
        raise ValueError(f"eps_tight: delta must lie in (0, 1), got {delta}")
    if rho == 0 or cks_delta(rho, 0.0) <= delta:
        return 0.0
    hi = eps_simple(rho, delta)
    while cks_delta(rho, hi) > delta:
        hi *= 2
    return _bisect(0.0, hi, lambda e: cks_delta(rho, e) <= delta)[1]


def rho_tight(eps, delta):
    """Largest rho with cks_delta(rho, eps) <= delta (the safe, lower end)."""
    if not 0 < delta < 1:
        raise ValueError(f"rho_tight: delta must lie in (0, 1), got {delta}")
    hi = 1.0
    while cks_delta(hi, eps) <= delta:
        hi *= 2
    return _bisect(0.0, hi, lambda r: cks_delta(r, eps) > delta)[0]


def normal_upper_quantile(p):
    """z with P[N(0,1) > z] = p, by bisection on erfc (p well above 1e-300)."""
    if not 0 < p < 1:
        raise ValueError(f"normal_upper_quantile: p must lie in (0, 1), got {p}")
    tail = lambda z: 0.5 * math.erfc(z / math.sqrt(2))  # noqa: E731
    return _bisect(-40.0, 40.0, lambda z: tail(z) <= p)[1]


# ------------------------------------------------------------------------------------------------
# Trees, the sampler's sigma, fixed point


def levels(T):
    return T.bit_length()  # floor(log2 T) + 1 for T >= 1


def prefix_variance_factor(s):
    """Var(Honaker prefix [1, s]) / sigma^2 as a float."""
    return float(prefix_variance_fraction(s))


def prefix_variance_fraction(s):
    """Exact: sum over set bits j of s of 2^j / (2^(j+1) - 1)."""
    return sum((Fraction(1 << j, (1 << (j + 1)) - 1) for j in range(s.bit_length()) if s >> j & 1), Fraction(0))


def sampler_sigma(sigma):
    """The sigma an exact sampler uses for a requested sigma: sigma^2 rounded up to n / 2^k with
    n in [2^51, 2^52), then sqrt (correctly rounded). Always >= the request."""
    if not SAMPLER_MIN_SIGMA <= sigma <= SAMPLER_MAX_SIGMA:
        raise ValueError(f"sigma {sigma} outside the sampler's range [2^-10, 2^24]")
    s2 = Fraction(sigma) ** 2
    k = 51 - (s2.numerator.bit_length() - s2.denominator.bit_length())
    while True:
        scaled = s2 * (Fraction(2) ** k)
        n = -((-scaled.numerator) // scaled.denominator)  # ceil
        if n >= 1 << 52:
            k -= 1
        elif n < 1 << 51:
            k += 1
        else:
            break
    return math.sqrt(math.ldexp(float(n), -k))  # n < 2^53: n 2^-k is an exact double


def to_fixed(v):
    """v on the 2^-20 grid as an integer, ties away from zero (llround(v * 2^20))."""
    x = abs(v) * SCALE
    n = math.floor(x)
    if x - n >= 0.5:
        n += 1
    return n if v >= 0 else -n


def quantize(fixed, q):
    """fixed (2^-20 units) rounded to a multiple of q units, ties away from zero."""
    if q <= 1:
        return fixed
    n, r = divmod(abs(fixed), q)
    if 2 * r >= q:
        n += 1
    return n * q if fixed >= 0 else -n * q


# ------------------------------------------------------------------------------------------------
# The plan


class PlanRefused(Exception):
    """The job must be refused (exit code 2); the message says why."""


@dataclass
class Job:
    epsilon: float
    delta: float
    C: int
    T: int
    count: bool = True
    sum: bool = True
    clamp_min: float = 0.0
    clamp_max: float = 1.0
    mu: float = None  # None: the default floor(min_s tau_s / 4)
    beta: float = None  # None: the default
    selection_epsilon_share: float = 0.5
    selection_delta_share: float = 2.0 / 3.0
    threshold: str = "subgaussian"  # or "gaussian-quantile"


@dataclass
class Column:
    name: str
    sensitivity: float  # L2 per level, in the column's unit
    sigma_formula: float  # before the sampler's rounding
    sigma: float  # what the sampler uses, in the column's unit
    rho: float  # levels sensitivity^2 / (2 sigma^2)


@dataclass
class Plan:
    job: Job
    levels: int
    mu: float
    mu_defaulted: bool
    eps_sel: float
    delta_sel: float
    eps_agg: float
    delta_agg: float
    beta: float
    beta_defaulted: bool
    delta_beta: float
    delta_conv: float
    rho_sel_target: float
    sigma_sel_formula: float
    sigma_sel: float
    rho_sel: float
    rho_agg_target: float
    columns: list = field(default_factory=list)
    sum_grid: float = 2.0 ** -20
    sum_quantum: int = 1  # in 2^-20 units
    clamp_bound: float = 0.0
    tail_z: float = 0.0
    lam: list = field(default_factory=list)  # lam[s], s = 1..T (lam[0] unused)
    tau: list = field(default_factory=list)
    eps_sel_tight: float = 0.0
    eps_sel_simple: float = 0.0
    eps_agg_tight: float = 0.0
    eps_agg_simple: float = 0.0
    eps_total: float = 0.0
    delta_total: float = 0.0

    def column(self, name):
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)


def make_plan(job):
    """The plan of PRIVACY.md sections 5-7; PlanRefused for the refusals of section 7."""
    eps, delta, C, T = job.epsilon, job.delta, job.C, job.T
    if not eps > 0:
        raise PlanRefused("epsilon must be > 0")
    if not 0 < delta < 1:
        raise PlanRefused("delta must be in (0, 1)")
    if C < 1 or T < 1:
        raise PlanRefused("max_records_per_user and triggers must be >= 1")
    if not job.clamp_min <= job.clamp_max:
        raise PlanRefused("clamp_min must be <= clamp_max")
    if job.mu is not None and job.mu < 0:
        raise PlanRefused("mu must be >= 0")
    if job.beta is not None and not 0 < job.beta < 1:
        raise PlanRefused("beta must be in (0, 1)")
    for share in (job.selection_epsilon_share, job.selection_delta_share):
        if not 0 < share < 1:
            raise PlanRefused("shares must be in (0, 1)")
    if not (job.count or job.sum):
        raise PlanRefused("no column")
    lv = levels(T)
    eps_sel = eps * job.selection_epsilon_share
    delta_sel = delta * job.selection_delta_share
    eps_agg, delta_agg = eps - eps_sel, delta - delta_sel
    try:
        cost_per_beta = (math.exp(eps_sel) + 1) * C * T
    except OverflowError:
        raise PlanRefused(f"epsilon {eps} too large: (e^eps_sel + 1) C T overflows")
    beta_defaulted = job.beta is None
    beta = delta_sel / (2 * cost_per_beta) if beta_defaulted else job.beta
    delta_beta = cost_per_beta * beta
    delta_conv = delta_sel - delta_beta
    if not delta_conv > 0:
        raise PlanRefused(f"beta {beta} costs {delta_beta} >= delta_sel {delta_sel}")

    rho_sel_target = rho_tight(eps_sel, delta_conv)
    sigma_sel_formula = math.sqrt(lv * C / (2 * rho_sel_target))
    sigma_sel = sampler_sigma(sigma_sel_formula)
    rho_sel = lv * C / (2 * sigma_sel ** 2)

    rho_agg_target = rho_tight(eps_agg, delta_agg)
    m = int(job.count) + int(job.sum)

    def sigma_col(L):
        return C * L * math.sqrt(m * lv / (2 * rho_agg_target))

    plan = Plan(job=job, levels=lv, mu=job.mu, mu_defaulted=job.mu is None, eps_sel=eps_sel, delta_sel=delta_sel, eps_agg=eps_agg, delta_agg=delta_agg,
                beta=beta, beta_defaulted=beta_defaulted, delta_beta=delta_beta, delta_conv=delta_conv,
                rho_sel_target=rho_sel_target, sigma_sel_formula=sigma_sel_formula, sigma_sel=sigma_sel,
                rho_sel=rho_sel, rho_agg_target=rho_agg_target)
    if job.count:
        f = sigma_col(1.0)
        s = sampler_sigma(f)
        plan.columns.append(Column("count", float(C), f, s, lv * C * C / (2 * s * s)))
    if job.sum:
        lo, hi = to_fixed(job.clamp_min), to_fixed(job.clamp_max)
        L0 = max(abs(lo), abs(hi))
        if L0 == 0:
            raise PlanRefused("sum with clamp [0, 0]")
        sigma_units = sigma_col(L0 / SCALE) * SCALE  # in 2^-20 units
        q = 1
        while sigma_units / q > SUM_GRID_MAX_SIGMA_UNITS:
            q *= 2
        L = max(abs(quantize(lo, q)), abs(quantize(hi, q))) / SCALE
        grid = q / SCALE
        f = sigma_col(L)
        s_units = sampler_sigma(f / grid)
        s = s_units * grid
        plan.sum_quantum, plan.sum_grid, plan.clamp_bound = q, grid, L
        plan.columns.append(Column("sum", C * L, f, s, lv * (C * L) ** 2 / (2 * s * s)))

    if job.threshold == "subgaussian":
        plan.tail_z = math.sqrt(2 * math.log(1 / beta))
    elif job.threshold == "gaussian-quantile":
        plan.tail_z = normal_upper_quantile(beta)
    else:
        raise PlanRefused(f"unknown threshold {job.threshold}")
    plan.lam = [0.0] * (T + 1)
    plan.tau = [0.0] * (T + 1)
    for s in range(1, T + 1):
        plan.lam[s] = sigma_sel * math.sqrt(prefix_variance_factor(s))
        plan.tau[s] = plan.lam[s] * plan.tail_z + bin(s).count("1") / SCALE
    if plan.mu_defaulted:
        plan.mu = float(math.floor(min(plan.tau[1:]) / 4))

    rho_agg_used = sum(c.rho for c in plan.columns)
    plan.eps_sel_tight = eps_tight(rho_sel, delta_conv)
    plan.eps_sel_simple = eps_simple(rho_sel, delta_conv)
    plan.eps_agg_tight = eps_tight(rho_agg_used, delta_agg)
    plan.eps_agg_simple = eps_simple(rho_agg_used, delta_agg)
    plan.eps_total = plan.eps_sel_tight + plan.eps_agg_tight
    plan.delta_total = delta_conv + delta_beta + delta_agg
    return plan


# ------------------------------------------------------------------------------------------------
# Discrete Gaussian


def discrete_gaussian_pmf(sigma, ymax=None):
    """{y: P[Y = y]} of N_Z(0, sigma^2) on |y| <= ymax (default 14 sigma + 2; the rest < 1e-40)."""
    if ymax is None:
        ymax = int(14 * sigma) + 2
    w = {y: math.exp(-y * y / (2 * sigma * sigma)) for y in range(-ymax, ymax + 1)}
    z = math.fsum(w.values())
    return {y: v / z for y, v in w.items()}


def discrete_gaussian_upper_tail(sigma, x):
    """P[Y > x] for Y ~ N_Z(0, sigma^2), x real."""
    pmf = discrete_gaussian_pmf(sigma)
    return math.fsum(p for y, p in pmf.items() if y > x)


def discrete_gaussian_variance(sigma):
    """E[Y^2] for Y ~ N_Z(0, sigma^2). By Poisson summation it differs from sigma^2 by a relative
    O(sigma^2 exp(-2 pi^2 sigma^2)) (below 1e-300 from sigma = 10), so large sigmas return sigma^2."""
    if sigma >= 10:
        return sigma * sigma
    pmf = discrete_gaussian_pmf(sigma)
    return math.fsum(y * y * p for y, p in pmf.items())


# ------------------------------------------------------------------------------------------------
# Self test against the shared reference values (mpmath, 50 digits) and PRIVACY.md's examples


def self_test(reference_dir):
    problems = []

    def close(label, got, want, rel):
        if not abs(got - want) <= rel * abs(want):
            problems.append(f"{label}: got {got!r}, want {want!r} (rel {rel})")

    # Honaker prefix variances (PRIVACY.md section 4; shared honaker_variance.json text).
    want = ["1", "2/3", "5/3", "4/7", "11/7", "26/21", "47/21", "8/15", "23/15", "6/5", "11/5", "116/105",
            "221/105", "62/35", "97/35", "16/31"]
    for i, w in enumerate(want, start=1):
        if prefix_variance_fraction(i) != Fraction(w):
            problems.append(f"prefix variance factor {i}: {prefix_variance_fraction(i)} != {w}")
    for T, lv in ((1, 1), (2, 2), (7, 3), (8, 4), (16, 5), (100, 7), (1000, 10)):
        if levels(T) != lv:
            problems.append(f"levels({T}) = {levels(T)}, want {lv}")
    # The sampler's sigma: >= the request, relative excess < 2^-50.
    for s in (2.0 ** -10, 0.3, 1.0, 16.156352875228205, 250.0, 12345.678, 2.0 ** 24):
        got = sampler_sigma(s)
        if not (got >= s and got / s - 1 < 2.0 ** -50):
            problems.append(f"sampler_sigma({s}) = {got!r}")
    # Fixed-point rounding.
    for v, q, want_fixed in ((0.5, 1, SCALE // 2), (-0.5 / SCALE, 1, -1), (1.0, 64, SCALE),
                             (3 * 2.0 ** -15, 64, 64 * 2), (-3 * 2.0 ** -15, 64, -64 * 2)):
        got = quantize(to_fixed(v), q)
        if got != want_fixed:
            problems.append(f"quantize(to_fixed({v}), {q}) = {got}, want {want_fixed}")
    # Discrete Gaussian variance is just below sigma^2 (and equal to it at sigma >= 2 to 1e-15).
    for s in (0.5, 1.0, 2.0, 10.0):
        v = discrete_gaussian_variance(s)
        if not v <= s * s * (1 + 1e-12):
            problems.append(f"discrete Gaussian variance at sigma {s}: {v} > sigma^2")
        if s >= 2 and abs(v / (s * s) - 1) > 1e-12:
            problems.append(f"discrete Gaussian variance at sigma {s}: {v}")
    # PRIVACY.md section 6 example: beta = 4.9e-15 for eps = 6, delta = 1e-9, C = 32, T = 100.
    plan = make_plan(Job(epsilon=6, delta=1e-9, C=32, T=100))
    close("PRIVACY.md beta example", plan.beta, 4.9e-15, 0.01)
    # PRIVACY.md section 5: the default mu is 45 users at the paper's budget, T = 100 (tau_1 = 254).
    if plan.mu != 45 or not plan.mu_defaulted:
        problems.append(f"default mu at the paper's budget: {plan.mu}, PRIVACY.md says 45")
    close("PRIVACY.md tau_1 example", plan.tau[1], 254, 0.005)
    # PRIVACY.md section 5: sigma_sum = 250 and g = 2^-14 at the paper's parameters, clamp [0, 1].
    close("PRIVACY.md sigma_sum example", plan.column("sum").sigma, 250, 0.005)
    if plan.sum_grid != 2.0 ** -14:
        problems.append(f"sum grid at the paper's parameters: {plan.sum_grid}, PRIVACY.md says 2^-14")
    # Normal quantile sanity.
    close("Phi^-1(1 - 0.025)", normal_upper_quantile(0.025), 1.959963984540054, 1e-12)
    close("Phi^-1(1 - 1e-15)", normal_upper_quantile(1e-15), 7.941345326170997, 1e-9)

    path = os.path.join(reference_dir, "zcdp_conversion.json")
    checked_shared = False
    if os.path.isfile(path):
        checked_shared = True
        with open(path, encoding="utf-8") as f:
            ref = json.load(f)
        for r in ref["eps_given_rho"]:
            close(f"eps_tight(rho={r['rho']}, delta={r['delta']})", eps_tight(r["rho"], r["delta"]), r["eps_cks"], 1e-12)
            close(f"eps_simple(rho={r['rho']}, delta={r['delta']})", eps_simple(r["rho"], r["delta"]),
                  r["eps_simple"], 1e-12)
        for r in ref["rho_given_eps"]:
            close(f"rho_tight(eps={r['eps']}, delta={r['delta']})", rho_tight(r["eps"], r["delta"]), r["rho_cks"], 1e-12)
            d = cks_delta(rho_tight(r["eps"], r["delta"]), r["eps"])
            if d > r["delta"]:
                problems.append(f"cks_delta(rho_tight({r['eps']}, {r['delta']})) = {d} > delta")
    return problems, checked_shared


def plan_dict(plan):
    """The plan as plain data (for the command line)."""
    out = {k: v for k, v in plan.__dict__.items() if k not in ("job", "columns", "lam", "tau")}
    out["columns"] = [c.__dict__ for c in plan.columns]
    out["thresholds"] = [{"step": s, "lambda": plan.lam[s], "tau": plan.tau[s]} for s in range(1, plan.job.T + 1)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--reference-dir", default=os.path.normpath(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "reference")))
    ap.add_argument("--epsilon", type=float)
    ap.add_argument("--delta", type=float)
    ap.add_argument("--C", type=int)
    ap.add_argument("--T", type=int)
    ap.add_argument("--count", action="store_true")
    ap.add_argument("--sum", action="store_true")
    ap.add_argument("--clamp-min", type=float, default=0.0)
    ap.add_argument("--clamp-max", type=float, default=1.0)
    ap.add_argument("--mu", type=float, default=None)
    ap.add_argument("--beta", type=float)
    ap.add_argument("--selection-epsilon-share", type=float, default=0.5)
    ap.add_argument("--selection-delta-share", type=float, default=2.0 / 3.0)
    ap.add_argument("--threshold", default="subgaussian")
    a = ap.parse_args()
    if a.self_test:
        problems, shared = self_test(a.reference_dir)
        for p in problems:
            print("FAIL", p)
        print(f"dp_reference self-test: {len(problems)} problem(s)"
              + ("" if shared else f" (shared reference values not found in {a.reference_dir})"))
        return 1 if problems else 0
    if None in (a.epsilon, a.delta, a.C, a.T):
        ap.error("--epsilon, --delta, --C and --T are required (or --self-test)")
    job = Job(epsilon=a.epsilon, delta=a.delta, C=a.C, T=a.T, count=a.count or not a.sum, sum=a.sum or not a.count,
              clamp_min=a.clamp_min, clamp_max=a.clamp_max, mu=a.mu, beta=a.beta,
              selection_epsilon_share=a.selection_epsilon_share, selection_delta_share=a.selection_delta_share,
              threshold=a.threshold)
    print(json.dumps(plan_dict(make_plan(job)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
