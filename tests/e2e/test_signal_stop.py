#!/usr/bin/env python3
"""End-to-end test of the clean stop on SIGTERM / SIGUSR1 (SLURM pre-emption), then --resume.

Each job first runs uninterrupted: its releases.csv is the reference. Then:

  * deterministic signals: DPSTREAM_FAULT=<point>@<hit>:<rank>:TERM|USR1 makes one rank signal
    itself inside the ingest, an all-to-all, a kernel or the checkpoint's I/O thread. The run must
    exit 5 with a log line naming the signal, the rank and the trigger it stopped after; releases.csv
    must hold exactly the rows of every trigger up to that one (also between two scheduled commits
    with [checkpoint] every = 5, and at a window's end), no summary.json; one --resume (at another rank
    count) must give a releases.csv byte-identical to the reference.
  * users bounded in batches of 5 triggers ([engine] trigger_batch = 5): a signal inside a batch
    stops the job after the batch's last trigger (commits wait for a batch's end); one inside the
    job's last batch finishes the job.
  * a signal during the job's last trigger just finishes the job (exit 0, summary.json).
  * [checkpoint] every = 0: exit 5, "nothing can be resumed", no output files left.
  * external signals on a larger job: SIGUSR1 to mpirun (which forwards it to every rank) stops
    the job cleanly; SIGTERM then SIGUSR1 to one rank (repeat window off) abort it ("second stop
    signal") and the last committed checkpoint still resumes to the reference; a repeat 50 ms later
    with the default 2 s window is the same request (clean stop).

Usage: test_signal_stop.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import os
import re
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

EXIT_STOPPED = 5
STOP_RE = re.compile(r"stopped cleanly on (SIGTERM|SIGUSR1) \(first seen by rank (\d+)\) after trigger (\d+) of (\d+) "
                     r"in window (\d+) of (\d+); commit (\d+)")


def job_toml(name, mode, users, triggers, windows=1, every=None, first_window=0):
    return harness.synthetic_job_toml(name, mode, users, triggers, keys=200, seed=3, window_seconds=900, max_records=8,
                                      noise_seed=5, windows=windows, first_window=first_window,
                                      every=1 if every is None else every)  # commits at every trigger unless given


def rows_through(reference, first_window, window_index, trigger):
    """Header and the reference's rows of every trigger up to (window_index, trigger), 1-based."""
    lines = reference.splitlines(keepends=True)
    keep = [lines[0]]
    last = (first_window + window_index - 1, trigger - 1)
    for line in lines[1:]:
        w, t = line.split(b",", 2)[:2]
        if (int(w), int(t)) <= last:
            keep.append(line)
    return b"".join(keep)


