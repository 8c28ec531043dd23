#!/usr/bin/env python3
"""End-to-end test of exactly-once checkpoints: SIGKILL a rank at every fault point, then resume.

Three small jobs (a synthetic mode = "dp" job with a fixed [privacy] seed, a synthetic mode = "none"
job with first_window != 0, and a mode = "dp" CSV job whose keys need quoting) each run once
uninterrupted: that run's releases.csv is the reference. Then, with DPSTREAM_FAULT=<point>@<hit>:<rank>
making one rank SIGKILL itself:

  * every fault point once on the DP job at a mid-stream hit (the last rank for points every rank
    reaches, rank 0 for the rank-0-only points), the rank-0 commit points also at the last commit,
    plus --random-kills more from a schedule seeded by --seed-schedule (random job, point, hit, rank);
  * a double fault (kill, resume killed again, resume), resumes at another rank count (1 -> 3,
    4 -> 2, 3 -> 1), a DP job without a seed (resume reuses the stored secret: two resumes of copies of
    one killed run agree, and differ from a fresh unseeded run), [checkpoint] every = 3 (same output;
    exactly the rows of the first commit after published@1; changing `every` on resume is accepted),
    and --resume of a completed job ("already complete", nothing changed).

After each killed run: exit code non-zero (the rank was killed; a hang is a failure), releases.csv
(if any) is a byte prefix of the reference and holds no row of a trigger that cannot have been
committed yet (when the killed process was the first run of the job with every = 1: rows of the
first h - 1 triggers at most for a kill at hit h before `committed`, exactly h triggers at
`published`; the job's last rows are appended before its last commit, so at the last hit h they
may be there from the commit's files on and are there from its manifest on), no summary.json, every
file under checkpoint/ mode 0600 and every directory 0700.
One `--resume` must then exit 0 with releases.csv byte-identical to the reference and a summary.json.
The completed reference run's checkpoint is checked too: MANIFEST-<seq>.json (the newest two),
segment names, sizes, ranks, modes, and `h5dump -H` on a rank-0 segment.

Usage: test_checkpoint_kill.py --ranks N [--bin build/src/dpstream] [--seed-schedule S] [--random-kills K] [--keep]
"""

import json
import os
import random
import re
import shutil
import stat
import subprocess
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

PER_TRIGGER = ["ingest", "shuffle_user", "bounding", "shuffle_key", "accumulate", "dp_release", "output"]
PER_COMMIT = ["ckpt_begin", "ckpt_half_written", "ckpt_before_rename", "ckpt_after_rename"]
RANK0_ONLY = ["manifest_before_rename", "committed", "publish_half", "published"]
ALL_POINTS = PER_TRIGGER + PER_COMMIT + RANK0_ONLY
AFTER_COMMIT = ("committed", "publish_half", "published")  # the commit of this hit is complete
MIN_KILLS = 20
JOURNAL_USERS = 200000  # the journal_bound case: > 1 MiB of journal per trigger on a rank of up to 2
KILL_TIMEOUT = 30.0  # a killed run must end within seconds; this only catches a hang

MANIFEST_RE = re.compile(r"^MANIFEST-(\d{6})\.json$")
SEGMENT_RE = re.compile(r"^w(\d+)/s(\d{6})-r(\d{4})\.h5$")


def add_args(ap):
    ap.add_argument("--seed-schedule", type=int, default=20261122, help="seed of the random kill schedule")
    ap.add_argument("--random-kills", type=int, default=12, help="kills drawn from the random schedule")


# ---------------------------------------------------------------------------------------------
# Jobs


def dp_toml(name="e2e-ckpt-dp", seed=True, every=None, triggers=8, windows=2, keys=100):
    return f"""\
[job]
name = "{name}"

[input]
kind = "synthetic"
users = 20000
keys = {keys}
seed = 11

[stream]
window_seconds = 800
triggers = {triggers}
windows = {windows}

[privacy]
mode = "dp"
max_records_per_user = 8
clamp_min = 0.0
clamp_max = 1.0
epsilon = 6.0
delta = 1e-9
{"seed = 11" if seed else ""}

[query]
aggregations = ["count", "sum"]
[checkpoint]
every = {every or 1}

[output]
format = "csv"
progress = "never"
"""


NONE_TOML = """\
[job]
name = "e2e-ckpt-none"

[input]
kind = "synthetic"
users = 3000
keys = 300
seed = 5

[stream]
window_seconds = 1000
triggers = 5
first_window = 4
windows = 3

[privacy]
mode = "none"
max_records_per_user = 6
clamp_min = 0.0
clamp_max = 0.5

[query]
aggregations = ["sum"]

[checkpoint]
every = 1

[output]
format = "csv"
progress = "never"
"""

CSV_W, CSV_T, CSV_FIRST, CSV_WINDOWS = 800, 8, 2, 2


