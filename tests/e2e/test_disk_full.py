#!/usr/bin/env python3
"""End-to-end test of a checkpoint that fills its file system, then --resume once there is room.

A DP job commits every 5 triggers into an output directory on a tmpfs too small for the window's
checkpoint segments, at four sizes (each fails at another commit and another write). The run must stop
with exit code 4 and one line that says the file system is full and to resume with --resume: no HDF5
error stack on stderr, and no crash at exit (HDF5 1.10 kept the failed file's id with its state freed,
and closing the library at exit dereferenced it: a segmentation fault after the error, in about two
runs of three at 2 ranks, src/h5.cpp). releases.csv must hold the reference's rows of the committed
triggers only. After the last tmpfs is grown, --resume must finish the job with releases.csv
byte-identical to an uninterrupted run's and the same state_digest.

Mounting a tmpfs needs root with CAP_SYS_ADMIN; without it the test is skipped (exit 77).

Usage: test_disk_full.py --ranks N [--bin build/src/dpstream] [--keep]
"""

import json
import os
import subprocess
import sys

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

EXIT_CHECKPOINT = 4
EXIT_SKIP = 77
SIZES, LARGE = ("3m", "4m", "6m", "8m"), "96m"  # a 300 k-user window's segments pass each within a few commits


def mount_tmpfs(path, size):
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True)


def main():
    args = harness.parse_args(__doc__)
    dps = harness.Dpstream(args)
    results = harness.Results("e2e_disk_full")
    with harness.TempDir(args.keep, "dpstream-e2e-disk-full-") as tmp:
        spec = harness.write_job(os.path.join(tmp, "job.toml"), harness.synthetic_job_toml(
            "disk-full", "dp", 300000, 100, keys=1000000, seed=3, window_seconds=86400, max_records=8, noise_seed=5,
            every=5))
        probe = os.path.join(tmp, "probe")
        os.makedirs(probe)
        mounted = mount_tmpfs(probe, "1m")
        if mounted.returncode != 0:
            print(f"skipped: cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {mounted.stderr.strip()}")
            return EXIT_SKIP
        subprocess.run(["umount", "-l", probe], capture_output=True)
        reference_dir = os.path.join(tmp, "reference")
        reference = dps.run_with("run", spec, "--out", reference_dir)
        if reference.returncode != 0:
            print(f"FAIL the uninterrupted run\n  {reference.describe()}")
            return 1
        want_rows = harness.read_bytes(os.path.join(reference_dir, "releases.csv"))
        with open(os.path.join(reference_dir, "summary.json"), encoding="utf-8") as f:
            want_digest = json.load(f)["state_digest"]
        for size in SIZES:
            small = os.path.join(tmp, f"fs-{size}")
            os.makedirs(small)
            mounted = mount_tmpfs(small, size)
            if mounted.returncode != 0:
                print(f"FAIL mount a {size} tmpfs: {mounted.stderr.strip()}")
                return 1
            try:
                check_fill_and_resume(dps, results, spec, small, size, size == SIZES[-1], want_rows, want_digest)
            finally:
                subprocess.run(["umount", "-l", small], capture_output=True)
    return results.finish()


def check_fill_and_resume(dps, results, spec, small, size, resume, want_rows, want_digest):
    """The job's commits fill `small` (a tmpfs of `size`); with `resume`, the tmpfs grows and the job resumes."""
    out = os.path.join(small, "out")
    # mpirun's wait before it kills the ranks still running once one exited non-zero (the harness's 0 would kill a
    # rank before a crash at its exit could show).
    full = dps.run_with("run", spec, "--out", out, env={"OMPI_MCA_odls_base_sigkill_timeout": "2"})

    def fails_cleanly():
        assert full.returncode == EXIT_CHECKPOINT, (
            f"expected exit {EXIT_CHECKPOINT} on a full file system (if the job now fits {size}, shrink the "
            f"tmpfs)\n  {full.describe()}")
        ours = [line for line in full.stderr.splitlines() if line.startswith("dpstream:")]
        assert len(ours) == 1, f"{len(ours)} lines of dpstream's\n  {full.describe()}"
        assert "it is full" in ours[0] and "resume with --resume" in ours[0], full.describe()
        for noise in ("HDF5-DIAG", "Segmentation fault", "received signal", "Signal:"):
            assert noise not in full.stderr, f"{noise!r} on stderr\n  {full.describe()}"

    def keeps_committed_rows_only():
        got = harness.read_bytes(os.path.join(out, "releases.csv"))
        assert got is not None, "no releases.csv"
        assert want_rows.startswith(got), f"differs at byte {harness.first_difference(got, want_rows)}"
        assert len(got) < len(want_rows), "every row, though a commit failed"
        assert not os.path.exists(os.path.join(out, "summary.json")), "summary.json of a failed run"

    results.check(f"{size}: a commit on a full file system: exit 4, one clear line, no crash", fails_cleanly)
    results.check(f"{size}: releases.csv holds the committed triggers' rows only", keeps_committed_rows_only)
    if not resume:
        return
    grown = subprocess.run(["mount", "-o", f"remount,size={LARGE}", small], capture_output=True, text=True)

    def resumes_to_the_reference():
        assert grown.returncode == 0, f"cannot grow the tmpfs: {grown.stderr.strip()}"
        resumed = dps.run_with("run", spec, "--out", out, "--resume")
        assert resumed.returncode == 0, resumed.describe()
        got = harness.read_bytes(os.path.join(out, "releases.csv"))
        assert got == want_rows, f"differs at byte {harness.first_difference(got or b'', want_rows)}"
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            assert json.load(f)["state_digest"] == want_digest

    results.check(f"{size}, then room made: --resume gives the uninterrupted run's bytes", resumes_to_the_reference)


if __name__ == "__main__":
    sys.exit(main())
