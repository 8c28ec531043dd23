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
  mu (when the job does not set it) = floor(min_s tau_s / 24);
  reported eps of each part = eps_tight(rho actually used, that part's conversion delta);
  total = basic composition of the two parts.

  That is [privacy] composition = "basic" (the seed's split). composition = "zcdp" (the default,
  PRIVACY.md section 7) keeps one zCDP ledger for the whole mechanism:
         beta (default) = delta_sel / (2 (e^eps + 1) C T)       (e^eps with the TOTAL eps),
         delta_beta = (e^eps + 1) C T beta (must stay < delta_sel),
         rho_total = rho(eps, delta - delta_beta), rho_sel = rho_total share_e, rho_agg = rho_total - rho_sel;
         sigmas, columns, tau, lambda, mu as above from rho_sel and rho_agg;
         total eps = eps_tight(rho_sel_used + rho_agg_used, delta - delta_beta), total delta = delta.
         (eps_sel, delta_sel, delta_conv = delta_sel - delta_beta, eps_agg, delta_agg and the per-part
         eps_tight/eps_simple are still reported, for information.)

  Baselines (mode "baseline-repeated" / "baseline-batch", PRIVACY.md section 8), levels = 1, mu = 0:
    composition "zcdp": releases R = T (repeated) or 1 (batch), keys K = T C or C;
         delta_thr = delta share_d, delta_conv = delta - delta_thr, rho_total = rho(eps, delta_conv),
         rho_release = rho_total / R, tail = delta_thr / K;
         total eps = eps_tight(R rho_release_used, delta_conv), total delta = delta_conv + delta_thr.
    composition "optimal": delta0 = 1 - (1 - delta/2)^(1/T); eps0 = largest eps0 with
         OCT_T(eps0, delta0)(eps) <= delta (bisection below); delta0_thr = delta0 share_d,
         delta_conv = delta0 - delta0_thr, rho_release = rho(eps0, delta_conv), tail = delta0_thr / C
         (K = T C and delta_thr = T delta0_thr reported); total eps = eps, total delta =
         OCT_T(eps_tight(rho_release_used, delta_conv), delta0)(eps).
    both: rho_thr = rho_release share_e, sigma_thr = sampler(sqrt(C / (2 rho_thr))), columns as above
         with levels = 1 and rho_agg = rho_release - rho_thr, tau = 1 + sigma_thr sqrt(2 ln(1/tail))
         ("subgaussian") or 1 + sigma_thr Phi^-1(1 - tail) ("gaussian-quantile").

  Optimal composition of k (eps0, delta0) mechanisms (Kairouz, Oh & Viswanath 2015; Murtagh &
  Vadhan 2016, Thm 1.5):
    OCT_k(eps0, delta0)(eps) = 1 - (1 - delta0)^k (1 - D),
    D = sum_{l=0}^{k} C(k, l) max(0, e^{(k-l) eps0} - e^{eps + l eps0}) / (1 + e^{eps0})^k;
  evaluated here in floating point in log space (oct_delta) and, as a check, in 60-digit decimal
  arithmetic with exact binomials (oct_delta_decimal).

Usable as a library (tests import it) or from the command line, printing the plan as JSON:

  python3 dp_reference.py --epsilon 6 --delta 1e-9 --C 32 --T 100 [--count] [--sum] ...
          [--mode dp|baseline-repeated|baseline-batch] [--composition zcdp|basic|optimal]
  python3 dp_reference.py --self-test     # checks against tests/reference/*.json
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
# Optimal composition (Kairouz, Oh & Viswanath 2015; Murtagh & Vadhan 2016, Thm 1.5)


def _oct_check(eps0, delta0, k, eps):
    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"optimal composition: k must be an integer >= 1, got {k!r}")
    for name, v in (("eps0", eps0), ("eps", eps)):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"optimal composition: {name} must be finite and >= 0, got {v!r}")
    if not 0 <= delta0 < 1:
        raise ValueError(f"optimal composition: delta0 must lie in [0, 1), got {delta0!r}")


_LOG_BINOMIALS = {}


def _log_binomials(k):
    """[ln C(k, l) for l = 0..k], from the exact integers (cached per k)."""
    if k not in _LOG_BINOMIALS:
        out, c = [], 1
        for l in range(k + 1):
            out.append(math.log(c))
            c = c * (k - l) // (l + 1)
        _LOG_BINOMIALS[k] = out
    return _LOG_BINOMIALS[k]


