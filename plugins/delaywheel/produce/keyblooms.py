"""A Bloom filter of each segment's keys, so a cancel by key reads the keys of the few segments that may hold it.

Segments carry no key index (a per-message index entry is what they exist to avoid), and scanning every pending
segment's keys would read every pending key, millions of them with millions of timers pending. A filter costs a send
about 1.25 bytes and two hash steps per key; a lookup reads each pending segment's filter (kept in the row, not TOASTed)
and the keys of the segments it lets through, about 1 % of those that do not hold the key. The hashes are computed here,
for the keys of a batch at once and for a looked-up key alike, and passed to SQL (`delaywheel.bloom_may_hold`), which
only tests bits: one definition of the hash, so the two sides cannot disagree.

Far segments are tested a level up first (far_key_summaries): a send's far keys, whose ~27 segments (one per far day) each
have a filter, are also cut by the key's *group* (the top bits of h2) into `buckets` groups, and each group's filter
is a summary row. A looked-up key's group in every possible bucket count names the one summary row per send that
may hold it (`slots`), so a cancel tests about one filter per send instead of one per far segment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: a cancel by key (probe) needs neither, nor does the CLI's start
    import numpy as np
    import pyarrow as pa

BITS_PER_KEY = 10  # with HASHES probes: about 1 % false positives
HASHES = 4  # must match delaywheel.bloom_may_hold (sql/segments.sql)
MIN_BYTES = 8
MIN_MESSAGES = 16
_FNV_OFFSET, _FNV_PRIME, _MASK32 = 2166136261, 16777619, 0xFFFFFFFF
# Summaries (far_key_summaries): a send's far keys in `buckets` groups, a power of two up to 2**GROUP_BITS, so that a group
# holds up to about GROUP_KEYS keys, with SUMMARY_BITS_PER_KEY bits a key (a filter of up to ~1.3 KB, kept in its
# row; about 0.1 % false positives with HASHES probes: a lookup tests one summary per send, and each false positive
# costs a probe of every far day's id-range index). A key's group is the top log2(buckets) bits of h2, and its
# row's slot is buckets + group: every (buckets, group) pair has a slot of its own.
GROUP_BITS = 10
GROUP_KEYS = 512
SUMMARY_BITS_PER_KEY = 20
# A summary's filter is read from a B-tree entry (far_key_summaries_lookup), which holds at most ~2.7 kB: a group of more than
# ~800 keys (a send of more than ~800,000 far keys, or keys chosen to share a group) gets a filter of this size, with
# more false positives, never a miss.
SUMMARY_MAX_BYTES = 2000


def key_hashes(keys: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(h1, h2) per key, uint64 below 2**32: FNV-1a over the UTF-8 bytes, and a mix of it (odd) for the probe
    step. Null keys hash like the empty string; callers leave them out."""
    import numpy as np
    import pyarrow as pa

    keys = keys.cast(pa.string())
    n = len(keys)
    offsets = np.frombuffer(keys.buffers()[1], np.int32)[keys.offset : keys.offset + n + 1].astype(np.int64)
    data = np.frombuffer(keys.buffers()[2], np.uint8) if keys.buffers()[2] is not None else np.zeros(0, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    h1 = np.full(n, _FNV_OFFSET, np.uint64)
    prime, mask = np.uint64(_FNV_PRIME), np.uint64(_MASK32)
    shortest = int(lengths.min(initial=0))
    for j in range(shortest):  # byte by byte: first over every key
        h1 ^= data[starts + j]
        h1 *= prime
        h1 &= mask
    rows = np.arange(n)
    for j in range(shortest, int(lengths.max(initial=0))):  # then over the keys still that long
        rows = rows[lengths[rows] > j]
        h1[rows] = ((h1[rows] ^ data[starts[rows] + j]) * prime) & mask
    h2 = h1 ^ (h1 >> np.uint64(16))  # murmur3's finalizer, so that h2 is not a shifted h1
    h2 = (h2 * np.uint64(0x85EBCA6B)) & np.uint64(_MASK32)
    h2 ^= h2 >> np.uint64(13)
    h2 = (h2 * np.uint64(0xC2B2AE35)) & np.uint64(_MASK32)
    h2 ^= h2 >> np.uint64(16)
    return h1, h2 | np.uint64(1)


def probe(key: str) -> tuple[int, int]:
    """The hashes of one key, as bigint parameters for delaywheel.bloom_may_hold: key_hashes' steps in plain Python
    (a test holds them equal), so a cancel by key imports neither numpy nor pyarrow."""
    h1 = _FNV_OFFSET
    for byte in key.encode():
        h1 = ((h1 ^ byte) * _FNV_PRIME) & _MASK32
    h2 = h1 ^ (h1 >> 16)
    h2 = (h2 * 0x85EBCA6B) & _MASK32
    h2 ^= h2 >> 13
    h2 = (h2 * 0xC2B2AE35) & _MASK32
    h2 ^= h2 >> 16
    return h1, h2 | 1


def slots(h2: int) -> list[int]:
    """The summary slots that may hold a key with this h2: its group under every bucket count."""
    return [(1 << b) + (h2 >> (32 - b) if b else 0) for b in range(GROUP_BITS + 1)]


def _filters(
    h1: np.ndarray,
    h2: np.ndarray,
    group: np.ndarray,
    counts: np.ndarray,
    bits_per_key: int = BITS_PER_KEY,
    max_bytes: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One filter per group with keys (hashes h1, h2; `group` of each key; `counts` of keys per group, 0: none) of
    `bits_per_key` bits a key, at most `max_bytes`: bits (h1 + i * h2) mod m for i < HASHES, numbered as PostgreSQL's
    get_bit numbers them (byte by byte, least significant bit first). Returns the byte offsets of the filters
    (len(counts) + 1) and their packed bytes."""
    import numpy as np

    sizes = np.where(counts > 0, np.maximum(MIN_BYTES, -(-counts * bits_per_key // 8)), 0)
    if max_bytes is not None:
        sizes = np.minimum(sizes, max_bytes)
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    bits = np.zeros(int(offsets[-1]) * 8, bool)
    m = (sizes * 8).astype(np.uint64)[group]
    base = (offsets[:-1] * 8)[group]
    for i in range(HASHES):
        bits[base + ((h1 + np.uint64(i) * h2) % m).astype(np.int64)] = True
    return offsets, np.packbits(bits, bitorder="little")


def _hashed(keys: pa.Array, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(filtered per segment, segment of each hashed key, h1, h2) for the keys of the segments that get a filter
    (MIN_MESSAGES or more), null keys left out."""
    import numpy as np
    import pyarrow as pa

    filtered = counts >= MIN_MESSAGES
    present = keys.is_valid().to_numpy(zero_copy_only=False) & np.repeat(filtered, counts)
    segment = np.repeat(np.arange(len(counts)), counts)[present]
    h1, h2 = key_hashes(keys.filter(pa.array(present))) if present.any() else (np.zeros(0, np.uint64),) * 2
    return filtered, segment, h1, h2


def segment_blooms(keys: pa.Array, counts: np.ndarray) -> pa.Array:
    """One filter per segment (`counts` keys each, in order; bytes, a multiple of 8 bits). A segment of fewer than MIN_MESSAGES gets none
    (NULL): its few keys are read as cheaply, and a single send skips the work."""
    return _segment_blooms(*_hashed(keys, counts))


def far_filters(keys: pa.Array, counts: np.ndarray) -> tuple[pa.Array, list[int], list[bytes]]:
    """A send's far segments: their filters (`segment_blooms`), and the (slot, filter) of each summary row
    (far_key_summaries), of the keys of the segments that have a filter; no rows when none has one (segments without a
    filter are found by their keys). The keys are hashed once for both."""
    import numpy as np

    filtered, segment, h1, h2 = _hashed(keys, counts)
    blooms = _segment_blooms(filtered, segment, h1, h2)
    if not len(h1):
        return blooms, [], []
    bucket_bits = min(GROUP_BITS, int(np.ceil(np.log2(len(h1) / GROUP_KEYS)))) if len(h1) > GROUP_KEYS else 0
    group = (h2 >> np.uint64(32 - bucket_bits)).astype(np.int64) if bucket_bits else np.zeros(len(h1), np.int64)
    found = np.bincount(group, minlength=1 << bucket_bits)
    offsets, packed = _filters(h1, h2, group, found, SUMMARY_BITS_PER_KEY, SUMMARY_MAX_BYTES)
    rows = np.flatnonzero(found)
    return (
        blooms,
        [int((1 << bucket_bits) + g) for g in rows],
        [packed[offsets[g] : offsets[g + 1]].tobytes() for g in rows],
    )


def _segment_blooms(filtered: np.ndarray, segment: np.ndarray, h1: np.ndarray, h2: np.ndarray) -> pa.Array:
    import numpy as np
    import pyarrow as pa

    if not filtered.any():
        return pa.nulls(len(filtered), pa.binary())
    # a filtered segment without a key still gets the smallest filter (all zero): it holds no key
    found = np.where(filtered, np.maximum(np.bincount(segment, minlength=len(filtered)), 1), 0)
    offsets, packed = _filters(h1, h2, segment, found)
    validity = None if filtered.all() else pa.py_buffer(np.packbits(filtered, bitorder="little"))
    return pa.Array.from_buffers(
        pa.binary(), len(filtered), [validity, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(packed)]
    )
