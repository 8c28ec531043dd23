#!/usr/bin/env python3
"""Memory and time model of a synthetic dpstream job on N nodes: does it fit, and how long a trigger takes.

  python3 jobs/memory_model.py --job jobs/paper-billion.toml --calibration CAL/summary.json \
      [--users 100000000] [--nodes 1 4 16 64] [--memory-per-node-gib 24] [--ranks-per-node 2]
  python3 jobs/memory_model.py --job JOB.toml --calibration CAL/summary.json --check RUN/summary.json

Peak RSS per rank = base + state + other * records per rank, where
  state  is the generator's 16 bytes per local user and the geometry of the engine's tables (the user
         table's buckets and records, the key table's slots, their growth steps and load limits; absl's
         for overflow sets), 256 shards per rank, from the expected counts of the workload: active
         users, tracked keys, each shard's count spread as hashing spreads it (Poisson), and each
         user's record from its kept records (at most one pair each);
  other  (bytes per input record of the rank's window: record buffers of a bounding batch (a trigger
         up to T = 99, T / 50 triggers above: about a fiftieth of the window from T = 100 on), the checkpoint
         journal, allocator slack) and base (bytes per process) are fitted on calibration runs
         that commit at the job's cadence in triggers (the journal grows with the triggers between
         two commits: calibrate with [checkpoint] every = k and run the job with the same k):
         summary.json files of the same workload at smaller scales (the peak RSS minus the modelled
         state). With a single calibration, base is the RSS of an empty process (50 MiB), or the
         calibration's whole RSS beyond its state when that is less (a small run's process: 31 MiB).
Time per trigger = records per trigger / (ranks x the calibration's records per second per rank):
on one node of this kind; a cluster adds network time to the two shuffles, not modelled.
--check compares the model's prediction with a measured run (bytes per user and key, peak RSS).
docs/SCALE.md explains the terms and lists the measured checks.
"""
import argparse
import json
import math
import sys
import tomllib

SHARDS = 256  # UserState::kShards == KeyStateTable::kShards
# kernels/table_memory.hpp kSpareSigmas: a key table reservation's spare, which its table fills to 7/8
# (Packed.piece_top) before it leaves its slab piece (kept mapped: table_bytes counts it).
SPARE_SIGMAS = 2
# The user table (kernels/bounding.hpp, UserState) packs a record per user (12 bytes: user, state, kept and
# its 2-byte directory entry; then 2 bytes per key fingerprint, up to 32) into 256-byte buckets of 253 bytes
# for directories and records (at most 16 records a bucket, which binds only users of few keys), reserved for the
# window's expected users and kept records (four standard deviations of a shard's users to spare) at
# most 85% full, grown by 1/8 + 1 bucket beyond it; fingerprints past 32 go to an exact absl set of
# 16-byte (user, fingerprint) entries, kept counts of 255 or more to an absl map. The key table
# (kernels/key_accumulate.hpp, PackedSlots) has 16-byte slots (key, count, users), no control byte, a
# capacity of 16 grown by 1/4 at load 5/6. A sum is stored as its excess over count * 2^20: zero for the
# synthetic workload (every value is 1.0), so no sum table. Keys released at least once keep their round
# state (12 bytes) in a side table: few in a large uniform key space, not modelled.
OVERFLOW_SLOT, WIDE_KEPT_SLOT, KEY_SLOT = 16, 16, 16
BUCKET, BUCKET_ROOM, MAX_RECORDS, MAX_LOAD_PERCENT = 256, 253, 16, 85
RECORD_HEAD, INLINE_FINGERPRINTS, WIDE_KEPT = 12, 32, 255
# The synthetic generator keeps, per local user, U_(k) and k (12 bytes) and its place in a due list (4).
GENERATOR_USER = 16
BASE_BYTES = 50 * 2**20


def capacity(items):
    """absl flat hash table capacity for `items`: 2^k - 1 (at least 7) with items <= cap - cap/8."""
    cap = 7
    while items > cap - cap // 8:
        cap = cap * 2 + 1
    return cap