def oct_sum(eps0, k, eps):
    """D = sum_l C(k, l) max(0, e^{(k-l) eps0} - e^{eps + l eps0}) / (1 + e^{eps0})^k, in floating point.

    Term l is positive iff (k - 2l) eps0 > eps; it is written as
      exp(ln C(k, l) + (k - l) eps0 - k ln(1 + e^{eps0})) * (1 - e^{eps - (k - 2l) eps0})
    (the binomial's log from the exact integer), so nothing overflows and each term has a relative
    error of a few ulps times the size of the exponent."""
    _oct_check(eps0, 0.0, k, eps)
    if eps0 == 0:
        return 0.0
    log_norm = k * (eps0 + math.log1p(math.exp(-eps0)))  # k ln(1 + e^eps0)
    log_comb = _log_binomials(k)
    terms = []
    for l in range(k + 1):
        gap = (k - 2 * l) * eps0 - eps
        if not gap > 0:
            break  # gap decreases with l
        log_term = log_comb[l] + (k - l) * eps0 - log_norm
        terms.append(math.exp(log_term) * -math.expm1(-gap))
    return math.fsum(terms)


def oct_delta(eps0, delta0, k, eps):
    """delta of the k-fold (adaptive) composition of (eps0, delta0)-DP mechanisms at eps."""
    _oct_check(eps0, delta0, k, eps)
    d = oct_sum(eps0, k, eps)
    if d >= 1:
        return 1.0
    # 1 - (1 - delta0)^k (1 - D), without cancellation.
    return min(1.0, -math.expm1(k * math.log1p(-delta0) + math.log1p(-d)))


def oct_delta_decimal(eps0, delta0, k, eps, digits=60):
    """The same curve evaluated literally: every double input taken at its exact binary value,
    exact integer binomials, `digits`-digit decimal exponentials. Returns a Decimal."""
    from decimal import Decimal, localcontext
    _oct_check(eps0, delta0, k, eps)
    with localcontext() as ctx:
        ctx.prec = digits
        ctx.Emax, ctx.Emin = 10 ** 9, -10 ** 9
        e0, ee, d0 = Decimal(eps0), Decimal(eps), Decimal(delta0)
        total = Decimal(0)
        for l in range(k + 1):
            t = ((k - l) * e0).exp() - (ee + l * e0).exp()
            if not t > 0:
                break  # the difference decreases with l: every later term is <= 0 too
            total += math.comb(k, l) * t
        return 1 - (1 - d0) ** k * (1 - total / (1 + e0.exp()) ** k)


def oct_delta_discrete_decimal(eps0, delta0, k, i, digits=60):
    """KOV 2015 Thm 3.3 at eps = (k - 2i) eps0 (the closed form over l < i), as a Decimal."""
    from decimal import Decimal, localcontext
    with localcontext() as ctx:
        ctx.prec = digits
        ctx.Emax, ctx.Emin = 10 ** 9, -10 ** 9
        e = Decimal(eps0).exp()
        s = sum((math.comb(k, l) * (e ** (k - l) - e ** (k - 2 * i + l)) for l in range(i)), Decimal(0))
        return 1 - (1 - Decimal(delta0)) ** k * (1 - s / (1 + e) ** k)


def oct_delta0(delta, T):
    """The paper's per-release delta0: (1 - delta0)^T = 1 - delta / 2."""
    return -math.expm1(math.log1p(-delta / 2) / T)


def oct_eps0(eps, delta, delta0, k):
    """Largest eps0 with oct_delta(eps0, delta0, k, eps) <= delta (bisection, the safe lower end).
    The curve increases with eps0 and is (1 - (1 - delta0)^k) at eps0 = 0."""
    if not oct_delta(0.0, delta0, k, eps) <= delta:
        raise ValueError(f"optimal composition: even eps0 = 0 spends more than delta = {delta} (delta0 {delta0}, k {k})")
    hi = max(eps, 1.0)
    while oct_delta(hi, delta0, k, eps) <= delta:
        hi *= 2
    return _bisect(0.0, hi, lambda e0: oct_delta(e0, delta0, k, eps) > delta)[0]


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


DP_MODES = ("dp",)
BASELINE_MODES = ("baseline-repeated", "baseline-batch")
COMPOSITIONS = {"dp": ("zcdp", "basic"), "baseline-repeated": ("zcdp", "optimal"),
                "baseline-batch": ("zcdp", "optimal")}


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
    mu: float = None  # None: the default floor(min_s tau_s / 24) (mode dp only)
    beta: float = None  # None: the default (mode dp only)
    selection_epsilon_share: float = 0.5
    selection_delta_share: float = 2.0 / 3.0
    threshold: str = "subgaussian"  # or "gaussian-quantile"
    mode: str = "dp"  # or "baseline-repeated", "baseline-batch"
    composition: str = "zcdp"  # the engine's default; "basic" (dp) or "optimal" (baselines)


@dataclass
class Column:
    name: str
    sensitivity: float  # L2 per level, in the column's unit
    sigma_formula: float  # before the sampler's rounding
    sigma: float  # what the sampler uses, in the column's unit
    rho: float  # levels sensitivity^2 / (2 sigma^2)


class _Columns:
    def column(self, name):
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)


