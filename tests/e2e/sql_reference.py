#!/usr/bin/env python3
"""Independent plain-Python reference of `dpstream query` (python3 stdlib only).

Written from docs/SQL.md and the id/secret contract (kernels/noise.hpp, src/id_prf.hpp), not from the
engine's SQL sources:

  secret      = SHA-256("dpstream test seed" || LE64(seed))                     (test mode, --seed)
  K_domain    = HMAC-SHA256(secret, "dpstream ids" || domain byte)[0..16)         (0 = user, 1 = key)
  id(text)    = low 8 bytes, little-endian, of SipHash-2-4-128(K_domain, text)
  gid         = key id of  LE32(len f1) || f1 || LE32(len f2) || f2 ...           (GROUP BY fields, utf-8)
  r(u, g)     = first 8 bytes LE of HMAC-SHA256(K_s, LE64(uid) || LE64(gid)),
                K_s = HMAC-SHA256(secret, "dpstream sql sample")
  fixed point = round-half-even(clamp(v, -2^50, 2^50) * 2^32), an integer of 2^-32 units

reference() computes the NOISE-FREE value of every aggregate of every group with at least one user after
WHERE, per-user aggregation and the k-group sampling, by the formulas of docs/SQL.md's table (exact
integer / rational arithmetic; converted to float at the end).

Run standalone, it checks itself against known-answer vectors (SipHash's own, and ids printed by the
engine's C++ IdPrf):  python3 sql_reference.py
"""

import hashlib
import hmac
import math
import re
import sys
from fractions import Fraction

MASK64 = (1 << 64) - 1
FRAC_BITS = 32
UNIT = 1 << FRAC_BITS
CLAMP = float(1 << 50)

# ----------------------------------------------------------------------------------------------
# SipHash-2-4, 128-bit output (Aumasson & Bernstein, "SipHash: a fast short-input PRF", and the
# 128-bit variant of the reference implementation: v1 ^= 0xee at initialization, v2 ^= 0xee before the
# first finalization, v1 ^= 0xdd before the second; output LE64(first) || LE64(second)).


def _rotl(x, b):
    return ((x << b) | (x >> (64 - b))) & MASK64


def _sipround(v0, v1, v2, v3):
    v0 = (v0 + v1) & MASK64
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 = (v2 + v3) & MASK64
    v3 = _rotl(v3, 16) ^ v2
    v0 = (v0 + v3) & MASK64
    v3 = _rotl(v3, 21) ^ v0
    v2 = (v2 + v1) & MASK64
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


def siphash128(key16, data):
    """SipHash-2-4 with 16-byte output (as OpenSSL's EVP_MAC "SIPHASH" with size 16)."""
    if len(key16) != 16:
        raise ValueError("SipHash key must be 16 bytes")
    data = bytes(data)
    k0 = int.from_bytes(key16[:8], "little")
    k1 = int.from_bytes(key16[8:], "little")
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D ^ 0xEE
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573
    n = len(data)
    full = n - n % 8
    for i in range(0, full, 8):
        m = int.from_bytes(data[i:i + 8], "little")
        v3 ^= m
        for _ in range(2):
            v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0 ^= m
    last = int.from_bytes(data[full:], "little") | ((n & 0xFF) << 56)
    v3 ^= last
    for _ in range(2):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0 ^= last
    v2 ^= 0xEE
    for _ in range(4):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    out0 = v0 ^ v1 ^ v2 ^ v3
    v1 ^= 0xDD
    for _ in range(4):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    out1 = v0 ^ v1 ^ v2 ^ v3
    return out0.to_bytes(8, "little") + out1.to_bytes(8, "little")


# ----------------------------------------------------------------------------------------------
# Secret, keyed ids, group ids, sample ranks.

USER, KEY = 0, 1


def secret_from_seed(seed):
    """kernels/noise.cpp: SHA-256("dpstream test seed" || LE64(seed)) (no terminator)."""
    return hashlib.sha256(b"dpstream test seed" + (seed & MASK64).to_bytes(8, "little")).digest()


_KEY_CACHE = {}


