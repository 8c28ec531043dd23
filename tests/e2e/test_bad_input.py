#!/usr/bin/env python3
"""End-to-end test of dpstream on bad input and bad job specs.

One case per bad input. Each failing case asserts the exit code (2 job-spec/config error,
3 input-data error), a helpful stderr substring, and that the out dir holds no releases.csv,
summary.json or partial file afterwards. The bad_rows = "skip" case asserts the run succeeds
and summary.json counts every kind of bad row; the bad_rows = "fail" cases assert exit 3 and a
message naming the bad row's line number (bad rows are placed late in the file, so with several
ranks they are found by a rank other than 0).

Usage: test_bad_input.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import csv
import json
import os
import re
import shutil
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import reference  # noqa: E402
from reference import Job  # noqa: E402

W = 100
FIRST_WINDOW = 1  # valid timestamps: [100, 200)
JOB = Job(window_seconds=W, triggers=4, first_window=FIRST_WINDOW, windows=1, max_records_per_user=3,
          clamp_min=0.0, clamp_max=1.0)


def toml_job(csv_path=None, out_dir=None, *, drop=(), extra="", replace=None):
    """A valid CSV job spec; `drop` removes lines starting with a key, `replace` maps key -> line."""
    lines = [
        "[job]",
        'name = "e2e-bad-input"',
        "",
        "[input]",
        'kind = "csv"',
        f'path = "{csv_path}"' if csv_path else None,
        'bad_rows = "skip"',
        "",
        "[stream]",
        f"window_seconds = {W}",
        "triggers = 4",
        f"first_window = {FIRST_WINDOW}",
        "windows = 1",
        "",
        "[privacy]",
        'mode = "none"',
        "max_records_per_user = 3",
        "clamp_min = 0.0",
        "clamp_max = 1.0",
        "",
        "[output]",
        f'dir = "{out_dir}"' if out_dir else None,
        'format = "csv"',
        'progress = "never"',
    ]
    out = []
    for line in lines:
        if line is None:
            continue
        key = line.split("=")[0].strip()
        if key in drop:
            continue
        if replace and key in replace:
            line = replace[key]
        out.append(line)
    return "\n".join(out) + "\n" + extra


GOOD_ROWS = [
    "u1,k1,0.5,100",
    "u1,k2,0.25,101",
    "u2,k1,1.5,125",
    '"u,9","k ""q""",0.75,150',
    "u3,k3,-2,160",
    "u1,k1,0.125,170",
    "u1,k1,0.125,171",
    "u4,k2,1,199",
]

# (label, row, kind); kind is the summary.json counter the row must land in.
BAD_ROWS = [
    ("too few fields", "u1,k1,0.5", "malformed"),
    ("too many fields", "u1,k1,0.5,100,extra", "malformed"),
    ("non-numeric value", "u2,k1,abc,110", "malformed"),
    ("empty value", "u2,k1,,110", "malformed"),
    ("non-integer timestamp", "u2,k1,0.5,110.5", "malformed"),
    ("non-numeric timestamp", "u2,k1,0.5,ten", "malformed"),
    ("empty user_id", ",k1,0.5,120", "malformed"),
    ("empty quoted user_id", '"",k1,0.5,120', "malformed"),
    ("empty key", "u3,,0.5,120", "malformed"),
    ("unbalanced quote", '"u4,k1,0.5,130', "malformed"),
    ("NaN value", "u5,k1,NaN,140", "non_finite"),
    ("nan value", "u5,k1,nan,140", "non_finite"),
    ("inf value", "u5,k1,inf,140", "non_finite"),
    ("-inf value", "u5,k1,-inf,140", "non_finite"),
    ("timestamp before the first window", "u6,k1,0.5,99", "out_of_window"),
    ("timestamp after the last window", "u6,k1,0.5,200", "out_of_window"),
    ("negative timestamp", "u6,k1,0.5,-5", "out_of_window"),
]
HEADER = "user_id,key,value,timestamp"


def write(path, text):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    return path