@dataclass
class Plan(_Columns):
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
    delta_conv: float  # delta_sel - delta_beta (basic: key selection's conversion delta)
    rho_sel_target: float
    sigma_sel_formula: float
    sigma_sel: float
    rho_sel: float
    rho_agg_target: float
    composition: str = "basic"
    rho_total: float = 0.0  # zcdp: rho(eps, delta - delta_beta), the ledger's target
    delta_ledger: float = 0.0  # zcdp: delta - delta_beta (the one conversion's delta)
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


@dataclass
class BaselinePlan(_Columns):
    """One release's noise and threshold, and the accounting over the T releases (PRIVACY.md 8)."""
    job: Job
    composition: str
    releases_composed: int  # zcdp: T (repeated) or 1 (batch); optimal: T
    keys_per_user: float  # zcdp: T C or C; optimal: T C
    delta_threshold: float  # zcdp: share_d delta; optimal: T delta0_thr (reported)
    delta_conversion: float  # zcdp: delta - delta_thr; optimal: delta0 - delta0_thr
    tail: float  # per key and release
    rho_total: float = 0.0  # zcdp: rho(eps, delta_conv), the ledger over all releases (target)
    delta0: float = 0.0  # optimal only (0 with zcdp, as the engine reports)
    eps0: float = 0.0
    delta0_threshold: float = 0.0
    rho_release_target: float = 0.0
    rho_thr_target: float = 0.0
    rho_agg_target: float = 0.0
    sigma_thr_formula: float = 0.0
    sigma_thr: float = 0.0
    rho_thr: float = 0.0  # C / (2 sigma_thr^2)
    columns: list = field(default_factory=list)
    sum_grid: float = 2.0 ** -20
    sum_quantum: int = 1
    clamp_bound: float = 0.0
    tail_z: float = 0.0
    tau: float = 0.0
    levels: int = 1
    mu: float = 0.0
    rho_release_used: float = 0.0  # rho_thr + the columns' rho
    rho_total_used: float = 0.0  # releases_composed rho_release_used
    eps0_used: float = 0.0  # optimal: eps_tight(rho_release_used, delta_conv)
    eps_total: float = 0.0
    delta_total: float = 0.0


def _check_common(job):
    if job.mode not in DP_MODES + BASELINE_MODES:
        raise PlanRefused(f"mode {job.mode!r} has no privacy plan")
    if job.composition not in COMPOSITIONS[job.mode]:
        raise PlanRefused(f"composition {job.composition!r} is not available with mode {job.mode!r} "
                          f"(use one of {COMPOSITIONS[job.mode]})")
    if not job.epsilon > 0:
        raise PlanRefused("epsilon must be > 0")
    if not 0 < job.delta < 1:
        raise PlanRefused("delta must be in (0, 1)")
    if job.C < 1 or job.T < 1:
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
    if job.threshold not in ("subgaussian", "gaussian-quantile"):
        raise PlanRefused(f"unknown threshold {job.threshold}")


def _tail_z(job, p):
    if not 0 < p < 1:
        raise PlanRefused(f"tail probability {p} outside (0, 1)")
    return math.sqrt(2 * math.log(1 / p)) if job.threshold == "subgaussian" else normal_upper_quantile(p)


def _sampler(sigma, what):
    try:
        return sampler_sigma(sigma)
    except ValueError as e:
        raise PlanRefused(f"{what}: {e}")


def _add_columns(job, plan, lv, rho_agg_target):
    """Count and sum noise: sigma_col = C L_col sqrt(m lv / (2 rho_agg)); the sum grid (section 5)."""
    C = job.C
    m = int(job.count) + int(job.sum)

    def sigma_col(L):
        return C * L * math.sqrt(m * lv / (2 * rho_agg_target))

    if job.count:
        f = sigma_col(1.0)
        s = _sampler(f, "count")
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
        if L == 0 or grid > (job.clamp_max - job.clamp_min) / 100:
            raise PlanRefused(f"sum grid {grid} coarser than 1% of the clamp range")
        f = sigma_col(L)
        s_units = _sampler(f / grid, "sum")
        s = s_units * grid
        plan.sum_quantum, plan.sum_grid, plan.clamp_bound = q, grid, L
        plan.columns.append(Column("sum", C * L, f, s, lv * (C * L) ** 2 / (2 * s * s)))