def id_key(secret, domain):
    """K_domain = HMAC-SHA256(secret, "dpstream ids" || domain byte)[0..16)."""
    k = (secret, domain)
    if k not in _KEY_CACHE:
        _KEY_CACHE[k] = hmac.new(secret, b"dpstream ids" + bytes([domain]), hashlib.sha256).digest()[:16]
    return _KEY_CACHE[k]


def id128(secret, domain, data):
    """(id, check): the two little-endian 64-bit halves of SipHash-2-4-128(K_domain, data)."""
    out = siphash128(id_key(secret, domain), data)
    return int.from_bytes(out[:8], "little"), int.from_bytes(out[8:], "little")


def user_id(secret, text):
    return id128(secret, USER, text.encode("utf-8"))[0]


def key_id(secret, data):
    return id128(secret, KEY, bytes(data))[0]


def group_encoding(fields):
    """docs/SQL.md: for each GROUP BY field in order, LE32(byte length) || utf-8 bytes."""
    out = bytearray()
    for f in fields:
        b = f.encode("utf-8")
        out += len(b).to_bytes(4, "little") + b
    return bytes(out)


def group_id(secret, fields):
    return key_id(secret, group_encoding(fields))


_SAMPLE_KEYS = {}


def sample_rank(secret, uid, gid):
    """r(u, g) = first 8 bytes LE of SipHash-2-4-128(K_s, LE64(uid) || LE64(gid)),
    K_s = HMAC-SHA256(secret, "dpstream sql sample")[0:16]."""
    ks = _SAMPLE_KEYS.get(secret)
    if ks is None:
        ks = _SAMPLE_KEYS[secret] = hmac.new(secret, b"dpstream sql sample", hashlib.sha256).digest()[:16]
    mac = siphash128(ks, uid.to_bytes(8, "little") + gid.to_bytes(8, "little"))
    return int.from_bytes(mac[:8], "little")


# ----------------------------------------------------------------------------------------------
# Fixed point and number parsing.

# strtod's decimal syntax as the test data uses it (no hex floats, no inf/nan, no spaces).
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z")


def parse_number(text):
    """float of a field, or None for NULL (empty); raises ValueError for a bad field."""
    if text == "":
        return None
    if not _NUMBER_RE.match(text):
        raise ValueError(f"not a number: {text!r}")
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"not finite: {text!r}")
    return v


def to_fixed(v):
    """docs/SQL.md: clamp to [-2^50, 2^50] (on the double), then round-half-even(v * 2^32).
    v * 2^32 is exact (scaling by a power of two); round() of a float is half-even in Python."""
    v = float(v)
    v = min(max(v, -CLAMP), CLAMP)
    return int(round(v * UNIT))


def from_fixed(units):
    return float(Fraction(units, UNIT)) if isinstance(units, int) else float(units / UNIT)


# ----------------------------------------------------------------------------------------------
# The reference operator.

NTILE_BRANCH = 16
NTILE_DEPTH = 4
NTILE_LEAVES = NTILE_BRANCH ** NTILE_DEPTH  # 65536


def agg_reads(agg):
    """The value column an aggregate reads (None for COUNT(*) and COUNT(DISTINCT))."""
    if agg["kind"] == "count_distinct":
        return None
    return agg.get("column")


def ntile_leaf(x, lower, upper):
    """min(65535, floor((x - L) / (U - L) * 65536)) in doubles (x the user's clamped mean)."""
    if upper == lower:
        return 0
    return min(NTILE_LEAVES - 1, math.floor((x - lower) / (upper - lower) * NTILE_LEAVES))


