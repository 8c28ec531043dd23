#!/usr/bin/env python3
"""End-to-end test of the budget ledger (src/ledger.hpp, docs/LEDGER.md): `dpstream ledger` and
jobs with [privacy] ledger, against an independent computation of the block accounting.

1. Accounting: jobs of several kinds (DP-SQLP zcdp, DP-SQLP basic, baseline optimal) on overlapping
   windows; after each, `ledger show --json` per block equals the accounting recomputed here from each
   job's own `dpstream budget --json` (rho = key selection + columns, delta outside zCDP = delta_beta)
   with dp_reference.eps_tight (zCDP blocks), or the plain sums of (epsilon, delta) (mixed blocks).
2. Refusal: the job that would exceed a block's ceiling exits 2 naming the block, what it asks and
   what is left; the ledger is unchanged, the job wrote no releases.
3. Racing: 8 jobs started at once on one ledger; exactly as many are admitted as the independent
   computation allows, and no block exceeds its ceiling.
4. Resume: a job stopped after its first trigger (SIGTERM at a fault point) and resumed is charged
   once; a job killed at its first ingest (after admission) keeps its charge and a fresh re-run (a new
   secret: a new release) is charged again; a seeded job is refused (its output is not private).
5. Damage: an edited charge row, a truncated file, a file that is not a ledger: refused (exit 2).
6. Refusals before any record is read: mode none, windows from the input, other window length,
   retired block, missing ledger, re-init.
7. choose-c --ledger: charged per window, refused beyond the ceiling (the count recomputed here).

Usage: test_ledger.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import concurrent.futures
import json
import math
import os
import shutil
import sqlite3
import subprocess
import sys

import harness

sys.dont_write_bytecode = True  # keep the source tree clean
import dp_reference  # noqa: E402

CEILING_EPS, CEILING_DELTA = 10.0, 1e-6
DAY = 86400


def job_toml(name, ledger, *, eps=3.0, mode="dp", composition="zcdp", windows=1, first_window=0, window_seconds=DAY,
             triggers=6, every=None, extra=""):
    return f"""[job]