def make_plan(job):
    """The plan of PRIVACY.md sections 5-8 (a Plan for mode dp, a BaselinePlan for the baselines);
    PlanRefused for the refusals of sections 7-8."""
    _check_common(job)
    if job.mode in BASELINE_MODES:
        return make_baseline_plan(job)
    eps, delta, C, T = job.epsilon, job.delta, job.C, job.T
    one_ledger = job.composition == "zcdp"
    lv = levels(T)
    eps_sel = eps * job.selection_epsilon_share
    delta_sel = delta * job.selection_delta_share
    eps_agg, delta_agg = eps - eps_sel, delta - delta_sel
    try:
        # Theorem 3.1's coupling charges (e^eps' + 1) C T beta with eps' the eps of the mechanism
        # without thresholds: key selection alone (basic) or everything (zcdp).
        cost_per_beta = (math.exp(eps if one_ledger else eps_sel) + 1) * C * T
    except OverflowError:
        raise PlanRefused(f"epsilon {eps} too large: (e^eps + 1) C T overflows")
    beta_defaulted = job.beta is None
    beta = delta_sel / (2 * cost_per_beta) if beta_defaulted else job.beta
    if not beta > 0:
        raise PlanRefused(f"epsilon {eps} too large: no usable beta")
    delta_beta = cost_per_beta * beta
    delta_conv = delta_sel - delta_beta
    if not delta_conv > 0:
        raise PlanRefused(f"beta {beta} costs {delta_beta} >= delta_sel {delta_sel}")

    if one_ledger:
        delta_ledger = delta - delta_beta
        rho_total = rho_tight(eps, delta_ledger)
        rho_sel_target = rho_total * job.selection_epsilon_share
        rho_agg_target = rho_total - rho_sel_target
    else:
        delta_ledger = rho_total = 0.0
        rho_sel_target = rho_tight(eps_sel, delta_conv)
        rho_agg_target = rho_tight(eps_agg, delta_agg)
    sigma_sel_formula = math.sqrt(lv * C / (2 * rho_sel_target))
    sigma_sel = _sampler(sigma_sel_formula, "key selection")
    rho_sel = lv * C / (2 * sigma_sel ** 2)

    plan = Plan(job=job, levels=lv, mu=job.mu, mu_defaulted=job.mu is None, eps_sel=eps_sel, delta_sel=delta_sel,
                eps_agg=eps_agg, delta_agg=delta_agg, beta=beta, beta_defaulted=beta_defaulted, delta_beta=delta_beta,
                delta_conv=delta_conv, rho_sel_target=rho_sel_target, sigma_sel_formula=sigma_sel_formula,
                sigma_sel=sigma_sel, rho_sel=rho_sel, rho_agg_target=rho_agg_target, composition=job.composition,
                rho_total=rho_total, delta_ledger=delta_ledger)
    _add_columns(job, plan, lv, rho_agg_target)

    plan.tail_z = _tail_z(job, beta)
    plan.lam = [0.0] * (T + 1)
    plan.tau = [0.0] * (T + 1)
    for s in range(1, T + 1):
        plan.lam[s] = sigma_sel * math.sqrt(prefix_variance_factor(s))
        plan.tau[s] = plan.lam[s] * plan.tail_z + bin(s).count("1") / SCALE
    if plan.mu_defaulted:
        plan.mu = float(math.floor(min(plan.tau[1:]) / 24))

    rho_agg_used = sum(c.rho for c in plan.columns)
    plan.eps_sel_tight = eps_tight(rho_sel, delta_conv)
    plan.eps_sel_simple = eps_simple(rho_sel, delta_conv)
    plan.eps_agg_tight = eps_tight(rho_agg_used, delta_agg)
    plan.eps_agg_simple = eps_simple(rho_agg_used, delta_agg)
    if one_ledger:
        plan.eps_total = eps_tight(rho_sel + rho_agg_used, delta_ledger)
        plan.delta_total = delta_ledger + delta_beta
    else:
        plan.eps_total = plan.eps_sel_tight + plan.eps_agg_tight
        plan.delta_total = delta_conv + delta_beta + delta_agg
    if plan.eps_total > eps * (1 + 1e-9) or plan.delta_total > delta * (1 + 1e-9):
        raise PlanRefused(f"over budget: ({plan.eps_total}, {plan.delta_total})")
    return plan