def ntile_descent(leaf_counts, p, lower, upper, exact=False):
    """The doc's descent on (here exact) counts: leaf_counts {leaf: users}. exact=True does the
    arithmetic in rationals instead of doubles (to tell a double-rounding tie from a real error)."""
    num = Fraction if exact else float
    lo, hi = num(lower), num(upper)
    q = num(p)
    first_leaf, width = 0, NTILE_LEAVES
    for _level in range(NTILE_DEPTH):
        width //= NTILE_BRANCH
        c = [0] * NTILE_BRANCH
        for leaf, n in leaf_counts.items():
            if first_leaf <= leaf < first_leaf + width * NTILE_BRANCH:
                c[(leaf - first_leaf) // width] += n
        c = [max(0, x) for x in c]
        total = sum(c)
        if total == 0:
            return float(lo + q * (hi - lo))
        target = q * total
        cum = 0
        j = None
        for i in range(NTILE_BRANCH):
            if c[i] > 0 and cum + c[i] >= target:
                j = i
                break
            cum += c[i]
        if j is None:  # only by float slack: take the last non-empty child
            j = max(i for i in range(NTILE_BRANCH) if c[i] > 0)
            cum = sum(c[:j])
        q = (target - cum) / num(c[j])
        q = min(max(q, num(0)), num(1))
        step = (hi - lo) / NTILE_BRANCH
        lo, hi = lo + step * j, lo + step * (j + 1)
        first_leaf += width * j
    return float(lo + q * (hi - lo))


class RefStats:
    """Counters of a reference run (not DP): rows read / bad / kept by WHERE, users per group."""

    def __init__(self):
        self.rows_read = 0
        self.rows_bad = 0
        self.rows_where = 0
        self.bad_reasons = []
        self.groups_before_sampling = 0
        self.sampled_away = 0  # (user, group) pairs dropped by the k-group sampling
        self.user_groups = {}  # user text -> list of group tuples kept after sampling


def reference(rows, user_column, group_columns, aggregates, where=None, k=1, max_rows_per_group=1, seed=0,
              where_numeric_columns=(), stats=None, null_users_in_n=True, exact_ntile=False):
    """Noise-free `dpstream query`.

    rows: list of dicts {column: field text}; group_columns: GROUP BY columns in order; aggregates: dicts
    {"kind": "count", "column": None|col, "upper": U|None} | {"kind": "count_distinct"} |
    {"kind": "sum"|"avg"|"var"|"stddev", "column", "lower", "upper"} |
    {"kind": "ntile", "column", "p", "lower", "upper"}, each optionally with a "name";
    where: predicate on the row dict (the Python equivalent of the SQL WHERE), applied to good rows only;
    where_numeric_columns: columns the WHERE compares with a number (typed on read like value columns).
    null_users_in_n: AVG / VAR use N = all users of the group (docs/SQL.md: "users N, shared with
    selection"); False uses the users with a non-NULL value instead (diagnostics only).

    Returns {group tuple: {"users": n, "values": [per aggregate], name: value ...}}: counts and
    COUNT(DISTINCT) as ints, the others as floats.
    """
    secret = secret_from_seed(seed)
    st = stats if stats is not None else RefStats()
    value_cols = sorted({c for c in (agg_reads(a) for a in aggregates) if c} | set(where_numeric_columns))
    # 1. read + type; 2. WHERE.
    per = {}  # (user, group) -> {"rows": n, col: [count non-null, fixed sum]}
    for row in rows:
        st.rows_read += 1
        user = row.get(user_column, "")
        try:
            if user == "":
                raise ValueError("empty user")
            typed = {c: parse_number(row[c]) for c in value_cols}
        except (ValueError, KeyError) as e:
            st.rows_bad += 1
            st.bad_reasons.append(str(e))
            continue
        if where is not None and not where(row):
            continue
        st.rows_where += 1
        g = tuple(row[c] for c in group_columns)
        cell = per.get((user, g))
        if cell is None:
            cell = per[(user, g)] = {"rows": 0, "cols": {c: [0, 0] for c in value_cols}}
        cell["rows"] += 1
        for c in value_cols:
            v = typed[c]
            if v is not None:
                cell["cols"][c][0] += 1
                cell["cols"][c][1] += to_fixed(v)
    # 4. stability bounding: each user keeps its k groups of smallest (r(u, g), gid).
    by_user = {}
    for (user, g) in per:
        by_user.setdefault(user, []).append(g)
    st.groups_before_sampling = len({g for (_u, g) in per})
    gid_cache = {}

    def gid_of(g):
        if g not in gid_cache:
            gid_cache[g] = group_id(secret, list(g))
        return gid_cache[g]

    kept = {}  # group -> list of user cells
    for user, groups in by_user.items():
        if len(groups) > k:
            uid = user_id(secret, user)
            groups = sorted(groups, key=lambda g: (sample_rank(secret, uid, gid_of(g)), gid_of(g)))
            st.sampled_away += len(groups) - k
            groups = groups[:k]
        st.user_groups[user] = list(groups)
        for g in groups:
            kept.setdefault(g, []).append(per[(user, g)])
    # 3 + 5. per-user partial values, then the noise-free aggregate of each group.
    out = {}
    for g, cells in kept.items():
        n_users = len(cells)
        res = {"users": n_users, "values": []}
        for a in aggregates:
            res["values"].append(_aggregate(a, cells, n_users, max_rows_per_group, null_users_in_n, exact_ntile))
            if a.get("name"):
                res[a["name"]] = res["values"][-1]
        out[g] = res
    return out


def _user_mean(cell, col, lo_u, hi_u):
    """The user's clamped mean in fixed point (floor of sum / count), or None without a value."""
    cnt, s = cell["cols"][col]
    if cnt == 0:
        return None
    return min(max(s // cnt, lo_u), hi_u)


def _aggregate(a, cells, n_users, max_rows_per_group, null_users_in_n, exact_ntile):
    kind = a["kind"]
    if kind == "count_distinct":
        return n_users
    if kind == "count":
        u = a.get("upper")
        u = max_rows_per_group if u is None else int(u)
        col = a.get("column")
        total = 0
        for c in cells:
            n = c["rows"] if col is None else c["cols"][col][0]
            total += min(max(n, 0), u)
        return total
    lo_u, hi_u = to_fixed(a["lower"]), to_fixed(a["upper"])
    col = a["column"]
    if kind == "sum":
        total = 0
        for c in cells:
            total += min(max(c["cols"][col][1], lo_u), hi_u)
        return from_fixed(total)
    means = [m for m in (_user_mean(c, col, lo_u, hi_u) for c in cells) if m is not None]
    if kind in ("avg", "var", "stddev"):
        lo, hi = Fraction(lo_u, UNIT), Fraction(hi_u, UNIT)
        m = (lo + hi) / 2
        xs = [Fraction(x, UNIT) for x in means]
        n = max(1, n_users if null_users_in_n else len(xs))
        s = sum((x - m for x in xs), Fraction(0))
        if kind == "avg":
            return float(min(max(m + s / n, lo), hi))
        h = ((hi - lo) / 2) ** 2
        q = sum(((x - m) ** 2 - h / 2 for x in xs), Fraction(0))
        var = min(max((q + n * h / 2) / n - (s / n) ** 2, Fraction(0)), h)
        return float(var) if kind == "var" else math.sqrt(var)
    if kind == "ntile":
        lower, upper = float(a["lower"]), float(a["upper"])
        leaves = {}
        for x in means:
            leaf = ntile_leaf(x / UNIT, lower, upper)
            leaves[leaf] = leaves.get(leaf, 0) + 1
        return ntile_descent(leaves, a["p"], lower, upper, exact=exact_ntile)
    raise ValueError(f"unknown aggregate kind {kind!r}")


def sort_key(group):
    """Rows of result.csv are sorted by the group field strings as bytes."""
    return tuple(f.encode("utf-8") for f in group)


# ----------------------------------------------------------------------------------------------
# Known answers.

# SipHash-2-4-128, key 00..0f, message 00 01 .. (len-1): the first two are the reference
# implementation's vectors_sip128; all four printed by `openssl mac -macopt hexkey:000102..0f
# -macopt size:16 SIPHASH` (OpenSSL 3).
SIPHASH128_VECTORS = [
    (0, "a3817f04ba25a8e66df67214c7550293"),
    (1, "da87c1d86b99af44347659119b22fc45"),
    (8, "3b62a9ba6258f5610f83e264f31497b4"),
    (15, "5493e99933b0a8117e08ec0f97cfc3d9"),
]

# Ids printed by the engine's own IdPrf (src/id_prf.cpp linked from build-dev, /tmp program):
# (seed, domain, data, id, check).
IDPRF_VECTORS = [
    (7, USER, b"u0001", 18415730231334349109, 12037431240696468212),
    (7, KEY, b"u0001", 12452036291421780466, 17140582043995130141),
    (1, USER, b"", 8710863610412108785, 667277165003002363),
    (23, USER, "user with spaces, and \u00e9".encode("utf-8"), 3926125984620748687, 17163078193485493333),
    (7, KEY, group_encoding(["EU", "a"]), 16259437292007686325, 11067987649593992759),
    (12345678901234, KEY, b"0123456789abcdef0123", 9203929740275286973, 1142862778030815619),
    (7, USER, b"abcdefg", 3273748357287340694, 1353461803517418389),
    (7, USER, b"abcdefgh", 1765984328182687032, 4200034232205607134),
]

# kernels tests: SHA-256("dpstream test seed" || LE64(1)) (tests/kernels/test_noise.cpp).
SECRET_VECTORS = [
    (1, "b8b6cce4bdd0d4fbe2972cd8304dc99f23b112396584903d04e1edc5b0fa025c"),
    (2, "b34045d61cc43d59f03dd0512d28227e987255405e49ccac1de08f8129c7eb28"),
]


def self_check():
    """Raises AssertionError on any mismatch; returns the number of vectors checked."""
    n = 0
    key = bytes(range(16))
    for length, want in SIPHASH128_VECTORS:
        got = siphash128(key, bytes(range(length))).hex()
        assert got == want, f"siphash128 len {length}: {got} != {want}"
        n += 1
    for seed, want in SECRET_VECTORS:
        got = secret_from_seed(seed).hex()
        assert got == want, f"secret_from_seed({seed}) = {got} != {want}"
        n += 1
    for seed, domain, data, want_id, want_check in IDPRF_VECTORS:
        got = id128(secret_from_seed(seed), domain, data)
        assert got == (want_id, want_check), f"id({seed}, {domain}, {data!r}) = {got} != {(want_id, want_check)}"
        n += 1
    # fixed point: half-even at the 2^-32 grid, and the clamp on the double
    assert to_fixed(0.5 / UNIT) == 0 and to_fixed(1.5 / UNIT) == 2 and to_fixed(-2.5 / UNIT) == -2
    assert to_fixed(1e300) == 1 << 82 and to_fixed(-1e300) == -(1 << 82) and to_fixed(-0.0) == 0
    assert to_fixed(0.1) == 429496730  # 0.1 * 2^32 = 429496729.6000000238...
    # a tiny group by hand: two users, one sampled away from one of three groups with k = 2
    rows = [{"u": "a", "g": "x", "v": "1"}, {"u": "a", "g": "x", "v": "2"}, {"u": "b", "g": "x", "v": ""},
            {"u": "b", "g": "y", "v": "-3"}, {"u": "b", "g": "z", "v": "4"}, {"u": "c", "g": "x", "v": "bad"}]
    aggs = [{"kind": "count", "column": None, "upper": 3}, {"kind": "sum", "column": "v", "lower": -1, "upper": 5},
            {"kind": "avg", "column": "v", "lower": 0, "upper": 4}]
    st = RefStats()
    res = reference(rows, "u", ["g"], aggs, k=2, seed=3, stats=st)
    assert st.rows_bad == 1 and st.rows_read == 6
    assert res[("x",)]["values"][:2] == [2 + (1 if ("x",) in st.user_groups["b"] else 0), 3.0]
    assert sum(len(v) for v in st.user_groups.values()) == 3 and st.sampled_away == 1
    # avg in x: a's mean 1.5; b (NULL only, if kept) counts in N: (1.5 - 2 + 0) / 2 + 2
    want = 1.5 if ("x",) not in st.user_groups["b"] else 1.75
    assert res[("x",)]["values"][2] == want, res
    assert ntile_descent({0: 1, 65535: 1}, 0.0, 0, 1) == 0.0 and ntile_descent({0: 1, 65535: 1}, 1.0, 0, 1) == 1.0
    return n + 1


if __name__ == "__main__":
    count = self_check()
    print(f"sql_reference self-check: {count} known-answer groups ok")
    sys.exit(0)
