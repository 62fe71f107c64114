"""Compact wire form of one replica's finished responses: one flat int32 array per bucket.

A bucket is what one replica published in one step for one destination replica. Flat int arrays
travel through Ray (a publish call's argument, a pull's reply) without pickling per sequence and
are read back zero-copy.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rollout_spec.groups import GROUP_ID_MAX
from rollout_spec.token_ids import BYTES_LIKE, int_array, token_array

MAX_REPLICA = (1 << 16) - 1
"""Largest replica index (the router takes at most 65536 replicas)."""

Bucket = np.ndarray
"""One int32 array: ``[S, groups[S], lengths[S], tokens[sum(lengths)]]``; group -1 means none.

A single buffer because Ray's per-object cost (about a millisecond a put) dominates at these
sizes, and one array serialises on Ray's fastest path."""


def pack(groups: Sequence[int] | np.ndarray, sequences: Sequence[np.ndarray]) -> Bucket:
    """Concatenate ``sequences`` (1-D int arrays of token ids) with their group ids (-1: none)
    into one :data:`Bucket`; raises naming the bad argument before building anything."""
    gids = int_array("groups", groups, -1, GROUP_ID_MAX)
    _check_sequences(sequences)
    if len(gids) != len(sequences):
        raise ValueError(f"groups ({len(gids)}) and sequences ({len(sequences)}) differ in length")
    num = len(sequences)
    # each sequence checked on its own: joined first, numpy would turn a bool beside ints into 1
    parts = [token_array(f"sequences[{i}]", s) for i, s in enumerate(sequences)]
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=num)
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    out = np.empty(1 + 2 * num + len(tokens), np.int32)
    out[0] = num
    out[1 : 1 + num] = gids
    out[1 + num : 1 + 2 * num] = lengths
    out[1 + 2 * num :] = tokens
    return out


def _check_sequences(sequences: object) -> None:
    """Refuse a ``sequences`` that is not a sized sequence of sequences (a generator, a dict, a
    str), whose ``len`` would fail unnamed or whose items would not be its responses."""
    if not isinstance(sequences, (Sequence, np.ndarray)) or isinstance(sequences, (str, *BYTES_LIKE)):
        raise TypeError(f"sequences must be a sequence of 1-D token id arrays, got {type(sequences).__name__}")


def _header(bucket: Bucket) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    if not isinstance(bucket, np.ndarray) or bucket.dtype != np.int32 or bucket.ndim != 1 or len(bucket) < 1:
        raise ValueError("corrupt bucket: expected a 1-D int32 array")
    num = int(bucket[0])
    lengths = bucket[1 + num : 1 + 2 * num]
    tokens = bucket[1 + 2 * num :]
    groups = bucket[1 : 1 + num]
    if num < 0 or len(lengths) != num or int(lengths.sum(dtype=np.int64)) != len(tokens):
        raise ValueError("corrupt bucket: groups, lengths and tokens do not agree")
    if (num and (int(groups.min()) < -1 or int(lengths.min()) < 0)) or (len(tokens) and int(tokens.min()) < 0):
        raise ValueError(f"corrupt bucket: groups must be in [-1, {GROUP_ID_MAX}], lengths and tokens non-negative")
    return num, groups, lengths, tokens


def unpack(bucket: Bucket) -> tuple[list[int | None], list[list[int]]]:
    """The inverse of :func:`pack`, as the lists ``Drafter.add_sequences`` takes.

    Raises:
        ValueError: "corrupt bucket" when the header and the tokens do not agree.
    """
    num, groups, lengths, tokens = _header(bucket)
    bounds = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    seqs = [tokens[bounds[i] : bounds[i + 1]].tolist() for i in range(num)]
    return [None if g < 0 else int(g) for g in groups.tolist()], seqs


def bucket_tokens(bucket: Bucket) -> int:
    """Tokens held by a bucket (checking it as :func:`unpack` does)."""
    return len(_header(bucket)[3])


def split_by_destination(
    groups: np.ndarray, sequences: Sequence[np.ndarray], destinations: np.ndarray
) -> dict[int, Bucket]:
    """One bucket per destination replica: sequence i goes to every replica in ``destinations[i]``.

    Args:
        groups: int[S] group ids in [0, 2**31) (-1 for none).
        sequences: S 1-D int arrays of token ids.
        destinations: int[S, k] replicas in [0, MAX_REPLICA] that should hold each sequence.
    """
    groups = int_array("groups", groups, -1, GROUP_ID_MAX)
    destinations = int_array("destinations", destinations, 0, MAX_REPLICA, ndim=2)
    _check_sequences(sequences)
    if len(groups) != len(sequences) or destinations.shape[0] != len(sequences):
        raise ValueError(f"groups ({len(groups)}) and destinations (shape {destinations.shape}) must have "
                         f"one entry (row) per sequence ({len(sequences)})")
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