def make_baseline_plan(job, eps0=None):
    """PRIVACY.md section 8: one release = Gaussian thresholding of the user count (L2 sqrt(C)) and the
    columns' Gaussian noise (one level); thresholding is delta-approximate zCDP with delta = keys x tail.
    With composition "optimal", `eps0` replaces the bisection's (to follow another implementation's
    eps0 through the rest of the plan exactly)."""
    _check_common(job)
    eps, delta, C, T = job.epsilon, job.delta, job.C, job.T
    repeated = job.mode == "baseline-repeated"
    if job.composition == "zcdp":
        releases = T if repeated else 1
        keys = float(T * C if repeated else C)
        delta_thr = delta * job.selection_delta_share
        delta_conv = delta - delta_thr
        rho_total = rho_tight(eps, delta_conv)
        plan = BaselinePlan(job=job, composition="zcdp", releases_composed=releases, keys_per_user=keys,
                            delta_threshold=delta_thr, delta_conversion=delta_conv, tail=delta_thr / keys,
                            rho_total=rho_total, rho_release_target=rho_total / releases)
    else:
        delta0 = oct_delta0(delta, T)
        if eps0 is None:
            try:
                eps0 = oct_eps0(eps, delta, delta0, T)
            except ValueError as e:
                raise PlanRefused(f"composition optimal: {e}")
        delta0_thr = delta0 * job.selection_delta_share
        delta_conv = delta0 - delta0_thr
        if not eps0 > 0:
            raise PlanRefused("composition optimal: eps0 = 0")
        plan = BaselinePlan(job=job, composition="optimal", releases_composed=T, keys_per_user=float(T * C),
                            delta_threshold=delta0_thr * T, delta_conversion=delta_conv, tail=delta0_thr / C,
                            delta0=delta0, eps0=eps0, delta0_threshold=delta0_thr,
                            rho_release_target=rho_tight(eps0, delta_conv))
    plan.rho_thr_target = plan.rho_release_target * job.selection_epsilon_share
    plan.rho_agg_target = plan.rho_release_target - plan.rho_thr_target
    plan.sigma_thr_formula = math.sqrt(C / (2 * plan.rho_thr_target))
    plan.sigma_thr = _sampler(plan.sigma_thr_formula, "threshold")
    plan.rho_thr = C / (2 * plan.sigma_thr ** 2)
    _add_columns(job, plan, 1, plan.rho_agg_target)
    plan.tail_z = _tail_z(job, plan.tail)
    plan.tau = 1 + plan.sigma_thr * plan.tail_z  # integer noisy counts: a lone user passes iff N > tau - 1
    plan.rho_release_used = plan.rho_thr + sum(c.rho for c in plan.columns)
    plan.rho_total_used = plan.releases_composed * plan.rho_release_used
    if job.composition == "zcdp":
        plan.eps_total = eps_tight(plan.rho_total_used, plan.delta_conversion)
        plan.delta_total = plan.delta_conversion + plan.delta_threshold
    else:
        plan.eps0_used = eps_tight(plan.rho_release_used, plan.delta_conversion)
        plan.eps_total = eps
        plan.delta_total = oct_delta(plan.eps0_used, plan.delta0, T, eps)
    if plan.eps_total > eps * (1 + 1e-9) or plan.delta_total > delta * (1 + 1e-9):
        raise PlanRefused(f"over budget: ({plan.eps_total}, {plan.delta_total})")
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
# Self test against the checked-in reference values (tests/reference, mpmath, 50 digits) and PRIVACY.md's examples


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
    # PRIVACY.md section 6 example: beta = 4.9e-15 for eps = 6, delta = 1e-9, C = 32, T = 100 (basic split).
    plan = make_plan(Job(epsilon=6, delta=1e-9, C=32, T=100, composition="basic"))
    close("PRIVACY.md beta example", plan.beta, 4.9e-15, 0.01)
    # tau_1 = 254 with the basic split (the seed's numbers; earlier PRIVACY.md example).
    close("basic split tau_1 at the paper's budget", plan.tau[1], 254, 0.005)
    # PRIVACY.md section 5: the default mu is floor(min tau / 24) = 5 users at the paper's budget, T = 100,
    # one zCDP ledger (min tau = 138).
    z = make_plan(Job(epsilon=6, delta=1e-9, C=32, T=100))
    close("PRIVACY.md section 5: min tau (zcdp)", min(z.tau[1:]), 138, 0.005)
    if z.mu != 5 or not z.mu_defaulted:
        problems.append(f"default mu at the paper's budget (zcdp): {z.mu}, PRIVACY.md says 5")
    # PRIVACY.md section 5: sigma_sum = 250 and g = 2^-14 at the paper's parameters, clamp [0, 1].
    close("PRIVACY.md sigma_sum example", plan.column("sum").sigma, 250, 0.005)
    if plan.sum_grid != 2.0 ** -14:
        problems.append(f"sum grid at the paper's parameters: {plan.sum_grid}, PRIVACY.md says 2^-14")
    problems += _self_test_zcdp_split(close, plan)
    problems += _self_test_optimal_composition(close)
    problems += _self_test_baselines(close)
    # Normal quantile sanity.
    close("Phi^-1(1 - 0.025)", normal_upper_quantile(0.025), 1.959963984540054, 1e-12)
    close("Phi^-1(1 - 1e-15)", normal_upper_quantile(1e-15), 7.941345326170997, 1e-9)

    path = os.path.join(reference_dir, "zcdp_conversion.json")
    checked_shared = os.path.isfile(path)
    if not checked_shared:
        problems.append(f"reference values missing: {path}")
    else:
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