name = "{name}"
[input]
kind = "synthetic"
users = 3000
keys = 200
seed = 5
[stream]
window_seconds = {window_seconds}
triggers = {triggers}
windows = {windows}
first_window = {first_window}
[privacy]
mode = "{mode}"
composition = "{composition}"
max_records_per_user = 8
epsilon = {eps}
delta = 1e-9
ledger = "{ledger}"
{extra}
[query]
aggregations = ["count"]
{f"[checkpoint]{chr(10)}every = {every}" if every is not None else "[checkpoint]" + chr(10) + "every = 0"}
[output]
progress = "never"
"""


def charge_of(budget, C=8, T=6):
    """A job's charge from its own budget JSON. zCDP jobs: rho and the failure masses, DP-SQLP's
    threshold failure C T beta paid (e^eps + 1) times at the block's eps ("coupled"), the baselines'
    singleton-key probability paid once ("one-sided"); other jobs: their (epsilon, delta)."""
    total = budget["total"]
    if budget["composition"] != "zcdp":
        return {"zcdp": False, "epsilon": total["epsilon"], "delta": total["delta"]}
    if budget["mode"] == "dp":
        rho = budget["key_selection"]["tree"]["rho"] + sum(c["rho"] for c in budget["aggregation"]["columns"])
        return {"zcdp": True, "rho": rho, "coupled": C * T * budget["key_selection"]["beta_per_test"], "one_sided": 0.0,
                "epsilon": total["epsilon"], "delta": total["delta"]}
    return {"zcdp": True, "rho": total["rho"], "coupled": 0.0, "one_sided": budget["threshold"]["delta"],
            "epsilon": total["epsilon"], "delta": total["delta"]}


def needed_delta(rho, coupled, eps, one_sided=0.0):
    return (dp_reference.cks_delta(rho, eps) if rho > 0 else 0.0) + one_sided + (math.exp(eps) + 1) * coupled


def expected_block(charges, ceiling_eps=CEILING_EPS, ceiling_delta=CEILING_DELTA):
    """The block's accounting, recomputed: zCDP when every charge is (need is convex in eps: its least
    value on [0, eps_g] by ternary search, then the smallest eps with need <= delta_g by bisection),
    else basic composition."""
    if all(c["zcdp"] for c in charges):
        rho = sum(c["rho"] for c in charges)
        coupled = sum(c["coupled"] for c in charges)
        one_sided = sum(c.get("one_sided", 0.0) for c in charges)

        def need(e):
            return needed_delta(rho, coupled, e, one_sided)
        a, b = 0.0, ceiling_eps
        for _ in range(300):
            m1, m2 = a + (b - a) / 3, b - (b - a) / 3
            if need(m1) <= need(m2):
                b = m2
            else:
                a = m1
        best = (a + b) / 2
        basic_eps, basic_delta = sum(c["epsilon"] for c in charges), sum(c["delta"] for c in charges)
        if need(best) > ceiling_delta:
            if basic_delta <= ceiling_delta and basic_eps < math.inf and charges:
                return {"accounting": "basic", "epsilon": basic_eps, "delta": basic_delta}
            return {"accounting": "zcdp", "epsilon": math.inf, "rho": rho, "coupled": coupled, "one_sided": one_sided}
        lo, hi = 0.0, best
        for _ in range(200):
            mid = (lo + hi) / 2
            if need(mid) <= ceiling_delta:
                hi = mid
            else:
                lo = mid
        if basic_delta <= ceiling_delta and basic_eps < hi:  # basic composition proves more: it is used
            return {"accounting": "basic", "epsilon": basic_eps, "delta": basic_delta}
        return {"accounting": "zcdp", "epsilon": hi, "rho": rho, "coupled": coupled, "one_sided": one_sided}
    return {"accounting": "basic", "epsilon": sum(c["epsilon"] for c in charges),
            "delta": sum(c["delta"] for c in charges)}


def between(one, n):
    """A ceiling epsilon that admits n charges `one` on a block and not n + 1 (by bisection here)."""
    lo, hi = 0.01, 100.0
    for _ in range(100):  # the smallest ceiling admitting n
        mid = (lo + hi) / 2
        if expected_block([one] * n, mid)["epsilon"] <= mid:
            hi = mid
        else:
            lo = mid
    fits_n = hi
    lo, hi = fits_n, 100.0
    for _ in range(100):  # the smallest ceiling admitting n + 1
        mid = (lo + hi) / 2
        if expected_block([one] * (n + 1), mid)["epsilon"] <= mid:
            hi = mid
        else:
            lo = mid
    assert hi > fits_n * 1.01, "test setup: n and n + 1 charges need distinct ceilings"
    return (fits_n + hi) / 2


def close(a, b, rel=1e-9):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


def main():
    args = harness.parse_args(__doc__.splitlines()[0])
    dp = harness.Dpstream(args)
    results = harness.Results("e2e ledger")
    with harness.TempDir(args.keep, "dpstream-ledger-") as tmp:
        def path(name):
            return os.path.join(tmp, name)

        def init(name, eps=CEILING_EPS, delta=CEILING_DELTA, block=DAY):
            r = dp.run_with("ledger", "init", path(name), "--epsilon", eps, "--delta", delta, "--block-seconds", block,
                            ranks=1)
            assert r.returncode == 0, r.describe()
            return path(name)

        def show(ledger):
            r = dp.run_with("ledger", "show", ledger, "--json", ranks=1)
            assert r.returncode == 0, r.describe()
            return {b["block"]: b for b in json.loads(r.stdout)["blocks"]}

        def write(name, text):
            p = path(name + ".toml")
            harness.write_job(p, text)
            return p

        def budget_of(spec):
            r = dp.run_with("budget", spec, "--json", ranks=1)
            assert r.returncode == 0, r.describe()
            return json.loads(r.stdout)

        # 1. Accounting against the independent computation.
        def accounting():
            ledger = init("acct.db")
            jobs = [("a", dict(eps=3.0, windows=2)),                        # blocks 0, 1: zcdp
                    ("b", dict(eps=2.0, first_window=1, windows=2)),        # blocks 1, 2: zcdp
                    ("c", dict(eps=1.0, composition="basic", first_window=2)),  # block 2 becomes basic
                    ("d", dict(eps=1.0, mode="baseline-batch", composition="optimal", first_window=3)),
                    ("e", dict(eps=1.0, mode="baseline-repeated", composition="zcdp", windows=1))]  # block 0
            charged = {}
            for name, kw in jobs:
                spec = write(name, job_toml(name, ledger, **kw))
                r = dp.run_with("run", spec, "--out", path("out-" + name))
                assert r.returncode == 0, r.describe()
                assert "charged windows" in r.stderr, r.describe()
                c = charge_of(budget_of(spec))
                first = kw.get("first_window", 0)
                for w in range(first, first + kw.get("windows", 1)):
                    charged.setdefault(w, []).append(c)
                blocks = show(ledger)
                assert sorted(blocks) == sorted(charged), (blocks.keys(), charged.keys())
                for w, cs in charged.items():
                    want, got = expected_block(cs), blocks[w]
                    assert got["accounting"] == want["accounting"], (w, got, want)
                    assert got["charges"] == len(cs)
                    if want["accounting"] == "zcdp":
                        assert close(got["epsilon_spent"], want["epsilon"], 1e-7), (w, got, want)
                        assert close(got["rho_spent"], want["rho"]) and close(got["failure_coupled"], want["coupled"])
                        assert close(got["failure_one_sided"], want["one_sided"]), (got, want)
                        # rho_left: a lower bound of the most another charge could add (a grid of eps <= eps_g)
                        rooms = [(CEILING_EPS * i / 64, CEILING_DELTA - want["one_sided"] - (
                            math.exp(CEILING_EPS * i / 64) + 1) * want["coupled"]) for i in range(1, 65)]
                        best_left = max(dp_reference.rho_tight(e, r) for e, r in rooms if r > 0) - want["rho"]
                        assert 0 <= got["rho_left"] <= best_left * (1 + 1e-3) + 1e-9 and \
                            got["rho_left"] >= best_left * 0.99, (got, best_left)
                    else:
                        assert close(got["epsilon_spent"], want["epsilon"]), (w, got, want)
                        assert close(got["delta_spent"], want["delta"]), (w, got, want)
                    assert got["epsilon_spent"] <= CEILING_EPS * (1 + 1e-12)
            r = dp.run_with("ledger", "explain", ledger, ranks=1)
            assert r.returncode == 0 and "job 'c'" in r.stdout and "basic composition" in r.stdout, r.describe()
            # A basic block says why: a charge that is not zCDP, or every charge zCDP and basic the smaller bound.
            for w, cs in charged.items():
                if expected_block(cs)["accounting"] == "basic":
                    why = "every charge is zCDP, but" if all(c["zcdp"] for c in cs) else "not every charge is zCDP"
                    assert why in r.stdout, (w, why, r.stdout)
        results.check("accounting: every block as recomputed from the jobs' own budgets (zcdp and mixed)", accounting)

        # 2. Refusal: a fourth eps-3 job on a block holding three; nothing written, ledger unchanged.
        def refusal():
            specs = [write(f"r{i}", job_toml(f"r{i}", path("refuse.db"))) for i in range(4)]
            one = charge_of(budget_of(specs[0]))
            # A ceiling between the zCDP total of three and of four such charges (computed here).
            ceiling = between(one, 3)
            ledger = init("refuse.db", eps=ceiling)
            for i in range(3):
                r = dp.run_with("run", specs[i], "--out", path(f"out-r{i}"))
                assert r.returncode == 0, r.describe()
            before = show(ledger)
            r = dp.run_with("run", specs[3], "--out", path("out-r3"))
            assert r.returncode == 2, r.describe()
            for part in ("block 0", "asks", "left", "Lower the job's epsilon", "[privacy]", "--epsilon"):
                assert part in r.stderr, (part, r.stderr)
            assert show(ledger) == before
            assert not os.path.exists(path("out-r3")), "the refused run left the --out it made"
        results.check("refusal: exit 2 naming block, ask and what is left; nothing charged or written", refusal)

        # 3. Racing starts.
        def racing():
            specs = [write(f"race{i}", job_toml(f"race{i}", path("race.db"), eps=2.0)) for i in range(8)]
            one = charge_of(budget_of(specs[0]))
            fit = 3  # the ceiling lies between the zCDP totals of 3 and 4 charges
            ledger = init("race.db", eps=between(one, fit))
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                runs = list(pool.map(lambda i: dp.run_with("run", specs[i], "--out", path(f"out-race{i}"), ranks=1,
                                                           timeout=300), range(8)))
            codes = sorted(r.returncode for r in runs)
            assert codes == [0] * fit + [2] * (8 - fit), [r.describe() for r in runs if r.returncode not in (0, 2)] or codes
            for r in runs:  # a refusal, not a time-out or another error
                assert r.returncode == 0 or "cannot admit" in r.stderr, r.describe()
            block = show(ledger)[0]
            assert block["charges"] == fit and block["epsilon_left"] >= 0, block
        results.check("racing: 8 concurrent jobs, exactly the independent count admitted, ceiling kept", racing)

        # 4. Resume and crash.
        def resume_and_crash():
            ledger = init("resume.db")
            spec = write("res", job_toml("res", ledger, every=1, triggers=8))
            stop = {"DPSTREAM_FAULT": "committed@2:0:TERM"}
            r = dp.run_with("run", spec, "--out", path("out-res"), env=stop)
            assert r.returncode == 5, r.describe()
            r = dp.run_with("run", spec, "--out", path("out-res"), "--resume")
            assert r.returncode == 0 and "already charged" in r.stderr, r.describe()
            assert show(ledger)[0]["charges"] == 1
            # Killed while it read its input, before the charge (which a CSV's parse once preceded: the charge was spent
            # with no checkpoint to resume it by): nothing spent, and a plain re-run is charged once.
            early_ledger = init("early.db")
            early = write("early", job_toml("early", early_ledger, every=1))
            r = dp.run_with("run", early, "--out", path("out-early"), env={"DPSTREAM_FAULT": "input_read@1:0"})
            assert r.returncode != 0 and show(early_ledger) == {}, "killed before its charge, a job spent budget\n  " + \
                r.describe()
            r = dp.run_with("run", early, "--out", path("out-early"))
            assert r.returncode == 0 and "charged windows" in r.stderr, r.describe()
            assert show(early_ledger)[0]["charges"] == 1
            crash = write("crash", job_toml("crash", ledger, every=1))
            r = dp.run_with("run", crash, "--out", path("out-crash"), env={"DPSTREAM_FAULT": "ingest@1:0"})
            assert r.returncode != 0, r.describe()
            assert show(ledger)[0]["charges"] == 2, "the crashed job's charge must stay"
            r = dp.run_with("run", crash, "--out", path("out-crash"), "--fresh")
            assert r.returncode == 0 and "charged windows" in r.stderr, r.describe()
            assert show(ledger)[0]["charges"] == 3, "a fresh run is a new release"
            # A plain run over the finished private job replaces its release: warned of, and charged again.
            r = dp.run_with("run", crash, "--out", path("out-crash"))
            assert r.returncode == 0 and "spends their privacy budget again" in r.stderr, r.describe()
            assert show(ledger)[0]["charges"] == 4
            # Its checkpoint deleted (docs/CHECKPOINTS.md: once the output is taken), summary.json still says so.
            shutil.rmtree(os.path.join(path("out-crash"), "checkpoint"))
            r = dp.run_with("run", crash, "--out", path("out-crash"))
            assert r.returncode == 0 and "holds the release of the finished private job 'crash'" in r.stderr, \
                r.describe()
            assert show(ledger)[0]["charges"] == 5
            r = dp.run_with("run", crash, "--out", path("out-crash"), "--fresh")  # its checkpoint is back: --fresh
            assert r.returncode == 0 and "holds the release of the finished private job 'crash'" in r.stderr, \
                r.describe()
            assert show(ledger)[0]["charges"] == 6
            r = dp.run_with("run", write("seeded", job_toml("seeded", ledger, extra="seed = 7")), "--out",
                            path("out-seeded"))
            assert r.returncode == 2 and "not private" in r.stderr, r.describe()
            r = dp.run_with("run", crash, "--out", path("out-crash2"), "--set", 'privacy.ledger=""')
            assert r.returncode == 2 and "is empty" in r.stderr, r.describe()
            r = dp.run_with("run", spec, "--out", path("out-res"), "--resume", "--set", f'privacy.ledger="{path("x.db")}"')
            assert r.returncode != 0 and "ledger" in r.stderr, r.describe()
            # Another ledger at the same path (the job's relative path from another directory, or a ledger initialized
            # anew): the resume is refused, not charged there; with the ledger that admitted it, it goes on.
            ledger2 = init("resume2.db")
            spec2 = write("res2", job_toml("res2", ledger2, every=1, triggers=8))
            r = dp.run_with("run", spec2, "--out", path("out-res2"), env=stop)
            assert r.returncode == 5, r.describe()
            os.rename(ledger2, ledger2 + ".kept")
            init("resume2.db")
            r = dp.run_with("run", spec2, "--out", path("out-res2"), "--resume")
            assert r.returncode == 2 and "holds no charge of the run being resumed" in r.stderr, r.describe()
            assert show(ledger2) == {}, "the other ledger was charged for a resumed release"
            os.replace(ledger2 + ".kept", ledger2)
            r = dp.run_with("run", spec2, "--out", path("out-res2"), "--resume")
            assert r.returncode == 0 and "already charged" in r.stderr, r.describe()
        results.check("resume: charged once; a crash after admission keeps its charge", resume_and_crash)

        # 5. Damage.
        def damage():
            ledger = init("damage.db")
            r = dp.run_with("run", write("dmg", job_toml("dmg", ledger)), "--out", path("out-dmg"))
            assert r.returncode == 0, r.describe()
            with sqlite3.connect(ledger) as db:
                db.execute("UPDATE charges SET rho = '0x1p-20'")
            r = dp.run_with("ledger", "show", ledger, ranks=1)
            assert r.returncode == 2 and "chain" in r.stderr, r.describe()
            r = dp.run_with("run", path("dmg.toml"), "--out", path("out-dmg2"))
            assert r.returncode == 2 and "chain" in r.stderr, r.describe()
            for label, sql in (("a removed charge", "DELETE FROM charges WHERE seq = 1"),
                               ("a raised ceiling", "UPDATE meta SET value = '0x1.8p+3' WHERE key = 'epsilon'"),
                               ("an undone retirement", "DELETE FROM meta WHERE key = 'retired_through'")):
                copy = init("damage-" + label.replace(" ", "-") + ".db")
                for i in range(2):
                    r = dp.run_with("run", write(f"dm{i}", job_toml(f"dm{i}", copy)), "--out", path(f"out-dm-{label}{i}"))
                    assert r.returncode == 0, r.describe()
                r = dp.run_with("ledger", "retire", copy, "--through", -5, ranks=1)
                assert r.returncode == 0, r.describe()
                with sqlite3.connect(copy) as db:
                    db.execute(sql)
                r = dp.run_with("ledger", "show", copy, ranks=1)
                assert r.returncode == 2 and ("digest" in r.stderr or "chain" in r.stderr), (label, r.describe())
            other = init("trunc.db")
            with open(other, "r+b") as f:
                f.truncate(1000)
            r = dp.run_with("ledger", "show", other, ranks=1)
            assert r.returncode == 2, r.describe()
            with sqlite3.connect(path("foreign.db")) as db:
                db.execute("CREATE TABLE meta(key TEXT, value TEXT)")
            r = dp.run_with("ledger", "show", path("foreign.db"), ranks=1)
            assert r.returncode == 2 and "not a dpstream ledger" in r.stderr, r.describe()
            # Not a database at all: said so, without SQLite's statement; the file is left as it was.
            text = write("notes.txt", "not a ledger\n")
            r = dp.run_with("ledger", "show", text, ranks=1)
            assert r.returncode == 2 and "not an SQLite database" in r.stderr and "PRAGMA" not in r.stderr, \
                r.describe()
            with open(text, encoding="utf-8") as f:
                assert f.read() == "not a ledger\n", "ledger show changed a file that is not a ledger"
            r = dp.run_with("ledger", "show", os.path.dirname(text), ranks=1)
            assert r.returncode == 2 and "is a directory" in r.stderr, r.describe()
        results.check("damage: an edited or removed row, a raised ceiling, an undone retirement, a truncated file, a "
                      "foreign database, a text file, a directory: refused", damage)

        # 6. Refusals before data.
        def refusals():
            ledger = init("ref.db")
            cases = [("none", job_toml("n", ledger, mode="none").replace("epsilon = 3.0", "").replace(
                         "delta = 1e-9", "").replace('composition = "zcdp"', ""), "spends none"),
                     ("other length", job_toml("w", ledger, window_seconds=3600), "window_seconds = 86400"),
                     ("missing", job_toml("m", path("nope.db")), "ledger init")]
            for label, text, needle in cases:
                r = dp.run_with("run", write("ref-" + label.replace(" ", "-"), text), "--out", path("out-ref"))
                assert r.returncode == 2 and needle in r.stderr, (label, r.describe())
            csv = path("in.csv")
            with open(csv, "w") as f:
                f.write("user_id,key,value,timestamp\n1,a,1,5\n")
            text = (f'[input]\nkind = "csv"\npath = "{csv}"\n[stream]\nwindow_seconds = {DAY}\ntriggers = 2\n'
                    f'[privacy]\nmode = "dp"\nmax_records_per_user = 8\nepsilon = 1.0\ndelta = 1e-9\nledger = "{ledger}"\n')
            r = dp.run_with("run", write("ref-csv", text), "--out", path("out-ref-csv"))
            assert r.returncode == 2 and "first_window" in r.stderr, r.describe()
            r = dp.run_with("ledger", "retire", ledger, "--through", 0, ranks=1)
            assert r.returncode == 0, r.describe()
            r = dp.run_with("run", write("ret", job_toml("ret", ledger)), "--out", path("out-ret"))
            assert r.returncode == 2 and "retired" in r.stderr, r.describe()
            r = dp.run_with("ledger", "init", ledger, "--epsilon", 1, "--delta", 1e-6, ranks=1)
            assert r.returncode == 2 and "never re-initialized" in r.stderr, r.describe()
            r = dp.run_with("ledger", "init", "", "--epsilon", 1, "--delta", 1e-6, ranks=1)
            assert r.returncode == 2 and "the ledger's path is empty" in r.stderr, r.describe()
            # Outputs the job could not write are refused before the charge (the run failed only once charged).
            fresh = init("outputs.db")
            for blocked in ("releases.csv", "summary.json"):
                out = path("out-blocked-" + blocked)
                os.makedirs(os.path.join(out, blocked))
                r = dp.run_with("run", write("blocked", job_toml("blocked", fresh)), "--out", out)
                assert r.returncode == 2 and "not a regular file" in r.stderr, r.describe()
            assert show(fresh) == {}, "a job refused for its outputs was charged"
            assert show(ledger) == {}
            # Blocks whose event time starts outside int64 seconds (blocks -2 and 2 of INT64_MAX s: a query's windows)
            # are refused, not charged with a wrapped time range.
            huge = init("huge.db", block=2**63 - 1)
            table = path("huge.csv")
            with open(table, "w") as f:
                f.write("uid,g,ts\nu1,a,5\n")
            for windows in ("-2:0", "1:2"):
                r = dp.run_with("query", "SELECT WITH ANONYMIZATION g, ANON_COUNT(*) FROM t GROUP BY g", "--input",
                                table, "--user-column", "uid", "--epsilon", 1, "--delta", 1e-9, "--window-column", "ts",
                                "--window-seconds", 2**63 - 1, "--windows", windows, "--ledger", huge, "--out",
                                path("out-huge" + windows))
                assert r.returncode == 2 and "outside int64 event time" in r.stderr, r.describe()
            assert show(huge) == {}
            # Windows up to INT64_MAX (the charge's loop must stop there) and a span beyond int64 (refused).
            seconds = init("seconds.db", block=1)
            top = 2**63 - 1
            for windows, code in ((f"{top - 1}:{top}", 0), (f"{-top - 1}:{top}", 2)):
                r = dp.run_with("query", "SELECT WITH ANONYMIZATION g, ANON_COUNT(*) FROM t GROUP BY g", "--input",
                                table, "--user-column", "uid", "--epsilon", 1, "--delta", 1e-9, "--window-column", "ts",
                                "--window-seconds", 1, "--windows", windows, "--ledger", seconds, "--out",
                                path("out-seconds" + windows), timeout=60)
                assert r.returncode == code, r.describe()
            assert sorted(show(seconds)) == [top - 1, top], sorted(show(seconds))
        results.check("refusals before a charge: mode none, CSV windows, window length, retired, missing, re-init, "
                      "a block outside int64 time, outputs that cannot be written",
                      refusals)
        # 8. The path is a file name. SQLite (built with URIs on) read "file:NAME?vfs=unix-none" as a URI: it charged
        # NAME, not the file checked, with its locks off. A link is followed to the file system the ledger is on.
        def path_is_a_file_name():
            target = init("uri-target.db")
            literal = "file:uri-target.db?vfs=unix-none"
            r = dp.run_with("ledger", "init", literal, "--epsilon", CEILING_EPS, "--delta", CEILING_DELTA, ranks=1,
                            cwd=tmp)
            assert r.returncode == 0 and os.path.isfile(path(literal)), r.describe()
            r = dp.run_with("run", write("uri", job_toml("uri", literal)), "--out", path("out-uri"), cwd=tmp)
            assert r.returncode == 0 and "charged windows" in r.stderr, r.describe()
            assert show(target) == {}, "a ledger named like a URI charged another file"
            assert sorted(show(path(literal))) == [0], "the ledger named was not charged"
            mount = path("ramfs")
            os.makedirs(mount)
            if subprocess.run(["mount", "-t", "ramfs", "ramfs", mount], capture_output=True).returncode != 0:
                print("     a link to a ledger on ramfs: skipped (cannot mount here)")
                return
            try:
                shutil.copy2(target, os.path.join(mount, "l.db"))
                os.symlink(os.path.join(mount, "l.db"), path("link.db"))
                for argv in (["ledger", "show", path("link.db")],
                             ["run", write("link", job_toml("link", path("link.db"))), "--out", path("out-link")]):
                    r = dp.run_with(*argv, ranks=1)
                    assert r.returncode == 2 and "is not supported" in r.stderr, r.describe()
            finally:
                subprocess.run(["umount", mount], capture_output=True)
        results.check("the ledger path is a file name (no SQLite URI); a link to an unsupported file system is refused",
                      path_is_a_file_name)

        # 9. Numbers beyond int64 are refused, not clamped; a retirement below the current one says nothing changed.
        def whole_numbers():
            r = dp.run_with("ledger", "init", path("big.db"), "--epsilon", 1, "--delta", 1e-6, "--block-seconds",
                            2**63, ranks=1)
            assert r.returncode == 2 and "--block-seconds: must be a whole number" in r.stderr, r.describe()
            assert not os.path.exists(path("big.db")), "a refused init made the ledger"
            ledger = init("retire-twice.db")
            r = dp.run_with("ledger", "retire", ledger, "--through", 2**64, ranks=1)
            assert r.returncode == 2 and "--through: must be a whole number" in r.stderr, r.describe()
            r = dp.run_with("ledger", "retire", ledger, "--through", 10, ranks=1)
            assert r.returncode == 0 and "every block <= 10 is retired" in r.stdout, r.describe()
            r = dp.run_with("ledger", "retire", ledger, "--through", 3, ranks=1)
            assert r.returncode == 0 and "every block <= 10 was retired already; nothing changed" in r.stdout, \
                r.describe()
        results.check("numbers beyond int64 refused (--block-seconds, --through); a lower retirement changes nothing",
                      whole_numbers)

        # 10. `budget` asks the job's ledger whether it would admit the job now (it said "within budget" while run was
        # refused): its verdict before each run is the run's, and it charges nothing.
        def budget_asks_the_ledger():
            ledger = init("budget.db", eps=3.0)
            spec = write("bq", job_toml("bq", ledger, eps=2.0))
            verdicts = []
            for i in range(4):
                before = show(ledger)
                b = dp.run_with("budget", spec, "--json", ranks=1)
                assert b.returncode == 0 and show(ledger) == before, "budget failed or charged\n  " + b.describe()
                verdict = json.loads(b.stdout)["ledger"]
                r = dp.run_with("run", spec, "--out", path(f"out-bq{i}"))
                assert verdict["admits_now"] == (r.returncode == 0), f"budget said {verdict}\n  " + r.describe()
                if not verdict["admits_now"]:
                    assert "cannot admit job 'bq'" in verdict["refusal"] and r.returncode == 2, verdict
                verdicts.append(verdict["admits_now"])
            assert True in verdicts and False in verdicts, f"expected admissions then a refusal, got {verdicts}"
            r = dp.run_with("budget", write("bqs", job_toml("bqs", ledger, extra="seed = 3")), ranks=1)
            assert r.returncode == 0 and "would refuse the job now" in r.stdout and "not private" in r.stdout, \
                r.describe()
            # run asks before it reads its input: a refusal comes before the input_read fault point, which it never
            # reaches (charged only after the input, run once refused only after a CSV's whole parse).
            r = dp.run_with("run", write("bqe", job_toml("bqe", path("missing.db"))), "--out", path("out-bqe"),
                            env={"DPSTREAM_FAULT": "input_read@1:0"})
            assert r.returncode == 2 and "no such file" in r.stderr, r.describe()
            r = dp.run_with("budget", write("bqm", job_toml("bqm", path("missing.db"))), ranks=1)
            assert r.returncode == 0 and "would refuse the job now" in r.stdout and "no such file" in r.stdout, \
                r.describe()
        results.check("budget: the ledger's verdict now, as run gets it; nothing charged", budget_asks_the_ledger)

        # 7. choose-c charges its window like a job, and is refused once the block is spent.
        def choose_c():
            ledger = init("choose.db", eps=2.0)
            spec = write("cc", job_toml("cc", ledger))
            codes = []
            for _ in range(8):
                r = dp.run_with("choose-c", spec, "--epsilon", 1, "--delta", 1e-7, "--ledger", ledger, "--json",
                                ranks=1)
                codes.append(r.returncode)
                assert r.returncode in (0, 2), r.describe()
                if r.returncode == 2:
                    assert "block 0" in r.stderr, r.describe()
            rho = dp_reference.rho_tight(1.0, 1e-7)
            one = {"zcdp": True, "rho": rho, "coupled": 0.0, "epsilon": 1.0, "delta": 1e-7}
            fit = max(n for n in range(1, 9) if expected_block([one] * n, 2.0)["epsilon"] <= 2.0)
            assert codes == [0] * fit + [2] * (8 - fit), (codes, fit)
            assert show(ledger)[0]["charges"] == fit
            # Without --ledger the job's own ledger is charged; another ledger or a seed is refused, charging nothing.
            own = init("choose-own.db", eps=2.0)
            own_spec = write("cc-own", job_toml("cc-own", own))
            r = dp.run_with("choose-c", own_spec, "--epsilon", 1, "--delta", 1e-7, "--json", ranks=1)
            assert r.returncode == 0, r.describe()
            assert show(own)[0]["charges"] == 1, show(own)
            r = dp.run_with("choose-c", own_spec, "--epsilon", 1, "--delta", 1e-7, "--ledger", ledger, ranks=1)
            assert r.returncode == 2 and "is not the job's [privacy] ledger" in r.stderr, r.describe()
            r = dp.run_with("choose-c", own_spec, "--epsilon", 1, "--delta", 1e-7, "--seed", 3, ranks=1)
            assert r.returncode == 2 and "--seed with a job that charges ledger" in r.stderr, r.describe()
            assert show(own)[0]["charges"] == 1 and show(ledger)[0]["charges"] == fit
        results.check("choose-c: charged per window like a job (its --ledger or the job's own), refused beyond the "
                      "ceiling, another ledger or a seed refused", choose_c)
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