def csv_toml(path):
    return f"""\
[job]
name = "e2e-ckpt-csv"

[input]
kind = "csv"
path = "{path}"
bad_rows = "skip"

[stream]
window_seconds = {CSV_W}
triggers = {CSV_T}
first_window = {CSV_FIRST}
windows = {CSV_WINDOWS}

[privacy]
mode = "dp"
max_records_per_user = 8
clamp_min = -0.25
clamp_max = 1.0
epsilon = 6.0
delta = 1e-9
seed = 5

[query]
aggregations = ["count", "sum"]

[checkpoint]
every = 1

[output]
format = "csv"
progress = "never"
"""


def write_csv_input(path, seed=7):
    """~35k rows, shuffled; the most popular keys need quoting or are not ASCII."""
    rng = random.Random(seed)
    keys = ['k,"q"', "ключ", "k 2"] + [f"k{i}" for i in range(3, 40)]
    rows = []
    for u in range(3000):
        user = f"u{u}" if u % 97 else f"u,{u}"
        for wi in range(CSV_WINDOWS):
            w = CSV_FIRST + wi
            for _ in range(rng.randint(0, 12)):
                key = keys[int(len(keys) * rng.random() ** 2)]
                value = round(rng.uniform(-0.5, 1.3), 3)
                rows.append((user, key, value, w * CSV_W + rng.randint(0, CSV_W - 1)))
    rng.shuffle(rows)

    def q(s):
        return '"' + s.replace('"', '""') + '"' if any(c in s for c in ',"') else s

    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("user_id,key,value,timestamp\n")
        for user, key, value, ts in rows:
            f.write(f"{q(user)},{q(key)},{value},{ts}\n")
    return len(rows)


class Job:
    def __init__(self, label, path, first_window, triggers, windows, dp):
        self.label = label
        self.path = path
        self.first_window = first_window
        self.triggers = triggers
        self.windows = windows
        self.total = triggers * windows  # = commits with every = 1
        self.dp = dp
        self.ref = None
        self.ref_dir = None

    def points(self):
        return [p for p in ALL_POINTS if self.dp or p != "dp_release"]

    def set_reference(self, data, ref_dir):
        """Splits the reference into the header and (global trigger index, row bytes)."""
        lines = data.splitlines(keepends=True)
        assert lines and lines[0].startswith(b"window,trigger,"), \
            f"{self.label}: reference releases.csv has no header: {data[:80]!r}"
        self.header = lines[0]
        self.rows = []
        for line in lines[1:]:
            w, t = line.split(b",", 2)[:2]
            g = (int(w) - self.first_window) * self.triggers + int(t)
            assert 0 <= g < self.total, f"{self.label}: row {line!r} lies outside the job's windows"
            assert not self.rows or self.rows[-1][0] <= g, f"{self.label}: reference rows not in trigger order"
            self.rows.append((g, line))
        self.ref = data
        self.ref_dir = ref_dir
        filled = len({g for g, _ in self.rows})
        # Guards the test itself: prefix checks mean little without rows at most triggers.
        assert filled >= min(6, self.total), f"{self.label}: reference has rows at only {filled} triggers"

    def rows_before(self, k):
        """Bytes of the rows of the first k triggers (global order)."""
        return b"".join(line for g, line in self.rows if g < k)

    def rows_at(self, g):
        return sum(1 for gg, _ in self.rows if gg == g)


# ---------------------------------------------------------------------------------------------
# Checks


def show(data, limit=300):
    return "None (no file)" if data is None else f"{len(data)} bytes, ending {data[-limit:]!r}"


def check_prefix(job, content, what):
    if content is None or job.ref is None:
        return
    if not job.ref.startswith(content):
        i = harness.first_difference(content, job.ref)
        raise AssertionError(f"{what}: releases.csv ({len(content)} bytes) is not a byte prefix of the reference "
                             f"({len(job.ref)} bytes); first difference at byte {i}:\n"
                             f"    got {content[max(0, i - 120):i + 80]!r}\n"
                             f"    ref {job.ref[max(0, i - 120):i + 80]!r}")


def check_bounds(job, content, lo, hi, what):
    """releases.csv holds at most the rows of the first `hi` triggers and at least those of the first
    `lo` (None: no lower bound); the header may be missing while no row is due."""
    data = content or b""
    upper = job.header + job.rows_before(hi)
    if not upper.startswith(data):
        extra = data[len(upper):] if data.startswith(upper) else None
        detail = (f"it has {len(data) - len(upper)} bytes beyond the rows of the first {hi} trigger(s), "
                  f"starting {extra[:200]!r}" if extra is not None else
                  f"first difference at byte {harness.first_difference(data, upper)}")
        raise AssertionError(f"{what}: releases.csv holds rows of a trigger that cannot be committed yet "
                             f"(allowed: the first {hi} trigger(s), {len(upper)} bytes; got {show(content)}); {detail}")
    if lo is not None:
        lower = job.header + job.rows_before(lo)
        if job.rows_before(lo) and not data.startswith(lower):
            raise AssertionError(f"{what}: releases.csv lacks rows of committed and published triggers "
                                 f"(expected at least the first {lo} trigger(s), {len(lower)} bytes; "
                                 f"got {show(content)})")