def _self_test_zcdp_split(close, basic):
    """PRIVACY.md sections 6-7 on composition = "zcdp" at the paper's budget (eps 6, delta 1e-9, C 32,
    T 100); `basic` is the same job with composition = "basic"."""
    problems = []
    z = make_plan(Job(epsilon=6, delta=1e-9, C=32, T=100, composition="zcdp"))
    if Job(1, 1e-9, 1, 1).composition != "zcdp":
        problems.append("Job's default composition is not the engine's default \"zcdp\"")
    close("PRIVACY.md section 6: zcdp beta 2.6e-16", z.beta, 2.6e-16, 0.01)
    # Section 7: rho_tight(6, 6.7e-10) = 0.43 against rho_tight(3, 3.3e-10) x 2 = 0.23; "1.85x the rho"
    # (really 1.87x), sigma 27% lower, thresholds 24% lower, value noise 27% lower.
    close("PRIVACY.md section 7: one ledger's rho 0.43", z.rho_total, 0.43, 0.01)
    close("PRIVACY.md section 7: the basic parts' rho 0.23", basic.rho_sel_target + basic.rho_agg_target, 0.23, 0.01)
    close("PRIVACY.md section 7: rho per tree 1.85x", z.rho_sel_target / basic.rho_sel_target, 1.85, 0.02)
    close("PRIVACY.md section 7: sigma_sel 27% lower", z.sigma_sel / basic.sigma_sel, 0.73, 0.01)
    close("PRIVACY.md section 7: tau_T 24% lower", z.tau[100] / basic.tau[100], 0.76, 0.01)
    close("PRIVACY.md section 7: count sigma 27% lower", z.column("count").sigma / basic.column("count").sigma, 0.73, 0.01)
    close("PRIVACY.md section 7: tail_z 4% higher", z.tail_z / basic.tail_z, 1.04, 0.005)
    # The ledger: rho_sel + rho_agg = rho(eps, delta - delta_beta); the beta term is charged at e^eps.
    close("zcdp: rho split", z.rho_sel_target + z.rho_agg_target, z.rho_total, 1e-15)
    close("zcdp: delta_beta = (e^eps + 1) C T beta", z.delta_beta, (math.exp(6) + 1) * 32 * 100 * z.beta, 1e-15)
    close("zcdp: delta_beta is half of delta_sel", z.delta_beta, 1e-9 * (2 / 3) / 2, 1e-12)
    if not (z.eps_total <= 6 and z.delta_total <= 1e-9 * (1 + 1e-15)):
        problems.append(f"zcdp total over budget: ({z.eps_total}, {z.delta_total})")
    if not cks_delta(z.rho_sel + sum(c.rho for c in z.columns), 6.0) <= z.delta_ledger:
        problems.append("zcdp: the used rho converts to more than delta - delta_beta at eps")
    if not z.eps_total > 6 * (1 - 1e-6):
        problems.append(f"zcdp: total eps {z.eps_total} leaves budget unused (sigma rounding should cost < 1e-12)")
    return problems


