#!/usr/bin/env python3
"""Independent plain-Python reference of the dpstream release contract (CSV input, mode "none").

Written from the contract only, not from the C++ sources:

  window  w = floor(ts / W)
  trigger i = floor((ts - w*W) * T / W)
  stream order = (window, trigger, timestamp, byte position of the row in the file)
  each user keeps its first C records (stream order) per window; kept values are clamped to
  [clamp_min, clamp_max] and rounded to a grid of 2^-20 before summing;
  at every trigger, one row per key that got >= 1 kept record at that trigger, holding the
  running (count, sum) of the window so far; rows sorted by (window, trigger, key as bytes).

Usable as a library (tests import it) or from the command line:

  python3 reference.py input.csv --window-seconds 86400 --triggers 10 --max-records-per-user 16 \
      [--first-window 0] [--windows 1] [--clamp-min 0] [--clamp-max 1] [--compare releases.csv]
"""

import argparse
import csv
import math
import re
import sys
from dataclasses import dataclass, field

FRAC_BITS = 20
SCALE = 1 << FRAC_BITS
REQUIRED_COLUMNS = ("user_id", "key", "value", "timestamp")

# A real number as written in a data file: optional minus, digits with optional fraction (or a
# leading-dot fraction), optional exponent. NaN/inf spellings are recognised separately.
_REAL_RE = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_NONFINITE_RE = re.compile(r"-?(?:nan|inf|infinity)", re.IGNORECASE)
_INT_RE = re.compile(r"-?[0-9]+")


@dataclass
class Job:
    window_seconds: int = 86400
    triggers: int = 1
    first_window: int = 0
    windows: int = 1
    max_records_per_user: int = 1
    clamp_min: float = 0.0
    clamp_max: float = 1.0


@dataclass
class Row:
    user: str
    key: str
    value: float
    ts: int
    pos: int  # byte offset of the line in the file
    line: int  # 1-based line number (header is line 1)


@dataclass
class BadRow:
    line: int
    kind: str  # "malformed" | "non_finite" | "out_of_window"
    text: str


@dataclass
class InputResult:
    rows: list = field(default_factory=list)  # accepted Rows
    bad: list = field(default_factory=list)  # BadRows, in file order
    data_lines: int = 0  # non-blank lines after the header

    def count(self, kind):
        return sum(1 for b in self.bad if b.kind == kind)


class InputFileError(Exception):
    pass


def window_of(ts, job):
    return ts // job.window_seconds  # Python // is floor division


def trigger_of(ts, job):
    w = window_of(ts, job)
    return (ts - w * job.window_seconds) * job.triggers // job.window_seconds


def _split_line(text):
    """Fields of one CSV line, or None when its quoting is broken."""
    if text.count('"') % 2 == 1:
        return None  # an odd number of quote characters cannot be balanced
    try:
        fields = next(csv.reader([text], strict=True))
    except (csv.Error, StopIteration):
        return None
    return fields


def parse_value(text):
    """('ok', float) | ('non_finite', None) | ('malformed', None)."""
    if _NONFINITE_RE.fullmatch(text):
        return "non_finite", None
    if not _REAL_RE.fullmatch(text):
        return "malformed", None
    v = float(text)
    if not math.isfinite(v):  # e.g. 1e999
        return "non_finite", None
    return "ok", v


def parse_timestamp(text):
    if not _INT_RE.fullmatch(text):
        return None
    return int(text)


