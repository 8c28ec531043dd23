"""Shared helpers of the dpstream end-to-end tests (python3 stdlib only)."""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_BIN = os.path.normpath(os.path.join(HERE, "..", "..", "build", "src", "dpstream"))


def parse_args(description, extra=None):
    """The common options; `extra(parser)` may add script-specific ones."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--ranks", type=int, default=1, help="MPI ranks (mpirun -np N; oversubscribed under Open MPI)")
    ap.add_argument("--bin", default=os.environ.get("DPSTREAM_BIN", DEFAULT_BIN), help="path to the dpstream binary")
    ap.add_argument("--mpirun", default=os.environ.get("MPIRUN", "mpirun"), help="mpirun executable")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory and print its path")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for one dpstream run")
    if extra:
        extra(ap)
    return ap.parse_args()


class Run:
    def __init__(self, argv, proc, seconds):
        self.argv = argv
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.seconds = seconds

    def describe(self):
        return (f"command: {' '.join(self.argv)}\n  exit code: {self.returncode}\n"
                f"  stderr: {self.stderr.strip()[:2000]!r}\n  stdout: {self.stdout.strip()[:500]!r}")


class Dpstream:
    def __init__(self, args):
        self.bin = os.path.abspath(args.bin)
        self.ranks = args.ranks
        self.mpirun = args.mpirun
        self.timeout = args.timeout
        if not os.access(self.bin, os.X_OK):
            sys.exit(f"dpstream binary not found or not executable: {self.bin}")
        self.env = dict(os.environ)
        self.env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        self.env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        # More ranks than cores under Open MPI; other MPIs ignore OMPI_* (a flag would break them).
        self.env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
        # Open MPI's session directory per mpirun (see launch_env): concurrent mpiruns, of parallel
        # tests or of one test's thread pool, otherwise race to create and remove a shared
        # /tmp/ompi.<host>.<uid> ("mkdir ... File exists", orte_init failed), seen in CI under load.
        self._ompi_tmp = tempfile.TemporaryDirectory(prefix="dpstream-ompi-")
        self._own_session_dirs = "OMPI_MCA_orte_tmpdir_base" not in self.env
        # When a rank exits non-zero, mpirun otherwise waits ~2 s before reaping the job; every
        # rank of dpstream exits on its own after an error, so there is nothing to wait for.
        self.env.setdefault("OMPI_MCA_odls_base_sigkill_timeout", "0")

    def launch_env(self, env):
        """env for one mpirun: its own Open MPI session directory (unless the caller chose one)."""
        if self._own_session_dirs:
            env = dict(env, OMPI_MCA_orte_tmpdir_base=tempfile.mkdtemp(dir=self._ompi_tmp.name))
        return env

    def run(self, *args, cwd=None):
        argv = [self.mpirun, "-np", str(self.ranks), self.bin, *map(str, args)]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=self.launch_env(self.env), cwd=cwd,
                                  timeout=self.timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"timed out after {self.timeout} s: {' '.join(argv)}\n  stderr: {e.stderr!r}")
        return Run(argv, proc, time.monotonic() - t0)

    def run_with(self, *args, ranks=None, env=None, timeout=None, cwd=None):
        """Like run(), with another rank count, extra environment variables (DPSTREAM_FAULT is
        never inherited unless given here) and another time limit. On a time-out the whole process
        group of mpirun is killed (a hang is a failure, never left running)."""
        argv = [self.mpirun, "-np", str(ranks or self.ranks), self.bin, *map(str, args)]
        full_env = dict(self.env)
        full_env.pop("DPSTREAM_FAULT", None)
        full_env.update(env or {})
        limit = self.timeout if timeout is None else timeout
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, encoding="utf-8",
                                errors="replace", env=self.launch_env(full_env), cwd=cwd, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            extra = " ".join(f"{k}={v}" for k, v in (env or {}).items())
            raise AssertionError(f"timed out (hang) after {limit} s: {extra} {' '.join(argv)}\n"
                                 f"  stderr: {err.strip()[-2000:]!r}\n  stdout: {out.strip()[-500:]!r}")
        return Run(argv, subprocess.CompletedProcess(argv, proc.returncode, out, err), time.monotonic() - t0)


class Results:
    """Collects named checks and prints `N passed, M failed`."""

    def __init__(self, name):
        self.name = name
        self.passed = 0
        self.failed = []

    def check(self, label, fn):
        t0 = time.monotonic()
        try:
            fn()
        except AssertionError as e:
            self.failed.append(label)
            print(f"FAIL {label}\n  {e}", flush=True)
        except Exception:  # a crash in the test itself is a failure too
            self.failed.append(label)
            print(f"FAIL {label} (exception in the test)\n{traceback.format_exc()}", flush=True)
        else:
            self.passed += 1
            print(f"ok   {label} ({time.monotonic() - t0:.1f} s)", flush=True)

    def finish(self):
        print(f"{self.name}: {self.passed} passed, {len(self.failed)} failed")
        for f in self.failed:
            print(f"  failed: {f}")
        return 1 if self.failed else 0


class CaseDirs:
    """Numbered sub-directories of `root`, one per test case: NNN-label."""

    def __init__(self, root):
        self.root = root
        self.serial = 0

    def __call__(self, label):
        self.serial += 1
        d = os.path.join(self.root, f"{self.serial:03d}-" + re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-")[:60])
        os.makedirs(d)
        return d


class TempDir:
    def __init__(self, keep, prefix):
        self.keep = keep
        self.path = tempfile.mkdtemp(prefix=prefix)

    def __enter__(self):
        return self.path

    def __exit__(self, *exc):
        if self.keep:
            print(f"kept temporary directory {self.path}")
        else:
            shutil.rmtree(self.path, ignore_errors=True)


def synthetic_job_toml(name, mode, users, triggers, *, keys, seed, window_seconds, max_records, noise_seed,
                       windows=1, first_window=0, every=None):
    """A synthetic job spec counting and summing values in [0, 1]; mode "dp" gets eps 6, delta 1e-9
    and a fixed noise seed; `every` adds a [checkpoint] section."""
    dp = mode == "dp"
    return f"""\
