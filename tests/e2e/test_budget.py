#!/usr/bin/env python3
"""End-to-end test of `dpstream budget` and of the DP job refusals (docs/PRIVACY.md sections 6-8).

1. Plan, mode "dp": for jobs over T = 1, 2, 7, 100, 1000, C = 1, 32, eps = 0.5, 1, 6, delta = 1e-5,
   1e-9, count / sum / both, custom shares, explicit beta, both threshold tails, each under
   composition = "basic" (set explicitly: the seed's split) and the default "zcdp" (one ledger),
   `budget --json --thresholds` must match the independent Python plan of dp_reference.py to
   relative 1e-6 (every sigma, rho, delta term, beta, eps, tau_s and lambda_s), every sigma must be
   the formula's rounded *up* by at most 1e-12 relative, every rho must stay within its target, the
   total within the budget; the text output must hold the key lines with the same numbers and name
   the composition.
2. Plan, every (mode, composition) pair: dp/zcdp, dp/basic, baseline-repeated/zcdp,
   baseline-repeated/optimal, baseline-batch/zcdp, baseline-batch/optimal at the paper's budget
   (eps 6, delta 1e-9, C 32, T 100 and 1000; count only, and count + sum with a clamp range) and
   other budgets (T = 1, 7, 16): the same comparison; for the baselines every number of `budget
   --json` (rho, sigma_thr, tau, tail, keys, eps0, delta0, delta terms, totals), re-derived budgets
   from the engine's own sigmas (zCDP conversion, or the optimal composition in 60-digit decimal),
   the threshold's real discrete-Gaussian tail, and the text naming the mode and the composition.
   The paper's claim (zcdp beats basic on sigma_sel, tau_T and the count sigma at T = 100) is
   checked on the engine's numbers and printed with the baselines' sigmas and taus.
3. Refusals: each bad [privacy]/[query] setting (including a composition that does not fit the
   mode) exits with code 2 and a message naming the key to change, both for `budget` and for `run`
   on a CSV path that does not exist (the refusal comes before any data is read), and no output dir
   is created.
4. Test mode: [privacy] seed makes `budget` print a warning and summary.json say "private": false;
   an unseeded run says "private": true; a seeded run is reproducible.

The dpstream runs are independent and mostly wait for MPI start-up: they are started --parallel at
a time (default 6) ahead of the checks, which then run in order.

Usage: test_budget.py --ranks N [--bin build/src/dpstream] [--keep] [--parallel 6]
"""

import json
import math
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dp_reference  # noqa: E402
import harness  # noqa: E402