def read_input(path, job):
    """Reads a CSV file per the contract. Raises InputFileError for a missing file/column."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputFileError(f"cannot open {path}: {e}")
    result = InputResult()
    pos = 0
    line_no = 0
    header = None
    first_w, last_w = job.first_window, job.first_window + job.windows
    while pos < len(data):
        nl = data.find(b"\n", pos)
        end = len(data) if nl < 0 else nl
        raw = data[pos:end]
        offset = pos
        pos = end + 1
        line_no += 1
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        text = raw.decode("utf-8")
        if header is None:
            fields = _split_line(text)
            if fields is None:
                raise InputFileError(f"{path}: header is not valid CSV")
            for col in REQUIRED_COLUMNS:
                if col not in fields:
                    raise InputFileError(f"{path}: missing column {col}")
            header = {col: fields.index(col) for col in REQUIRED_COLUMNS}
            ncols = len(fields)
            continue
        if text == "":
            continue
        result.data_lines += 1
        fields = _split_line(text)
        if fields is None or len(fields) != ncols:
            result.bad.append(BadRow(line_no, "malformed", text))
            continue
        user, key = fields[header["user_id"]], fields[header["key"]]
        vtext, ttext = fields[header["value"]], fields[header["timestamp"]]
        if user == "" or key == "":
            result.bad.append(BadRow(line_no, "malformed", text))
            continue
        status, value = parse_value(vtext)
        if status != "ok":
            result.bad.append(BadRow(line_no, status, text))
            continue
        ts = parse_timestamp(ttext)
        if ts is None:
            result.bad.append(BadRow(line_no, "malformed", text))
            continue
        if not (first_w <= window_of(ts, job) < last_w):
            result.bad.append(BadRow(line_no, "out_of_window", text))
            continue
        result.rows.append(Row(user, key, value, ts, offset, line_no))
    if header is None:
        raise InputFileError(f"{path}: empty file, no header")
    return result


def to_fixed(v):
    """v rounded to the 2^-20 grid, as an integer number of 2^-20 units (half away from zero)."""
    x = abs(v) * SCALE  # exact: scaling by a power of two
    n = math.floor(x)
    if x - n >= 0.5:
        n += 1
    return n if v >= 0 else -n


@dataclass
class Expected:
    releases: list  # (window, trigger, key, count, sum as float), in output order
    read: int
    accepted: int
    kept: int
    dropped_by_bounding: int
    clamped: int
    malformed: int
    non_finite: int
    out_of_window: int
    distinct_keys_per_window: dict  # window -> number of keys with a kept record
    distinct_users_per_window: dict  # window -> number of users with an accepted record
    kept_per_user: dict  # (window, user) -> records kept
    accepted_per_user: dict  # (window, user) -> records accepted (before bounding)


def compute(inp, job):
    """Expected releases and counters for an InputResult."""
    C = job.max_records_per_user
    lo, hi = job.clamp_min, job.clamp_max
    order = sorted(inp.rows, key=lambda r: (window_of(r.ts, job), trigger_of(r.ts, job), r.ts, r.pos))
    kept_per_user, accepted_per_user = {}, {}
    clamped = 0
    # (window, trigger) -> set of keys touched; (window, key) -> [count, fixed sum]
    touched = {}
    totals = {}
    releases = []
    current = None  # (window, trigger) being accumulated

    def flush(wt):
        if wt is None:
            return
        w, t = wt
        for key in sorted(touched.get(wt, ()), key=lambda k: k.encode("utf-8")):
            c, s = totals[(w, key)]
            releases.append((w, t, key, c, s / SCALE))

    for r in order:
        w, t = window_of(r.ts, job), trigger_of(r.ts, job)
        if (w, t) != current:
            flush(current)
            current = (w, t)
        uk = (w, r.user)
        accepted_per_user[uk] = accepted_per_user.get(uk, 0) + 1
        if kept_per_user.get(uk, 0) >= C:
            continue
        kept_per_user[uk] = kept_per_user.get(uk, 0) + 1
        v = r.value
        if v < lo or v > hi:
            clamped += 1
            v = min(max(v, lo), hi)
        acc = totals.setdefault((w, r.key), [0, 0])
        acc[0] += 1
        acc[1] += to_fixed(v)
        touched.setdefault((w, t), set()).add(r.key)
    flush(current)

    kept = sum(kept_per_user.values())
    keys_per_window, users_per_window = {}, {}
    for (w, _key) in totals:
        keys_per_window[w] = keys_per_window.get(w, 0) + 1
    for (w, _user) in accepted_per_user:
        users_per_window[w] = users_per_window.get(w, 0) + 1
    return Expected(
        releases=releases,
        read=inp.data_lines,
        accepted=len(inp.rows),
        kept=kept,
        dropped_by_bounding=len(inp.rows) - kept,
        clamped=clamped,
        malformed=inp.count("malformed"),
        non_finite=inp.count("non_finite"),
        out_of_window=inp.count("out_of_window"),
        distinct_keys_per_window=keys_per_window,
        distinct_users_per_window=users_per_window,
        kept_per_user=kept_per_user,
        accepted_per_user=accepted_per_user,
    )


# ---------------------------------------------------------------------------------------------
# Reading dpstream's output and comparing


def read_releases(path):
    """Rows of a releases.csv as (window, trigger, key, count, sum); raises ValueError on bad form."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, strict=True)
        header = next(reader, None)
        if header != ["window", "trigger", "key", "count", "sum"]:
            raise ValueError(f"{path}: unexpected header {header!r}")
        rows = []
        for n, rec in enumerate(reader, start=2):
            if len(rec) != 5:
                raise ValueError(f"{path}:{n}: expected 5 fields, got {rec!r}")
            try:
                rows.append((int(rec[0]), int(rec[1]), rec[2], int(rec[3]), float(rec[4])))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e} in {rec!r}")
    return rows


def sums_close(a, b):
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


def compare_releases(actual, expected, limit=10):
    """List of human-readable differences (empty when equal). Sums compare with tolerance."""
    problems = []
    if len(actual) != len(expected):
        problems.append(f"row count: dpstream wrote {len(actual)} rows, reference expects {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a[:4] != e[:4] or not sums_close(a[4], e[4]):
            problems.append(f"data row {i + 1} (line {i + 2}): dpstream {a!r}, reference {e!r}")
            if len(problems) >= limit:
                problems.append("... (further differences not shown)")
                break
    if len(problems) < limit and len(actual) != len(expected):
        extra = actual[len(expected):] if len(actual) > len(expected) else expected[len(actual):]
        who = "dpstream" if len(actual) > len(expected) else "reference"
        problems.append(f"first rows only in {who}: {extra[:3]!r}")
    return problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--window-seconds", type=int, default=86400)
    ap.add_argument("--triggers", type=int, required=True)
    ap.add_argument("--first-window", type=int, default=0)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--max-records-per-user", type=int, required=True)
    ap.add_argument("--clamp-min", type=float, default=0.0)
    ap.add_argument("--clamp-max", type=float, default=1.0)
    ap.add_argument("--compare", metavar="RELEASES_CSV", help="compare with a dpstream releases.csv instead of printing")
    a = ap.parse_args(argv)
    job = Job(a.window_seconds, a.triggers, a.first_window, a.windows, a.max_records_per_user, a.clamp_min, a.clamp_max)
    exp = compute(read_input(a.csv, job), job)
    if a.compare:
        problems = compare_releases(read_releases(a.compare), exp.releases)
        for p in problems:
            print(p)
        print("equal" if not problems else "DIFFERENT")
        return 1 if problems else 0
    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow(["window", "trigger", "key", "count", "sum"])
    for r in exp.releases:
        w.writerow([r[0], r[1], r[2], r[3], repr(r[4])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
