#!/usr/bin/env python3
"""End-to-end test on a real single-node SLURM cluster (munged + slurmctld + slurmd on localhost,
started by slurm/local-cluster.sh in a temporary directory and torn down at the end).

  * slurm/run.sbatch on a small job (sbatch --wait): releases.csv equals a direct mpirun run, the
    job log has the layout line and the RESULT line;
  * pre-emption: slurm/preemptible.sbatch on a longer DP job is signalled mid-stream with
    `scancel --signal=USR1 --batch` (what `#SBATCH --signal=B:USR1@secs` does before a time limit);
    dpstream stops after its trigger with the checkpoint committed, the script requeues the job, the
    second run resumes (SLURM_RESTART_COUNT = 1) and the final releases.csv is byte-identical to an
    uninterrupted run;
  * slurm/resume.sbatch continues a job stopped by a signal under slurm/run.sbatch (exit 5), and a
    job cancelled by a plain scancel (SIGTERM to every process, as at a time limit), which stops
    cleanly without a second signal reaching the ranks and is reported as a clean stop (exit 5,
    although mpirun itself dies of the SIGTERM);
  * slurm/sweep.sbatch as a 3-task array job over C: one RESULT line per value;
  * slurm/scaling.sh strong at 1 and 2 ranks: its CSV has both points;
  * slurm/billion.sbatch at 2e4 users: the memory model's table in the log, the job's releases equal
    a direct run; with --mem=1 (1 MiB per node) it refuses to start (exit 3) and says why.

Skips (exit 77) only when slurm-wlm / munge are not installed.
Usage: test_slurm_cluster.py [--bin build/src/dpstream] [--keep]
"""

import csv
import os
import re
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SKIP = 77
EXIT_STOPPED = 5


def ranks_running(spec):
    """Whether dpstream ranks of the job spec `spec` are running on this node."""
    out = subprocess.run(["pgrep", "-f", f"dpstream.* run {re.escape(spec)}"], capture_output=True, text=True).stdout
    return bool(out.split())


def job_toml(name, users, triggers, every=None):
    return harness.synthetic_job_toml(name, "dp", users, triggers, keys=3000, seed=21, window_seconds=86400,
                                      max_records=16, noise_seed=4, every=every)