REL = 1e-6


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def toml_job(csv_path, out_dir, *, triggers=8, privacy=None, aggregations=("count", "sum"), window_seconds=8000):
    """A CSV job; `privacy` entries override/extend the defaults (value None removes a key)."""
    pr = {"mode": "dp", "max_records_per_user": 4, "clamp_min": 0.0, "clamp_max": 1.0, "epsilon": 3.0,
          "delta": 1e-9, "mu": 10.0}
    for k, v in (privacy or {}).items():
        if v is None:
            pr.pop(k, None)
        else:
            pr[k] = v
    if pr.get("mode") == "dp":  # dp_reference.py models the trees; test_banded_budget.py the banded counters
        pr.setdefault("selection_counter", "tree")
        pr.setdefault("value_counter", "tree")
    lines = ["[job]", 'name = "e2e-budget"', "", "[input]", 'kind = "csv"', f"path = {toml_value(csv_path)}", "",
             "[stream]", f"window_seconds = {window_seconds}", f"triggers = {triggers}", "", "[privacy]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in pr.items()]
    lines += ["", "[query]", f"aggregations = {toml_value(list(aggregations))}", "",
              "[output]", f"dir = {toml_value(out_dir)}", 'progress = "never"']
    return "\n".join(lines) + "\n"


# (label, T, privacy overrides, aggregations); C = max_records_per_user.
PLAN_JOBS = [
    ("T=1 C=1 eps=1 delta=1e-5 count", 1, {"max_records_per_user": 1, "epsilon": 1.0, "delta": 1e-5}, ("count",)),
    ("T=2 C=32 eps=6 delta=1e-9 both", 2, {"max_records_per_user": 32, "epsilon": 6.0, "delta": 1e-9},
     ("count", "sum")),
    ("T=7 C=1 eps=0.5 delta=1e-9 sum clamp [-2,3.5]", 7,
     {"max_records_per_user": 1, "epsilon": 0.5, "delta": 1e-9, "clamp_min": -2.0, "clamp_max": 3.5}, ("sum",)),
    ("T=100 C=32 eps=6 delta=1e-9 both (paper)", 100, {"max_records_per_user": 32, "epsilon": 6.0, "delta": 1e-9},
     ("count", "sum")),
    ("T=1000 C=32 eps=1 delta=1e-5 count shares 0.3/0.5", 1000,
     {"max_records_per_user": 32, "epsilon": 1.0, "delta": 1e-5, "selection_epsilon_share": 0.3,
      "selection_delta_share": 0.5}, ("count",)),
    ("T=100 C=1 eps=0.5 delta=1e-5 both beta=1e-12 mu=5", 100,
     {"max_records_per_user": 1, "epsilon": 0.5, "delta": 1e-5, "beta": 1e-12, "mu": 5.0}, ("count", "sum")),
    ("T=7 C=32 eps=6 delta=1e-5 sum clamp [-1000,10] gaussian-quantile", 7,
     {"max_records_per_user": 32, "epsilon": 6.0, "delta": 1e-5, "clamp_min": -1000.0, "clamp_max": 10.0,
      "threshold": "gaussian-quantile"}, ("sum",)),
    ("T=1000 C=1 eps=6 delta=1e-9 both clamp [0,1e-3] (fine grid)", 1000,
     {"max_records_per_user": 1, "epsilon": 6.0, "delta": 1e-9, "clamp_max": 1e-3}, ("count", "sum")),
    ("T=2 C=1 eps=1 delta=1e-9 both clamp [0.3,0.7] shares 0.7/0.9 beta=1e-14", 2,
     {"max_records_per_user": 1, "epsilon": 1.0, "delta": 1e-9, "clamp_min": 0.3, "clamp_max": 0.7,
      "selection_epsilon_share": 0.7, "selection_delta_share": 0.9, "beta": 1e-14}, ("sum", "count")),
    ("T=100 C=32 eps=6 delta=1e-9 both, mu not set (default floor(min tau / 24))", 100,
     {"max_records_per_user": 32, "epsilon": 6.0, "delta": 1e-9, "mu": None}, ("count", "sum")),
    ("T=7 C=1 eps=1 delta=1e-5 count, mu not set", 7,
     {"max_records_per_user": 1, "epsilon": 1.0, "delta": 1e-5, "mu": None}, ("count",)),
    ("T=1 C=32 eps=0.5 delta=1e-5 sum mu=0", 1,
     {"max_records_per_user": 32, "epsilon": 0.5, "delta": 1e-5, "mu": 0.0}, ("sum",)),
]
# Each PLAN_JOBS entry runs twice: with composition = "basic" set explicitly (the seed's split, the
# numbers this test checked before "zcdp" became the default) and with the default (zcdp).
BASIC = {"composition": "basic"}
# The largest accepted beta is (e^eps' + 1) C T beta < delta_sel, with eps' = eps_sel (basic) or eps
# (zcdp); 0.999 of it leaves delta_conv tiny (basic) and charges almost all of delta_sel to beta.
BETA_LIMIT_BASIC = (1e-9 * 2 / 3) / ((math.exp(1.5) + 1) * 4 * 8)
BETA_LIMIT_ZCDP = (1e-9 * 2 / 3) / ((math.exp(3.0) + 1) * 4 * 8)
PLAN_JOBS_BASIC_ONLY = [
    ("T=8 C=4 eps=3 delta=1e-9 beta = 0.999 of the basic limit", 8, {"beta": 0.999 * BETA_LIMIT_BASIC}, ("count", "sum")),
]
PLAN_JOBS_ZCDP_ONLY = [
    ("T=8 C=4 eps=3 delta=1e-9 beta = 0.999 of the zcdp limit (e^eps)", 8, {"beta": 0.999 * BETA_LIMIT_ZCDP},
     ("count", "sum")),
    ("T=100 C=32 eps=6 delta=1e-9 both, composition = \"zcdp\" set explicitly", 100,
     {"max_records_per_user": 32, "epsilon": 6.0, "delta": 1e-9, "composition": "zcdp"}, ("count", "sum")),
]

# Every (mode, composition) pair at these budgets (C = max_records_per_user).
PAIRS = [("dp", "zcdp"), ("dp", "basic"), ("baseline-repeated", "zcdp"), ("baseline-repeated", "optimal"),
         ("baseline-batch", "zcdp"), ("baseline-batch", "optimal")]
PAPER = {"max_records_per_user": 32, "epsilon": 6.0, "delta": 1e-9}
MATRIX_BUDGETS = [
    ("paper T=100 count", 100, dict(PAPER), ("count",)),
    ("paper T=100 count+sum clamp [-0.5,2]", 100, dict(PAPER, clamp_min=-0.5, clamp_max=2.0), ("count", "sum")),
    ("paper T=1000 count", 1000, dict(PAPER), ("count",)),
    ("paper T=1000 count+sum clamp [-0.5,2]", 1000, dict(PAPER, clamp_min=-0.5, clamp_max=2.0), ("count", "sum")),
    ("eps=1 delta=1e-6 C=4 T=16 count+sum", 16, {"max_records_per_user": 4, "epsilon": 1.0, "delta": 1e-6},
     ("count", "sum")),
    ("eps=1 delta=1e-6 C=2 T=1 sum clamp [-2,3.5] shares 0.3/0.5", 1,
     {"max_records_per_user": 2, "epsilon": 1.0, "delta": 1e-6, "clamp_min": -2.0, "clamp_max": 3.5,
      "selection_epsilon_share": 0.3, "selection_delta_share": 0.5}, ("sum",)),
    ("eps=0.5 delta=1e-5 C=1 T=7 count gaussian-quantile", 7,
     {"max_records_per_user": 1, "epsilon": 0.5, "delta": 1e-5, "threshold": "gaussian-quantile"}, ("count",)),
]


def pair_privacy(privacy, mode, composition):
    """The privacy overrides of a budget under (mode, composition); baselines have no mu."""
    pr = dict(privacy, mode=mode, composition=composition)
    if mode != "dp":
        pr["mu"] = None
    return pr


TOML_TO_JOB = {"max_records_per_user": "C", "epsilon": "epsilon", "delta": "delta", "clamp_min": "clamp_min",
               "clamp_max": "clamp_max", "mu": "mu", "beta": "beta", "selection_epsilon_share": "selection_epsilon_share",
               "selection_delta_share": "selection_delta_share", "threshold": "threshold", "mode": "mode",
               "composition": "composition"}


def reference_job(T, privacy, aggregations):
    """The dp_reference.Job of toml_job(..., triggers=T, privacy=privacy, aggregations=aggregations)."""
    pr = {"max_records_per_user": 4, "clamp_min": 0.0, "clamp_max": 1.0, "epsilon": 3.0, "delta": 1e-9, "mu": 10.0}
    for k, v in privacy.items():
        if v is None:
            pr.pop(k, None)
        else:
            pr[k] = v
    kw = {"T": T, "count": "count" in aggregations, "sum": "sum" in aggregations}
    for k, v in pr.items():
        if k in TOML_TO_JOB:
            kw[TOML_TO_JOB[k]] = v
    return dp_reference.Job(**kw)


class Mismatches:
    def __init__(self):
        self.items = []

    def rel(self, label, got, want, rel=REL):
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            self.items.append(f"{label}: engine {got!r} is not a number (reference {want!r})")
        elif not abs(got - want) <= rel * max(abs(want), 1e-300):
            self.items.append(f"{label}: engine {got!r}, reference {want!r} (relative {abs(got - want) / abs(want):.2e})"
                              if want else f"{label}: engine {got!r}, reference {want!r}")

    def eq(self, label, got, want):
        if got != want:
            self.items.append(f"{label}: engine {got!r}, reference {want!r}")

    def true(self, label, ok, detail=""):
        if not ok:
            self.items.append(f"{label} {detail}".rstrip())

    def check(self, context):
        assert not self.items, f"{context}: {len(self.items)} mismatch(es):\n  " + "\n  ".join(self.items[:40])


def sigma_rounded_up(m, label, engine_sigma, formula_sigma):
    """The engine's sigma is the formula's with sigma^2 rounded up to n / 2^k: >= (tiny slack for the
    last bits of rho's bisection) and at most 1e-12 above."""
    r = engine_sigma / formula_sigma - 1
    m.true(f"{label}: engine sigma {engine_sigma!r} is not the formula's {formula_sigma!r} rounded up",
           -1e-13 <= r <= 1e-12, f"(relative {r:.3e})")


def compare_plan(j, ref, m):
    job = ref.job
    m.eq("budget.epsilon", j["budget"]["epsilon"], job.epsilon)
    m.eq("budget.delta", j["budget"]["delta"], job.delta)
    m.eq("private", j["private"], True)
    m.eq("mode", j.get("mode"), "dp")
    m.eq("composition", j.get("composition"), ref.composition)
    m.eq("threshold_proven", j.get("threshold_proven"), job.threshold == "subgaussian")
    m.eq("trees.triggers", j["trees"]["triggers"], job.T)
    m.eq("trees.levels", j["trees"]["levels"], ref.levels)

    ks = j["key_selection"]
    m.rel("key_selection.epsilon", ks["epsilon"], ref.eps_sel)
    m.rel("key_selection.delta", ks["delta"], ref.delta_sel)
    m.rel("key_selection.delta_conversion", ks["delta_conversion"], ref.delta_conv)
    m.rel("key_selection.delta_beta", ks["delta_beta"], ref.delta_beta)
    m.rel("key_selection.beta_per_test", ks["beta_per_test"], ref.beta)
    m.eq("key_selection.beta_defaulted", ks["beta_defaulted"], ref.beta_defaulted)
    m.eq("key_selection.mu", ks["mu"], ref.mu)
    if "mu_defaulted" in ks:
        m.eq("key_selection.mu_defaulted", ks["mu_defaulted"], ref.mu_defaulted)
    m.eq("key_selection.tree.name", ks["tree"]["name"], "key_selection")
    m.rel("key_selection.tree.l2_sensitivity_per_level", ks["tree"]["l2_sensitivity_per_level"], math.sqrt(job.C))
    m.rel("key_selection.tree.sigma", ks["tree"]["sigma"], ref.sigma_sel)
    sigma_rounded_up(m, "key_selection", ks["tree"]["sigma"], ref.sigma_sel_formula)
    m.rel("key_selection.tree.rho", ks["tree"]["rho"], ref.rho_sel)
    m.true("key_selection.tree.rho exceeds its target (basic: rho(eps_sel, delta_conv); zcdp: share_e rho_total)",
           ks["tree"]["rho"] <= ref.rho_sel_target * (1 + 1e-12),
           f"({ks['tree']['rho']!r} > {ref.rho_sel_target!r})")
    m.rel("key_selection.eps_tight", ks["eps_tight"], ref.eps_sel_tight)
    m.rel("key_selection.eps_simple", ks["eps_simple"], ref.eps_sel_simple)
    m.eq("key_selection.threshold_tail", ks["threshold_tail"], job.threshold)
    m.rel("key_selection.tail_z", ks["tail_z"], ref.tail_z)
    m.rel("key_selection.tau_first", ks["tau_first"], ref.tau[1])
    m.rel("key_selection.tau_last", ks["tau_last"], ref.tau[job.T])
    m.rel("key_selection.tau_max", ks["tau_max"], max(ref.tau[1:]))
    rows = ks.get("thresholds")
    m.true("key_selection.thresholds missing or not T rows", isinstance(rows, list) and len(rows) == job.T,
           f"(got {type(rows).__name__} of {len(rows) if isinstance(rows, list) else '-'})")
    if isinstance(rows, list):
        for s, row in enumerate(rows[:job.T], start=1):
            m.eq(f"thresholds[{s}].step", row.get("step"), s)
            m.rel(f"thresholds[{s}].lambda", row.get("lambda"), ref.lam[s])
            m.rel(f"thresholds[{s}].tau", row.get("tau"), ref.tau[s])

    ag = j["aggregation"]
    m.rel("aggregation.epsilon", ag["epsilon"], ref.eps_agg)
    m.rel("aggregation.delta", ag["delta"], ref.delta_agg)
    m.rel("aggregation.rho", ag["rho"], ref.rho_agg_target)
    m.eq("aggregation.columns names", [c["name"] for c in ag["columns"]], [c.name for c in ref.columns])
    for c in ag["columns"]:
        try:
            rc = ref.column(c["name"])
        except KeyError:
            continue
        m.rel(f"aggregation.{c['name']}.sigma", c["sigma"], rc.sigma)
        sigma_rounded_up(m, f"aggregation.{c['name']}", c["sigma"], rc.sigma_formula)
        m.rel(f"aggregation.{c['name']}.rho", c["rho"], rc.rho)
        m.rel(f"aggregation.{c['name']}.l2_sensitivity_per_level", c["l2_sensitivity_per_level"], rc.sensitivity)
        m.eq(f"aggregation.{c['name']}.unit", c["unit"], "records" if c["name"] == "count" else "value")
    used = sum(c["rho"] for c in ag["columns"])
    m.true("aggregation: the columns' rho exceed rho_agg", used <= ref.rho_agg_target * (1 + 1e-12),
           f"({used!r} > {ref.rho_agg_target!r})")
    if job.sum:
        m.rel("aggregation.sum_grid", ag["sum_grid"], ref.sum_grid, 1e-12)
        m.rel("aggregation.clamp_bound", ag["clamp_bound"], ref.clamp_bound, 1e-12)
        sigma_quanta = ref.column("sum").sigma / ref.sum_grid
        m.true("sum noise is not within the sampler's grid range (sigma <= 2^22 grid steps, and > 2^21 unless g = 2^-20)",
               sigma_quanta <= 2 ** 22 * (1 + 1e-12) and (ref.sum_quantum == 1 or sigma_quanta > 2 ** 21),
               f"({sigma_quanta})")
    m.rel("aggregation.eps_tight", ag["eps_tight"], ref.eps_agg_tight)
    m.rel("aggregation.eps_simple", ag["eps_simple"], ref.eps_agg_simple)

    tot = j["total"]
    m.rel("total.epsilon", tot["epsilon"], ref.eps_total)
    m.rel("total.delta", tot["delta"], ref.delta_total)
    m.eq("total.within_budget", tot["within_budget"], True)
    # Within budget: by the engine's own numbers and re-derived from its sigmas with our conversion.
    m.true("total.epsilon over budget", tot["epsilon"] <= job.epsilon * (1 + 1e-9), f"({tot['epsilon']!r} > {job.epsilon})")
    m.true("total.delta over budget", tot["delta"] <= job.delta * (1 + 1e-9), f"({tot['delta']!r} > {job.delta})")
    if ref.composition == "zcdp":
        # One ledger: the engine's rho (from its sigmas) converted once with delta - delta_beta.
        m.rel("total.rho", tot["rho"], ref.rho_total)
        m.true("total.rho is not rho(eps, delta - delta_beta) split into the two parts",
               abs(ks["tree"]["rho"] / ref.rho_sel_target - 1) < 1e-11 and abs(ag["rho"] + ref.rho_sel_target - tot["rho"])
               <= 1e-12 * tot["rho"])
        eps_all = dp_reference.eps_tight(ks["tree"]["rho"] + used, job.delta - ks["delta_beta"])
        m.true("eps re-derived from the engine's rho (one ledger) is over budget", eps_all <= job.epsilon * (1 + 1e-9),
               f"({eps_all} > {job.epsilon})")
        m.rel("key_selection.delta_beta = (e^eps + 1) C T beta", ks["delta_beta"],
              (math.exp(job.epsilon) + 1) * job.C * job.T * ks["beta_per_test"], 1e-12)
        m.true("total.delta is not delta", abs(tot["delta"] - job.delta) <= 1e-15 * job.delta, f"({tot['delta']!r})")
    else:
        eps_sel = dp_reference.eps_tight(ks["tree"]["rho"], ks["delta_conversion"])
        eps_agg = dp_reference.eps_tight(used, ag["delta"])
        m.true("eps re-derived from the engine's rho is over budget", eps_sel + eps_agg <= job.epsilon * (1 + 1e-9),
               f"({eps_sel} + {eps_agg} > {job.epsilon})")
        m.rel("key_selection.delta_beta = (e^eps_sel + 1) C T beta", ks["delta_beta"],
              (math.exp(ks["epsilon"]) + 1) * job.C * job.T * ks["beta_per_test"], 1e-12)
    m.true("key selection's delta terms exceed its share", ks["delta_conversion"] + ks["delta_beta"] <= ks["delta"] * (1 + 1e-12))
    m.true("the engine's key-selection delta_conversion is not > 0", ks["delta_conversion"] > 0)


def number_after(text, pattern, label):
    mo = re.search(pattern, text, re.MULTILINE)
    assert mo, f"budget text has no line matching {pattern!r} ({label})\n--- text ---\n{text}"
    return float(mo.group(1))


def compare_text(text, ref, m):
    job = ref.job
    lines = text.splitlines()
    m.true("first line is not the budget line", lines and lines[0].startswith("privacy budget per window: epsilon = "),
           f"({lines[:1]})")
    m.true("budget line: wrong epsilon/delta",
           re.search(rf"^privacy budget per window: epsilon = {re.escape(f'{job.epsilon:g}')}, delta = ", text, re.M)
           is not None)
    m.true("trees line wrong", f"trees: T = {job.T} triggers, {ref.levels} levels" in text and f"C = {job.C}" in text)
    m.true("a WARNING about the seed is printed for an unseeded job",
           not any("WARNING" in ln and "seed" in ln for ln in lines))
    mo = re.search(r"threshold\s+mu = ([-+0-9.e]+)", text)
    m.true("no 'threshold mu = ...' line", mo is not None)
    if mo:
        m.true(f"text mu = {mo.group(1)}, reference {ref.mu}", abs(float(mo.group(1)) - ref.mu) <= 1e-6 * max(1.0, ref.mu))
    num = r"([-+0-9.e]+)"
    m.rel("text key selection eps", number_after(text, rf"^key selection\s+eps {num}", "eps_sel"), ref.eps_sel, 1e-5)
    m.rel("text key-selection sigma", number_after(text, rf"^\s+tree\s+sigma = {num} users per node", "sigma_sel"),
          ref.sigma_sel, 1e-5)
    m.rel("text key-selection eps tight", number_after(text, rf"^\s+eps\s+{num} tight \(CKS", "eps_sel tight"),
          ref.eps_sel_tight, 1e-5)
    m.rel("text beta", number_after(text, rf"^\s+beta\s+{num} per threshold test", "beta"), ref.beta, 1e-3)
    m.rel("text tau_1", number_after(text, rf"tau_1 = {num}", "tau_1"), ref.tau[1], 1e-5)
    m.rel("text tau_T", number_after(text, rf"tau_T = {num}", "tau_T"), ref.tau[job.T], 1e-5)
    m.rel("text aggregation eps", number_after(text, rf"^aggregation\s+eps {num}", "eps_agg"), ref.eps_agg, 1e-5)
    for c in ref.columns:
        m.rel(f"text {c.name} sigma", number_after(text, rf"^\s+{c.name}\s+sigma = {num}", c.name), c.sigma, 1e-5)
    if job.sum:
        m.rel("text sum grid", number_after(text, rf"^\s+sum grid\s+values rounded to multiples of {num}", "grid"),
              ref.sum_grid, 1e-5)
    mo = re.search(rf"^total\s+eps {num} <= ([-+0-9.e]+), delta {num} <= ([-+0-9.e]+): within budget(.*)$", text, re.M)
    m.true("no 'total ... within budget' line", mo is not None)
    if mo:
        m.rel("text total eps", float(mo.group(1)), ref.eps_total, 1e-5)
        m.rel("text total delta", float(mo.group(3)), ref.delta_total, 1e-3)
    # The composition is named: zcdp has its own line and says so in the total line; basic says so there.
    tail = mo.group(5) if mo else ""
    if ref.composition == "zcdp":
        mo = re.search(rf"^composition\s+zcdp: rho = {num} = rho\(eps, delta - beta term {num}\), shared by key "
                       rf"selection \({num}\) and aggregation \({num}\)", text, re.M)
        m.true("no 'composition     zcdp: rho = ...' line", mo is not None)
        if mo:
            m.rel("text zcdp rho", float(mo.group(1)), ref.rho_total, 1e-5)
            m.rel("text zcdp beta term", float(mo.group(2)), ref.delta_beta, 1e-3)
            m.rel("text zcdp key selection rho", float(mo.group(3)), ref.rho_sel, 1e-5)
            m.rel("text zcdp aggregation rho", float(mo.group(4)), ref.rho_agg_target, 1e-5)
        m.true("total line does not say 'composition zcdp'", "composition zcdp" in tail, f"({tail!r})")
        m.true("beta line does not charge (e^eps + 1)", re.search(r"charged \(e\^eps \+ 1\) \* C \* T", text) is not None)
    else:
        m.true("total line does not say 'basic composition'", "basic composition" in tail, f"({tail!r})")
        m.true("a 'composition zcdp' line is printed for composition = basic",
               re.search(r"^composition\s+zcdp", text, re.M) is None)
        m.true("beta line does not charge (e^eps_sel + 1)",
               re.search(r"charged \(e\^eps_sel \+ 1\) \* C \* T", text) is not None)
    # --thresholds table: "step  lambda        tau" then one row per step.
    try:
        start = lines.index("step  lambda        tau")
    except ValueError:
        m.true("no thresholds table header", False)
        return
    table = lines[start + 1:start + 1 + job.T]
    m.eq("thresholds table rows", len(table), job.T)
    for s, row in enumerate(table, start=1):
        parts = row.split()
        if len(parts) != 3 or parts[0] != str(s):
            m.true(f"thresholds table row {s} malformed: {row!r}", False)
            continue
        m.rel(f"text lambda_{s}", float(parts[1]), ref.lam[s], 1e-5)
        m.rel(f"text tau_{s}", float(parts[2]), ref.tau[s], 1e-5)


def compare_columns(ag, ref, ref_e, levels, m):
    """The released columns (count, sum) of a plan; ref_e holds the formulas the engine's own
    upstream numbers lead to (for the rounding checks)."""
    job = ref.job
    m.eq("aggregation.columns names", [c["name"] for c in ag["columns"]], [c.name for c in ref.columns])
    for c in ag["columns"]:
        try:
            rc, rc_e = ref.column(c["name"]), ref_e.column(c["name"])
        except KeyError:
            continue
        m.rel(f"aggregation.{c['name']}.sigma", c["sigma"], rc.sigma)
        sigma_rounded_up(m, f"aggregation.{c['name']}", c["sigma"], rc_e.sigma_formula)
        m.rel(f"aggregation.{c['name']}.rho", c["rho"], rc.rho)
        m.rel(f"aggregation.{c['name']}.rho = levels L^2 / (2 sigma^2)", c["rho"],
              levels * c["l2_sensitivity_per_level"] ** 2 / (2 * c["sigma"] ** 2), 1e-12)
        m.rel(f"aggregation.{c['name']}.l2_sensitivity_per_level", c["l2_sensitivity_per_level"], rc.sensitivity)
        m.eq(f"aggregation.{c['name']}.unit", c["unit"], "records" if c["name"] == "count" else "value")
    used = sum(c["rho"] for c in ag["columns"])
    m.true("aggregation: the columns' rho exceed rho_agg", used <= ref_e.rho_agg_target * (1 + 1e-12),
           f"({used!r} > {ref_e.rho_agg_target!r})")
    if job.sum:
        m.rel("aggregation.sum_grid", ag["sum_grid"], ref.sum_grid, 1e-12)
        m.rel("aggregation.clamp_bound", ag["clamp_bound"], ref.clamp_bound, 1e-12)
        sigma_quanta = ref.column("sum").sigma / ref.sum_grid
        m.true("sum noise is not within the sampler's grid range (sigma <= 2^22 grid steps, and > 2^21 unless g = 2^-20)",
               sigma_quanta <= 2 ** 22 * (1 + 1e-12) and (ref.sum_quantum == 1 or sigma_quanta > 2 ** 21),
               f"({sigma_quanta})")
    return used


def compare_baseline(j, ref, m):
    """`budget --json` of a baseline job against dp_reference.make_baseline_plan (PRIVACY.md 8)."""
    job = ref.job
    T, C = job.T, job.C
    optimal = ref.composition == "optimal"
    m.eq("budget.epsilon", j["budget"]["epsilon"], job.epsilon)
    m.eq("budget.delta", j["budget"]["delta"], job.delta)
    m.eq("mode", j.get("mode"), job.mode)
    m.eq("composition", j.get("composition"), ref.composition)
    m.eq("private", j["private"], True)
    m.eq("threshold_proven", j.get("threshold_proven"), job.threshold == "subgaussian")
    rl, pr, th, ag, tot = j["releases"], j["per_release"], j["threshold"], j["aggregation"], j["total"]
    m.eq("releases.triggers", rl["triggers"], T)
    m.eq("releases.C", rl["C"], C)
    m.rel("releases.releases_composed", rl["releases_composed"], ref.releases_composed, 0)
    ref_e = ref
    if optimal:
        # eps0: ours is the largest by a float bisection; the engine's may sit a hair lower (safety margin),
        # never above. The rest of the plan follows from it: recompute it from the engine's eps0.
        m.rel("per_release.eps0", pr["eps0"], ref.eps0, 1e-9)
        m.true("per_release.eps0 above the largest eps0 that meets the budget", pr["eps0"] <= ref.eps0 * (1 + 1e-12),
               f"({pr['eps0']!r} > {ref.eps0!r})")
        m.rel("per_release.delta0", pr["delta0"], ref.delta0, 1e-12)
        ref_e = dp_reference.make_baseline_plan(job, eps0=pr["eps0"])
    else:
        m.eq("per_release.eps0 (zcdp: not used)", pr["eps0"], 0)
        m.eq("per_release.delta0 (zcdp: not used)", pr["delta0"], 0)
    m.rel("per_release.rho", pr["rho"], ref.rho_release_target)
    m.true("per_release.rho over its target", pr["rho"] <= ref_e.rho_release_target * (1 + 1e-12),
           f"({pr['rho']!r} > {ref_e.rho_release_target!r})")

    noise = th["noise"]
    m.eq("threshold.noise.name", noise["name"], "threshold")
    m.eq("threshold.noise.unit", noise["unit"], "users")
    m.rel("threshold.noise.l2_sensitivity_per_level", noise["l2_sensitivity_per_level"], math.sqrt(C))
    m.rel("threshold.noise.sigma", noise["sigma"], ref.sigma_thr)
    sigma_rounded_up(m, "threshold", noise["sigma"], ref_e.sigma_thr_formula)
    m.rel("threshold.noise.rho", noise["rho"], ref.rho_thr)
    m.rel("threshold.noise.rho = C / (2 sigma^2)", noise["rho"], C / (2 * noise["sigma"] ** 2), 1e-12)
    m.true("threshold.noise.rho over share_e rho_release", noise["rho"] <= ref_e.rho_thr_target * (1 + 1e-12),
           f"({noise['rho']!r} > {ref_e.rho_thr_target!r})")
    m.rel("threshold.tau", th["tau"], ref.tau)
    m.rel("threshold.tau = 1 + sigma tail_z", th["tau"], 1 + noise["sigma"] * th["tail_z"], 1e-12)
    m.rel("threshold.tail_per_key", th["tail_per_key"], ref.tail)
    m.rel("threshold.keys_per_user", th["keys_per_user"], ref.keys_per_user, 0)
    m.rel("threshold.delta", th["delta"], ref.delta_threshold)
    m.rel("threshold.tail_z", th["tail_z"], ref.tail_z)
    m.eq("threshold.threshold_tail", th["threshold_tail"], job.threshold)
    # The threshold really bounds the tail: a key whose only user is this one passes iff N > tau - 1.
    sigma = noise["sigma"]
    if job.threshold == "subgaussian":
        m.rel("tail_z = sqrt(2 ln(1/tail))", th["tail_z"], math.sqrt(2 * math.log(1 / th["tail_per_key"])), 1e-12)
        if sigma <= 5000:
            exact = dp_reference.discrete_gaussian_upper_tail(sigma, th["tau"] - 1)
            m.true("the discrete Gaussian's P[N > tau - 1] exceeds tail_per_key", exact <= th["tail_per_key"],
                   f"({exact!r} > {th['tail_per_key']!r})")
    else:
        m.rel("gaussian-quantile: P[N(0, sigma^2) > tau - 1] = tail",
              0.5 * math.erfc((th["tau"] - 1) / sigma / math.sqrt(2)), th["tail_per_key"], 1e-6)

    used_cols = compare_columns(ag, ref, ref_e, 1, m)
    rho_release_used = noise["rho"] + used_cols

    m.rel("total.epsilon", tot["epsilon"], ref.eps_total)
    m.rel("total.delta", tot["delta"], ref.delta_total)
    m.eq("total.within_budget", tot["within_budget"], True)
    m.rel("total.rho", tot["rho"], ref.rho_total_used)
    m.rel("total.rho = releases x one release's rho", tot["rho"], rl["releases_composed"] * rho_release_used, 1e-12)
    m.rel("total.delta_conversion", tot["delta_conversion"], ref.delta_conversion)
    m.true("total.composition does not name the composition",
           ("optimal composition" in tot["composition"]) if optimal else ("zCDP" in tot["composition"]),
           f"({tot['composition']!r})")
    m.true("total.epsilon over budget", tot["epsilon"] <= job.epsilon * (1 + 1e-9), f"({tot['epsilon']!r} > {job.epsilon})")
    m.true("total.delta over budget", tot["delta"] <= job.delta * (1 + 1e-9), f"({tot['delta']!r} > {job.delta})")
    # Within budget, re-derived from the engine's own sigmas with our accounting.
    if optimal:
        d0 = pr["delta0"]
        m.rel("delta0: (1 - delta0)^T = 1 - delta / 2", float(1 - (1 - Decimal(d0)) ** T), job.delta / 2, 1e-12)
        m.rel("delta0 = delta_conversion + C tail", tot["delta_conversion"] + C * th["tail_per_key"], d0, 1e-12)
        m.rel("threshold.delta = T C tail", th["delta"], T * C * th["tail_per_key"], 1e-12)
        eps0_used = dp_reference.eps_tight(rho_release_used, tot["delta_conversion"])
        m.true("eps0 re-derived from the engine's sigmas exceeds its eps0", eps0_used <= pr["eps0"] * (1 + 1e-12),
               f"({eps0_used!r} > {pr['eps0']!r})")
        spent = dp_reference.oct_delta_decimal(eps0_used, d0, T, job.epsilon) if T <= 1000 else None
        m.true("optimal composition (60 digits) of the engine's releases is over delta",
               spent is None or spent <= Decimal(job.delta) * (1 + Decimal("1e-9")), f"({spent} > {job.delta})")
        if spent is not None:
            m.rel("total.delta = OCT_T(eps0 used, delta0)(eps) (60 digits)", tot["delta"], float(spent), 1e-9)
    else:
        eps_all = dp_reference.eps_tight(rl["releases_composed"] * rho_release_used, tot["delta_conversion"])
        m.true("eps re-derived from the engine's sigmas is over budget", eps_all <= job.epsilon * (1 + 1e-9),
               f"({eps_all!r} > {job.epsilon})")
        m.rel("threshold.delta = keys x tail", th["delta"], th["keys_per_user"] * th["tail_per_key"], 1e-12)
        m.true("delta_conversion + threshold.delta over delta",
               tot["delta_conversion"] + th["delta"] <= job.delta * (1 + 1e-12))


def compare_baseline_text(text, ref, m):
    """`dpstream budget` of a baseline job: names the mode and the composition, with the numbers."""
    job = ref.job
    num = r"([-+0-9.e]+)"
    lines = text.splitlines()
    m.true("first line is not the budget line", lines and lines[0].startswith("privacy budget per window: epsilon = "),
           f"({lines[:1]})")
    m.true("budget line: wrong epsilon",
           re.search(rf"^privacy budget per window: epsilon = {re.escape(f'{job.epsilon:g}')}, delta = ", text, re.M)
           is not None)
    m.true("a WARNING about the seed is printed for an unseeded job",
           not any("WARNING" in ln and "seed" in ln for ln in lines))
    m.true(f"no 'mode {job.mode}: ... T = {job.T} triggers, C = {job.C}' line",
           re.search(rf"^mode {re.escape(job.mode)}: .* T = {job.T} triggers, C = {job.C}$", text, re.M) is not None)
    if ref.composition == "zcdp":
        mo = re.search(rf"^composition\s+zcdp: rho = {num} in total, a user pays (\d+) release\(s\)' rho; "
                       rf"converted once with delta {num}", text, re.M)
        m.true("no 'composition     zcdp: rho = ... in total' line", mo is not None)
        if mo:
            m.rel("text zcdp rho", float(mo.group(1)), ref.rho_total, 1e-5)
            m.eq("text releases a user pays", int(mo.group(2)), ref.releases_composed)
            m.rel("text conversion delta", float(mo.group(3)), ref.delta_conversion, 1e-3)
        m.true("zcdp text mentions the optimal composition", "optimal" not in text.lower())
    else:
        mo = re.search(rf"^composition\s+optimal \(KOV 2015\): T = (\d+) releases of \(eps0 {num}, delta0 {num}\)",
                       text, re.M)
        m.true("no 'composition     optimal (KOV 2015): T = ... releases of (eps0 ..., delta0 ...)' line", mo is not None)
        if mo:
            m.eq("text T", int(mo.group(1)), job.T)
            m.rel("text eps0", float(mo.group(2)), ref.eps0, 1e-5)
            m.rel("text delta0", float(mo.group(3)), ref.delta0, 1e-3)
        m.true("optimal text mentions zcdp", "zcdp" not in text.lower())
    mo = re.search(rf"^\s+per release\s+rho = {num} \(threshold {num} \+ columns {num}\)", text, re.M)
    m.true("no 'per release rho = ... (threshold ... + columns ...)' line", mo is not None)
    if mo:
        m.rel("text per-release rho", float(mo.group(1)), ref.rho_release_target, 1e-5)
        m.rel("text threshold rho", float(mo.group(2)), ref.rho_thr, 1e-5)
        m.rel("text columns rho", float(mo.group(3)), ref.rho_agg_target, 1e-5)
    mo = re.search(rf"^threshold\s+sigma = {num} users, L2 sensitivity sqrt\(C\) = {num}; tau = 1 \+ sigma \* {num} = {num}$",
                   text, re.M)
    m.true("no 'threshold sigma = ... tau = 1 + sigma * z = tau' line", mo is not None)
    if mo:
        m.rel("text sigma_thr", float(mo.group(1)), ref.sigma_thr, 1e-5)
        m.rel("text sqrt(C)", float(mo.group(2)), math.sqrt(job.C), 1e-5)
        m.rel("text tail_z", float(mo.group(3)), ref.tail_z, 1e-5)
        m.rel("text tau", float(mo.group(4)), ref.tau, 1e-5)
    mo = re.search(rf"^\s+delta\s+{num} = {num} keys-and-releases per user x tail {num} per key and release", text, re.M)
    m.true("no 'delta ... keys-and-releases per user x tail ...' line", mo is not None)
    if mo:
        m.rel("text threshold delta", float(mo.group(1)), ref.delta_threshold, 1e-3)
        m.rel("text keys per user", float(mo.group(2)), ref.keys_per_user, 1e-3)
        m.rel("text tail", float(mo.group(3)), ref.tail, 1e-3)
    for c in ref.columns:
        m.rel(f"text {c.name} sigma", number_after(text, rf"^\s+{c.name}\s+sigma = {num} \S+ per release", c.name),
              c.sigma, 1e-5)
    mo = re.search(rf"^total\s+eps {num} <= ([-+0-9.e]+), delta {num} <= ([-+0-9.e]+): within budget", text, re.M)
    m.true("no 'total ... within budget' line", mo is not None)
    if mo:
        m.rel("text total eps", float(mo.group(1)), ref.eps_total, 1e-5)
        m.rel("text total delta", float(mo.group(3)), ref.delta_total, 1e-3)


def expect_refusal(run, needles, out_dir, label):
    assert run.returncode == 2, f"{label}: expected exit code 2 (job spec refused)\n  " + run.describe()
    err = run.stderr
    assert "dpstream: error" in err, f"{label}: no 'dpstream: error' line on stderr\n  " + run.describe()
    missing = [n for n in needles if n.lower() not in err.lower()]
    assert not missing, f"{label}: the message does not name {missing}\n  " + run.describe()
    assert not os.path.exists(out_dir), f"{label}: the refused run created {out_dir}: {os.listdir(out_dir)}"


# (label, toml kwargs, needles the message must hold)
REFUSALS = [
    ("epsilon = 0", {"privacy": {"epsilon": 0.0}}, ["epsilon", "> 0"]),
    ("epsilon = -1", {"privacy": {"epsilon": -1.0}}, ["epsilon"]),
    ("epsilon missing", {"privacy": {"epsilon": None}}, ["epsilon", "required"]),
    ("delta = 0", {"privacy": {"delta": 0.0}}, ["delta", "(0, 1)"]),
    ("delta = 1", {"privacy": {"delta": 1.0}}, ["delta", "(0, 1)"]),
    ("delta = 1.5", {"privacy": {"delta": 1.5}}, ["delta"]),
    ("delta missing", {"privacy": {"delta": None}}, ["delta", "required"]),
    ("max_records_per_user = 0 (C < 1)", {"privacy": {"max_records_per_user": 0}}, ["max_records_per_user"]),
    ("triggers = 0 (T < 1)", {"triggers": 0}, ["triggers"]),
    ("clamp_min > clamp_max", {"privacy": {"clamp_min": 2.0, "clamp_max": 1.0}}, ["clamp_max", "clamp_min"]),
    ("mu = -1", {"privacy": {"mu": -1.0}}, ["mu", ">= 0"]),
    ("beta = 0", {"privacy": {"beta": 0.0}}, ["beta", "(0, 1)"]),
    ("beta = 1", {"privacy": {"beta": 1.0}}, ["beta", "(0, 1)"]),
    ("selection_epsilon_share = 1", {"privacy": {"selection_epsilon_share": 1.0}}, ["selection_epsilon_share"]),
    ("selection_delta_share = 0", {"privacy": {"selection_delta_share": 0.0}}, ["selection_delta_share"]),
    ("unknown aggregation \"median\"", {"aggregations": ("count", "median")}, ["aggregations", "median"]),
    ("no aggregation", {"aggregations": ()}, ["aggregations"]),
    # Refused by the plan itself (not by the parser): these need the job's numbers.
    ("beta too large for the selection delta (beta = 1e-3)", {"privacy": {"beta": 1e-3}}, ["beta", "below"]),
    ("beta just above the basic limit (e^eps_sel)", {"privacy": {"beta": "LIMIT", "composition": "basic"}},
     ["beta", "below"]),
    ("beta just above the zcdp limit (e^eps, default composition)", {"privacy": {"beta": "LIMIT_ZCDP"}},
     ["beta", "below"]),
    ("beta between the zcdp and the basic limits (composition = \"zcdp\" set)",
     {"privacy": {"beta": "BETWEEN", "composition": "zcdp"}}, ["beta", "below"]),
    ("sum with clamp [0, 0]", {"privacy": {"clamp_min": 0.0, "clamp_max": 0.0}}, ["clamp", "[\"count\"]"]),
    ("epsilon so small that sigma leaves the sampler's range", {"privacy": {"epsilon": 1e-7}}, ["epsilon"]),
    ("epsilon absurdly large (1e4)", {"privacy": {"epsilon": 1e4}}, ["epsilon"]),
    # A tiny delta (the smallest double), not the small epsilon, leaves no beta: the message must name delta.
    ("delta so small that no beta is left (5e-324)", {"privacy": {"delta": 5e-324, "epsilon": 0.1}},
     ["delta = 5e-324", "larger delta"]),
    ("epsilon absurdly large (1e4), composition = \"basic\"", {"privacy": {"epsilon": 1e4, "composition": "basic"}},
     ["epsilon"]),
    # The composition must fit the mode (PRIVACY.md sections 7-8).
    ("composition = \"optimal\" with mode = \"dp\"", {"privacy": {"composition": "optimal"}}, ["composition", "optimal"]),
    ("composition = \"basic\" with mode = \"baseline-repeated\"",
     {"privacy": {"mode": "baseline-repeated", "composition": "basic", "mu": None}}, ["composition", "basic"]),
    ("composition = \"basic\" with mode = \"baseline-batch\"",
     {"privacy": {"mode": "baseline-batch", "composition": "basic", "mu": None}}, ["composition", "basic"]),
    ("unknown composition \"rdp\"", {"privacy": {"composition": "rdp"}}, ["composition", "rdp"]),
    ("baseline-repeated zcdp: epsilon so small that sigma leaves the sampler's range",
     {"privacy": {"mode": "baseline-repeated", "epsilon": 1e-7, "mu": None}}, ["epsilon"]),
    ("baseline-batch optimal: epsilon so small that sigma leaves the sampler's range",
     {"privacy": {"mode": "baseline-batch", "composition": "optimal", "epsilon": 1e-7, "mu": None}}, ["epsilon"]),
]

# Symbolic betas of REFUSALS (toml_job's defaults: eps 3, delta 1e-9, C 4, T 8), nudged up by 1e-9.
SYMBOLIC_BETA = {"LIMIT": BETA_LIMIT_BASIC * (1 + 1e-9), "LIMIT_ZCDP": BETA_LIMIT_ZCDP * (1 + 1e-9),
                 "BETWEEN": math.sqrt(BETA_LIMIT_BASIC * BETA_LIMIT_ZCDP)}


def resolve_privacy(privacy):
    pr = dict(privacy)
    if isinstance(pr.get("beta"), str):
        pr["beta"] = SYMBOLIC_BETA[pr["beta"]]
    return pr


def deferred(prepare):
    """Runs prepare() now (it writes the jobs and starts the dpstream runs) and returns the check to run
    later; an error while preparing becomes the check's failure."""
    try:
        return prepare()
    except Exception as e:  # re-raised inside the check, where Results reports it
        err = e

        def fail():
            raise err

        return fail


def parse_json(run, what):
    assert run.returncode == 0, f"{what} failed\n  " + run.describe()
    try:
        return json.loads(run.stdout)
    except ValueError as e:
        raise AssertionError(f"{what} printed no JSON ({e}):\n{run.stdout[:2000]}")


def main():
    args = harness.parse_args(__doc__, lambda ap: ap.add_argument(
        "--parallel", type=int, default=6, help="dpstream runs started at a time ahead of the checks"))
    dp = harness.Dpstream(args)
    results = harness.Results(f"test_budget (ranks={args.ranks})")
    pool = ThreadPoolExecutor(max_workers=max(1, args.parallel))

    def start(*argv, cwd=None):
        """dp.run(*argv) in the pool: a future of the Run."""
        return pool.submit(dp.run, *argv, cwd=cwd)

    with harness.TempDir(args.keep, "dpstream-e2e-budget-") as root, pool:
        serial = [0]

        def case_dir(name):
            serial[0] += 1
            d = os.path.join(root, f"{serial[0]:03d}-" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")[:60])
            os.makedirs(d)
            return d

        def reference_self_test():
            problems, _ = dp_reference.self_test(os.path.join(harness.HERE, "..", "reference"))
            assert not problems, "\n  ".join(problems)

        # ---- 1. and 2. the plan, JSON and text (all runs started first, checked in order) ----
        def plan_case(label, T, privacy, aggregations):
            def prepare():
                d = case_dir(label)
                missing_csv = os.path.join(d, "no-such-input.csv")  # budget must not read data
                job = harness.write_job(os.path.join(d, "job.toml"),
                                        toml_job(missing_csv, os.path.join(d, "out"), triggers=T, privacy=privacy,
                                                 aggregations=aggregations, window_seconds=max(8000, T)))
                ref = dp_reference.make_plan(reference_job(T, privacy, aggregations))
                baseline = isinstance(ref, dp_reference.BaselinePlan)
                extra = () if baseline else ("--thresholds",)
                f_json = start("budget", job, "--json", *extra, cwd=d)
                f_text = start("budget", job, *extra, cwd=d)

                def check():
                    j = parse_json(f_json.result(), "budget --json")
                    m = Mismatches()
                    (compare_baseline if baseline else compare_plan)(j, ref, m)
                    m.check(f"budget --json vs dp_reference for {label}")
                    run = f_text.result()
                    assert run.returncode == 0, "budget failed\n  " + run.describe()
                    m = Mismatches()
                    (compare_baseline_text if baseline else compare_text)(run.stdout, ref, m)
                    m.check(f"budget text vs dp_reference for {label}\n--- text ---\n{run.stdout[:3000]}\n---")
                    assert not os.path.exists(os.path.join(d, "out")), "budget created the output dir"

                return check

            return deferred(prepare)

        plan_checks = []
        for label, T, privacy, aggregations in PLAN_JOBS:
            plan_checks.append((f"budget plan, dp/basic: {label}", plan_case(label, T, dict(privacy, **BASIC), aggregations)))
            plan_checks.append((f"budget plan, dp/zcdp (default): {label}", plan_case(label, T, privacy, aggregations)))
        for label, T, privacy, aggregations in PLAN_JOBS_BASIC_ONLY:
            plan_checks.append((f"budget plan, dp/basic: {label}", plan_case(label, T, dict(privacy, **BASIC), aggregations)))
        for label, T, privacy, aggregations in PLAN_JOBS_ZCDP_ONLY:
            plan_checks.append((f"budget plan, dp/zcdp: {label}", plan_case(label, T, privacy, aggregations)))
        for label, T, privacy, aggregations in MATRIX_BUDGETS:
            for mode, comp in PAIRS:
                plan_checks.append((f"budget plan, {mode}/{comp}: {label}",
                                    plan_case(f"{mode} {comp} {label}", T, pair_privacy(privacy, mode, comp), aggregations)))

        def paper_jobs():
            """Runs of the paper's budget (both columns, clamp [0, 1]) under every pair, T = 100 and 1000, and
            the dp job with no composition set; {key: future}."""
            fut = {}
            for T in (100, 1000):
                for mode, comp in PAIRS:
                    d = case_dir(f"paper {mode} {comp} T={T}")
                    job = harness.write_job(os.path.join(d, "job.toml"), toml_job(
                        os.path.join(d, "none.csv"), os.path.join(d, "out"), triggers=T,
                        privacy=pair_privacy(PAPER, mode, comp), window_seconds=8000))
                    fut[(mode, comp, T)] = start("budget", job, "--json", cwd=d)
            d = case_dir("paper dp default composition")
            job = harness.write_job(os.path.join(d, "job.toml"), toml_job(
                os.path.join(d, "none.csv"), os.path.join(d, "out"), triggers=100, privacy=PAPER))
            fut["default"] = start("budget", job, "--json", cwd=d)
            return fut

        def paper_prepare():
            fut = paper_jobs()
            return lambda: fut

        paper = deferred(paper_prepare)  # paper() -> the futures (or the preparation's error)

        # ---- 3. refusals (runs started now too) ----
        def refusal_case(label, kw, needles):
            def prepare():
                d = case_dir(label)
                missing_csv = os.path.join(d, "no-such-input.csv")
                out = os.path.join(d, "out")
                kw2 = {k: (dict(v) if isinstance(v, dict) else v) for k, v in kw.items()}
                if "privacy" in kw2:
                    kw2["privacy"] = resolve_privacy(kw2["privacy"])
                job = harness.write_job(os.path.join(d, "job.toml"), toml_job(missing_csv, out, **kw2))
                runs = [(sub, start(sub, job, cwd=d)) for sub in ("budget", "run")]
                # The same job on an existing CSV (in a sibling directory): refused too, and nothing
                # written. When only the missing-CSV run fails, the refusal comes after the input check
                # (PRIVACY.md section 7).
                sub_dir = d + "-with-input"
                os.makedirs(sub_dir)
                data = os.path.join(sub_dir, "in.csv")
                with open(data, "w", encoding="utf-8") as f:
                    f.write("user_id,key,value,timestamp\nu1,k1,0.5,10\n")
                out2 = os.path.join(sub_dir, "out")
                job2 = harness.write_job(os.path.join(sub_dir, "job.toml"), toml_job(data, out2, **kw2))
                run2 = start("run", job2, cwd=sub_dir)

                def check():
                    problems = []
                    for sub, f in runs:
                        try:
                            expect_refusal(f.result(), needles, out, f"`{sub}` (input CSV does not exist)")
                        except AssertionError as e:
                            problems.append(str(e))
                    assert not os.path.exists(missing_csv), "the input path appeared"
                    left = sorted(os.listdir(d))
                    assert left == ["job.toml"], f"the refused runs wrote {left} next to the job"
                    try:
                        expect_refusal(run2.result(), needles, out2, "`run` (input CSV exists)")
                    except AssertionError as e:
                        problems.append(str(e))
                    left = sorted(os.listdir(sub_dir))
                    assert left == ["in.csv", "job.toml"], f"the refused run wrote {left} next to its job"
                    assert not problems, "\n  ".join(problems)

                return check

            return deferred(prepare)

        refusal_checks = [(f"refused with exit 2 before reading data: {label}", refusal_case(label, kw, needles))
                          for label, kw, needles in REFUSALS]

        # ---- the checks, in order ----
        results.check("dp_reference self-test (shared mpmath values, PRIVACY.md examples, optimal composition)",
                      reference_self_test)
        for label, check in plan_checks:
            results.check(label, check)

        def paper_example():
            # PRIVACY.md (basic split): beta = 4.9e-15 at eps 6, delta 1e-9, C 32, T 100; sigma_sum ~ 250, g = 2^-14.
            j = parse_json(paper()[("dp", "basic", 100)].result(), "budget --json")
            beta = j["key_selection"]["beta_per_test"]
            sums = [c for c in j["aggregation"]["columns"] if c["name"] == "sum"]
            assert abs(beta - 4.9e-15) < 0.05e-15, f"beta {beta}, PRIVACY.md says 4.9e-15"
            assert sums and abs(sums[0]["sigma"] - 250) < 1, f"sum sigma {sums}, PRIVACY.md says 250"
            assert j["aggregation"]["sum_grid"] == 2.0 ** -14, f"sum grid {j['aggregation']['sum_grid']}, PRIVACY.md says 2^-14"
            # One ledger: beta = 2.6e-16 (PRIVACY.md section 6); the default composition is zcdp, the same plan.
            z = parse_json(paper()[("dp", "zcdp", 100)].result(), "budget --json")
            assert abs(z["key_selection"]["beta_per_test"] - 2.6e-16) < 0.05e-16, \
                f"zcdp beta {z['key_selection']['beta_per_test']}, PRIVACY.md says 2.6e-16"
            dflt = parse_json(paper()["default"].result(), "budget --json")
            assert dflt.get("composition") == "zcdp", f"the default composition is {dflt.get('composition')!r}, not zcdp"
            assert dflt == z, f"no composition set differs from composition = \"zcdp\":\n{dflt}\n{z}"

        results.check("PRIVACY.md's worked numbers (basic: beta 4.9e-15, sigma_sum 250, grid 2^-14; zcdp: beta "
                      "2.6e-16) and the default composition is zcdp", paper_example)

        def paper_claims():
            # At eps 6, delta 1e-9, C 32, T 100 one ledger beats the basic split on all three noises.
            fut = paper()
            b = parse_json(fut[("dp", "basic", 100)].result(), "budget --json")
            z = parse_json(fut[("dp", "zcdp", 100)].result(), "budget --json")

            def count_sigma(j):
                return [c["sigma"] for c in j["aggregation"]["columns"] if c["name"] == "count"][0]

            rows = [("sigma_sel", b["key_selection"]["tree"]["sigma"], z["key_selection"]["tree"]["sigma"]),
                    ("tau_1", b["key_selection"]["tau_first"], z["key_selection"]["tau_first"]),
                    ("tau_T", b["key_selection"]["tau_last"], z["key_selection"]["tau_last"]),
                    ("count sigma", count_sigma(b), count_sigma(z)),
                    ("beta", b["key_selection"]["beta_per_test"], z["key_selection"]["beta_per_test"])]
            print("  paper budget (eps 6, delta 1e-9, C 32, T 100), dp: basic vs zcdp")
            for name, vb, vz in rows:
                print(f"    {name:<12} basic {vb:<12.6g} zcdp {vz:<12.6g} zcdp/basic {vz / vb:.4f}")
            for name, vb, vz in rows[:4]:
                assert vz < vb, f"zcdp's {name} {vz} is not below basic's {vb}"
            print("  baselines at the paper's budget (count + sum, clamp [0, 1]):")
            for T in (100, 1000):
                for mode in ("baseline-repeated", "baseline-batch"):
                    for comp in ("zcdp", "optimal"):
                        j = parse_json(fut[(mode, comp, T)].result(), "budget --json")
                        th, pr = j["threshold"], j["per_release"]
                        extra = f" eps0 {pr['eps0']:.6g} delta0 {pr['delta0']:.4g}" if comp == "optimal" else ""
                        print(f"    T={T:<5} {mode:<18} {comp:<8} sigma_thr {th['noise']['sigma']:<10.6g} "
                              f"tau {th['tau']:<10.6g} count sigma {count_sigma(j):<10.6g}{extra}")
                for comp in ("zcdp", "basic"):
                    j = parse_json(fut[("dp", comp, T)].result(), "budget --json")
                    print(f"    T={T:<5} {'dp':<18} {comp:<8} sigma_sel {j['key_selection']['tree']['sigma']:<10.6g} "
                          f"tau_T {j['key_selection']['tau_last']:<10.6g} count sigma {count_sigma(j):<10.6g}")

        results.check("paper's budget, T = 100: dp/zcdp has lower sigma_sel, tau_T and count sigma than dp/basic",
                      paper_claims)

        for label, check in refusal_checks:
            results.check(label, check)

        def reference_refuses_too():
            # The same cases are refused by the Python plan (guards the reference itself).
            for label, kw, _ in REFUSALS:
                pr = resolve_privacy(kw.get("privacy", {}))
                if "epsilon" in pr and pr["epsilon"] is None or "delta" in pr and pr["delta"] is None:
                    continue  # a parser matter
                aggs = kw.get("aggregations", ("count", "sum"))
                if any(a not in ("count", "sum") for a in aggs):
                    continue
                T = kw.get("triggers", 8)
                try:
                    dp_reference.make_plan(reference_job(T, pr, aggs))
                except (dp_reference.PlanRefused, ValueError):
                    continue
                raise AssertionError(f"dp_reference accepts the refused case {label}")
            # ... and accepts the BETWEEN beta under basic (only the e^eps charge refuses it).
            pr = resolve_privacy({"beta": "BETWEEN", "composition": "basic"})
            dp_reference.make_plan(reference_job(8, pr, ("count", "sum")))

        results.check("dp_reference refuses the same cases", reference_refuses_too)

        def mode_none_budget():
            d = case_dir("mode none budget")
            out = os.path.join(d, "out")
            job = harness.write_job(os.path.join(d, "job.toml"), toml_job(
                os.path.join(d, "none.csv"), out, privacy={"mode": "none", "epsilon": None, "delta": None, "mu": None}))
            expect_refusal(dp.run("budget", job, cwd=d), ["mode", "dp"], out, "`budget` on mode = \"none\"")
            expect_refusal(dp.run("budget", job, "--json", cwd=d), ["mode", "dp"], out,
                           "`budget --json` on mode = \"none\"")

        results.check("budget on mode = \"none\" -> exit 2 (set mode = \"dp\")", mode_none_budget)

        # ---- 3. test mode (seed) and the "private" flag ----
        def csv_rows(path):
            lines = ["user_id,key,value,timestamp"]
            for u in range(300):
                lines.append(f"u{u},k{u % 3},{(u % 10) / 10},{(u * 37) % 8000}")
            with open(path, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")

        def seeded_budget_warns():
            d = case_dir("seed warning")
            job_seeded = harness.write_job(os.path.join(d, "seeded.toml"), toml_job(
                os.path.join(d, "x.csv"), os.path.join(d, "out"), privacy={"seed": 7}))
            job_plain = harness.write_job(os.path.join(d, "plain.toml"), toml_job(
                os.path.join(d, "x.csv"), os.path.join(d, "out")))
            r = dp.run("budget", job_seeded, cwd=d)
            assert r.returncode == 0, r.describe()
            warn = [ln for ln in (r.stdout + r.stderr).splitlines() if "WARNING" in ln]
            assert warn and "seed" in warn[0] and "not private" in warn[0].lower(), \
                f"no warning naming the seed and 'NOT private':\n{r.stdout}\n{r.stderr}"
            r = dp.run("budget", job_seeded, "--json", cwd=d)
            assert r.returncode == 0, r.describe()
            assert json.loads(r.stdout)["private"] is False, "budget --json of a seeded job does not say private: false"
            r = dp.run("budget", job_plain, cwd=d)
            assert r.returncode == 0, r.describe()
            warn = [ln for ln in (r.stdout + r.stderr).splitlines() if "WARNING" in ln and "seed" in ln]
            assert not warn, f"unseeded budget warns about a seed: {warn}"

        def private_flag():
            d = case_dir("private flag")
            data = os.path.join(d, "in.csv")
            csv_rows(data)
            outs = {}
            for name, privacy in (("seeded", {"seed": 7}), ("seeded-again", {"seed": 7}), ("unseeded", {}),
                                  ("unseeded-again", {}), ("none", {"mode": "none"})):
                out = os.path.join(d, name)
                job = harness.write_job(os.path.join(d, name + ".toml"), toml_job(data, out, privacy=privacy))
                r = dp.run("run", job, cwd=d)
                assert r.returncode == 0, f"{name} run failed\n  " + r.describe()
                with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
                    summary = json.load(f)
                with open(os.path.join(out, "releases.csv"), encoding="utf-8") as f:
                    outs[name] = (summary, f.read())
            got = {k: v[0].get("private") for k, v in outs.items()}
            want = {"seeded": False, "seeded-again": False, "unseeded": True, "unseeded-again": True, "none": False}
            assert got == want, f"summary.json \"private\": got {got}, want {want}"
            assert outs["seeded"][1] == outs["seeded-again"][1], "two runs with seed 7 released different rows"
            assert outs["unseeded"][1] != outs["unseeded-again"][1] or outs["unseeded"][1].count("\n") <= 1, \
                "two unseeded runs released identical noisy rows (is the secret fixed?)"
            assert outs["seeded"][1].count("\n") > 1, "the seeded run released nothing (test data too small?)"

        results.check("budget on a seeded job prints a WARNING; --json says private: false", seeded_budget_warns)
        results.check("summary.json: seeded run private false, unseeded true; seeded runs reproducible", private_flag)
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
