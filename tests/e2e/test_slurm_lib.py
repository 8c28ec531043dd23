#!/usr/bin/env python3
"""slurm/lib.sh without SLURM: bash scripts source it with fake SLURM_* variables, signals are sent by hand.

  * dpstream_has_checkpoint: OUT/checkpoint/job.h5 alone (a start killed before commit 0) is no
    checkpoint (dpstream refuses --resume there, exit 4), a MANIFEST-<commit>.json is; and
    slurm/preemptible.sbatch on such a directory starts the job (no --resume) and finishes it;
  * a SIGUSR1 that reaches the batch shell before the launch: dpstream_launch starts nothing (no
    mpirun) and returns 5, DPSTREAM_LAUNCHED=0; slurm/preemptible.sbatch then requeues (a stub
    scontrol) and its next run starts the job and finishes it;
  * SIGTERM to every process of the emulated job at once (batch shell, mpirun, ranks, the ranks'
    tee), as SLURM does at a time limit or scancel: mpirun dies of it (exit 1), the ranks stop
    cleanly with their commit, and dpstream_launch returns 5 and logs rank 0's stop line; a failing
    run keeps its own exit code; no temporary file is left;
  * DPSTREAM_LAUNCHER=srun (a fake srun that records its arguments and runs the ranks with mpirun):
    srun gets --kill-on-bad-exit=0 and --wait=60 (DPSTREAM_SRUN_WAIT overrides it; not a number:
    exit 2, nothing started), so that ranks left in a collective by one that died are killed;
  * a SIGUSR1 to the batch shell as soon as the launcher exists, which has no handler yet (a fake
    mpirun that a SIGUSR1 kills until the test lets it go on): dpstream_launch holds it for
    DPSTREAM_USR1_GRACE seconds, then passes it on; the ranks stop cleanly, exit 5 and
    DPSTREAM_GOT_USR1=1 (passed on at once it killed the launcher: exit 138).

Usage: test_slurm_lib.py [--bin build/src/dpstream] [--ranks N] [--mpirun mpirun] [--keep]
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
LIB = os.path.join(REPO, "slurm", "lib.sh")
EXIT_STOPPED = 5

# An sbatch-like script: lib.sh, dpstream_setup, optionally a SIGUSR1 to itself before the launch.
BATCH = r"""set -euo pipefail
DPSTREAM_SCRIPT=test_slurm_lib
source "$DPSTREAM_HOME/slurm/lib.sh"
dpstream_setup
[[ ${PRE_USR1:-0} == 1 ]] && kill -USR1 $$
code=0
dpstream_launch "$@" || code=$?
echo "LAUNCH code=$code launched=${DPSTREAM_LAUNCHED:-unset} usr1=$DPSTREAM_GOT_USR1" >&2
exit "$code"
"""

# DPSTREAM_HOME for slurm/*.sbatch: the real lib.sh, with a SIGUSR1 to the batch shell right after
# dpstream_setup when PRE_USR1=1 (what SLURM's warning does when it comes before the launch).
FAKE_LIB = r"""source "{lib}"
eval "orig_$(declare -f dpstream_setup)"
dpstream_setup() {{ orig_dpstream_setup; [[ ${{PRE_USR1:-0}} == 1 ]] && kill -USR1 $$; true; }}
"""


# PATH's mpirun: logs its pid (exec keeps it), then execs the real one. With FAKE_SLOW_START=FILE it is a
# launcher slow to install its SIGUSR1 handler, as mpirun and srun are in their first instants: a SIGUSR1
# kills it (exit 138) until FILE exists. Then it starts the real mpirun and passes a SIGUSR1 on to the
# ranks (-np N) once each has its handler installed (SigCgt) and rank 0 is held at its first trigger
# (DPSTREAM_FAULT=ingest@1:0:STOP): whatever the timing, the ranks get it as a clean stop, mid-job.
FAKE_MPIRUN = r"""#!/bin/bash
echo $$ >> "@LAUNCHES@"
[[ -n ${FAKE_SLOW_START:-} ]] || exec "@MPIRUN@" "$@"
until [[ -e $FAKE_SLOW_START ]]; do sleep 0.02; done
got=0
trap 'got=1' USR1
"@MPIRUN@" "$@" &
pid=$!
field() { awk -v f="$2:" '$1 == f {print $2}' "/proc/$1/status" 2>/dev/null; }
while kill -0 "$pid" 2>/dev/null; do
  if ((got)); then
    mapfile -t ranks < <(pgrep -P "$pid")
    ready=0 held=0
    for r in "${ranks[@]}"; do
      m=$(field "$r" SigCgt)
      ((16#${m:-0} & 0x200)) && ((++ready))
      [[ $(field "$r" State) == T ]] && held=1
    done
    if ((ready == $2 && held)); then
      trap '' USR1
      kill -USR1 "${ranks[@]}"
      kill -CONT "${ranks[@]}"
      break
    fi
  fi
  sleep 0.02
done
wait "$pid"
"""

# PATH's srun: records its arguments (one a line), then runs the command on -n N ranks with PATH's mpirun.
FAKE_SRUN = r"""#!/bin/sh
printf '%s\n' "$@" > "@SRUN_ARGS@"
np=1
while [ $# -gt 0 ]; do
  case $1 in
    -n) np=$2; shift 2 ;;
    -c) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
exec mpirun -np "$np" "$@"
"""


def session_pids(sid):
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True).stdout
    return {int(p) for p, s in (line.split() for line in out.splitlines() if line.strip()) if int(s) == sid}


def children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def main():
    args = harness.parse_args(__doc__.splitlines()[0])
    dps = harness.Dpstream(args)
    results = harness.Results("e2e_slurm_lib")
    real_mpirun = shutil.which(args.mpirun) or args.mpirun

    with harness.TempDir(args.keep, "dpstream-slurm-lib-") as tmp:
        case_dir = harness.CaseDirs(tmp)
        batch = harness.write_job(os.path.join(tmp, "batch.sh"), BATCH)
        fake_home = os.path.join(tmp, "home")
        os.makedirs(os.path.join(fake_home, "slurm"))
        harness.write_job(os.path.join(fake_home, "slurm", "lib.sh"), FAKE_LIB.format(lib=LIB))
        # PATH: an mpirun that logs its pid (FAKE_MPIRUN), an srun that logs its arguments, a scontrol stub.
        stubs = os.path.join(tmp, "bin")
        os.makedirs(stubs)
        launches = os.path.join(tmp, "launches.txt")
        requeues = os.path.join(tmp, "scontrol.txt")
        srun_args = os.path.join(tmp, "srun-args.txt")
        for name, body in (("mpirun", FAKE_MPIRUN.replace("@LAUNCHES@", launches).replace("@MPIRUN@", real_mpirun)),
                           ("srun", FAKE_SRUN.replace("@SRUN_ARGS@", srun_args)),
                           ("scontrol", f'#!/bin/sh\necho "$*" >> "{requeues}"\n')):
            path = harness.write_job(os.path.join(stubs, name), body)
            os.chmod(path, 0o755)
        small = harness.write_job(os.path.join(tmp, "small.toml"), harness.synthetic_job_toml(
            "slurm-lib-small", "none", 20000, 6, keys=300, seed=5, window_seconds=900, max_records=8, noise_seed=1))
        # Long enough to be signalled mid-stream (a few seconds at 2 ranks), committing every trigger.
        big = harness.write_job(os.path.join(tmp, "big.toml"), harness.synthetic_job_toml(
            "slurm-lib-big", "none", 1500000, 60, keys=3000, seed=5, window_seconds=86400, max_records=8,
            noise_seed=1, every=1))

        def env_for(case, **extra):
            env = {k: v for k, v in dps.launch_env(dps.env).items() if not k.startswith("SLURM_")}
            env.update(SLURM_JOB_ID="4242", SLURM_NTASKS=str(args.ranks), SLURM_CPUS_PER_TASK="1",
                       SLURM_SUBMIT_DIR=case, DPSTREAM_HOME=REPO, DPSTREAM_BIN=dps.bin, DPSTREAM_LAUNCHER="mpirun",
                       PATH=stubs + os.pathsep + env.get("PATH", ""), TMPDIR=case)
            env.pop("DPSTREAM_FAULT", None)
            env.update(extra)
            return env

        def launched():
            if not os.path.exists(launches):
                return []
            with open(launches) as f:
                return [int(p) for p in f.read().split()]

        def reset_stubs():
            for path in (launches, requeues, srun_args):
                if os.path.exists(path):
                    os.remove(path)

        def run_script(argv, env, timeout=120):
            proc = subprocess.run(["bash", *argv], capture_output=True, text=True, env=env, cwd=env["SLURM_SUBMIT_DIR"],
                                  timeout=timeout)
            return proc.returncode, proc.stderr + proc.stdout

        def job_h5_only(case):
            """OUT whose checkpoint holds job.h5 and no manifest: a run's, with its commits removed."""
            out = os.path.join(case, "out")
            run = dps.run_with("run", small, "--out", out)
            assert run.returncode == 0, run.describe()
            ckpt = os.path.join(out, "checkpoint")
            for name in os.listdir(ckpt):
                if name != "job.h5":
                    p = os.path.join(ckpt, name)
                    shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
            for name in ("releases.csv", "summary.json"):
                os.remove(os.path.join(out, name))
            return out

        def has_checkpoint():
            case = case_dir("has-checkpoint")
            out = job_h5_only(case)

            def probe():
                return subprocess.run(["bash", "-c", 'source "$1"; dpstream_has_checkpoint "$2"', "-", LIB, out]).returncode

            assert probe() != 0, "job.h5 without a manifest counts as a checkpoint (the script would add --resume: exit 4)"
            tmp_manifest = os.path.join(out, "checkpoint", "MANIFEST-000000.json.tmp")
            harness.write_job(tmp_manifest, "{}")
            assert probe() != 0, "a MANIFEST-*.json.tmp (a commit not made) counts as a checkpoint"
            os.rename(tmp_manifest, tmp_manifest[:-len(".tmp")])
            assert probe() == 0, "MANIFEST-000000.json (commit 0) does not count as a checkpoint"
            # The script on job.h5 alone: a new run, not a refused --resume.
            out = job_h5_only(case_dir("preemptible-job-h5-only"))
            reset_stubs()
            code, text = run_script([os.path.join(REPO, "slurm", "preemptible.sbatch"), small, out], env_for(tmp))
            assert code == 0, f"preemptible.sbatch on job.h5 alone exited {code}:\n{text[-3000:]}"
            assert "resuming from the checkpoint" not in text, text[-3000:]
            assert os.path.exists(os.path.join(out, "summary.json")), "the job did not finish"
        results.check("dpstream_has_checkpoint: a MANIFEST, not job.h5 alone; preemptible.sbatch starts the job", has_checkpoint)

        def layout_and_launcher():
            # -N 2 --ntasks-per-node=4 under the script's #SBATCH --ntasks=2: the job runs on 2 ranks, and says so.
            case = case_dir("layout")
            reset_stubs()
            code, text = run_script([os.path.join(REPO, "slurm", "run.sbatch"), small, os.path.join(case, "out")],
                                    env_for(case, SLURM_NTASKS_PER_NODE="4", SLURM_JOB_NUM_NODES="2"))
            assert code == 0, f"run.sbatch exited {code}:\n{text[-3000:]}"
            assert f"warning: {args.ranks} rank(s), fewer than --ntasks-per-node=4 x 2 node(s)" in text and \
                "-n 8" in text, \
                text[-3000:]
            # The launcher missing from PATH (no MPI module loaded): exit 2 naming it, nothing started. PATH holds
            # links to what the script needs besides the launcher.
            tools = os.path.join(case, "tools")
            os.makedirs(tools)
            for tool in ("bash", "date", "dirname", "mkdir", "cat", "python3", "rm", "mktemp", "tee", "grep", "sleep"):
                found = shutil.which(tool)
                if found:
                    os.symlink(found, os.path.join(tools, tool))
            reset_stubs()
            code, text = run_script([os.path.join(REPO, "slurm", "run.sbatch"), small, os.path.join(case, "out2")],
                                    env_for(case, PATH=tools))
            assert code == 2 and "mpirun not found on PATH" in text, f"exit {code}:\n{text[-3000:]}"
            assert not launched() and not os.path.exists(os.path.join(case, "out2", "releases.csv")), text[-3000:]
        results.check("-N x --ntasks-per-node under #SBATCH --ntasks: warned; no launcher on PATH: exit 2 naming it",
                      layout_and_launcher)

        def usr1_before_launch():
            case = case_dir("usr1-before-launch")
            out = os.path.join(case, "out")
            reset_stubs()
            code, text = run_script([batch, "run", big, "--out", out, "--progress", "never"],
                                    env_for(case, PRE_USR1="1"))
            assert code == EXIT_STOPPED and "launched=0" in text, f"exit {code} ({EXIT_STOPPED} expected):\n{text[-3000:]}"
            assert not launched(), f"mpirun was started: {launched()}\n{text[-3000:]}"
            assert not os.path.exists(out), "an output directory was made"
            # preemptible.sbatch requeues; the requeued run starts the job (nothing to resume) and finishes it.
            out = os.path.join(case_dir("preemptible-usr1-before-launch"), "out")
            reset_stubs()
            code, text = run_script([os.path.join(REPO, "slurm", "preemptible.sbatch"), small, out],
                                    env_for(tmp, DPSTREAM_HOME=fake_home, PRE_USR1="1"))
            calls = open(requeues).read() if os.path.exists(requeues) else ""
            assert code == 0 and calls.strip() == "requeue 4242", f"exit {code}, scontrol calls {calls!r}:\n{text[-3000:]}"
            assert not launched(), f"mpirun was started: {launched()}"
            reset_stubs()
            code, text = run_script([os.path.join(REPO, "slurm", "preemptible.sbatch"), small, out],
                                    env_for(tmp, DPSTREAM_HOME=fake_home, SLURM_RESTART_COUNT="1"))
            assert code == 0 and "finished:" in text and "resuming" not in text, f"requeued run: exit {code}\n{text[-3000:]}"
            assert not os.path.exists(requeues), "the finished run requeued"
        results.check("SIGUSR1 before the launch: nothing started, exit 5, preemptible.sbatch requeues, next run finishes",
                      usr1_before_launch)

        def sigterm_to_every_process():
            case = case_dir("sigterm-all")
            out = os.path.join(case, "out")
            reset_stubs()
            env = env_for(case)
            proc = subprocess.Popen(["bash", batch, "run", big, "--out", out, "--progress", "never"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=case,
                                    start_new_session=True)
            try:
                releases = os.path.join(out, "releases.csv")
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # committed rows: the ranks run their trigger loop
                    assert proc.poll() is None, f"the job ended before the signal: {proc.communicate()[1][-2000:]}"
                    if os.path.exists(releases) and open(releases, "rb").read().count(b"\n") >= 2:
                        break
                    time.sleep(0.02)
                else:
                    raise AssertionError("no committed rows within 60 s")
                mpirun = launched()
                assert len(mpirun) == 1, f"mpirun pids {mpirun}"
                ranks = children(mpirun[0])
                assert len(ranks) == args.ranks, f"ranks {ranks} under mpirun {mpirun[0]}"
                # Like SLURM: every process of the job at once (the shell, mpirun, the ranks and their tee).
                pids = session_pids(proc.pid) | set(mpirun) | ranks
                for rank in ranks:
                    pids |= children(rank)
                for pid in sorted(pids):
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                _out, err = proc.communicate(timeout=90)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
            code = proc.returncode
            m = re.search(r"dpstream: stopped cleanly on SIGTERM .* after trigger (\d+) of 60 .*commit (\d+) holds", err)
            assert m, f"no clean stop line in the job's log (exit {code}):\n{err[-3000:]}"
            assert code == EXIT_STOPPED, f"exit {code} after a clean stop ({EXIT_STOPPED} expected):\n{err[-3000:]}"
            assert os.path.exists(os.path.join(out, "checkpoint", f"MANIFEST-{int(m.group(2)):06d}.json")), \
                f"commit {m.group(2)} has no manifest"
            assert not os.path.exists(os.path.join(out, "summary.json")), "summary.json after a stop"
            left = [f for f in os.listdir(case) if f.startswith("dpstream-stderr.")]
            assert not left, f"temporary files left: {left}"
            # A failure is not a stop: its own code (2: no such spec), stderr still on the job's.
            code, text = run_script([batch, "run", os.path.join(case, "missing.toml"), "--out", out + "-2"], env)
            assert code == 2 and "missing.toml" in text, f"exit {code} (2 expected):\n{text[-3000:]}"
        results.check("SIGTERM to shell, tee, mpirun and ranks: exit 5 with the stop line; a failure keeps its code",
                      sigterm_to_every_process)

        def srun_options():
            """srun's options, up to the command (bash -c ...); None when srun was not called."""
            if not os.path.exists(srun_args):
                return None
            with open(srun_args) as f:
                argv = f.read().splitlines()
            return argv[:argv.index("bash")] if "bash" in argv else argv

        def srun_wait():
            case = case_dir("srun-wait")
            reset_stubs()
            out = os.path.join(case, "out")
            code, text = run_script([batch, "run", small, "--out", out, "--progress", "never"],
                                    env_for(case, DPSTREAM_LAUNCHER="srun"))
            opts = srun_options()
            assert code == 0 and opts is not None, f"exit {code}, srun options {opts}:\n{text[-3000:]}"
            assert os.path.exists(os.path.join(out, "summary.json")), f"the job did not finish:\n{text[-3000:]}"
            assert "--kill-on-bad-exit=0" in opts, f"srun {opts}: a rank's exit 5 would kill the others mid-commit"
            assert "--wait=60" in opts, f"srun {opts}: no --wait=60 (ranks left by one that died wait for the time limit)"
            reset_stubs()
            code, text = run_script([batch, "run", small, "--out", out + "-2", "--progress", "never"],
                                    env_for(case, DPSTREAM_LAUNCHER="srun", DPSTREAM_SRUN_WAIT="17"))
            opts = srun_options()
            assert code == 0 and opts is not None and "--wait=17" in opts, f"exit {code}, srun {opts}:\n{text[-3000:]}"
            reset_stubs()
            code, text = run_script([batch, "run", small, "--out", out + "-3", "--progress", "never"],
                                    env_for(case, DPSTREAM_LAUNCHER="srun", DPSTREAM_SRUN_WAIT="1m"))
            assert code == 2 and "DPSTREAM_SRUN_WAIT=1m" in text, f"exit {code} (2 expected):\n{text[-3000:]}"
            assert srun_options() is None and not launched(), "DPSTREAM_SRUN_WAIT=1m: srun was started"
        results.check("srun: --kill-on-bad-exit=0 --wait=60 (DPSTREAM_SRUN_WAIT=17 gives --wait=17; not a number: exit 2)",
                      srun_wait)

        def usr1_right_after_launch():
            case = case_dir("usr1-after-launch")
            out = os.path.join(case, "out")
            go = os.path.join(case, "go")
            log = os.path.join(case, "batch.log")
            reset_stubs()
            # A 2 s grace; mpirun stops 2 x DPSTREAM_STOP_GRACE s after the ranks' exit 5: 1 s keeps that short.
            env = env_for(case, FAKE_SLOW_START=go, DPSTREAM_USR1_GRACE="2", DPSTREAM_STOP_GRACE="1",
                          DPSTREAM_FAULT="ingest@1:0:STOP")

            def log_text():
                with open(log, errors="replace") as f:
                    return f.read()

            with open(log, "w") as err:
                proc = subprocess.Popen(["bash", batch, "run", big, "--out", out, "--progress", "never"],
                                        stdout=err, stderr=err, env=env, cwd=case, start_new_session=True)
            try:
                deadline = time.monotonic() + 60
                while not launched():  # the launcher exists, without a SIGUSR1 handler
                    assert proc.poll() is None and time.monotonic() < deadline, f"no launch:\n{log_text()[-3000:]}"
                    time.sleep(0.005)
                os.kill(proc.pid, signal.SIGUSR1)
                # Only once lib.sh says it holds the signal may the launcher go on: passed on at once, the
                # signal found it without a handler.
                while "held until" not in log_text():
                    assert proc.poll() is None, \
                        f"the job ended with exit {proc.returncode} before the SIGUSR1 was held:\n{log_text()[-3000:]}"
                    assert time.monotonic() < deadline, f"the SIGUSR1 was not held:\n{log_text()[-3000:]}"
                    time.sleep(0.01)
                harness.write_job(go, "")
                code = proc.wait(timeout=90)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            text = log_text()
            assert code == EXIT_STOPPED and "launched=1 usr1=1" in text, \
                f"exit {code} ({EXIT_STOPPED} with DPSTREAM_GOT_USR1=1 expected):\n{text[-3000:]}"
            assert "passing the held SIGUSR1 on" in text, text[-3000:]
            m = re.search(r"dpstream: stopped cleanly on SIGUSR1 .* after trigger (\d+) of 60 .*commit (\d+) holds", text)
            assert m, f"no clean stop line:\n{text[-3000:]}"
            assert os.path.exists(os.path.join(out, "checkpoint", f"MANIFEST-{int(m.group(2)):06d}.json")), \
                f"commit {m.group(2)} has no manifest"
            assert not os.path.exists(os.path.join(out, "summary.json")), "summary.json after a stop"
        results.check("SIGUSR1 as the launcher starts (no handler yet): held DPSTREAM_USR1_GRACE s, clean stop, exit 5",
                      usr1_right_after_launch)

    return results.finish()


if __name__ == "__main__":
    sys.exit(main())
