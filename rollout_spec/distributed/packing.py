"""Compact wire form of one replica's finished responses: one flat int32 array per bucket.

A bucket is what one replica published in one step for one destination replica. Flat int arrays
travel through Ray (a publish call's argument, a pull's reply) without pickling per sequence and
are read back zero-copy.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rollout_spec.groups import GROUP_ID_MAX

Bucket = np.ndarray
"""One int32 array: ``[S, groups[S], lengths[S], tokens[sum(lengths)]]``; group -1 means none.

A single buffer because Ray's per-object cost (about a millisecond a put) dominates at these
sizes, and one array serialises on Ray's fastest path."""


def pack(groups: Sequence[int] | np.ndarray, sequences: Sequence[np.ndarray]) -> Bucket:
    """Concatenate ``sequences`` (1-D int arrays) with their group ids into one :data:`Bucket`."""
    if len(groups) != len(sequences):
        raise ValueError(f"groups ({len(groups)}) and sequences ({len(sequences)}) differ in length")
    gids = np.asarray(groups, np.int64).reshape(-1)
    if len(gids) and (gids.min() < -1 or gids.max() > GROUP_ID_MAX):
        raise ValueError(f"groups must be in [-1, {GROUP_ID_MAX}] (-1: no group)")
    num = len(sequences)
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=num)
    out = np.empty(1 + 2 * num + int(lengths.sum()), np.int32)
    out[0] = num
    out[1 : 1 + num] = gids
    out[1 + num : 1 + 2 * num] = lengths
    if num:
        out[1 + 2 * num :] = np.concatenate(sequences)
    return out


def _header(bucket: Bucket) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    if bucket.dtype != np.int32 or bucket.ndim != 1 or len(bucket) < 1:
        raise ValueError("corrupt bucket: expected a 1-D int32 array")
    num = int(bucket[0])
    lengths = bucket[1 + num : 1 + 2 * num]
    tokens = bucket[1 + 2 * num :]
    if num < 0 or len(lengths) != num or int(lengths.sum(dtype=np.int64)) != len(tokens):
        raise ValueError("corrupt bucket: groups, lengths and tokens do not agree")
    return num, bucket[1 : 1 + num], lengths, tokens


def unpack(bucket: Bucket) -> tuple[list[int | None], list[list[int]]]:
    """The inverse of :func:`pack`, as the lists ``Drafter.add_sequences`` takes."""
    num, groups, lengths, tokens = _header(bucket)
    bounds = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    seqs = [tokens[bounds[i] : bounds[i + 1]].tolist() for i in range(num)]
    return [None if g < 0 else int(g) for g in groups.tolist()], seqs


def bucket_tokens(bucket: Bucket) -> int:
    """Tokens held by a bucket."""
    return len(_header(bucket)[3])


def split_by_destination(
    groups: np.ndarray, sequences: Sequence[np.ndarray], destinations: np.ndarray
) -> dict[int, Bucket]:
    """One bucket per destination replica: sequence i goes to every replica in ``destinations[i]``.

    Args:
        groups: int[S] group ids in [0, 2**31) (-1 for none).
        sequences: S 1-D int arrays.
        destinations: int32[S, k] replicas that should hold each sequence.
    """
    if destinations.ndim != 2 or destinations.shape[0] != len(sequences):
        raise ValueError("destinations must be int[S, k] with one row per sequence")
    rows = np.repeat(np.arange(len(sequences)), destinations.shape[1])
    dests = destinations.reshape(-1)
    order = np.argsort(dests, kind="stable")
    rows, dests = rows[order], dests[order]
    cuts = np.flatnonzero(np.diff(dests)) + 1
    out: dict[int, Bucket] = {}
    for part_rows, part_dests in zip(np.split(rows, cuts), np.split(dests, cuts)):
        if len(part_rows):
            out[int(part_dests[0])] = pack(groups[part_rows], [sequences[i] for i in part_rows])
    return out