def check_modes(ckpt_dir, what):
    if not os.path.isdir(ckpt_dir):
        return 0
    bad = []
    n = 0
    for dirpath, dirs, files in os.walk(ckpt_dir):
        m = stat.S_IMODE(os.lstat(dirpath).st_mode)
        if m != 0o700:
            bad.append(f"{os.path.relpath(dirpath, ckpt_dir)}/ {m:04o}")
        for name in files:
            full = os.path.join(dirpath, name)
            m = stat.S_IMODE(os.lstat(full).st_mode)
            n += 1
            if m != 0o600:
                bad.append(f"{os.path.relpath(full, ckpt_dir)} {m:04o}")
    assert not bad, f"{what}: files under checkpoint/ must be 0600 and directories 0700; wrong: {bad[:10]}"
    return n


def read_manifests(ckpt_dir):
    """[(seq, name, parsed json or None)] sorted by seq."""
    out = []
    for name in os.listdir(ckpt_dir):
        m = MANIFEST_RE.match(name)
        if m:
            with open(os.path.join(ckpt_dir, name), "rb") as f:
                raw = f.read()
            try:
                doc = json.loads(raw)
            except ValueError:
                doc = None
            out.append((int(m.group(1)), name, doc))
    return sorted(out)


def check_completed_checkpoint(job, out_dir, ranks):
    """Layout of the checkpoint of a completed run; returns the number of files checked."""
    ck = os.path.join(out_dir, "checkpoint")
    assert os.path.isdir(ck), f"no checkpoint directory {ck}"
    assert os.path.isfile(os.path.join(ck, "job.h5")), "no checkpoint/job.h5"
    n = check_modes(ck, "completed run")
    mans = read_manifests(ck)
    assert len(mans) == 2, f"expected the newest two MANIFEST-<seq>.json files, found {[m[1] for m in mans]}"
    for seq, name, doc in mans:
        assert doc is not None, f"{name} is not valid JSON"
        missing = [k for k in ("seq", "complete", "window_index", "next_trigger", "releases_bytes", "segments")
                   if k not in doc]
        assert not missing, f"{name} lacks the fields {missing}"
        assert doc["seq"] == seq, f"{name} has seq {doc['seq']}"
    seq, name, doc = mans[-1]
    assert doc["complete"] is True, f"newest manifest {name} of a completed job has complete = {doc['complete']!r}"
    segs = doc["segments"]
    assert isinstance(segs, list) and segs, f"{name}: segments is {segs!r}"
    latest_ranks = set()
    for s in segs:
        miss = [k for k in ("file", "seq", "rank", "bytes", "xxh3") if k not in s]
        assert not miss, f"{name}: segment entry {s} lacks {miss}"
        m = SEGMENT_RE.match(s["file"])
        assert m, f"{name}: segment file {s['file']!r} is not w<window>/s<seq 6 digits>-r<rank 4 digits>.h5"
        assert int(m.group(2)) == s["seq"] and int(m.group(3)) == s["rank"], \
            f"{name}: entry {s} disagrees with its name"
        assert 0 <= s["rank"] < ranks, f"{name}: entry {s} names rank {s['rank']} of a {ranks}-rank run"
        assert s["seq"] <= seq, f"{name}: entry {s} is newer than the manifest"
        full = os.path.join(ck, s["file"])
        assert os.path.isfile(full), f"{name}: segment {s['file']} does not exist"
        size = os.path.getsize(full)
        assert size == s["bytes"], f"{name}: {s['file']} has {size} bytes, manifest says {s['bytes']}"
        if s["seq"] == seq:
            latest_ranks.add(s["rank"])
    assert latest_ranks == set(range(ranks)), \
        f"{name}: the newest commit has segments of ranks {sorted(latest_ranks)}, expected one per rank 0..{ranks - 1}"
    assert doc["releases_bytes"] == len(job.ref), \
        f"{name}: releases_bytes = {doc['releases_bytes']}, but the completed releases.csv has {len(job.ref)} bytes"
    strays = []
    for dirpath, _dirs, files in os.walk(ck):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), ck)
            if rel != "job.h5" and not MANIFEST_RE.match(rel) and not SEGMENT_RE.match(rel):
                strays.append(rel)
    assert not strays, f"unexpected files left in the checkpoint of a completed run: {strays[:10]}"
    # A light look inside one rank-0 segment of the newest commit.
    seg0 = next(s["file"] for s in segs if s["seq"] == seq and s["rank"] == 0)
    h5dump = shutil.which("h5dump")
    if not h5dump:
        print("     (h5dump not found: segment contents not checked)")
        return n
    proc = subprocess.run([h5dump, "-H", os.path.join(ck, seg0)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"h5dump -H {seg0} failed ({proc.returncode}): {proc.stderr[:500]!r}"
    want = {"users": ["id", "kept"], "pairs": ["user", "key_fingerprint"],
            "keys": ["id", "count", "sum_low", "sum_high", "users", "round", "round_start", "round_base_users"], "releases": ["csv"]}
    missing = [g for g in want if f'GROUP "{g}"' not in proc.stdout]
    missing += [f"{g}/{d}" for g, ds in want.items() for d in ds if f'DATASET "{d}"' not in proc.stdout]
    assert not missing, f"h5dump -H {seg0} lists no {missing}:\n{proc.stdout[:1500]}"
    return n


# ---------------------------------------------------------------------------------------------


def main():
    args = harness.parse_args(__doc__, add_args)
    dp = harness.Dpstream(args)
    results = harness.Results(f"test_checkpoint_kill (ranks={args.ranks})")
    last = args.ranks - 1
    kills = {"n": 0}
    with harness.TempDir(args.keep, "dpstream-e2e-ckpt-kill-") as root:
        case_dir = harness.CaseDirs(root)

        csv_path = os.path.join(root, "input.csv")
        n_rows = write_csv_input(csv_path)
        dp_job = Job("dp", harness.write_job(os.path.join(root, "dp.toml"), dp_toml()), 0, 8, 2, True)
        none_job = Job("none", harness.write_job(os.path.join(root, "none.toml"), NONE_TOML), 4, 5, 3, False)
        csv_job = Job("csv", harness.write_job(os.path.join(root, "csv.toml"), csv_toml(csv_path)),
                      CSV_FIRST, CSV_T, CSV_WINDOWS, True)
        dp3_job = Job("dp every=3", harness.write_job(os.path.join(root, "dp-every3.toml"), dp_toml(every=3)),
                      0, 8, 2, True)
        noseed_job = Job("dp no seed", harness.write_job(os.path.join(root, "dp-noseed.toml"),
                                                         dp_toml("e2e-ckpt-dp-noseed", seed=False)), 0, 8, 2, True)
        # Keys first tested after step b + 15 = 23 draw their selection counter's prefix as blocks, fixed by
        # that step (kernels/banded_counter.hpp): a resume must seek them there again (FirstTest in the log).
        blocked_job = Job("dp T=64", harness.write_job(os.path.join(root, "dp-t64.toml"),
                                                      dp_toml("e2e-ckpt-dp-t64", triggers=64, windows=1, keys=3000)),
                          0, 64, 1, True)
        jobs = [dp_job, none_job, csv_job]

        def fresh(job, out, *extra, ranks=None, cwd=None):
            return dp.run_with("run", job.path, "--out", out, "--progress", "never", *extra, ranks=ranks, cwd=cwd)

        def kill(job, out, fault, *extra, ranks=None, resume=False, bounds=None, what=None, deferred=None):
            """One run killed by DPSTREAM_FAULT; checks what it leaves. Returns releases.csv's bytes.
            A stray summary.json is appended to `deferred` (if given) so the resume is still tried."""
            what = what or f"DPSTREAM_FAULT={fault}"
            argv = ["run", job.path, "--out", out, "--progress", "never", *(["--resume"] if resume else []), *extra]
            r = dp.run_with(*argv, ranks=ranks, env={"DPSTREAM_FAULT": fault}, timeout=min(KILL_TIMEOUT, args.timeout),
                            cwd=os.path.dirname(out))
            both = r.stdout + r.stderr
            assert r.returncode != 0, (f"{what}: the run was not killed (exit 0): the fault point was not reached "
                                       f"that often\n  " + r.describe())
            assert r.returncode == 137 or "signal 9" in both or "Killed" in both, \
                f"{what}: the run failed, but not by the SIGKILL of the fault\n  " + r.describe()
            kills["n"] += 1
            content = harness.read_bytes(os.path.join(out, "releases.csv"))
            check_prefix(job, content, what)
            if bounds:
                check_bounds(job, content, bounds[0], bounds[1], what)
            if os.path.exists(os.path.join(out, "summary.json")):
                had = "no file" if content is None else f"{len(content)} of {len(job.ref)} bytes"
                msg = (f"{what}: the killed run left summary.json (written before the job was committed complete; "
                       f"releases.csv then had {had})")
                if deferred is None:
                    raise AssertionError(msg)
                deferred.append(msg)
            check_modes(os.path.join(out, "checkpoint"), what)
            return content

        def resume(job, out, *extra, ranks=None, expect=None, what="resume"):
            r = dp.run_with("run", job.path, "--out", out, "--progress", "never", "--resume", *extra, ranks=ranks,
                            cwd=os.path.dirname(out))
            assert r.returncode == 0, f"{what} failed\n  " + r.describe()
            got = harness.read_bytes(os.path.join(out, "releases.csv"))
            want = job.ref if expect is None else expect
            if got != want:
                if got is None:
                    raise AssertionError(f"{what}: no releases.csv after the resume")
                i = harness.first_difference(got, want)
                raise AssertionError(f"{what}: releases.csv ({len(got)} bytes) differs from the uninterrupted run "
                                     f"({len(want)} bytes) at byte {i}:\n    got {got[max(0, i - 120):i + 80]!r}\n"
                                     f"    ref {want[max(0, i - 120):i + 80]!r}")
            summary = os.path.join(out, "summary.json")
            assert os.path.isfile(summary), f"{what}: no summary.json after the resumed run completed"
            with open(summary, encoding="utf-8") as f:
                digest = json.load(f)["state_digest"]
            if expect is None:  # the state at each window's end, not only the rows, is the uninterrupted run's
                with open(os.path.join(job.ref_dir, "summary.json"), encoding="utf-8") as f:
                    want_digest = json.load(f)["state_digest"]
                assert digest == want_digest, (f"{what}: summary.json state_digest {digest} differs from the "
                                               f"uninterrupted run's {want_digest}")
            return r

        def bounds_for(job, point, hit):
            """(lo, hi) in triggers for a kill of the first run of an every = 1 job at point@hit. The job's
            last rows are appended before its last commit (docs/CHECKPOINTS.md): from the start of that
            commit's files they may be there, and from its manifest on they are."""
            if point == "published":
                return (hit, hit)
            if point == "publish_half":
                return (hit - 1, hit)
            if hit == job.total and point in ("manifest_before_rename", "committed"):
                return (hit, hit)
            if hit == job.total and point in PER_COMMIT:  # rank 0 appended them before its segment
                return (hit, hit)
            return (None, hit - 1)

        def kill_resume(job, point, hit, rank, *, ranks=None, resume_ranks=None, exact=True, resume_extra=()):
            c = case_dir(f"{job.label}-{point}-{hit}-{rank}")
            out = os.path.join(c, "out")
            fault = f"{point}@{hit}:{rank}"
            # The bounds hold for a rank-0 kill; for another rank rank 0 may still be publishing rows of
            # the previous commit, but never rows of a trigger not committed yet (the upper bound).
            b = bounds_for(job, point, hit) if exact else None
            if b and rank != 0:
                b = (None, b[1])
            deferred = []
            kill(job, out, fault, ranks=ranks, bounds=b, what=f"{job.label} DPSTREAM_FAULT={fault}", deferred=deferred)
            resume(job, out, *resume_extra, ranks=resume_ranks, what=f"{job.label} resume after {fault}")
            assert not deferred, "; ".join(deferred) + " (the resume itself completed and matched the reference)"

        # ---- references ----

        def reference(job, ranks=None):
            def check():
                d = case_dir(f"ref-{job.label}")
                out = os.path.join(d, "out")
                r = fresh(job, out, ranks=ranks, cwd=d)
                assert r.returncode == 0, f"uninterrupted run of {job.label} failed\n  " + r.describe()
                data = harness.read_bytes(os.path.join(out, "releases.csv"))
                assert data is not None, f"{job.label}: no releases.csv"
                job.set_reference(data, out)
                print(f"     {job.label}: {len(job.rows)} rows over {len({g for g, _ in job.rows})} of {job.total} "
                      f"triggers, {r.seconds:.1f} s")
            return check

        def have(*js):
            for j in js:
                assert j.ref is not None, f"no reference for {j.label} (its uninterrupted run failed)"

        results.check(f"uninterrupted DP job (synthetic, {args.ranks} rank(s)) = reference", reference(dp_job))
        results.check("uninterrupted none job (synthetic, first_window 4, 3 windows) = reference", reference(none_job))
        results.check(f"uninterrupted CSV job ({n_rows} rows, quoted and non-ASCII keys) = reference",
                      reference(csv_job))

        def completed_layout():
            have(dp_job)
            n = check_completed_checkpoint(dp_job, dp_job.ref_dir, args.ranks)
            print(f"     {n} files under checkpoint/")

        results.check("completed checkpoint: manifests, segments, modes 0600/0700, h5dump -H", completed_layout)

        def segment_bytes_in_summary():
            """One window (so the last manifest lists every segment): summary.json counts them all."""
            out = os.path.join(case_dir("one-window"), "out")
            r = fresh(dp_job, out, "--set", "stream.windows=1", "--set", "checkpoint.every=2")
            assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
            with open(os.path.join(out, "summary.json")) as f:
                written = json.load(f)["checkpoint"]["segment_bytes_written"]
            _seq, name, doc = read_manifests(os.path.join(out, "checkpoint"))[-1]
            listed = sum(seg["bytes"] for seg in doc["segments"])
            assert len(doc["segments"]) >= 4 * args.ranks, f"{name}: only {len(doc['segments'])} segments"
            assert written == listed, f"segment_bytes_written = {written}, {name} lists {listed} bytes"

        results.check("summary.json's segment_bytes_written = the bytes of every segment", segment_bytes_in_summary)

        # ---- every point once, mid-stream, on the DP job ----

        def publish_hit(job, start):
            """The first hit >= start whose trigger has rows (so publish_half is really mid-rows)."""
            for h in range(start, job.total + 1):
                if job.rows_at(h - 1) >= 2:
                    return h
            return start

        for point in dp_job.points():
            rank = 0 if point in RANK0_ONLY else last

            def case(point=point, rank=rank):
                have(dp_job)
                hit = publish_hit(dp_job, 3) if point in AFTER_COMMIT else 3
                kill_resume(dp_job, point, hit, rank)

            hit_text = "3 (or the next trigger with rows)" if point in AFTER_COMMIT else "3"
            results.check(f"dp: kill {point}@{hit_text} on rank {rank} -> one --resume = reference", case)

        for point in AFTER_COMMIT + ("manifest_before_rename",):
            def case_last(point=point):
                have(dp_job)
                # Rows at the last trigger, or the bounds could not tell appended from staged last rows.
                assert dp_job.rows_at(dp_job.total - 1) > 0, "the DP job's last trigger releases no row"
                kill_resume(dp_job, point, dp_job.total, 0)

            results.check(f"dp: kill {point} at the last commit -> resume completes (summary.json)", case_last)

        # ---- random schedule ----

        rng = random.Random(args.seed_schedule)
        schedule = []
        for _ in range(args.random_kills):
            job = rng.choice(jobs)
            point = rng.choice(job.points())
            rank = 0 if point in RANK0_ONLY else rng.randrange(args.ranks)
            lo = 1 if point in AFTER_COMMIT else 2  # at least one commit before the kill
            schedule.append((job, point, rng.randint(lo, job.total), rank))
        print(f"random schedule (--seed-schedule {args.seed_schedule}): "
              + ", ".join(f"{j.label}:{p}@{h}:{r}" for j, p, h, r in schedule), flush=True)
        for job, point, hit, rank in schedule:
            def rcase(job=job, point=point, hit=hit, rank=rank):
                have(job)
                kill_resume(job, point, hit, rank)

            results.check(f"random: {job.label} kill {point}@{hit}:{rank} -> resume = reference", rcase)

        # ---- double fault ----

        def double_fault():
            have(dp_job)
            out = os.path.join(case_dir("double-fault"), "out")
            kill(dp_job, out, f"accumulate@5:{last}", bounds=(None, 4))
            for fault in ("manifest_before_rename@2:0", f"ckpt_half_written@3:{last}"):
                kill(dp_job, out, fault, resume=True, what=f"resume killed at {fault}")
            resume(dp_job, out, what="third resume")

        results.check("double fault: kill, resume killed twice more, resume = reference", double_fault)

        # ---- another rank count on resume ----

        for job, fault, k_ranks, r_ranks in [(dp_job, "shuffle_key@6:0", 1, 3),
                                             (dp_job, "ckpt_after_rename@5:3", 4, 2),
                                             (csv_job, "published@10:0", 3, 1),
                                             (none_job, "committed@4:0", 2, 4)]:
            def rank_change(job=job, fault=fault, k_ranks=k_ranks, r_ranks=r_ranks):
                have(job)
                out = os.path.join(case_dir(f"ranks-{k_ranks}-{r_ranks}"), "out")
                point, rest = fault.split("@")
                hit, rank = map(int, rest.split(":"))
                b = bounds_for(job, point, hit)
                kill(job, out, fault, ranks=k_ranks, bounds=b if rank == 0 else (None, b[1]))
                resume(job, out, ranks=r_ranks, what=f"resume at {r_ranks} rank(s)")

            results.check(f"{job.label}: kill {fault} at {k_ranks} rank(s), resume at {r_ranks} = reference",
                          rank_change)

        # ---- key selection's blocked prefixes across a resume ----

        results.check(f"uninterrupted DP job with T = 64 ({args.ranks} rank(s)) = reference", reference(blocked_job))
        for fault, k_ranks, r_ranks in [("committed@40:0", args.ranks, args.ranks), ("dp_release@50:0", 2, 3),
                                        ("committed@30:0", 3, 1)]:
            def blocked_resume(fault=fault, k_ranks=k_ranks, r_ranks=r_ranks):
                have(blocked_job)
                out = os.path.join(case_dir(f"blocked-{fault}-{k_ranks}-{r_ranks}"), "out")
                point, hit = fault.split("@")[0], int(fault.split("@")[1].split(":")[0])
                kill(blocked_job, out, fault, ranks=k_ranks, bounds=bounds_for(blocked_job, point, hit))
                resume(blocked_job, out, ranks=r_ranks, what=f"resume at {r_ranks} rank(s)")

            results.check(f"dp T=64: kill {fault} at {k_ranks} rank(s), resume at {r_ranks} = reference "
                          "(first tests' blocked prefixes kept)", blocked_resume)

        # A window's log that mixes rank counts (commits by 4 ranks, then by 2), resumed again at 2:
        # the 4-rank segments must still be re-partitioned (each rank reads them all).
        def mixed_rank_log():
            have(dp_job)
            out = os.path.join(case_dir("ranks-4-2-2"), "out")
            kill(dp_job, out, "committed@4:0", ranks=4, bounds=(None, 4))
            kill(dp_job, out, "committed@3:0", resume=True, ranks=2, what="resume at 2 rank(s), killed again")
            resume(dp_job, out, ranks=2, what="second resume at 2 rank(s)")

        results.check("dp: log of 4-rank then 2-rank commits, resumed again at 2 = reference", mixed_rank_log)

        # ---- DP without a seed: the resume reuses the stored secret ----

        def no_seed():
            a = os.path.join(case_dir("noseed-a"), "out")
            killed = kill(noseed_job, a, "committed@6:0", what="unseeded DP killed at committed@6:0")
            b = os.path.join(case_dir("noseed-b"), "out")
            shutil.copytree(a, b)
            r = dp.run_with("run", noseed_job.path, "--out", a, "--progress", "never", "--resume",
                            cwd=os.path.dirname(a))
            assert r.returncode == 0, "resume of the unseeded job failed\n  " + r.describe()
            ra = harness.read_bytes(os.path.join(a, "releases.csv"))
            assert ra and ra.startswith(killed or b""), "the resume rewrote rows published before the kill"
            noseed_job.set_reference(ra, a)  # the reference is now this resumed run
            kill(noseed_job, b, "published@3:0", resume=True, what="resume of the copy killed at published@3:0")
            resume(noseed_job, b, what="second resume of the copy (must equal the first copy's resume)")
            c = os.path.join(case_dir("noseed-fresh"), "out")
            r = fresh(noseed_job, c, cwd=os.path.dirname(c))
            assert r.returncode == 0, "fresh unseeded run failed\n  " + r.describe()
            rc = harness.read_bytes(os.path.join(c, "releases.csv"))
            assert rc != ra, ("a fresh unseeded run equals the resumed one: the noise does not depend on the secret, "
                              "so this test cannot tell whether the resume reused it")

        results.check("dp without seed: resumes of two copies of a killed run agree (secret reused)", no_seed)

        # ---- [checkpoint] every = 3 ----

        def every3_reference():
            have(dp_job)
            out = os.path.join(case_dir("every3-ref"), "out")
            r = fresh(dp3_job, out, cwd=os.path.dirname(out))
            assert r.returncode == 0, "uninterrupted run with every = 3 failed\n  " + r.describe()
            data = harness.read_bytes(os.path.join(out, "releases.csv"))
            assert data == dp_job.ref, "every = 3 changed releases.csv (it must not change output)"
            dp3_job.set_reference(data, out)

        results.check("every = 3: uninterrupted run equals every = 1", every3_reference)

        def time_cadence(seconds, want_commits):
            def case():
                # Without `every`, commits follow rank 0's clock: with 1 ms nearly every trigger commits (a
                # trigger done within 1 ms of the last commit does not: want_commits is then a range), with
                # the default 30 s only the two windows' ends do. The output never changes.
                have(dp_job)
                path = os.path.join(case_dir(f"seconds-{seconds}"), "job.toml")
                text = dp_toml().replace("[checkpoint]\nevery = 1\n", "" if seconds is None else
                                         f"[checkpoint]\nseconds = {seconds}\n")
                assert text != dp_toml(), "the job text holds no [checkpoint] every = 1 to replace"
                harness.write_job(path, text)
                out = os.path.join(os.path.dirname(path), "out")
                r = fresh(Job("dp seconds", path, 0, 8, 2, True), out, cwd=os.path.dirname(out))
                assert r.returncode == 0, r.describe()
                assert harness.read_bytes(os.path.join(out, "releases.csv")) == dp_job.ref, \
                    "a time-based cadence changed releases.csv"
                with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
                    ck = json.load(f)["checkpoint"]
                causes = ck["commits_by_cause"]
                lo, hi = want_commits if isinstance(want_commits, tuple) else (want_commits, want_commits)
                assert ck["every"] is None and lo <= ck["commits"] <= hi and causes["window_end"] == 2 and \
                    causes["every"] == 0 and causes["journal"] == 0 and ck["commits"] == sum(causes.values()), \
                    f"checkpoint summary {ck}"

            return case

        results.check("seconds = 0.001 without every: the clock commits (nearly) every trigger",
                      time_cadence(0.001, (9, 16)))
        results.check("default cadence (30 s): commits at the windows' ends only", time_cadence(None, 2))

        def journal_bound():
            # [checkpoint] journal_mib = 1 on a job whose journal outgrows 1 MiB within a trigger or two
            # on some rank: the bound, not the 30-s clock (which gives the windows' ends only), makes
            # the commits, and releases.csv and state_digest are those of the run without the bound.
            # A run killed after its third commit resumes to the same output.
            text = dp_toml("e2e-ckpt-journal").replace("users = 20000", f"users = {JOURNAL_USERS}")
            text = text.replace("[checkpoint]\nevery = 1\n", "")
            assert "every" not in text and f"users = {JOURNAL_USERS}" in text, "the job text changed shape"
            d = case_dir("journal-bound")
            outs = {}
            for label, extra in (("clock", ()), ("bound", ("--set", "checkpoint.journal_mib=1"))):
                out = os.path.join(d, label, "out")
                job = Job(f"dp {label}", harness.write_job(os.path.join(d, f"{label}.toml"), text), 0, 8, 2, True)
                r = fresh(job, out, *extra, cwd=d)
                assert r.returncode == 0, f"{label}: " + r.describe()
                with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
                    summary = json.load(f)
                outs[label] = (harness.read_bytes(os.path.join(out, "releases.csv")), summary, job, out)
            (ref, ref_summary, _, _), (got, summary, job, out) = outs["clock"], outs["bound"]
            ck_clock, ck_bound = ref_summary["checkpoint"], summary["checkpoint"]
            assert ck_clock["commits"] == 2 and ck_clock["commits_by_cause"]["window_end"] == 2, \
                f"without the bound, commits at the windows' ends only: {ck_clock}"
            causes = ck_bound["commits_by_cause"]
            assert ck_bound["journal_mib"] == 1 and causes["journal"] >= 4 and causes["window_end"] == 2 and \
                causes["seconds"] == 0 and causes["every"] == 0 and ck_bound["commits"] == sum(causes.values()), \
                f"journal_mib = 1: the bound makes the commits: {ck_bound}"
            assert got == ref, "journal_mib = 1 changed releases.csv (a commit must not change output)"
            assert summary["state_digest"] == ref_summary["state_digest"], "journal_mib = 1 changed state_digest"
            print(f"     commits: clock {ck_clock['commits']}, bound {ck_bound['commits']} ({causes})")
            job.set_reference(ref, outs["clock"][3])
            killed = os.path.join(d, "killed", "out")
            os.makedirs(os.path.dirname(killed))
            kill(job, killed, "published@3:0", "--set", "checkpoint.journal_mib=1",
                 what="journal_mib = 1, published@3:0")
            resume(job, killed, "--set", "checkpoint.journal_mib=1", what="resume of a journal_mib = 1 run")
            with open(os.path.join(killed, "summary.json"), encoding="utf-8") as f:
                resumed = json.load(f)["checkpoint"]
            assert resumed["commits_by_cause"] == causes and resumed["commits"] < sum(causes.values()), \
                (f"commits_by_cause counts the whole job across the resume (the uninterrupted run's {causes}), "
                 f"commits this run's: {resumed}")

        results.check("journal_mib = 1: the journal bound commits more often than the clock, same output",
                      journal_bound)

        def every3_published(commit, triggers):
            def case():
                have(dp3_job)
                out = os.path.join(case_dir(f"every3-published{commit}"), "out")
                kill(dp3_job, out, f"published@{commit}:0", bounds=(triggers, triggers),
                     what=f"every = 3, published@{commit}:0 (releases.csv = rows of the first {triggers} triggers)")
                resume(dp3_job, out)

            return case

        results.check("every = 3: published@1 leaves exactly triggers 0-2, resume = reference", every3_published(1, 3))
        results.check("every = 3: published@3 leaves exactly window 0 (last trigger commits), resume = reference",
                      every3_published(3, 8))

        def every3_mid():
            have(dp3_job)
            out = os.path.join(case_dir("every3-mid"), "out")
            kill(dp3_job, out, f"accumulate@5:{last}", bounds=(None, 3))
            resume(dp3_job, out)

        results.check("every = 3: kill mid-interval (accumulate@5), resume = reference", every3_mid)

        def every_changed(job, fault, new_every, hi):
            def case():
                have(job)
                out = os.path.join(case_dir(f"every-change-{new_every}"), "out")
                kill(job, out, fault, bounds=(None, hi))
                resume(job, out, "--set", f"checkpoint.every={new_every}", what=f"resume with every = {new_every}")

            return case

        results.check("every = 3 killed, resumed with --set checkpoint.every=1: accepted, = reference",
                      every_changed(dp3_job, f"output@5:{last}", 1, 3))
        results.check("every = 1 killed, resumed with --set checkpoint.every=4: accepted, = reference",
                      every_changed(dp_job, f"ingest@6:{last}", 4, 5))

        # ---- --resume of a completed job ----

        def already_complete():
            have(dp_job)
            out = os.path.join(case_dir("already-complete"), "out")
            shutil.copytree(dp_job.ref_dir, out)
            before = harness.snapshot_tree(out)
            r = dp.run_with("run", dp_job.path, "--out", out, "--progress", "never", "--resume", cwd=os.path.dirname(out))
            assert r.returncode == 0, "--resume of a completed job failed\n  " + r.describe()
            assert "already complete" in r.stdout + r.stderr, "no 'already complete' line\n  " + r.describe()
            after = harness.snapshot_tree(out)
            assert before == after, "--resume of a completed job changed the out dir: " + \
                harness.describe_tree_change(before, after)

        results.check("--resume of a completed job: exit 0, 'already complete', nothing changed", already_complete)

        def enough_kills():
            print(f"     kill points exercised: {kills['n']}")
            assert kills["n"] >= MIN_KILLS, f"only {kills['n']} kills were exercised (at least {MIN_KILLS} expected)"

        results.check("enough kills exercised", enough_kills)
    print(f"kill points exercised: {kills['n']}")
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