[job]
name = "{name}"

[input]
kind = "synthetic"
users = {users}
keys = {keys}
seed = {seed}

[stream]
window_seconds = {window_seconds}
triggers = {triggers}
windows = {windows}
first_window = {first_window}

[privacy]
mode = "{mode}"
max_records_per_user = {max_records}
clamp_min = 0.0
clamp_max = 1.0
{"epsilon = 6.0" if dp else ""}
{"delta = 1e-9" if dp else ""}
{f"seed = {noise_seed}" if dp else ""}

[query]
aggregations = ["count", "sum"]
{f"[checkpoint]{chr(10)}every = {every}{chr(10)}" if every is not None else ""}
[output]
format = "csv"
progress = "never"
"""


def write_job(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def leftover_outputs(out_dir):
    """Files in out_dir that a failed run must not leave behind."""
    if not os.path.isdir(out_dir):
        return []
    bad = []
    for name in sorted(os.listdir(out_dir)):
        if name in ("releases.csv", "summary.json") or "partial" in name or name.startswith(".releases") \
                or name.startswith(".summary"):
            bad.append(name)
    return bad


def get(d, dotted):
    """d['a']['b'] for 'a.b'; AssertionError naming the field when absent."""
    cur = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise AssertionError(f"summary.json has no field {dotted}")
        cur = cur[part]
    return cur


# ---- file helpers (checkpoint tests) ----

def read_bytes(path):
    """The file's bytes, or None when it does not exist."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def snapshot_tree(root):
    """{relative path: bytes} of every file under root ({} when root does not exist)."""
    snap = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            snap[os.path.relpath(full, root)] = read_bytes(full)
    return snap


def describe_tree_change(before, after):
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return f"added {added}, removed {removed}, changed {changed}"


def flip_byte(path, offset=None):
    """XORs one byte (default: the middle one) with 0xFF; returns the offset."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            raise AssertionError(f"cannot flip a byte of the empty file {path}")
        offset = size // 2 if offset is None else offset
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    return offset


def truncate_file(path, keep=None):
    """Truncates to `keep` bytes (default: half of the file)."""
    size = os.path.getsize(path)
    keep = size // 2 if keep is None else keep
    os.truncate(path, keep)
    return keep


def first_difference(a, b):
    """Index of the first byte where a and b differ (len of the shorter when one is a prefix)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