class Case:
    serial = 0

    def __init__(self, dp, root, name):
        self.dp = dp
        Case.serial += 1
        self.dir = os.path.join(root, f"{Case.serial:02d}-" + re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-"))
        os.makedirs(self.dir)
        self.out = os.path.join(self.dir, "out")
        self.csv = os.path.join(self.dir, "in.csv")
        self.job = os.path.join(self.dir, "job.toml")

    def run(self, *args):
        # Run inside the case directory: whatever a buggy run writes to a relative path stays there.
        return self.dp.run("run", *args, cwd=self.dir)


def expect_failure(run, code, out_dir, needles, regex=None):
    """Exit code `code`, every needle (case-insensitive) in stderr, and no outputs left behind."""
    assert run.returncode == code, f"expected exit code {code}\n  " + run.describe()
    err = run.stderr
    assert "dpstream:" in err and "error" in err, "no 'dpstream: ... error' line on stderr\n  " + run.describe()
    missing = [n for n in needles if n.lower() not in err.lower()]
    assert not missing, f"stderr does not mention {missing}\n  " + run.describe()
    if regex:
        assert re.search(regex, err, re.IGNORECASE), f"stderr does not match {regex!r}\n  " + run.describe()
    left = harness.leftover_outputs(out_dir)
    assert not left, f"failed run left {left} in {out_dir}"


def main():
    args = harness.parse_args(__doc__)
    dp = harness.Dpstream(args)
    results = harness.Results(f"test_bad_input (ranks={args.ranks})")
    with harness.TempDir(args.keep, "dpstream-e2e-bad-input-") as root:

        def new(name):
            return Case(dp, root, name)

        # ---- input-data errors (exit 3) ----

        def missing_csv():
            c = new("missing csv")
            missing = os.path.join(c.dir, "does-not-exist.csv")
            write(c.job, toml_job(missing, c.out))
            expect_failure(c.run(c.job), 3, c.out, ["does-not-exist.csv"])

        def missing_column():
            c = new("missing column")
            write(c.csv, "user_id,key,value,ts\nu1,k1,0.5,100\n")
            write(c.job, toml_job(c.csv, c.out))
            expect_failure(c.run(c.job), 3, c.out, ["timestamp"])

        def bare_cr_lines():
            # Lines ending in a bare CR read as one header line: named as such, and no row goes into the message.
            c = new("bare CR lines")
            write(c.csv, "user_id,key,value,timestamp\r" + "".join(f"secret-user-{i},k1,0.5,{i}\r" for i in range(500)))
            write(c.job, toml_job(c.csv, c.out))
            run = c.run(c.job)
            expect_failure(run, 3, c.out, ["bare CR"])
            assert "secret-user" not in run.stderr, run.describe()

        def long_header_quoted_short():
            # A missing column's message lists the header's first 4096 bytes, not all of it.
            c = new("long header")
            write(c.csv, "user_id,key,value," + ",".join(f"column{i}" for i in range(2000)) + "\nu1,k1,0.5\n")
            write(c.job, toml_job(c.csv, c.out))
            run = c.run(c.job)
            expect_failure(run, 3, c.out, ["timestamp", "..."])
            assert "column1999" not in run.stderr, run.describe()

        def empty_csv():
            c = new("empty csv")
            write(c.csv, "")
            write(c.job, toml_job(c.csv, c.out))
            expect_failure(c.run(c.job), 3, c.out, ["in.csv"])

        def csv_is_a_directory():
            c = new("csv is a directory")
            os.makedirs(c.csv)
            write(c.job, toml_job(c.csv, c.out))
            expect_failure(c.run(c.job), 3, c.out, ["is a directory", "in.csv"])

        def csv_not_a_regular_file(kind):
            def case():
                # Read as a stream, /dev/zero never ends (memory grew without bound) and a FIFO blocks at its open.
                c = new(f"csv is a {kind}")
                path = "/dev/zero"
                if kind == "fifo":
                    path = os.path.join(c.dir, "in.fifo")
                    os.mkfifo(path)
                write(c.job, toml_job(path, c.out))
                expect_failure(c.run(c.job), 3, c.out, ["not a regular file", path])

            return case

        def repeated_header_column():
            c = new("repeated header column")
            write(c.csv, "user_id,key,value,timestamp,key\nu1,k1,0.5,100,k2\n")
            write(c.job, toml_job(c.csv, c.out))
            expect_failure(c.run(c.job), 3, c.out, ["'key' twice", "rename"])

        def spec_is_a_directory():
            c = new("spec is a directory")
            expect_failure(c.run(c.dir, "--out", c.out), 2, c.out, ["is a directory", "job spec"])

        def byte_order_mark_and_crlf():
            rows = HEADER + "\n" + "".join(f"u{i % 7},k{i % 5},0.5,{100 + i}\n" for i in range(60))
            outs = []
            for label, text in (("plain", rows.encode()), ("bom", b"\xef\xbb\xbf" + rows.encode()),
                                ("bom crlf", b"\xef\xbb\xbf" + rows.replace("\n", "\r\n").encode())):
                c = new(label)
                with open(c.csv, "wb") as f:
                    f.write(text)
                write(c.job, toml_job(c.csv, c.out))
                run = c.run(c.job)
                assert run.returncode == 0, f"{label}: " + run.describe()
                outs.append(reference.read_releases(os.path.join(c.out, "releases.csv")))
            assert outs[0] and outs[1] == outs[0] and outs[2] == outs[0], \
                f"releases differ: plain {len(outs[0])} rows, with a BOM {len(outs[1])}, BOM and CRLF {len(outs[2])}"

        def generate_refusals():
            c = new("generate refusals")
            syn = os.path.join(c.dir, "syn.toml")
            write(syn, toml_job(None, c.out, drop=("bad_rows",),
                                replace={"kind": 'kind = "synthetic"\nusers = 50\nkeys = 5'}))
            target = os.path.join(c.dir, "stream.csv")
            first = dp.run_with("generate", syn, "--csv", target, ranks=1)
            assert first.returncode == 0 and os.path.getsize(target) > 0, first.describe()
            before = harness.read_bytes(target)
            again = dp.run_with("generate", syn, "--csv", target, ranks=1)
            assert again.returncode == 2 and "exists already" in again.stderr, again.describe()
            assert harness.read_bytes(target) == before, "generate replaced an existing file"
            write(c.csv, HEADER + "\nu1,k1,0.5,100\n")
            write(c.job, toml_job(c.csv, c.out))
            from_csv = dp.run_with("generate", c.job, "--csv", os.path.join(c.dir, "other.csv"), ranks=1)
            assert from_csv.returncode == 2 and "synthetic" in from_csv.stderr, from_csv.describe()
            assert not os.path.exists(os.path.join(c.dir, "other.csv")), "generate wrote a CSV job's stream"
            # An empty --csv was found out only after the whole stream was made; --out was ignored.
            empty = dp.run_with("generate", syn, "--csv", "", ranks=1, cwd=c.dir)
            assert empty.returncode == 2 and "--csv: is empty" in empty.stderr, empty.describe()
            assert not os.path.exists(os.path.join(c.dir, ".tmp")), "generate --csv '' made .tmp"
            with_out = dp.run_with("generate", syn, "--csv", os.path.join(c.dir, "o.csv"), "--out", c.out, ranks=1)
            assert with_out.returncode == 2 and "drop --out" in with_out.stderr, with_out.describe()

        def skip_bad_rows():
            c = new("skip bad rows")
            lines = [HEADER]
            goods = list(GOOD_ROWS)
            for i, (_label, row, _kind) in enumerate(BAD_ROWS):
                if goods and i % 2 == 0:
                    lines.append(goods.pop(0))
                lines.append(row)
                if i == 5:
                    lines.append("")  # a blank line is ignored
            lines.extend(goods)
            write(c.csv, "\n".join(lines) + "\n")
            write(c.job, toml_job(c.csv, c.out))
            run = c.run(c.job)
            assert run.returncode == 0, "run with bad_rows = \"skip\" failed\n  " + run.describe()
            partial = [n for n in os.listdir(c.out) if "partial" in n]
            assert not partial, f"a successful run left {partial} in the out dir"
            with open(os.path.join(c.out, "summary.json"), encoding="utf-8") as f:
                summary = json.load(f)
            want = {f"input.{k}": sum(1 for b in BAD_ROWS if b[2] == k)
                    for k in ("malformed", "non_finite", "out_of_window")}
            inp = reference.read_input(c.csv, JOB)
            exp = reference.compute(inp, JOB)
            # The reference must classify the rows the same way (guards the test itself).
            assert {f"input.{k}": inp.count(k) for k in ("malformed", "non_finite", "out_of_window")} == want, \
                f"reference classification {[(b.line, b.kind) for b in inp.bad]}"
            want["records.kept"] = exp.kept
            want["records.dropped_by_bounding"] = exp.dropped_by_bounding
            want["records.clamped"] = exp.clamped
            diffs = [f"{k}: dpstream {harness.get(summary, k)}, expected {v}" for k, v in want.items()
                     if harness.get(summary, k) != v]
            assert not diffs, "summary.json counts are wrong:\n  " + "\n  ".join(diffs)
            problems = reference.compare_releases(reference.read_releases(os.path.join(c.out, "releases.csv")),
                                                  exp.releases)
            assert not problems, "releases.csv differs from the reference:\n  " + "\n  ".join(problems)

        def fail_on_bad_row(index):
            label, row, _kind = BAD_ROWS[index]

            def case():
                c = new(f"fail {label}")
                # 40 good rows, the bad row at a late line (so another rank owns it when N > 1),
                # then a few more good rows; the last case ends without a trailing newline.
                body = [f"u{i % 9},k{i % 5},0.5,{100 + i % 100}" for i in range(40 + index)]
                lines = [HEADER] + body + [row] + [f"u{i},k1,0.5,150" for i in range(3)]
                bad_line = len(body) + 2
                text = "\n".join(lines) + ("\n" if index % 2 == 0 else "")
                write(c.csv, text)
                write(c.job, toml_job(c.csv, c.out, replace={"bad_rows": 'bad_rows = "fail"'}))
                expect_failure(c.run(c.job), 3, c.out, [], regex=rf"(line\s*{bad_line}\b|:{bad_line}\b)")

            return case

        def tiny_value_is_a_real():
            # 1e-400 is a finite real that underflows to 0 in a double: neither NaN nor inf.
            c = new("tiny value")
            write(c.csv, HEADER + "\nu1,k1,1e-400,100\nu2,k1,0.5,100\n")
            write(c.job, toml_job(c.csv, c.out))
            run = c.run(c.job)
            assert run.returncode == 0, run.describe()
            with open(os.path.join(c.out, "summary.json"), encoding="utf-8") as f:
                summary = json.load(f)
            got = {k: harness.get(summary, k) for k in ("input.malformed", "input.non_finite", "records.kept")}
            assert got == {"input.malformed": 0, "input.non_finite": 0, "records.kept": 2}, \
                f"value 1e-400 should be kept as 0; summary says {got}"
            rows = reference.read_releases(os.path.join(c.out, "releases.csv"))
            assert rows == [(1, 0, "k1", 2, 0.5)], f"releases {rows}, expected [(1, 0, 'k1', 2, 0.5)]"

        def huge_sums(mode):
            def case():
                # Sums beyond the 64-bit fixed-point range (2^43) neither abort nor wrap: whether they
                # occur depends on the data, and an abort would be an output (docs/PRIVACY.md).
                c = new(f"huge sums {mode}")
                n = 6000
                rows = [f"u{i},big,1e12,{100 + i % 100}" for i in range(n)]  # clamped to 2^31
                rows += [f"v{i},small,-2147483648,{100 + i % 100}" for i in range(n)]
                write(c.csv, HEADER + "\n" + "\n".join(rows) + "\n")
                privacy = {"mode": f'mode = "{mode}"', "clamp_min": "clamp_min = -2147483648.0",
                           "clamp_max": "clamp_max = 2147483648.0"}
                extra = "" if mode == "none" else "\n[query]\naggregations = [\"count\", \"sum\"]\n"
                if mode != "none":
                    privacy["clamp_max"] += "\nepsilon = 6.0\ndelta = 1e-9"
                write(c.job, toml_job(c.csv, c.out, replace=privacy, extra=extra))
                run = c.run(c.job)
                assert run.returncode == 0, run.describe()
                with open(os.path.join(c.out, "releases.csv"), encoding="utf-8", newline="") as f:
                    last = {}
                    for r in csv.DictReader(f):
                        last[r["key"]] = r
                if mode == "none":
                    want = {"big": str(n * 2**31), "small": str(-n * 2**31)}
                    got = {k: last[k]["sum"] for k in want if k in last}
                    assert got == want, f"final sums {got}, expected {want}"
                else:  # noisy (sigma about 2.4e10 per tree node at C = 3, eps 6), far within 5% of 1.3e13
                    for k, sign in (("big", 1), ("small", -1)):
                        assert k in last, f"key {k} was not released: {sorted(last)}"
                        est = float(last[k]["sum"])
                        assert abs(est - sign * n * 2**31) < 0.05 * n * 2**31, f"{k}: sum {est}"

            return case

        def header_only():
            c = new("header only")
            write(c.csv, HEADER + "\n")
            write(c.job, toml_job(c.csv, c.out))
            run = c.run(c.job)
            assert run.returncode == 0, run.describe()
            assert reference.read_releases(os.path.join(c.out, "releases.csv")) == []

        def default_threads_without_omp_num_threads():
            # OpenMP's own default (a thread per CPU the process may use) oversubscribes a node whose
            # ranks are not bound; without OMP_NUM_THREADS dpstream takes the CPUs the rank may use,
            # at most the CPUs of the node's ranks divided by its ranks (src/omp_threads.hpp).
            c = new("default threads")
            write(c.csv, HEADER + "\nu1,k1,0.5,100\n")
            write(c.job, toml_job(c.csv, c.out))
            saved = dp.env
            dp.env = {k: v for k, v in saved.items() if k not in ("OMP_NUM_THREADS", "OMP_THREAD_LIMIT")}
            dp.env["OMPI_MCA_hwloc_base_binding_policy"] = "none"  # unbound: each rank may use every CPU
            try:
                run = c.run(c.job)
            finally:
                dp.env = saved
            assert run.returncode == 0, run.describe()
            with open(os.path.join(c.out, "summary.json"), encoding="utf-8") as f:
                got = json.load(f)["threads_per_rank"]
            allowed = len(os.sched_getaffinity(0))  # unbound ranks inherit it: the node's CPUs are these
            want = max(1, allowed // args.ranks)
            assert got == want, f"threads_per_rank {got}, expected {want} ({allowed} CPUs, {args.ranks} ranks)"

        def out_dir_used_verbatim(name):
            def case():
                # --out DIR is a path, not TOML text: quotes and backslashes are part of the name.
                c = new("odd out dir")
                write(c.csv, HEADER + "\nu1,k1,0.5,100\n")
                write(c.job, toml_job(c.csv, None))
                run = c.run(c.job, "--out", name)  # relative to the case directory (the run's cwd)
                assert run.returncode == 0, run.describe()
                assert os.path.isfile(os.path.join(c.dir, name, "releases.csv")), \
                    f"no releases.csv in --out {name!r}; the run created {sorted(os.listdir(c.dir))}"

            return case

        # ---- job-spec / config errors (exit 2) ----

        def spec_case(name, needles, regex=None, **kw):
            def case():
                c = new(name)
                write(c.csv, HEADER + "\nu1,k1,0.5,100\n")
                write(c.job, toml_job(c.csv, c.out, **kw))
                expect_failure(c.run(c.job), 2, c.out, needles, regex)

            return case

        def malformed_toml():
            c = new("malformed toml")
            write(c.csv, HEADER + "\nu1,k1,0.5,100\n")
            text = toml_job(c.csv, c.out).splitlines()
            text.insert(4, "kind = = \"csv\"")  # line 5
            write(c.job, "\n".join(text) + "\n")
            expect_failure(c.run(c.job), 2, c.out, ["job.toml"], regex=r"line\D{0,3}5\b")

        def nonexistent_spec():
            c = new("nonexistent spec")
            missing = os.path.join(c.dir, "no-such-job.toml")
            expect_failure(c.run(missing, "--out", c.out), 2, c.out, ["no-such-job.toml"])

        def bad_set(assignment, needles):
            def case():
                c = new(f"set {assignment}")
                write(c.csv, HEADER + "\nu1,k1,0.5,100\n")
                write(c.job, toml_job(c.csv, c.out))
                expect_failure(c.run(c.job, "--set", assignment), 2, c.out, needles)

            return case

        def set_errors_name_the_set(assignment, needles):
            def case():
                # A value given by --set is reported against the --set, not against the job spec's file.
                c = new(f"set names {assignment}")
                write(c.csv, HEADER + "\nu1,k1,0.5,100\n")
                write(c.job, toml_job(c.csv, c.out))
                run = c.run(c.job, "--set", assignment)
                expect_failure(run, 2, c.out, [f"--set {assignment}"] + needles)
                assert "job.toml" not in run.stderr, "the error blames the job spec for a --set\n  " + run.describe()

            return case

        def plan_errors_name_the_sets():
            # The privacy plan's refusals weigh several values: they name the spec and the --sets applied over it.
            c = new("plan names sets")
            write(c.csv, HEADER + "\nu1,k1,0.5,100\n")
            write(c.job, toml_job(c.csv, c.out))
            sets = ["privacy.mode=dp", "privacy.epsilon=1e9", "privacy.delta=1e-9", "privacy.max_records_per_user=2"]
            run = c.run(c.job, *[a for s in sets for a in ("--set", s)])
            expect_failure(run, 2, c.out, ["job.toml with --set " + ", --set ".join(sets), "epsilon"])

        def empty_out_option():
            c = new("empty out")
            write(c.csv, HEADER + "\nu1,k1,0.5,100\n")
            write(c.job, toml_job(c.csv, None))
            before = sorted(os.listdir(c.dir))
            expect_failure(c.run(c.job, "--out", ""), 2, c.out, ["--out", "empty"])
            assert sorted(os.listdir(c.dir)) == before, f"a refused run made {sorted(os.listdir(c.dir))}"

        def messages_name_the_command_and_the_path():
            c = new("messages")
            run = dp.run("budget", cwd=c.dir)
            expect_failure(run, 2, c.out, ["no job spec given", "dpstream budget JOB.toml"])
            a_file = write(os.path.join(c.dir, "releases.csv"), "window,trigger,key,count,sum\n")
            run = dp.run("evaluate", "--truth", a_file, "--released", c.dir, cwd=c.dir)
            expect_failure(run, 3, c.out, ["--truth", "not a directory"])

        def unknown_command():
            c = new("unknown command")
            run = dp.run("frobnicate", cwd=c.dir)
            expect_failure(run, 2, c.out, ["unknown command", "frobnicate", "run", "query"])

        def foreign_checkpoint_path(kind, flags):
            def case():
                # OUT/checkpoint is emptied by a fresh start: a file or directory dpstream did not write is refused
                # (exit 4), not deleted.
                c = new(f"foreign checkpoint {kind} {' '.join(flags)}")
                write(c.csv, HEADER + "\nu1,k1,0.5,100\n")
                write(c.job, toml_job(c.csv, c.out))
                place = os.path.join(c.out, "checkpoint")
                if kind == "file":
                    os.makedirs(c.out)
                    write(place, "the user's own file\n")
                else:
                    os.makedirs(place)
                    write(os.path.join(place, "notes.txt"), "the user's own file\n")
                expect_failure(c.run(c.job, *flags), 4, c.out, ["checkpoint", "another --out"])
                kept = place if kind == "file" else os.path.join(place, "notes.txt")
                with open(kept, encoding="utf-8") as f:
                    assert f.read() == "the user's own file\n", f"{kept} was changed"

            return case

        def foreign_releases(flags):
            def case():
                # A releases.csv that no dpstream job left (no checkpoint/, no job's summary.json beside it) is
                # refused (exit 2), not replaced; one that a finished job left is replaced by a new run.
                c = new(f"foreign releases {' '.join(flags)}")
                write(c.csv, HEADER + "\nu1,k1,0.5,100\n")
                write(c.job, toml_job(c.csv, c.out))
                os.makedirs(c.out)
                place = os.path.join(c.out, "releases.csv")
                write(place, "the user's own table\n")
                run = c.run(c.job, *flags)
                assert run.returncode == 2 and "another --out" in run.stderr, run.describe()
                assert sorted(os.listdir(c.out)) == ["releases.csv"], f"the refused run left {os.listdir(c.out)}"
                with open(place, encoding="utf-8") as f:
                    assert f.read() == "the user's own table\n", f"{place} was changed"
                # A summary.json no job wrote vouches for nothing, beside the table or alone: refused, both kept.
                summary = os.path.join(c.out, "summary.json")
                write(summary, '{"mine": true}\n')
                for files in (["releases.csv", "summary.json"], ["summary.json"]):
                    if "releases.csv" not in files:
                        os.remove(place)
                    run = c.run(c.job, *flags)
                    assert run.returncode == 2 and "summary.json was not written by a dpstream job" in run.stderr, \
                        run.describe()
                    assert sorted(os.listdir(c.out)) == files, f"the refused run left {os.listdir(c.out)}"
                    with open(summary, encoding="utf-8") as f:
                        assert f.read() == '{"mine": true}\n', f"{summary} was changed"
                # A summary of a dpstream from before dpstream_version was recorded: the job's, replaced.
                write(summary, '{"job": "older", "mode": "none", "records": {"read": 1}}\n')
                run = c.run(c.job, *flags)
                assert run.returncode == 0, run.describe()
                shutil.rmtree(c.out)
                for _ in range(2):  # the second run replaces the first one's output
                    run = c.run(c.job, *flags)
                    assert run.returncode == 0, run.describe()

            return case

        def large_delta_warned(delta, warned):
            def case():
                # A delta too large to mean privacy is run, with a warning (a CSV's users are unknown: >= 1e-3).
                c = new(f"delta {delta}")
                write(c.csv, HEADER + "\n" + "".join(f"u{i},k{i % 3},0.5,{100 + i}\n" for i in range(30)))
                write(c.job, toml_job(c.csv, c.out, replace={"mode": f'mode = "dp"\nepsilon = 1.0\ndelta = {delta}'}))
                run = c.run(c.job)
                assert run.returncode == 0, run.describe()
                said = f"warning: delta = {delta} is at least 0.001" in run.stderr
                assert said == warned, f"warning expected: {warned}\n  " + run.describe()

            return case

        def csv_without_path():
            c = new("csv without path")
            write(c.job, toml_job(None, c.out))
            expect_failure(c.run(c.job), 2, c.out, ["path"])

        results.check("missing CSV file -> exit 3", missing_csv)
        results.check("CSV header missing a column -> exit 3", missing_column)
        results.check("CSV lines ending in a bare CR -> exit 3 saying so, no row quoted", bare_cr_lines)
        results.check("a long header missing a column -> exit 3, its first 4096 bytes quoted", long_header_quoted_short)
        results.check("empty CSV file -> exit 3", empty_csv)
        results.check("CSV path is a directory -> exit 3 saying so", csv_is_a_directory)
        results.check("job spec is a directory -> exit 2 saying so", spec_is_a_directory)
        results.check("CSV path is /dev/zero -> exit 3 saying so (no endless read)", csv_not_a_regular_file("device"))
        results.check("CSV path is a FIFO -> exit 3 saying so (no hang)", csv_not_a_regular_file("fifo"))
        results.check("a header naming a column twice -> exit 3 saying which", repeated_header_column)
        results.check("a UTF-8 byte order mark and CRLF line ends: the same releases", byte_order_mark_and_crlf)
        results.check("generate: an existing file and a CSV job are refused (exit 2), nothing written", generate_refusals)
        results.check("bad rows with bad_rows=\"skip\" are counted in summary.json", skip_bad_rows)
        for i, (label, _row, _kind) in enumerate(BAD_ROWS):
            results.check(f"bad_rows=\"fail\": {label} -> exit 3 naming the line", fail_on_bad_row(i))
        results.check("value 1e-400 (underflows to 0) is a real, not non-finite", tiny_value_is_a_real)
        results.check("header-only CSV -> empty releases", header_only)
        results.check("OMP_NUM_THREADS unset, ranks unbound: no more threads than CPUs per rank",
                      default_threads_without_omp_num_threads)
        results.check("sums beyond 2^43 in mode none are exact, no abort", huge_sums("none"))
        results.check("sums beyond 2^43 in mode dp are released, no abort", huge_sums("dp"))
        results.check("--out DIR with a quote in the name is used verbatim", out_dir_used_verbatim('a"b'))
        results.check("--out DIR with a backslash in the name is used verbatim", out_dir_used_verbatim("a\\tb"))
        results.check("unknown key -> exit 2 naming it",
                      spec_case("unknown key", ["trigers"], replace={"windows": "windows = 1\ntrigers = 5"}))
        results.check("unknown section -> exit 2 naming it", spec_case("unknown section", ["privcy"], extra="\n[privcy]\nx = 1\n"))
        results.check("triggers = \"ten\" -> exit 2", spec_case("wrong type", ["triggers"], replace={"triggers": 'triggers = "ten"'}))
        results.check("triggers = 0 -> exit 2", spec_case("zero triggers", ["triggers"], replace={"triggers": "triggers = 0"}))
        results.check("clamp_max < clamp_min -> exit 2",
                      spec_case("clamp order", ["clamp_max"], replace={"clamp_min": "clamp_min = 2.0"}))
        # C may be left out only in mode "none" (the true totals); a private mode needs it.
        results.check("max_records_per_user missing in mode dp -> exit 2",
                      spec_case("no C", ["max_records_per_user"], drop=("max_records_per_user",),
                                replace={"mode": 'mode = "dp"\nepsilon = 1.0\ndelta = 1e-9'}))
        results.check("malformed TOML -> exit 2 naming the line", malformed_toml)
        results.check("nonexistent job spec -> exit 2", nonexistent_spec)
        results.check("--set without section -> exit 2", bad_set("triggers=5", ["triggers=5"]))
        results.check("--set without '=' -> exit 2", bad_set("stream.triggers", ["stream.triggers"]))
        results.check("--set unknown key -> exit 2 naming it", bad_set("stream.bogus=3", ["bogus"]))
        results.check("--set of a wrong type -> exit 2 naming the --set, not the file",
                      set_errors_name_the_set("stream.triggers=ten", ["triggers", "integer"]))
        results.check("--set of an unknown section -> exit 2 naming the --set",
                      set_errors_name_the_set("nosuch.key=3", ["unknown section"]))
        results.check("--set of an unknown key -> exit 2 naming the --set",
                      set_errors_name_the_set("input.bogus=1", ["unknown key"]))
        results.check("--set job.name= (empty) -> exit 2", set_errors_name_the_set("job.name=", ["must not be empty"]))
        results.check("a privacy plan refusal names the spec and its --sets", plan_errors_name_the_sets)
        results.check("--out \"\" -> exit 2, no default directory made", empty_out_option)
        results.check("an unknown command -> exit 2 naming it and the commands", unknown_command)
        results.check("budget without a spec names budget; evaluate --truth FILE says it is not a directory",
                      messages_name_the_command_and_the_path)
        results.check("a releases.csv or summary.json no job wrote in --out -> exit 2, kept", foreign_releases([]))
        results.check("... also without checkpoints (every = 0)", foreign_releases(["--set", "checkpoint.every=0"]))
        results.check("a file named checkpoint in --out -> exit 4, the file kept", foreign_checkpoint_path("file", []))
        results.check("a foreign checkpoint directory, --fresh -> exit 4, its files kept",
                      foreign_checkpoint_path("dir", ["--fresh"]))
        results.check("delta = 0.5 in mode dp: run, with a warning", large_delta_warned(0.5, True))
        results.check("delta = 1e-9 in mode dp: no warning", large_delta_warned(1e-9, False))
        results.check("kind = \"csv\" without path -> exit 2", csv_without_path)
        results.check("bad_rows = \"fail\" in mode dp -> exit 2 (a stop would depend on the data)",
                      spec_case("fail in dp", ["bad_rows", "skip"],
                                replace={"bad_rows": 'bad_rows = "fail"',
                                         "mode": 'mode = "dp"\nepsilon = 1.0\ndelta = 1e-9'}))
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