class Cluster:
    def __init__(self, root):
        self.dir = os.path.join(root, "cluster")
        self.env = dict(os.environ)

    def start(self):
        proc = subprocess.run(["bash", os.path.join(REPO, "slurm", "local-cluster.sh"), "start", self.dir],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"cluster did not start (exit {proc.returncode}):\n{proc.stderr}")
        m = re.search(r"export SLURM_CONF=(\S+)", proc.stdout)
        if not m:
            raise RuntimeError(f"no SLURM_CONF line from local-cluster.sh start:\n{proc.stdout}")
        self.env["SLURM_CONF"] = m.group(1)
        self.env["DPSTREAM_HOME"] = REPO

    def stop(self):
        subprocess.run(["bash", os.path.join(REPO, "slurm", "local-cluster.sh"), "stop", self.dir],
                       capture_output=True, text=True, timeout=120)

    def cmd(self, *argv, timeout=60, check=True):
        proc = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, cwd=REPO, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def sbatch(self, *argv, timeout=60):
        out = self.cmd("sbatch", "--parsable", *argv, timeout=timeout).stdout.strip()
        return out.split(";")[0]

    def state(self, job_id):
        out = self.cmd("scontrol", "show", "job", job_id, check=False).stdout
        m = re.search(r"JobState=(\S+)", out)
        return m.group(1) if m else "UNKNOWN"

    def wait_done(self, job_id, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state(job_id)
            if st in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"):
                return st
            time.sleep(0.5)
        self.cmd("scancel", job_id, check=False)
        raise AssertionError(f"job {job_id} not finished within {timeout} s (state {self.state(job_id)})")


def read_text(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def main():
    args = harness.parse_args(__doc__.splitlines()[0])
    for tool in ("slurmctld", "slurmd", "munged", "sbatch"):
        if shutil.which(tool) is None:
            print(f"SKIP: {tool} not found: the SLURM test needs Debian's slurm-wlm and munge "
                  f"(bash cmake/install-deps.sh installs them)")
            return SKIP
    if os.geteuid() != 0:
        print("SKIP: the local SLURM cluster runs its daemons as root (SlurmUser=root): run as root")
        return SKIP
    dps = harness.Dpstream(args)
    results = harness.Results("e2e_slurm_cluster")
    with harness.TempDir(args.keep, "dpstream-slurm-") as tmp:
        case_dir = harness.CaseDirs(tmp)
        cluster = Cluster(tmp)
        # DPSTREAM_BIN: the binary under test (also when the build directory is not REPO/build).
        cluster.env["DPSTREAM_BIN"] = dps.bin
        # The SIGUSR1s below come once the ranks committed rows (their handlers are installed), about 1 s
        # after the launch: slurm/lib.sh's default 10 s hold would outlast the 24-trigger job (about 4 s).
        cluster.env["DPSTREAM_USR1_GRACE"] = "1"
        small = harness.write_job(os.path.join(tmp, "small.toml"), job_toml("slurm-small", 20000, 6))
        long = harness.write_job(os.path.join(tmp, "long.toml"), job_toml("slurm-long", 1500000, 24, every=1))
        # Commits only at the window's end: a mid-window commit can only come from a clean stop. Larger
        # than `long`, so that its 24 triggers outlast scancel's ~1 s way to the ranks.
        long_rare = harness.write_job(os.path.join(tmp, "long-rare.toml"),
                                      job_toml("slurm-long", 4000000, 24, every=100))
        reference = {}
        for name, spec in (("small", small), ("long", long), ("long_rare", long_rare)):
            out = case_dir(f"reference-{name}")
            run = dps.run_with("run", spec, "--out", out, ranks=2)
            assert run.returncode == 0, run.describe()
            reference[name] = harness.read_bytes(os.path.join(out, "releases.csv"))
        t0 = time.monotonic()
        try:
            cluster.start()
        except Exception as e:  # noqa: BLE001 - reported as a failure, not a skip
            print(f"FAIL cluster start: {e}")
            return 1
        print(f"ok   cluster started in {time.monotonic() - t0:.1f} s ({cluster.env['SLURM_CONF']})", flush=True)
        try:
            def run_script():
                d = case_dir("run-sbatch")
                log = os.path.join(d, "job.out")
                job = cluster.sbatch("--wait", "-n", "2", f"--output={log}", "slurm/run.sbatch", small,
                                     os.path.join(d, "out"), timeout=120)
                text = read_text(log)
                assert cluster.state(job) == "COMPLETED", f"state {cluster.state(job)}\n{text}"
                assert "2 rank(s) x 1 thread(s)" in text, f"no layout line:\n{text}"
                assert re.search(r"^RESULT job=slurm-small .*ranks=2 ", text, re.M), f"no RESULT line:\n{text}"
                got = harness.read_bytes(os.path.join(d, "out", "releases.csv"))
                assert got == reference["small"], "releases.csv differs from the direct mpirun run"
            results.check("slurm/run.sbatch: same output as mpirun", run_script)

            def wait_for_rows(out, job, limit=90):
                releases = os.path.join(out, "releases.csv")
                deadline = time.monotonic() + limit
                while time.monotonic() < deadline:
                    if os.path.exists(releases) and read_text(releases).count("\n") >= 2:
                        return
                    if cluster.state(job) not in ("PENDING", "RUNNING", "CONFIGURING"):
                        raise AssertionError(f"job {job} ended ({cluster.state(job)}) before it could be signalled")
                    time.sleep(0.1)
                raise AssertionError(f"no committed rows within {limit} s")

            def preemption_requeue():
                d = case_dir("preemptible")
                log, out = os.path.join(d, "job.out"), os.path.join(d, "out")
                job = cluster.sbatch("-n", "2", f"--output={log}", "slurm/preemptible.sbatch", long, out)
                wait_for_rows(out, job)
                cluster.cmd("scancel", "--signal=USR1", "--batch", job)
                state = cluster.wait_done(job, timeout=240)
                text = read_text(log)
                assert state == "COMPLETED", f"state {state}\n{text[-3000:]}"
                m = re.search(r"stopped cleanly on SIGUSR1 .* after trigger (\d+) of 24", text)
                assert m and int(m.group(1)) < 24, f"no mid-stream clean stop in the log:\n{text[-3000:]}"
                assert "requeueing job" in text and "restart 1" in text, f"not requeued:\n{text[-3000:]}"
                assert re.search(r"resuming job 'slurm-long' from commit \d+", text), f"no resume:\n{text[-3000:]}"
                got = harness.read_bytes(os.path.join(out, "releases.csv"))
                assert got == reference["long"], (f"releases.csv after pre-emption differs from the uninterrupted "
                                                  f"run at byte {harness.first_difference(got or b'', reference['long'])}")
            results.check("pre-emption: signalled, requeued, resumed, identical output", preemption_requeue)

            def stop_then_resume_script():
                d = case_dir("run-then-resume")
                out = os.path.join(d, "out")
                job = cluster.sbatch("-n", "2", f"--output={os.path.join(d, 'run.out')}", "slurm/run.sbatch", long, out)
                wait_for_rows(out, job)
                cluster.cmd("scancel", "--signal=USR1", "--batch", job)
                state = cluster.wait_done(job, timeout=120)
                text = read_text(os.path.join(d, "run.out"))
                assert state == "FAILED" and f"ExitCode={EXIT_STOPPED}:0" in cluster.cmd("scontrol", "show", "job", job).stdout, \
                    f"run.sbatch must end with exit {EXIT_STOPPED} after a stop (state {state})\n{text[-2000:]}"
                assert "continue with: sbatch slurm/resume.sbatch" in text, text[-2000:]
                log = os.path.join(d, "resume.out")
                job2 = cluster.sbatch("--wait", "-n", "1", f"--output={log}", "slurm/resume.sbatch", long, out, timeout=180)
                assert cluster.state(job2) == "COMPLETED", read_text(log)[-2000:]
                assert harness.read_bytes(os.path.join(out, "releases.csv")) == reference["long"], "resumed output differs"
            results.check("run.sbatch stopped (exit 5), resume.sbatch on 1 rank: identical", stop_then_resume_script)

            def scancel_sigterm_then_resume():
                # Plain scancel: SIGTERM to every process of the job (shell, mpirun, ranks; mpirun
                # forwards it again: one request within the repeat window). The ranks stop cleanly
                # and commit; the job is cancelled (not requeued); a resume finishes it.
                d = case_dir("scancel-term")
                out = os.path.join(d, "out")
                job = cluster.sbatch("-n", "2", f"--output={os.path.join(d, 'job.out')}", "slurm/preemptible.sbatch",
                                     long_rare, out)
                time.sleep(0.5)
                deadline = time.monotonic() + 60
                while cluster.state(job) != "RUNNING" and time.monotonic() < deadline:
                    time.sleep(0.1)
                # Stop once the ranks run (the job's own time decides nothing: a faster engine must not
                # finish before the signal): first trigger or later, no rows before the window's end.
                # No pause after that: scancel takes ~1 s to reach the ranks (a 1.5M-user job finished
                # first, with a 0.5 s pause, in one CI run).
                while not ranks_running(long_rare) and time.monotonic() < deadline:
                    time.sleep(0.05)
                # ... and have written commit 0: a process just exec'd is still loading its libraries,
                # and a SIGTERM then kills it before main() can catch it (one CI run on a loaded machine).
                ckpt = os.path.join(out, "checkpoint")
                while time.monotonic() < deadline and not (
                        os.path.isdir(ckpt) and any(f.startswith("MANIFEST-") for f in os.listdir(ckpt))):
                    time.sleep(0.02)
                cluster.cmd("scancel", job)
                state = cluster.wait_done(job, timeout=120)
                # The job is CANCELLED at once; its shell logs once mpirun is done (within KillWait = 30 s).
                # mpirun dies of the SIGTERM itself (exit 1): the ranks' stop line makes it exit 5.
                deadline = time.monotonic() + 45
                while True:
                    time.sleep(1)
                    text = read_text(os.path.join(d, "job.out"))
                    if "stopped by SIGTERM with its checkpoint committed" in text or time.monotonic() > deadline:
                        break
                assert "stopped by SIGTERM with its checkpoint committed" in text and "dpstream exited with code" not in text, \
                    f"the clean stop is not reported as one (exit 5):\n{text[-3000:]}"
                assert "second stop signal" not in text, f"the ranks got a second signal:\n{text[-3000:]}"
                assert "requeueing" not in text, f"a cancelled job must not requeue itself:\n{text[-3000:]}"
                assert state == "CANCELLED", f"state {state}"
                log = os.path.join(d, "resume.out")
                proc = cluster.cmd("sbatch", "--parsable", "--wait", "-n", "2", f"--output={log}", "slurm/resume.sbatch",
                                   long_rare, out, timeout=180, check=False)
                rtext = read_text(log) if os.path.exists(log) else "(no log)"
                assert proc.returncode == 0, (f"resume.sbatch exited {proc.returncode}: {proc.stderr.strip()}\n"
                                              f"cancelled job's log:\n{text[-2000:]}\nresume log:\n{rtext[-3000:]}")
                job2 = proc.stdout.strip().split(";")[0]
                assert cluster.state(job2) == "COMPLETED", rtext[-2000:]
                # A clean stop committed the trigger it stopped after: the resume starts mid-window.
                m = re.search(r"resuming job 'slurm-long' from commit 1 \(window 1 of 1, (\d+) of 24", rtext)
                assert m and 0 < int(m.group(1)) < 24, f"no mid-window commit from a clean stop:\n{rtext[-2000:]}"
                assert harness.read_bytes(os.path.join(out, "releases.csv")) == reference["long_rare"], \
                    "resumed output differs"
            results.check("plain scancel (SIGTERM to all): clean stop, not requeued, resume.sbatch: identical", scancel_sigterm_then_resume)

            def sweep_array():
                d = case_dir("sweep")
                job = cluster.sbatch("--wait", "--array=1-3", "-n", "1", f"--output={d}/task-%a.out",
                                     "slurm/sweep.sbatch", small, os.path.join(d, "runs"), "privacy.max_records_per_user",
                                     "2", "4", "8", timeout=180)
                lines = {}
                for task in (1, 2, 3):
                    text = read_text(os.path.join(d, f"task-{task}.out"))
                    m = re.search(r"^RESULT sweep_param=privacy.max_records_per_user sweep_value=(\d+) keys_released=(\d+) "
                                  r"dropped_share=([0-9.]+) job=slurm-small", text, re.M)
                    assert m, f"task {task}: no sweep RESULT line:\n{text[-2000:]}"
                    lines[int(m.group(1))] = float(m.group(3))
                assert sorted(lines) == [2, 4, 8], f"values {sorted(lines)}"
                assert lines[2] > lines[4] > lines[8], f"dropped share must fall as C grows: {lines}"
                assert job
            results.check("sweep.sbatch array job over C", sweep_array)

            def scaling_driver():
                d = case_dir("scaling")
                proc = cluster.cmd("bash", "slurm/scaling.sh", "strong", small, d, "--ranks", "1 2", timeout=300)
                rows = list(csv.DictReader(open(os.path.join(d, "strong.csv"))))
                assert [r["ranks"] for r in rows] == ["1", "2"], f"{rows}\n{proc.stderr}"
                assert all(int(r["records"]) > 0 and float(r["records_per_s"]) > 0 for r in rows), rows
                assert rows[0]["records"] == rows[1]["records"], "strong scaling must keep the workload fixed"
            results.check("scaling.sh strong 1 and 2 ranks", scaling_driver)

            def billion_script():
                d = case_dir("billion")
                spec = os.path.join(REPO, "jobs", "paper-billion.toml")
                scale = ["--set", "input.users=20000", "--set", "privacy.seed=3"]
                cal = os.path.join(d, "calibration")
                run = dps.run_with("run", spec, "--out", cal, *scale, ranks=2)
                assert run.returncode == 0, run.describe()
                calibration = os.path.join(cal, "summary.json")
                log = os.path.join(d, "job.out")
                job = cluster.sbatch("--wait", "-N", "1", "--ntasks-per-node=2", f"--output={log}", "slurm/billion.sbatch",
                                     os.path.join(d, "out"), calibration, *scale, timeout=180)
                text = read_text(log)
                assert cluster.state(job) == "COMPLETED", f"state {cluster.state(job)}\n{text}"
                assert re.search(r"^\s+1\s+2\s.*\byes\b", text, re.M), f"no model row that fits:\n{text}"
                got = harness.read_bytes(os.path.join(d, "out", "releases.csv"))
                assert got == harness.read_bytes(os.path.join(cal, "releases.csv")), "releases differ from the direct run"
                log2 = os.path.join(d, "refused.out")
                proc = cluster.cmd("sbatch", "--parsable", "--wait", "-N", "1", "--ntasks-per-node=2", "--mem=1",
                                   f"--output={log2}", "slurm/billion.sbatch", os.path.join(d, "out2"), calibration, *scale,
                                   timeout=120, check=False)
                text2 = read_text(log2)
                assert proc.returncode == 3, f"exit {proc.returncode} (3 expected)\n{proc.stderr}\n{text2}"
                assert "does not fit" in text2 and "ask for more nodes" in text2, text2
                assert not os.path.exists(os.path.join(d, "out2", "releases.csv")), "a refused job must not start"
            results.check("billion.sbatch: memory model check, then the job; refused when it cannot fit", billion_script)
        finally:
            t1 = time.monotonic()
            cluster.stop()
            left = subprocess.run(["pgrep", "-f", cluster.dir], capture_output=True, text=True).stdout.split()
            print(f"ok   cluster stopped in {time.monotonic() - t1:.1f} s" if not left
                  else f"FAIL cluster processes left: {left}", flush=True)
            if left:
                results.failed.append("teardown")
    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
