#!/usr/bin/env python3
"""End-to-end test of `dpstream budget` and of the DP job refusals (docs/PRIVACY.md sections 6-7).

1. Plan: for jobs over T = 1, 2, 7, 100, 1000, C = 1, 32, eps = 0.5, 1, 6, delta = 1e-5, 1e-9,
   count / sum / both, custom shares, explicit beta, both threshold tails, `budget --json
   --thresholds` must match the independent Python plan of dp_reference.py to relative 1e-6
   (every sigma, rho, delta term, beta, eps, tau_s and lambda_s), every sigma must be the formula's
   rounded *up* by at most 1e-12 relative, every rho must stay within its target, the total within
   the budget; the text output must hold the key lines with the same numbers.
2. Refusals: each bad [privacy]/[query] setting exits with code 2 and a message naming the key to
   change, both for `budget` and for `run` on a CSV path that does not exist (the refusal comes
   before any data is read), and no output dir is created.
3. Test mode: [privacy] seed makes `budget` print a warning and summary.json say "private": false;
   an unseeded run says "private": true; a seeded run is reproducible.

Usage: test_budget.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import json
import math
import os
import re
import sys

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
    ("T=100 C=32 eps=6 delta=1e-9 both, mu not set (default floor(min tau / 4))", 100,
     {"max_records_per_user": 32, "epsilon": 6.0, "delta": 1e-9, "mu": None}, ("count", "sum")),
    ("T=7 C=1 eps=1 delta=1e-5 count, mu not set", 7,
     {"max_records_per_user": 1, "epsilon": 1.0, "delta": 1e-5, "mu": None}, ("count",)),
    ("T=1 C=32 eps=0.5 delta=1e-5 sum mu=0", 1,
     {"max_records_per_user": 32, "epsilon": 0.5, "delta": 1e-5, "mu": 0.0}, ("sum",)),
    # The largest accepted beta is (e^eps_sel + 1) C T beta < delta_sel; 0.999 of it leaves delta_conv tiny.
    ("T=8 C=4 eps=3 delta=1e-9 beta = 0.999 of the limit", 8,
     {"beta": 0.999 * (1e-9 * 2 / 3) / ((math.exp(1.5) + 1) * 4 * 8)}, ("count", "sum")),
]

TOML_TO_JOB = {"max_records_per_user": "C", "epsilon": "epsilon", "delta": "delta", "clamp_min": "clamp_min",
               "clamp_max": "clamp_max", "mu": "mu", "beta": "beta", "selection_epsilon_share": "selection_epsilon_share",
               "selection_delta_share": "selection_delta_share", "threshold": "threshold"}


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
    m.true("key_selection.tree.rho exceeds rho(eps_sel, delta_conv)", ks["tree"]["rho"] <= ref.rho_sel_target * (1 + 1e-12),
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
    eps_sel = dp_reference.eps_tight(ks["tree"]["rho"], ks["delta_conversion"])
    eps_agg = dp_reference.eps_tight(used, ag["delta"])
    m.true("eps re-derived from the engine's rho is over budget", eps_sel + eps_agg <= job.epsilon * (1 + 1e-9),
           f"({eps_sel} + {eps_agg} > {job.epsilon})")
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
    mo = re.search(rf"^total\s+eps {num} <= ([-+0-9.e]+), delta {num} <= ([-+0-9.e]+): within budget", text, re.M)
    m.true("no 'total ... within budget' line", mo is not None)
    if mo:
        m.rel("text total eps", float(mo.group(1)), ref.eps_total, 1e-5)
        m.rel("text total delta", float(mo.group(3)), ref.delta_total, 1e-3)
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
    ("beta just above the limit", {"privacy": {"beta": "LIMIT"}}, ["beta", "below"]),
    ("sum with clamp [0, 0]", {"privacy": {"clamp_min": 0.0, "clamp_max": 0.0}}, ["clamp", "[\"count\"]"]),
    ("epsilon so small that sigma leaves the sampler's range", {"privacy": {"epsilon": 1e-7}}, ["epsilon"]),
    ("epsilon absurdly large (1e4)", {"privacy": {"epsilon": 1e4}}, ["epsilon"]),
]


def main():
    args = harness.parse_args(__doc__)
    dp = harness.Dpstream(args)
    results = harness.Results(f"test_budget (ranks={args.ranks})")
    with harness.TempDir(args.keep, "dpstream-e2e-budget-") as root:
        serial = [0]

        def case_dir(name):
            serial[0] += 1
            d = os.path.join(root, f"{serial[0]:02d}-" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")[:60])
            os.makedirs(d)
            return d

        def reference_self_test():
            problems, _ = dp_reference.self_test(os.path.join(harness.HERE, "..", "..", "..", "shared", "reference"))
            assert not problems, "\n  ".join(problems)

        results.check("dp_reference self-test (shared mpmath values, PRIVACY.md examples)", reference_self_test)

        # ---- 1. the plan, JSON and text ----
        def plan_case(label, T, privacy, aggregations):
            def case():
                d = case_dir(label)
                missing_csv = os.path.join(d, "no-such-input.csv")  # budget must not read data
                job = harness.write_job(os.path.join(d, "job.toml"),
                                        toml_job(missing_csv, os.path.join(d, "out"), triggers=T, privacy=privacy,
                                                 aggregations=aggregations, window_seconds=max(8000, T)))
                ref = dp_reference.make_plan(reference_job(T, privacy, aggregations))
                run = dp.run("budget", job, "--json", "--thresholds", cwd=d)
                assert run.returncode == 0, "budget --json --thresholds failed\n  " + run.describe()
                try:
                    j = json.loads(run.stdout)
                except ValueError as e:
                    raise AssertionError(f"budget --json printed no JSON ({e}):\n{run.stdout[:2000]}")
                m = Mismatches()
                compare_plan(j, ref, m)
                m.check(f"budget --json vs dp_reference for {label}")
                run = dp.run("budget", job, "--thresholds", cwd=d)
                assert run.returncode == 0, "budget --thresholds failed\n  " + run.describe()
                m = Mismatches()
                compare_text(run.stdout, ref, m)
                m.check(f"budget text vs dp_reference for {label}\n--- text ---\n{run.stdout[:3000]}\n---")
                assert not os.path.exists(os.path.join(d, "out")), "budget created the output dir"

            return case

        for label, T, privacy, aggregations in PLAN_JOBS:
            results.check(f"budget plan: {label}", plan_case(label, T, privacy, aggregations))

        def paper_example():
            # PRIVACY.md: beta = 4.9e-15 at eps 6, delta 1e-9, C 32, T 100; sigma_sum ~ 250 and g = 2^-14.
            d = case_dir("paper example")
            job = harness.write_job(os.path.join(d, "job.toml"), toml_job(
                os.path.join(d, "none.csv"), os.path.join(d, "out"), triggers=100,
                privacy={"max_records_per_user": 32, "epsilon": 6.0, "delta": 1e-9}))
            run = dp.run("budget", job, "--json", cwd=d)
            assert run.returncode == 0, run.describe()
            j = json.loads(run.stdout)
            beta = j["key_selection"]["beta_per_test"]
            sums = [c for c in j["aggregation"]["columns"] if c["name"] == "sum"]
            assert abs(beta - 4.9e-15) < 0.05e-15, f"beta {beta}, PRIVACY.md says 4.9e-15"
            assert sums and abs(sums[0]["sigma"] - 250) < 1, f"sum sigma {sums}, PRIVACY.md says 250"
            assert j["aggregation"]["sum_grid"] == 2.0 ** -14, f"sum grid {j['aggregation']['sum_grid']}, PRIVACY.md says 2^-14"

        results.check("PRIVACY.md's worked numbers (beta 4.9e-15, sigma_sum 250, grid 2^-14)", paper_example)

        # ---- 2. refusals ----
        def refusal_case(label, kw, needles):
            def case():
                d = case_dir(label)
                missing_csv = os.path.join(d, "no-such-input.csv")
                out = os.path.join(d, "out")
                kw2 = {k: (dict(v) if isinstance(v, dict) else v) for k, v in kw.items()}
                if kw2.get("privacy", {}).get("beta") == "LIMIT":
                    # The largest refused beta: (e^eps_sel + 1) C T beta = delta_sel, nudged up by 1e-9.
                    eps_sel, delta_sel = 3.0 * 0.5, 1e-9 * 2 / 3
                    kw2["privacy"]["beta"] = delta_sel / ((math.exp(eps_sel) + 1) * 4 * 8) * (1 + 1e-9)
                job = harness.write_job(os.path.join(d, "job.toml"), toml_job(missing_csv, out, **kw2))
                problems = []
                for sub in ("budget", "run"):
                    r = dp.run(sub, job, cwd=d)
                    try:
                        expect_refusal(r, needles, out, f"`{sub}` (input CSV does not exist)")
                    except AssertionError as e:
                        problems.append(str(e))
                assert not os.path.exists(missing_csv), "the input path appeared"
                left = sorted(os.listdir(d))
                assert left == ["job.toml"], f"the refused runs wrote {left} next to the job"
                # The same job on an existing CSV: refused too, and still nothing written. When only the
                # missing-CSV run fails, the refusal comes after the input check (PRIVACY.md section 7).
                sub = os.path.join(d, "with-input")
                os.makedirs(sub)
                data = os.path.join(sub, "in.csv")
                with open(data, "w", encoding="utf-8") as f:
                    f.write("user_id,key,value,timestamp\nu1,k1,0.5,10\n")
                out2 = os.path.join(sub, "out")
                job2 = harness.write_job(os.path.join(sub, "job.toml"), toml_job(data, out2, **kw2))
                try:
                    expect_refusal(dp.run("run", job2, cwd=sub), needles, out2, "`run` (input CSV exists)")
                except AssertionError as e:
                    problems.append(str(e))
                assert not problems, "\n  ".join(problems)

            return case

        for label, kw, needles in REFUSALS:
            results.check(f"refused with exit 2 before reading data: {label}", refusal_case(label, kw, needles))

        def reference_refuses_too():
            # The same cases are refused by the Python plan (guards the reference itself).
            for label, kw, _ in REFUSALS:
                pr = dict(kw.get("privacy", {}))
                if pr.get("beta") == "LIMIT":
                    pr["beta"] = (1e-9 * 2 / 3) / ((math.exp(1.5) + 1) * 32) * (1 + 1e-9)
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
