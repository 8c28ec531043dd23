#!/usr/bin/env python3
"""End-to-end test of the checkpoint refusals and of the fallback to the previous commit.

A small synthetic mode = "dp" job (fixed [privacy] seed) runs once uninterrupted: the reference.
"Unfinished" out dirs are made by SIGKILLing rank 0 with DPSTREAM_FAULT=<point>@<hit>:0 (so
releases.csv already holds rows). Then:

  Refusals (exit code 4, "dpstream: checkpoint error: ..." on stderr, and the out dir - releases.csv
  and checkpoint/ - unchanged, no summary.json):
    * --resume with no checkpoint: empty dir, missing dir, a dir holding only an old releases.csv
      ("no checkpoint");
    * --resume with a changed job spec (--set or an edited TOML): the message names each changed
      field as section.key and no unchanged one; afterwards a plain --resume still completes;
    * --resume where checkpoint/ was copied from another job (other [job] name and spec): "another job";
    * a segment of an earlier commit (not the newest) truncated, one byte flipped ("checksum") or
      deleted ("missing");
    * a run without --resume into a dir with an unfinished checkpoint: names --resume and --fresh;
      then --fresh starts over (exit 0, = reference).
  Accepted:
    * a fresh run into a dir holding a completed job overwrites it (with another spec: equals an
      uninterrupted run of that spec);
    * a damaged newest commit (its segment flipped / truncated / deleted on rank 0 or the last rank,
      also for the first commit of window 1; or the newest MANIFEST truncated, one byte flipped, or one
      digit changed so it stays valid JSON): --resume prints "falling back", exits 0, and releases.csv
      equals the reference.

Usage: test_checkpoint_refusals.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import json
import os
import re
import shutil
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import test_checkpoint_kill as ck  # noqa: E402  (jobs and checkpoint-layout helpers)

KILL_TIMEOUT = 30.0
EXIT_CHECKPOINT = 4
ERROR_PREFIX = "dpstream: checkpoint error:"


def main():
    args = harness.parse_args(__doc__)
    dp = harness.Dpstream(args)
    results = harness.Results(f"test_checkpoint_refusals (ranks={args.ranks})")
    last = args.ranks - 1
    with harness.TempDir(args.keep, "dpstream-e2e-ckpt-refusals-") as root:
        case_dir = harness.CaseDirs(root)

        job = ck.Job("dp", harness.write_job(os.path.join(root, "dp.toml"), ck.dp_toml()), 0, 8, 2, True)
        other_text = ck.dp_toml("e2e-ckpt-other").replace("users = 20000", "users = 15000") \
            .replace("epsilon = 6.0", "epsilon = 4.0")
        other = ck.Job("other", harness.write_job(os.path.join(root, "other.toml"), other_text), 0, 8, 2, True)
        assert other_text != ck.dp_toml("e2e-ckpt-other")

        def run(job_path, out, *extra, env=None, timeout=None):
            return dp.run_with("run", job_path, "--out", out, "--progress", "never", *extra, env=env,
                               timeout=timeout, cwd=os.path.dirname(out))

        def reference(j):
            def check():
                out = os.path.join(case_dir(f"ref-{j.label}"), "out")
                r = run(j.path, out)
                assert r.returncode == 0, f"uninterrupted run of {j.label} failed\n  " + r.describe()
                data = harness.read_bytes(os.path.join(out, "releases.csv"))
                assert data is not None, f"{j.label}: no releases.csv"
                j.set_reference(data, out)
            return check

        def have(*js):
            for j in js:
                assert j.ref is not None, f"no reference for {j.label} (its uninterrupted run failed)"

        def unfinished(label, fault="published@5:0", j=None):
            """An out dir whose run was SIGKILLed at `fault` (rank 0 unless the fault says otherwise)."""
            j = j or job
            have(j)
            out = os.path.join(case_dir(label), "out")
            r = run(j.path, out, env={"DPSTREAM_FAULT": fault}, timeout=min(KILL_TIMEOUT, args.timeout))
            both = r.stdout + r.stderr
            assert r.returncode != 0 and (r.returncode == 137 or "signal 9" in both or "Killed" in both), \
                f"DPSTREAM_FAULT={fault}: the run was not killed by the fault\n  " + r.describe()
            content = harness.read_bytes(os.path.join(out, "releases.csv"))
            assert content is None or j.ref.startswith(content), \
                f"DPSTREAM_FAULT={fault}: releases.csv is not a prefix of the reference"
            assert os.path.isdir(os.path.join(out, "checkpoint")), f"DPSTREAM_FAULT={fault}: no checkpoint/ left"
            return out

        def expect_refusal(r, out, before, needles, what, absent=()):
            assert r.returncode == EXIT_CHECKPOINT, f"{what}: expected exit code {EXIT_CHECKPOINT}\n  " + r.describe()
            assert ERROR_PREFIX in r.stderr, f"{what}: no '{ERROR_PREFIX}' on stderr\n  " + r.describe()
            low = r.stderr.lower()
            missing = [n for n in needles if n.lower() not in low]
            assert not missing, f"{what}: stderr does not mention {missing}\n  " + r.describe()
            wrong = [n for n in absent if n.lower() in low]
            assert not wrong, f"{what}: stderr names unchanged fields {wrong}\n  " + r.describe()
            after = harness.snapshot_tree(out)
            assert after == before, f"{what}: the refused command changed the out dir: " + \
                harness.describe_tree_change(before, after)

        def resume_ok(out, what, fallback=False, j=None):
            j = j or job
            r = run(j.path, out, "--resume")
            assert r.returncode == 0, f"{what}: --resume failed\n  " + r.describe()
            if fallback:
                assert "falling back" in (r.stdout + r.stderr).lower(), \
                    f"{what}: no 'falling back' line\n  " + r.describe()
            got = harness.read_bytes(os.path.join(out, "releases.csv"))
            if got != j.ref:
                i = harness.first_difference(got or b"", j.ref)
                raise AssertionError(f"{what}: releases.csv ({show_len(got)}) differs from the uninterrupted run "
                                     f"({len(j.ref)} bytes) at byte {i}:\n    got {(got or b'')[max(0, i - 120):i + 80]!r}\n"
                                     f"    ref {j.ref[max(0, i - 120):i + 80]!r}")
            assert os.path.isfile(os.path.join(out, "summary.json")), f"{what}: no summary.json after completion"
            return r

        def show_len(data):
            return "no file" if data is None else f"{len(data)} bytes"

        def newest_two(out):
            mans = ck.read_manifests(os.path.join(out, "checkpoint"))
            assert len(mans) >= 2, f"expected two committed manifests in {out}/checkpoint, found {[m[1] for m in mans]}"
            (pseq, pname, pdoc), (seq, name, doc) = mans[-2], mans[-1]
            assert doc is not None and pdoc is not None, f"{name} or {pname} is not valid JSON"
            return (pseq, pname, pdoc), (seq, name, doc)

        results.check("uninterrupted DP job = reference", reference(job))
        results.check("uninterrupted other job (other name, users, epsilon) = reference", reference(other))

        # ---- --resume without a checkpoint ----

        def no_checkpoint(kind):
            def case():
                have(job)
                out = os.path.join(case_dir(f"no-checkpoint-{kind}"), "out")
                if kind == "empty dir":
                    os.makedirs(out)
                elif kind == "old releases.csv":
                    os.makedirs(out)
                    with open(os.path.join(out, "releases.csv"), "wb") as f:
                        f.write(job.ref[: len(job.ref) // 3])
                before = harness.snapshot_tree(out)
                r = run(job.path, out, "--resume")
                expect_refusal(r, out, before, ["no checkpoint"], f"--resume into {kind}")
                assert not os.path.exists(os.path.join(out, "summary.json"))
            return case

        for kind in ("empty dir", "missing dir", "old releases.csv"):
            results.check(f"--resume, {kind}, no checkpoint -> exit 4 'no checkpoint', nothing changed",
                          no_checkpoint(kind))

        # ---- --resume with a changed job spec ----

        state = {}

        def spec_dir():
            if "spec" not in state:
                state["spec"] = unfinished("changed-spec")
            return state["spec"]

        fields = {"privacy.epsilon": "5.0", "stream.triggers": "10", "input.users": "19000", "privacy.clamp_max": "2.0"}

        def changed(sets):
            def case():
                out = spec_dir()
                before = harness.snapshot_tree(out)
                argv = []
                for k in sets:
                    argv += ["--set", f"{k}={fields[k]}"]
                r = run(job.path, out, "--resume", *argv)
                expect_refusal(r, out, before, list(sets), f"--resume {' '.join(argv)}",
                               absent=[k for k in fields if k not in sets])
                # The keys the user changed come first; what the engine derives from them after, cut short.
                line = r.stderr.splitlines()[0]
                derived = line.find("engine.")
                assert derived == -1 or all(line.find(k) < derived for k in sets), r.describe()
                listed = re.search(r"was written: (.*); resume with", line)
                assert listed and all(len(part) < 200 for part in listed.group(1).split(", ")), \
                    "a field's value was not cut\n  " + r.describe()
            return case

        for k in ("privacy.epsilon", "stream.triggers", "input.users"):
            results.check(f"--resume with {k} changed (--set) -> exit 4 naming {k} only", changed([k]))
        results.check("--resume with three fields changed -> exit 4 naming each",
                      changed(["privacy.epsilon", "input.users", "privacy.clamp_max"]))

        def edited_toml():
            out = spec_dir()
            edited = harness.write_job(os.path.join(os.path.dirname(out), "edited.toml"),
                                       ck.dp_toml().replace("epsilon = 6.0", "epsilon = 5.5"))
            before = harness.snapshot_tree(out)
            r = run(edited, out, "--resume")
            expect_refusal(r, out, before, ["privacy.epsilon"], "--resume with an edited TOML (epsilon 6 -> 5.5)",
                           absent=["input.users", "stream.triggers"])

        results.check("--resume with an edited job file (epsilon) -> exit 4 naming privacy.epsilon", edited_toml)

        def spec_then_resume():
            resume_ok(spec_dir(), "plain --resume after the refused ones")

        results.check("after the refusals a plain --resume completes = reference", spec_then_resume)

        # ---- checkpoint of another job ----

        def another_job():
            have(job, other)
            mine = unfinished("another-job-mine")
            theirs = unfinished("another-job-theirs", j=other)
            shutil.rmtree(os.path.join(mine, "checkpoint"))
            shutil.copytree(os.path.join(theirs, "checkpoint"), os.path.join(mine, "checkpoint"))
            before = harness.snapshot_tree(mine)
            r = run(job.path, mine, "--resume")
            expect_refusal(r, mine, before, ["another job"], "--resume with checkpoint/ copied from another job")

        results.check("--resume with checkpoint/ of another job -> exit 4 'another job'", another_job)

        # ---- a damaged segment of an earlier commit ----

        def older_segment(out, rank):
            """A segment file of the newest checkpoint's chain older than the previous commit."""
            ckd = os.path.join(out, "checkpoint")
            (pseq, _pn, _pd), (seq, name, doc) = newest_two(out)
            listed = [s for s in doc["segments"] if s["seq"] < pseq]
            if listed:
                seg = min((s for s in listed if s["rank"] == rank), key=lambda s: s["seq"], default=None) \
                    or min(listed, key=lambda s: s["seq"])
                return os.path.join(ckd, seg["file"]), "listed in the newest manifest"
            # The manifest lists only the newest commit: take an older segment of its window on disk.
            cands = []
            for dirpath, _dirs, files in os.walk(ckd):
                for f in files:
                    rel = os.path.relpath(os.path.join(dirpath, f), ckd)
                    m = ck.SEGMENT_RE.match(rel)
                    if m and int(m.group(2)) < pseq and int(m.group(3)) == rank:
                        cands.append((int(m.group(2)), rel))
            assert cands, (f"{name} lists no segment older than the previous commit (seq {pseq}) and none is on disk: "
                           f"cannot damage a non-newest segment; segments {doc['segments']}")
            same_window = [c for c in cands if c[1].split("/")[0] == doc["segments"][0]["file"].split("/")[0]]
            return os.path.join(ckd, min(same_window or cands)[1]), "found on disk"

        def damaged_old(how, rank, needle):
            def case():
                out = unfinished(f"old-segment-{how}", fault="published@6:0")
                path, where = older_segment(out, rank)
                if how == "truncated":
                    harness.truncate_file(path)
                elif how == "flipped":
                    harness.flip_byte(path)
                else:
                    os.remove(path)
                before = harness.snapshot_tree(out)
                r = run(job.path, out, "--resume")
                expect_refusal(r, out, before, [needle],
                               f"--resume with {os.path.relpath(path, out)} ({where}) {how}")
            return case

        results.check("older segment (rank 0) truncated -> exit 4 'checksum'", damaged_old("truncated", 0, "checksum"))
        results.check(f"older segment (rank {last}) one byte flipped -> exit 4 'checksum'",
                      damaged_old("flipped", last, "checksum"))
        results.check(f"older segment (rank {last}) deleted -> exit 4 'missing'", damaged_old("deleted", last, "missing"))

        def edited_releases(how):
            def case():
                # Rows edited or replaced after the run: the committed bytes' XXH3 differs, the file is kept as it is.
                out = unfinished(f"releases-{how}", fault="published@6:0")
                path = os.path.join(out, "releases.csv")
                original = harness.read_bytes(path)
                header_end = original.index(b"\n") + 1
                assert len(original) > header_end + 40, f"too few committed rows to edit: {original!r}"
                if how == "one digit":
                    i = header_end + 2 + original[header_end + 2:].index(b",") + 1  # the first row's key
                    digit = b"1" if original[i:i + 1] != b"1" else b"2"
                    edited = original[:i] + digit + original[i + 1:]
                else:  # the same length of rows from another run: every byte of the header kept
                    edited = original[:header_end] + bytes(reversed(original[header_end:-1])) + original[-1:]
                with open(path, "wb") as f:
                    f.write(edited)
                # What a commit interrupted while a rank wrote its segment leaves: the refusal, found once the
                # state is loaded, must keep it too (it deleted such files, when the kill had left one); an
                # accepted resume deletes it.
                windows = sorted(d for d in os.listdir(os.path.join(out, "checkpoint")) if re.fullmatch(r"w\d+", d))
                assert windows, f"no window directory in {out}/checkpoint"
                stale = os.path.join(out, "checkpoint", windows[-1], "s999999-r0001.h5.tmp")
                with open(stale, "wb") as f:
                    f.write(b"an interrupted commit's segment")
                before = harness.snapshot_tree(out)
                r = run(job.path, out, "--resume")
                expect_refusal(r, out, before, ["XXH3", "releases.csv", "--fresh"], f"--resume with releases.csv's {how}")
                with open(path, "wb") as f:
                    f.write(original)
                resume_ok(out, f"--resume after releases.csv's {how} was put back")
                assert not os.path.exists(stale), f"the accepted resume left the temporary file {stale}"
            return case

        results.check("releases.csv with one committed digit edited -> exit 4 'XXH3', kept; put back -> = reference",
                      edited_releases("one digit"))
        results.check("releases.csv's committed rows replaced (same length) -> exit 4 'XXH3', kept",
                      edited_releases("rows replaced"))

        # ---- unfinished checkpoint without --resume, then --fresh ----

        def needs_flag():
            out = unfinished("needs-resume-or-fresh", fault="publish_half@4:0")
            state["fresh"] = out
            before = harness.snapshot_tree(out)
            r = run(job.path, out)
            expect_refusal(r, out, before, ["--resume", "--fresh"], "run without --resume into an unfinished checkpoint")
            # Without checkpoints the advice to resume says what resuming needs.
            r = run(job.path, out, "--set", "checkpoint.every=0")
            expect_refusal(r, out, before, ["--resume needs checkpoints", "every = 0"],
                           "a run without checkpoints into an unfinished checkpoint")

        def fresh_over_unfinished():
            out = state.get("fresh") or unfinished("fresh-over-unfinished", fault="publish_half@4:0")
            r = run(job.path, out, "--fresh")
            assert r.returncode == 0, "--fresh over an unfinished checkpoint failed\n  " + r.describe()
            got = harness.read_bytes(os.path.join(out, "releases.csv"))
            assert got == job.ref, f"--fresh: releases.csv ({show_len(got)}) differs from the reference ({len(job.ref)} bytes)"
            assert os.path.isfile(os.path.join(out, "summary.json")), "--fresh: no summary.json"
            mans = ck.read_manifests(os.path.join(out, "checkpoint"))
            assert mans and mans[-1][2] and mans[-1][2].get("complete") is True, \
                f"--fresh: the newest manifest does not say complete: {mans[-1][1:] if mans else 'none'}"

        results.check("run without --resume into an unfinished checkpoint -> exit 4 naming --resume and --fresh",
                      needs_flag)
        results.check("--fresh over an unfinished checkpoint starts over: exit 0, = reference", fresh_over_unfinished)

        def linked_checkpoint():
            # DIR/checkpoint as a link to a directory on other storage: a fresh start empties the target and keeps the
            # link (it made a directory in its place: the secret went to the output's storage); --resume goes through.
            base = case_dir("linked-checkpoint")
            target, out = os.path.join(base, "elsewhere"), os.path.join(base, "out")
            os.makedirs(target)
            os.makedirs(out)
            with open(os.path.join(target, "left.tmp"), "w") as f:
                f.write("an interrupted start's file\n")
            os.symlink(target, os.path.join(out, "checkpoint"))
            # The linked directory shared with other data (beside an old checkpoint's window directory): refused, kept.
            os.makedirs(os.path.join(target, "w0"))
            with open(os.path.join(target, "precious.txt"), "w") as f:
                f.write("a user's file\n")
            r = run(job.path, out)
            assert r.returncode == EXIT_CHECKPOINT and "precious.txt" in r.stderr, r.describe()
            assert sorted(os.listdir(target)) == ["left.tmp", "precious.txt", "w0"], sorted(os.listdir(target))
            os.remove(os.path.join(target, "precious.txt"))
            r = run(job.path, out, env={"DPSTREAM_FAULT": "published@5:0"}, timeout=min(KILL_TIMEOUT, args.timeout))
            assert r.returncode != 0, "the fault did not stop the run\n  " + r.describe()
            assert os.path.islink(os.path.join(out, "checkpoint")), "the link to the checkpoint's storage was replaced"
            held = sorted(os.listdir(target))
            assert "job.h5" in held and "left.tmp" not in held, f"the link's target holds {held}"
            assert oct(os.stat(target).st_mode & 0o777) == "0o700", "the checkpoint's storage is not private"
            resume_ok(out, "--resume through a linked checkpoint")
            assert os.path.islink(os.path.join(out, "checkpoint"))

        results.check("DIR/checkpoint linked to other storage: kept a link, emptied, private; resume = reference",
                      linked_checkpoint)

        # ---- a completed job is overwritten by a fresh run ----

        def overwrite_completed():
            have(job, other)
            out = os.path.join(case_dir("overwrite-completed"), "out")
            shutil.copytree(job.ref_dir, out)
            r = run(job.path, out)
            assert r.returncode == 0, "fresh run (same spec) into a completed job failed\n  " + r.describe()
            # A seeded job ([privacy] seed: a test) spends no budget: no warning that it does again.
            assert "spends their privacy budget again" not in r.stderr, r.describe()
            assert harness.read_bytes(os.path.join(out, "releases.csv")) == job.ref, "same-spec rerun differs"
            r = run(other.path, out)
            assert r.returncode == 0, "fresh run of another job into a completed job's dir failed\n  " + r.describe()
            got = harness.read_bytes(os.path.join(out, "releases.csv"))
            assert got == other.ref, (f"the dir of a completed job was not overwritten: releases.csv ({show_len(got)}) "
                                      f"differs from an uninterrupted run of the other job ({len(other.ref)} bytes)")
            with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
                name = json.load(f).get("job")
            assert name in (None, "e2e-ckpt-other"), f"summary.json names job {name!r}"

        results.check("fresh runs into a completed job's dir overwrite it (same and other spec)", overwrite_completed)

        # ---- a damaged newest commit: fall back to the previous one ----

        def newest_segment(out, rank):
            (_p, _pn, _pd), (seq, name, doc) = newest_two(out)
            segs = [s for s in doc["segments"] if s["seq"] == seq and s["rank"] == rank]
            assert segs, f"{name} lists no segment of rank {rank} for its own commit {seq}: {doc['segments']}"
            return os.path.join(out, "checkpoint", segs[0]["file"])

        def fallback(label, fault, damage):
            def case():
                out = unfinished(f"fallback-{label}", fault=fault)
                desc = damage(out)
                resume_ok(out, f"--resume after {desc} (killed at {fault})", fallback=True)
            return case

        def seg_flip(rank):
            def d(out):
                p = newest_segment(out, rank)
                harness.flip_byte(p)
                return f"one byte flipped in the newest segment {os.path.relpath(p, out)}"
            return d

        def seg_truncate(rank):
            def d(out):
                p = newest_segment(out, rank)
                harness.truncate_file(p)
                return f"truncating the newest segment {os.path.relpath(p, out)}"
            return d

        def seg_delete(rank):
            def d(out):
                p = newest_segment(out, rank)
                os.remove(p)
                return f"deleting the newest segment {os.path.relpath(p, out)}"
            return d

        def manifest_damage(how):
            def d(out):
                (_p, _pn, _pd), (_s, name, _doc) = newest_two(out)
                p = os.path.join(out, "checkpoint", name)
                if how == "truncated":
                    harness.truncate_file(p)
                elif how == "flipped":
                    harness.flip_byte(p)
                else:  # still valid JSON: one digit of releases_bytes changed
                    with open(p, "rb") as f:
                        text = f.read()
                    m = re.search(rb'"releases_bytes"\s*:\s*(\d+)', text)
                    assert m, f"{name} has no releases_bytes number: {text[:300]!r}"
                    i = m.end(1) - 1
                    digit = b"1" if text[i:i + 1] != b"1" else b"2"
                    with open(p, "wb") as f:
                        f.write(text[:i] + digit + text[i + 1:])
                    json.loads(text[:i] + digit + text[i + 1:])  # the damage must keep it valid JSON
                return f"{how} newest manifest {name}"
            return d

        results.check(f"newest segment (rank {last}) byte flipped, rows already published -> falling back, = reference",
                      fallback("seg-flip", "published@5:0", seg_flip(last)))
        results.check("newest segment (rank 0) truncated -> falling back, = reference",
                      fallback("seg-trunc", "committed@5:0", seg_truncate(0)))
        results.check(f"newest segment (rank {last}) deleted, killed mid-publish -> falling back, = reference",
                      fallback("seg-delete", "publish_half@6:0", seg_delete(last)))
        results.check("newest MANIFEST truncated -> falling back, = reference",
                      fallback("manifest-trunc", "published@5:0", manifest_damage("truncated")))
        results.check("newest MANIFEST one byte flipped -> falling back, = reference",
                      fallback("manifest-flip", "committed@6:0", manifest_damage("flipped")))
        results.check("newest MANIFEST with one digit changed (valid JSON) -> falling back, = reference",
                      fallback("manifest-digit", "published@7:0", manifest_damage("digit changed")))
        results.check("newest segment damaged in window 1 -> falling back, = reference",
                      fallback("seg-flip-w1", "published@11:0", seg_flip(0)))
        results.check("newest commit = first of window 1, its segment deleted -> falling back to window 0's end",
                      fallback("seg-delete-w1-first", "committed@9:0", seg_delete(last)))
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