class Absl:
    """absl flat_hash_map geometry: capacity 2^k - 1, at most 7/8 full, a control byte per slot."""
    first = staticmethod(capacity)
    top = staticmethod(lambda cap: cap - cap // 8)  # largest count this capacity holds
    next = staticmethod(lambda cap: cap * 2 + 1)
    bytes = staticmethod(lambda cap, slot: cap * (slot + 1) + 16)


class Stepped:
    """A table grown in steps (top: the largest count a capacity holds, next: the capacity after it)."""
    smallest = 16

    @classmethod
    def piece_top(cls, cap):
        """The largest count a reservation's slab piece holds: top unless the table says otherwise."""
        return cls.top(cap)

    @classmethod
    def first(cls, items):
        cap = cls.smallest
        while items > cls.top(cap):
            cap = cls.next(cap)
        return cap


class Packed(Stepped):
    """PackedSlots geometry, the key table (kernels/table_memory.hpp): 16, then steps of 1/4 (1/8 from 2^16),
    at most 5/6 full."""
    top = staticmethod(lambda cap: cap * 5 // 6)  # table_full: grows when (items + 1) * 6 > cap * 5
    piece_top = staticmethod(lambda cap: cap * 7 // 8)  # kMaxLoadInPiece: a reservation fills to 7/8
    next = staticmethod(lambda cap: max(16, cap + cap // (4 if cap < 65536 else 8)))
    bytes = staticmethod(lambda cap, slot: cap * slot)


class Buckets(Stepped):
    """UserState::Shard geometry (kernels/bounding.cpp), counted in record bytes: 4 buckets, grown by 1/8 + 1
    bucket before its records fill 85% of its buckets' room."""
    smallest = 4
    top = staticmethod(lambda cap: cap * BUCKET_ROOM * MAX_LOAD_PERCENT // 100)
    next = staticmethod(lambda cap: cap + cap // 8 + 1)
    bytes = staticmethod(lambda cap, slot: cap * BUCKET)


def reserved_buckets(users, record_bytes_per_user):
    """UserState::reserve: buckets for a shard's expected users and four standard deviations of their
    spread, at most 85% full; at least a bucket's room over its 16 records per user (UserState::over_count)."""
    per_user = max(record_bytes_per_user, BUCKET_ROOM / MAX_RECORDS)
    return math.ceil((users + 4 * math.sqrt(users)) * per_user * 100 / MAX_LOAD_PERCENT / BUCKET_ROOM)


def reserved_capacity(items):
    """kernels/table_memory.hpp reserved_capacity: room for a shard's expected share and SPARE_SIGMAS
    standard deviations of its spread, at most 5/6 full (the synthetic source tells the tables its window up front)."""
    items = int(items)
    spare = math.ceil(SPARE_SIGMAS * math.sqrt(items))
    cap = (items + spare) * 6 // 5
    while Packed.top(cap) < items + spare + 1:  # table_full(items + spare, cap): one more would grow it
        cap += 1
    return max(16, cap)


def table_bytes(mean_items, slot, var_items=None, geometry=Absl, reserved=False, start=None):
    """Expected bytes of one shard's table whose item count has this mean and variance (default
    Poisson: items hashed to shards one by one): the capacity steps are averaged over the count's
    spread (normal approximation). `reserved`: the table was sized for the mean up front (`start`:
    at that capacity)."""
    if mean_items <= 0:
        return 0
    sd = math.sqrt(var_items if var_items is not None else mean_items)
    lo, hi = max(0.0, mean_items - 6 * sd), mean_items + 6 * sd
    cdf = lambda x: 0.5 * math.erfc((mean_items - x) / (sd * math.sqrt(2)))  # noqa: E731
    total, cap = 0.0, geometry.first(lo)
    piece = None  # a reservation's capacity: its slab piece stays mapped once the table grows out of it
    if reserved:  # the table starts at the reserved capacity and grows from there
        cap = piece = start if start is not None else reserved_capacity(mean_items)
    while True:
        # in its piece a table may fill to piece_top (PackedSlots: 7/8), elsewhere to top
        top = geometry.piece_top(cap) if cap == piece else geometry.top(cap)
        if top >= lo:
            p = cdf(min(top, hi) + 0.5) - cdf(lo - 0.5)
            kept_piece = geometry.bytes(piece, slot) if piece is not None and cap != piece else 0
            total += p * (geometry.bytes(cap, slot) + kept_piece)
            lo = top + 1
        if top >= hi:
            return total
        cap = geometry.next(cap)


def workload(job, users):
    """Expected users, records, kept records and tracked keys of a synthetic job (core paper, section 5.1)."""
    inp, priv = job["input"], job["privacy"]
    lo = int(inp.get("records_per_user_min", 1))
    hi = int(inp.get("records_per_user_max", 100_000))
    q, s = float(inp.get("records_per_user_q", 26.0)), float(inp.get("records_per_user_s", 6.738))
    c = int(priv.get("max_records_per_user", 2**32 - 1))
    w = [(k + q) ** -s for k in range(lo, hi + 1)]
    z = sum(w)
    shift = 1 if lo == 0 else 0  # records per user = 1 + X when the minimum is 0
    mean = sum((k + shift) * x for k, x in zip(range(lo, hi + 1), w)) / z
    mean_kept = sum(min(k + shift, c) * x for k, x in zip(range(lo, hi + 1), w)) / z
    kept_sq = sum(min(k + shift, c) ** 2 * x for k, x in zip(range(lo, hi + 1), w)) / z
    # pairs ~ kept records (a large key space: a user's keys are distinct): a user's record bytes (mean and
    # second moment), its fingerprints past the record, and whether its kept count needs the wide map
    def record(k):
        return RECORD_HEAD + 2 * min(k, INLINE_FINGERPRINTS)

    kept_of = [(min(k + shift, c), x / z) for k, x in zip(range(lo, hi + 1), w)]
    record_bytes = sum(record(k) * x for k, x in kept_of)
    record_sq = sum(record(k) ** 2 * x for k, x in kept_of)
    overflow = sum(max(0, k - INLINE_FINGERPRINTS) * x for k, x in kept_of)
    wide = sum(x for k, x in kept_of if k >= WIDE_KEPT)
    keys = int(inp["keys"])
    kept = users * mean_kept
    if inp.get("key_distribution", "zipf-mandelbrot") == "uniform":
        tracked = keys * -math.expm1(-kept / keys)  # distinct keys among `kept` uniform draws
    else:
        if keys > 10_000_000:
            sys.exit("memory_model.py: Zipf keys are summed key by key; use at most 1e7 keys or uniform keys")
        kq, ks = float(inp.get("key_q", 1000.0)), float(inp.get("key_s", 1.4))
        p = [(k + kq) ** -ks for k in range(1, keys + 1)]
        pz = sum(p)
        tracked = sum(-math.expm1(kept * math.log1p(-x / pz)) for x in p)
    sums = "sum" in job.get("query", {}).get("aggregations", ["count", "sum"])
    return {"users": users, "records": users * mean, "kept": kept, "keys": tracked, "kept_sq_per_user": kept_sq,
            "record_bytes_per_user": record_bytes, "record_sq_per_user": record_sq,
            "overflow_pairs_per_user": overflow, "wide_kept_share": wide, "sums": sums}


def state_per_rank(w, ranks, fixed=None):
    if fixed:  # what-if: bytes per active user and per tracked key given
        return {"user": fixed[0] * w["users"] / ranks, "key": fixed[1] * w["keys"] / ranks,
                "generator": GENERATOR_USER * w["users"] / ranks}
    per_shard = ranks * SHARDS
    u = w["users"] / per_shard
    # the engine reserves for kept records as pairs (src/engine.cpp): bytes per user from their mean
    kept_per_user = w["kept"] / w["users"]
    start = reserved_buckets(u, RECORD_HEAD + 2 * min(INLINE_FINGERPRINTS, kept_per_user))
    # a table grows when its records' bytes or their count (16 a bucket: UserState::over_count) reach the load
    bytes_per_user = max(w["record_bytes_per_user"], BUCKET_ROOM / MAX_RECORDS)
    users = SHARDS * table_bytes(u * bytes_per_user, 0, var_items=u * w["record_sq_per_user"],
                                 geometry=Buckets, reserved=True, start=start)
    users += SHARDS * table_bytes(u * w["overflow_pairs_per_user"], OVERFLOW_SLOT)
    users += SHARDS * table_bytes(u * w["wide_kept_share"], WIDE_KEPT_SLOT)
    keys = SHARDS * table_bytes(w["keys"] / per_shard, KEY_SLOT, geometry=Packed, reserved=True)
    return {"user": users, "key": keys, "generator": GENERATOR_USER * w["users"] / ranks}


def fit(job, calibrations):
    """base and `other` bytes per record per rank from calibration summaries (least squares)."""
    points = []
    for c in calibrations:
        ranks = c["ranks"]
        w = workload(job, c["distinct_users"])
        st = state_per_rank(w, ranks)
        rss = max(c["peak_rss_bytes_per_rank"])
        points.append((c["records"]["read"] / ranks, rss - st["user"] - st["key"] - st["generator"]))
    if len(points) == 1:  # base: an empty process's RSS, or all of the run's RSS beyond its state when less
        x, y = points[0]
        base = max(0.0, min(BASE_BYTES, y))
        return base, max(0.0, (y - base) / x)
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return max(0.0, my - slope * mx), max(0.0, slope)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", required=True, help="the job spec (synthetic input)")
    ap.add_argument("--calibration", nargs="+", required=True, help="summary.json of runs of the same workload")
    ap.add_argument("--users", type=float, help="override input.users")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--memory-per-node-gib", type=float, default=24.0)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--headroom", type=float, default=0.9, help="share of a node's memory the ranks may use")
    ap.add_argument("--state-bytes", type=float, nargs=2, metavar=("PER_USER", "PER_KEY"),
                    help="what-if: state bytes per active user and per tracked key instead of today's tables")
    ap.add_argument("--other-bytes", type=float, help="what-if: bytes per window record beyond the tables")
    ap.add_argument("--check", help="summary.json of a run to compare with the model's prediction")
    a = ap.parse_args()
    with open(a.job, "rb") as f:
        job = tomllib.load(f)
    if job.get("input", {}).get("kind", "synthetic") != "synthetic":
        sys.exit("memory_model.py: the model covers synthetic inputs only (input.kind = \"synthetic\")")
    cals = [json.load(open(p)) for p in a.calibration]
    base, other = fit(job, cals)
    if a.other_bytes is not None:
        other = a.other_bytes
    rate = max(c["records"]["read"] / c["wall_seconds"] / c["ranks"] for c in cals)
    users = int(a.users or job["input"]["users"])
    w = workload(job, users)
    T = int(job["stream"]["triggers"])
    print(f"workload: {users:.3g} users, {w['records']:.3g} records ({w['kept']:.3g} kept), {w['keys']:.3g} tracked keys, T = {T}")
    print(f"fitted on {len(cals)} run(s): base {base / 2**20:.0f} MiB per rank, {other:.1f} B per input record of the "
          f"rank's window beyond the tables; {rate / 1e6:.2f} M records/s per rank")
    # The per-record term holds the commit journal, which grows with the triggers between commits.
    cadence = sorted({round(int(c["triggers"]) / max(1, c["checkpoint"]["commits"]), 1) for c in cals if "checkpoint" in c})
    if cadence:
        print(f"calibrated at {', '.join(map(str, cadence))} triggers per commit: run the job at that cadence "
              f"([checkpoint] every = {max(1, round(cadence[0]))}, rounded up to bounding batches) for the prediction to hold")
    # It also holds a bounding batch's record buffers: a calibration bounded in other batches (another
    # [engine] trigger_batch, or a build before the auto rule became T / 50) fits another term.
    batch = int(job.get("engine", {}).get("trigger_batch", 0)) or max(1, T // 50)
    for p, c in zip(a.calibration, cals):
        if "triggers_per_bounding_batch" in c and int(c["triggers_per_bounding_batch"]) != batch:
            print(f"memory_model.py: warning: {p} bounded {c['triggers_per_bounding_batch']} trigger(s) a batch, the job "
                  f"{batch}: calibrate with the job's [engine] trigger_batch", file=sys.stderr)

    def predict(ranks):
        st = state_per_rank(w, ranks, a.state_bytes)
        rss = base + st["user"] + st["key"] + st["generator"] + other * w["records"] / ranks
        return st, rss

    if a.check:
        run = json.load(open(a.check))
        ranks = run["ranks"]
        w = workload(job, run["distinct_users"])
        st, rss = predict(ranks)
        got = max(run["peak_rss_bytes_per_rank"])
        print(f"check on {a.check} ({ranks} ranks): tracked keys model {w['keys']:.4g} measured {run['distinct_keys']}; "
              f"B/user model {st['user'] * ranks / w['users']:.1f} measured {run['state_bytes_per_active_user']:.1f}; "
              f"B/key model {st['key'] * ranks / w['keys']:.1f} measured {run['key_state_bytes_per_tracked_key']:.1f}; "
              f"peak RSS/rank model {rss / 2**30:.2f} GiB measured {got / 2**30:.2f} GiB ({(rss - got) / got:+.1%})")
        return
    budget = a.memory_per_node_gib * 2**30 * a.headroom
    print(f"{'nodes':>6} {'ranks':>6} {'users/rank':>11} {'keys/rank':>11} {'B/user':>7} {'B/key':>6} "
          f"{'GiB/rank':>9} {'GiB/node':>9} {'fits':>5} {'s/trigger':>10}")
    for n in a.nodes:
        ranks = n * a.ranks_per_node
        st, rss = predict(ranks)
        node = rss * a.ranks_per_node
        print(f"{n:>6} {ranks:>6} {w['users'] / ranks:>11.3g} {w['keys'] / ranks:>11.3g} "
              f"{st['user'] * ranks / w['users']:>7.1f} {st['key'] * ranks / w['keys']:>6.1f} {rss / 2**30:>9.2f} "
              f"{node / 2**30:>9.2f} {'yes' if node <= budget else 'NO':>5} {w['records'] / T / ranks / rate:>10.2f}")


if __name__ == "__main__":
    main()
