"""Compact wire form of one replica's finished responses: three flat numpy arrays per bucket.

A bucket is what one replica published in one step for one destination replica. Flat int arrays
travel through Ray's object store without pickling per sequence and are read back zero-copy.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import numpy as np


class Bucket(TypedDict):
    """Sequences with their group ids, concatenated.

    ``groups`` int64[S] (-1: no group), ``lengths`` int32[S], ``tokens`` int32[sum(lengths)].
    """

    groups: np.ndarray
    lengths: np.ndarray
    tokens: np.ndarray


def pack(groups: Sequence[int] | np.ndarray, sequences: Sequence[np.ndarray]) -> Bucket:
    """Concatenate ``sequences`` (1-D int arrays) with their group ids into one :class:`Bucket`."""
    if len(groups) != len(sequences):
        raise ValueError(f"groups ({len(groups)}) and sequences ({len(sequences)}) differ in length")
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int32, count=len(sequences))
    tokens = np.concatenate(sequences).astype(np.int32, copy=False) if len(sequences) else np.zeros(0, np.int32)
    return Bucket(groups=np.asarray(groups, np.int64).reshape(-1), lengths=lengths, tokens=tokens)


def unpack(bucket: Bucket) -> tuple[list[int | None], list[list[int]]]:
    """The inverse of :func:`pack`, as the lists ``Drafter.add_sequences`` takes."""
    groups = bucket["groups"]
    lengths = bucket["lengths"]
    tokens = bucket["tokens"]
    if len(groups) != len(lengths) or int(lengths.sum()) != len(tokens):
        raise ValueError("corrupt bucket: groups, lengths and tokens do not agree")
    bounds = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    seqs = [tokens[bounds[i] : bounds[i + 1]].tolist() for i in range(len(lengths))]
    return [None if g < 0 else int(g) for g in groups.tolist()], seqs


def bucket_tokens(bucket: Bucket) -> int:
    """Tokens held by a bucket."""
    return len(bucket["tokens"])


def bucket_nbytes(bucket: Bucket) -> int:
    """Payload bytes of a bucket (what the object store holds, less Ray's small header)."""
    return sum(int(a.nbytes) for a in bucket.values())


def split_by_destination(
    groups: np.ndarray, sequences: Sequence[np.ndarray], destinations: np.ndarray
) -> dict[int, Bucket]:
    """One bucket per destination replica: sequence i goes to every replica in ``destinations[i]``.

    Args:
        groups: int64[S] group ids (-1 for none).
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