def _self_test_optimal_composition(close):
    """oct_delta against the 60-digit literal evaluation (and tests/reference/optimal_composition.py
    when present), the KOV discrete form, k = 1, monotonicity, and oct_eps0's choice."""
    problems = []
    points = [(1, 0.5, 0.0, 0.2), (1, 3.0, 1e-6, 1.0), (2, 1.0, 0.0, 0.5), (10, 1.0, 0.0, 2.5), (10, 1.0, 1e-6, 3.3),
              (10, 10.0, 0.0, 35.0), (100, 0.1, 0.0, 1.0), (100, 0.1, 1e-8, 4.2), (100, 0.01, 0.0, 0.05),
              (100, 0.0991987699447869, 5e-12, 6.0), (1000, 0.01, 0.0, 0.5), (1000, 0.1, 0.0, 6.0),
              (1000, 0.1, 1e-9, 20.0), (1000, 0.0303948639673882, 5e-13, 6.0), (1000, 1.0, 0.0, 100.0),
              (1000, 3.0, 0.0, 2000.0), (16, 0.3, 1e-7, 1.0)]
    shared = None
    here = os.path.dirname(os.path.abspath(__file__))
    shared_path = os.path.join(here, "..", "reference", "optimal_composition.py")
    if os.path.isfile(shared_path):
        import importlib.util
        import decimal
        saved = decimal.getcontext().copy()  # the module sets the global context on import
        try:
            spec = importlib.util.spec_from_file_location("_optimal_composition_reference", shared_path)
            shared = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(shared)
        except Exception as e:  # being written by someone else: report, do not crash
            problems.append(f"tests/reference/optimal_composition.py does not load: {e!r}")
            shared = None
        finally:
            decimal.setcontext(saved)
    for k, e0, d0, e in points:
        exact = oct_delta_decimal(e0, d0, k, e)
        got = oct_delta(e0, d0, k, e)
        if exact > 1e-290:
            close(f"oct_delta({e0}, {d0}, {k}, {e}) vs 60 digits", got, float(exact), 1e-11)
        elif got > 1e-280:
            problems.append(f"oct_delta({e0}, {d0}, {k}, {e}) = {got}, exact {exact}")
        if shared is not None and hasattr(shared, "general"):
            import decimal
            with decimal.localcontext() as ctx:
                ctx.prec, ctx.Emax, ctx.Emin = 80, 10 ** 9, -10 ** 9
                other = shared.general(k, e0, d0, e)
                if exact > 1e-30 and abs(other - exact) > decimal.Decimal("1e-30") * exact:
                    problems.append(f"oct_delta_decimal({e0}, {d0}, {k}, {e}) = {exact} but "
                                    f"tests/reference/optimal_composition.py says {other}")
    # KOV Thm 3.3 (discrete points eps = (k - 2i) eps0) equals the general form there.
    for k, e0, d0 in ((10, 1.0, 0.0), (100, 0.1, 1e-6), (1000, 0.01, 0.0), (100, 0.25, 0.0)):
        for i in (0, 1, 2, k // 10, k // 4, k // 2 - 1):
            eps_i = (k - 2 * i) * e0
            disc = oct_delta_discrete_decimal(e0, d0, k, i)
            if disc > 1e-35:  # 60 digits: the closed form's 1 - (...) keeps ~25 digits down there
                close(f"KOV discrete k={k} eps0={e0} i={i}", oct_delta(e0, d0, k, eps_i), float(disc), 1e-10)
    # k = 1: the (eps0, delta0) mechanism itself: delta0 at every eps >= eps0, and below eps0 the
    # randomized response curve 1 - (1 - delta0)(1 - (e^eps0 - e^eps) / (1 + e^eps0)).
    for e0, d0 in ((0.5, 0.0), (1.0, 1e-6), (6.0, 1e-9), (0.03, 5e-13)):
        for e in (e0, e0 * 1.5, e0 + 10):
            got = oct_delta(e0, d0, 1, e)
            if not abs(got - d0) <= 1e-15 * d0:
                problems.append(f"OCT k=1 at eps {e} >= eps0 {e0}: {got}, want delta0 = {d0}")
        for e in (0.0, e0 / 3, e0 * 0.9):
            want = 1 - (1 - d0) * (1 - (math.exp(e0) - math.exp(e)) / (1 + math.exp(e0)))
            close(f"OCT k=1 at eps {e} < eps0 {e0}", oct_delta(e0, d0, 1, e), want, 1e-12)
    # eps0 = 0: nothing but the deltas, 1 - (1 - delta0)^k.
    from decimal import Decimal
    for k, d0 in ((1, 1e-9), (100, 5e-12), (1000, 1e-6)):
        close(f"OCT eps0 = 0, k = {k}", oct_delta(0.0, d0, k, 1.0), float(1 - (1 - Decimal(d0)) ** k), 1e-12)
    # Monotone in eps0 (what the bisection needs) and non-increasing in eps.
    for k, e in ((100, 6.0), (1000, 6.0), (16, 1.0)):
        vals = [oct_delta(e0, 1e-12, k, e) for e0 in (0.0, 0.01, 0.03, 0.06, 0.1, 0.2, 0.5, 1.0)]
        if any(b < a for a, b in zip(vals, vals[1:])):
            problems.append(f"OCT k={k} eps={e} not increasing in eps0: {vals}")
        vals = [oct_delta(0.1, 1e-12, k, x) for x in (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)]
        if any(b > a for a, b in zip(vals, vals[1:])):
            problems.append(f"OCT k={k} eps0=0.1 not non-increasing in eps: {vals}")
    # oct_eps0: the composition of the chosen eps0 meets the budget (checked in 60 digits) and a
    # slightly larger eps0 does not; T = 1 has the closed form e^eps0 = (x + e^eps) / (1 - x),
    # x = (delta / 2) / (1 - delta / 2).
    for eps, delta, T in ((6.0, 1e-9, 1), (6.0, 1e-9, 100), (6.0, 1e-9, 1000), (1.0, 1e-6, 16), (0.5, 1e-5, 7),
                          (1.0, 1e-6, 1)):
        d0 = oct_delta0(delta, T)
        close(f"delta0 for T={T}: (1 - delta0)^T = 1 - delta/2", float(1 - (1 - Decimal(d0)) ** T), delta / 2, 1e-12)
        e0 = oct_eps0(eps, delta, d0, T)
        spent = oct_delta_decimal(e0, d0, T, eps)
        if not spent <= delta:
            problems.append(f"oct_eps0({eps}, {delta}, T={T}) = {e0} spends {spent} > delta (60 digits)")
        if not oct_delta_decimal(e0 * (1 + 1e-9), d0, T, eps) > delta:
            problems.append(f"oct_eps0({eps}, {delta}, T={T}) = {e0} is not the largest (1e-9 more still fits)")
        if T == 1:
            x = (delta / 2) / (1 - delta / 2)
            close(f"oct_eps0 T=1 closed form (eps {eps})", e0, math.log((x + math.exp(eps)) / (1 - x)), 1e-12)
            if not e0 > eps:
                problems.append(f"oct_eps0 T=1 should exceed eps (randomized response), got {e0}")
    return problems


def _self_test_baselines(close):
    """Internal consistency of the baseline plans at the paper's budget and a small one."""
    problems = []
    for eps, delta, C, T in ((6.0, 1e-9, 32, 100), (6.0, 1e-9, 32, 1000), (1.0, 1e-6, 4, 16)):
        for mode in BASELINE_MODES:
            for comp in ("zcdp", "optimal"):
                label = f"{mode}/{comp} eps={eps} delta={delta} C={C} T={T}"
                p = make_plan(Job(eps, delta, C, T, mode=mode, composition=comp))
                close(f"{label}: rho split", p.rho_thr_target + p.rho_agg_target, p.rho_release_target, 1e-15)
                close(f"{label}: sigma_thr", p.sigma_thr, math.sqrt(C / (2 * p.rho_thr_target)), 1e-12)
                close(f"{label}: tau", p.tau, 1 + p.sigma_thr * math.sqrt(2 * math.log(1 / p.tail)), 1e-12)
                if p.releases_composed * p.rho_release_used > p.releases_composed * p.rho_release_target * (1 + 1e-12):
                    problems.append(f"{label}: the used rho exceeds the target")
                # The subgaussian threshold really bounds the discrete Gaussian's tail.
                if p.sigma_thr < 2000:
                    exact_tail = discrete_gaussian_upper_tail(p.sigma_thr, p.tau - 1)
                    if not exact_tail <= p.tail:
                        problems.append(f"{label}: P[N > tau - 1] = {exact_tail} > tail {p.tail}")
                if comp == "zcdp":
                    close(f"{label}: keys x tail = delta_thr", p.keys_per_user * p.tail, p.delta_threshold, 1e-15)
                    want_r = T if mode == "baseline-repeated" else 1
                    if p.releases_composed != want_r:
                        problems.append(f"{label}: releases_composed {p.releases_composed}, want {want_r}")
                    if not (p.eps_total <= eps and p.delta_total <= delta * (1 + 1e-15)):
                        problems.append(f"{label}: over budget ({p.eps_total}, {p.delta_total})")
                else:
                    spent = oct_delta_decimal(p.eps0_used, p.delta0, T, eps)
                    if not (p.eps0_used <= p.eps0 and spent <= delta):
                        problems.append(f"{label}: eps0_used {p.eps0_used} (eps0 {p.eps0}) spends {spent} > delta")
                    close(f"{label}: C x tail = delta0_thr", C * p.tail, p.delta0_threshold, 1e-15)
        # Batch and repeated agree under "optimal" (per-release worst case, T-fold); under "zcdp"
        # batch pays one release and T C -> C keys.
        r = make_plan(Job(eps, delta, C, T, mode="baseline-repeated", composition="optimal"))
        b = make_plan(Job(eps, delta, C, T, mode="baseline-batch", composition="optimal"))
        if (r.sigma_thr, r.tau, r.eps0) != (b.sigma_thr, b.tau, b.eps0):
            problems.append(f"optimal: repeated and batch differ at T={T}")
        r = make_plan(Job(eps, delta, C, T, mode="baseline-repeated"))
        b = make_plan(Job(eps, delta, C, T, mode="baseline-batch"))
        close(f"zcdp T={T}: repeated's sigma_thr is sqrt(T) batch's", r.sigma_thr_formula / b.sigma_thr_formula,
              math.sqrt(T), 1e-12)
    # Refusals: composition must fit the mode.
    for mode, comp in (("dp", "optimal"), ("baseline-repeated", "basic"), ("baseline-batch", "basic"),
                       ("dp", "rdp"), ("baseline-batch", "")):
        try:
            make_plan(Job(6.0, 1e-9, 32, 100, mode=mode, composition=comp))
            problems.append(f"mode {mode} with composition {comp!r} is accepted")
        except PlanRefused as e:
            if "composition" not in str(e):
                problems.append(f"mode {mode} with composition {comp!r}: message does not name composition: {e}")
    return problems


def plan_dict(plan):
    """The plan as plain data (for the command line)."""
    out = {"mode": plan.job.mode}
    out.update({k: v for k, v in plan.__dict__.items() if k not in ("job", "columns", "lam", "tau")})
    out["columns"] = [c.__dict__ for c in plan.columns]
    if isinstance(plan, BaselinePlan):
        out["tau"] = plan.tau
    else:
        out["thresholds"] = [{"step": s, "lambda": plan.lam[s], "tau": plan.tau[s]} for s in range(1, plan.job.T + 1)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--reference-dir", default=os.path.normpath(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference")))
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
    ap.add_argument("--mode", default="dp", choices=DP_MODES + BASELINE_MODES)
    ap.add_argument("--composition", default="zcdp", choices=("zcdp", "basic", "optimal"))
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
              threshold=a.threshold, mode=a.mode, composition=a.composition)
    print(json.dumps(plan_dict(make_plan(job)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