def rank_pids(mpirun_pid):
    """PIDs of the dpstream ranks started by this mpirun (its children)."""
    out = subprocess.run(["pgrep", "-P", str(mpirun_pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def main():
    args = harness.parse_args(__doc__.splitlines()[0])
    dps = harness.Dpstream(args)
    R = args.ranks
    other = 3 if R != 3 else 2  # resume at another rank count
    results = harness.Results("e2e_signal_stop")

    with harness.TempDir(args.keep, "dpstream-e2e-signal-") as tmp:
        case_dir = harness.CaseDirs(tmp)
        jobs = {
            "none": job_toml("e2e-signal-none", "none", 4000, 6, windows=2, first_window=3),
            "dp": job_toml("e2e-signal-dp", "dp", 6000, 9),
            "dp-every5": job_toml("e2e-signal-dp", "dp", 6000, 9, every=5),
            "dp-batch5": job_toml("e2e-signal-dp", "dp", 6000, 9) + "\n[engine]\ntrigger_batch = 5\n",
            "none-every0": job_toml("e2e-signal-none", "none", 4000, 6, windows=2, first_window=3, every=0),
            "big": job_toml("e2e-signal-big", "none", 1500000, 8),
        }
        first_window = {"none": 3, "dp": 0, "dp-every5": 0, "dp-batch5": 0, "none-every0": 3, "big": 0}
        specs, reference = {}, {}
        for name, text in jobs.items():
            specs[name] = harness.write_job(os.path.join(tmp, f"{name}.toml"), text)
        for name in ("none", "dp", "big"):
            out = case_dir(f"reference-{name}")
            run = dps.run_with("run", specs[name], "--out", out)
            assert run.returncode == 0, run.describe()
            reference[name] = harness.read_bytes(os.path.join(out, "releases.csv"))
        reference["dp-every5"] = reference["dp"]  # `every` does not change the output
        reference["dp-batch5"] = reference["dp"]  # nor do batches

        def resume_and_compare(job, out, ranks):
            run = dps.run_with("run", specs[job], "--out", out, "--resume", ranks=ranks)
            assert run.returncode == 0, run.describe()
            got = harness.read_bytes(os.path.join(out, "releases.csv"))
            assert got == reference[job], (f"resumed releases.csv differs from the uninterrupted run at byte "
                                           f"{harness.first_difference(got, reference[job])}")
            assert os.path.exists(os.path.join(out, "summary.json")), "no summary.json after the resume"

        def stopped_run(job, fault, expect_signal, expect_rank, expect_trigger=None, expect_window=1):
            out = case_dir(f"{job}-{fault}")
            run = dps.run_with("run", specs[job], "--out", out, env={"DPSTREAM_FAULT": fault})
            assert run.returncode == EXIT_STOPPED, f"expected exit {EXIT_STOPPED}\n{run.describe()}"
            m = STOP_RE.search(run.stderr)
            assert m, f"no stop line in stderr\n{run.describe()}"
            sig, rank, trigger, _T, window, _W, _seq = m.groups()
            assert sig == expect_signal and int(rank) == expect_rank, f"stop line names {sig} on rank {rank}: {m.group(0)}"
            if expect_trigger is not None:
                assert (int(window), int(trigger)) == (expect_window, expect_trigger), \
                    f"stopped after window {window} trigger {trigger}, expected {expect_window} / {expect_trigger}"
            assert "--resume" in run.stderr, "the stop line does not say how to continue"
            got = harness.read_bytes(os.path.join(out, "releases.csv"))
            want = rows_through(reference[job], first_window[job], int(window), int(trigger))
            assert got == want, (f"releases.csv after the stop is not exactly the rows up to window {window} trigger "
                                 f"{trigger} ({len(got or b'')} vs {len(want)} bytes)")
            assert not os.path.exists(os.path.join(out, "summary.json")), "summary.json written by a stopped run"
            resume_and_compare(job, out, other)

        last = R - 1
        # Every trigger commits: the stop lands exactly on the trigger that saw the signal.
        results.check("TERM in ingest, mid-window (mode none)",
                      lambda: stopped_run("none", f"ingest@4:{last}:TERM", "SIGTERM", last, 4))
        results.check("TERM at a window's last trigger: stops between windows",
                      lambda: stopped_run("none", f"ingest@6:{last}:TERM", "SIGTERM", last, 6))
        results.check("USR1 inside the user all-to-all, window 2",
                      lambda: stopped_run("none", "shuffle_user@8:0:USR1", "SIGUSR1", 0, 2, expect_window=2))
        results.check("TERM inside the DP kernel",
                      lambda: stopped_run("dp", f"dp_release@5:{last}:TERM", "SIGTERM", last, 5))
        results.check("USR1 inside the bounding kernel between two scheduled commits (every = 5)",
                      lambda: stopped_run("dp-every5", "bounding@3:0:USR1", "SIGUSR1", 0, 3))
        results.check("TERM inside the key all-to-all after a scheduled commit (every = 5)",
                      lambda: stopped_run("dp-every5", f"shuffle_key@7:{last}:TERM", "SIGTERM", last, 7))
        # The I/O thread receives it while writing a segment: the stop follows within a trigger.
        results.check("USR1 on the checkpoint I/O thread",
                      lambda: stopped_run("dp", "ckpt_half_written@3:0:USR1", "SIGUSR1", 0))

        results.check("TERM inside the DP kernel at trigger 2 of a batch of triggers 1-5: stops after trigger 5",
                      lambda: stopped_run("dp-batch5", f"dp_release@2:{last}:TERM", "SIGTERM", last, 5))

        def finishes(job, case, fault, where):
            out = case_dir(case)
            run = dps.run_with("run", specs[job], "--out", out, env={"DPSTREAM_FAULT": fault})
            assert run.returncode == 0, f"a signal in the job's {where} must just finish it\n{run.describe()}"
            assert harness.read_bytes(os.path.join(out, "releases.csv")) == reference[job], "output differs"
            assert os.path.exists(os.path.join(out, "summary.json")), "no summary.json"
        results.check("signal inside the job's last batch (triggers 6-9) finishes the job",
                      lambda: finishes("dp-batch5", "dp-batch5-last-batch", f"dp_release@7:{last}:TERM", "last batch"))
        results.check("signal during the job's last trigger finishes the job",
                      lambda: finishes("dp", "dp-last-trigger", f"ingest@9:{last}:TERM", "last trigger"))

        def without_checkpoints():
            out = case_dir("every0")
            run = dps.run_with("run", specs["none-every0"], "--out", out, env={"DPSTREAM_FAULT": "ingest@3:0:TERM"})
            assert run.returncode == EXIT_STOPPED, run.describe()
            assert "nothing can be resumed" in run.stderr, run.describe()
            assert harness.leftover_outputs(out) == [], f"left behind: {harness.leftover_outputs(out)}"
            assert not os.path.exists(os.path.join(out, "checkpoint")), "a checkpoint dir without checkpoints"
        results.check("[checkpoint] every = 0: stops, keeps nothing", without_checkpoints)

        def start_big(out, extra_env=None):
            argv = [dps.mpirun, "-np", str(R), dps.bin, "run", specs["big"], "--out", out]
            env = dict(dps.env)
            env.pop("DPSTREAM_FAULT", None)
            env.update(extra_env or {})
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=dps.launch_env(env), start_new_session=True)
            releases = os.path.join(out, "releases.csv")
            header = len(b"window,trigger,key,count,sum\n")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # wait for the first committed rows (trigger 1 is done)
                if proc.poll() is not None:
                    raise AssertionError(f"the job ended before it could be signalled: {proc.communicate()[1]!r}")
                if os.path.exists(releases) and os.path.getsize(releases) > header:
                    return proc
                time.sleep(0.02)
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("no committed rows within 60 s")

        def finish(proc):
            try:
                _out, err = proc.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise AssertionError("hang after the signal")
            return proc.returncode, err

        def usr1_to_mpirun():
            out = case_dir("big-usr1-mpirun")
            proc = start_big(out)
            proc.send_signal(signal.SIGUSR1)
            code, err = finish(proc)
            assert code == EXIT_STOPPED, f"exit {code}\n{err[-2000:]}"
            m = STOP_RE.search(err)
            assert m and int(m.group(3)) < 8, f"no mid-stream stop line: {err[-2000:]!r}"
            got = harness.read_bytes(os.path.join(out, "releases.csv"))
            assert got == rows_through(reference["big"], 0, 1, int(m.group(3))), "releases.csv is not the committed prefix"
            resume_and_compare("big", out, R)
        results.check("SIGUSR1 to mpirun: forwarded, clean stop, resume", usr1_to_mpirun)

        def second_signal_aborts():
            # Two different signals back to back never merge into one; the repeat window is off.
            out = case_dir("big-term-then-usr1")
            proc = start_big(out, {"DPSTREAM_STOP_REPEAT_SECONDS": "0"})
            pids = rank_pids(proc.pid)
            assert pids, "no rank processes found under mpirun"
            os.kill(pids[-1], signal.SIGTERM)
            os.kill(pids[-1], signal.SIGUSR1)
            code, err = finish(proc)
            assert code not in (0, EXIT_STOPPED), f"a second signal must abort (exit {code})\n{err[-2000:]}"
            assert "second stop signal: aborting" in err, f"no abort line: {err[-2000:]!r}"
            assert not os.path.exists(os.path.join(out, "summary.json")), "summary.json after an abort"
            resume_and_compare("big", out, other)
        results.check("a second signal aborts; the last commit resumes", second_signal_aborts)

        def repeat_is_one_request():
            # SLURM signals a rank and mpirun, which forwards: the same request twice within moments.
            out = case_dir("big-term-twice")
            proc = start_big(out)
            pids = rank_pids(proc.pid)
            assert pids, "no rank processes found under mpirun"
            os.kill(pids[-1], signal.SIGTERM)
            time.sleep(0.05)
            try:
                os.kill(pids[-1], signal.SIGUSR1)
            except ProcessLookupError:
                pass  # already stopped
            code, err = finish(proc)
            assert code == EXIT_STOPPED, f"a repeat within the window must not abort (exit {code})\n{err[-2000:]}"
            assert "second stop signal" not in err, err[-2000:]
            resume_and_compare("big", out, R)
        results.check("a repeat within 2 s is the same request: clean stop", repeat_is_one_request)

    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
