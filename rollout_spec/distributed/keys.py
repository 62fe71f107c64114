"""Stable 31-bit group keys and the hash that ranks replicas for a group.

Python's ``hash`` of a str is salted per process, so two Ray workers would disagree on where a
group lives; everything here is a pure function of the bytes, identical in every process.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from numbers import Integral

import numpy as np

from rollout_spec.config import check_int
from rollout_spec.token_ids import BYTES_LIKE, token_array
from rollout_spec.groups import GROUP_ID_MAX, hashed_group_id, prompt_group_id, text_group_id


def group_key(group: object) -> int:
    """Map a group identity to an int in ``[0, 2**31)`` (the drafter's group ids), the same in every process.

    Ints in that range are returned unchanged, so a framework's integer group ids keep their
    meaning for the drafter; str and bytes are hashed; a 1-D sequence or array of token ids in
    ``[0, 2**31)`` (the prompt, which identifies it across RL steps) gets
    :func:`rollout_spec.groups.prompt_group_id`, the id the engine and every adapter use.

    Raises:
        TypeError: for None, bool, any other type, or tokens that are not 1-D integers.
        ValueError: for a negative int or one of 2**31 or more, or a token id out of range.
    """
    if isinstance(group, bool) or group is None:
        raise TypeError(f"group id must be an int, str, bytes or token sequence, got {group!r}")
    if isinstance(group, Integral):
        value = int(group)
        if not 0 <= value <= GROUP_ID_MAX:
            raise ValueError(f"group id must be in [0, {GROUP_ID_MAX}], got {value}")
        return value
    if isinstance(group, str):
        return text_group_id(group)
    if isinstance(group, BYTES_LIKE):
        return hashed_group_id(bytes(group))
    if isinstance(group, (Sequence, np.ndarray)):
        return prompt_group_id(token_array("group id token sequence", group))
    raise TypeError(f"group id must be an int, str, bytes or token sequence, got {type(group).__name__}")


def group_keys(groups: Iterable[object]) -> np.ndarray:
    """Vector form of :func:`group_key`: int64[G].

    Raises:
        TypeError: for a str or bytes (one group, not a batch: iterated, it would be its
            characters or byte values), anything not iterable (one int group, None), and as
            :func:`group_key` for each group.
    """
    if isinstance(groups, (str, *BYTES_LIKE)) or not isinstance(groups, Iterable):
        raise TypeError(f"groups must be an iterable of group ids, got {type(groups).__name__} {groups!r} "
                        "(one group: pass [group])")
    return np.fromiter((group_key(g) for g in groups), dtype=np.int64)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 values: a cheap bijection whose output bits look random.

    ``x`` holds integers (a signed one is taken as its two's-complement bits); anything else is a
    TypeError, not truncated to an integer.
    """
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"mix64 takes integers, got dtype {arr.dtype}")
    z = arr.astype(np.uint64)  # a copy: shifted in place below
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def rendezvous_scores(keys: np.ndarray, num_replicas: int, seed: int = 0) -> np.ndarray:
    """Highest-random-weight scores, uint64[G, N]: a group prefers replicas in descending score.

    Adding or removing one replica changes the first choice of only the groups that move to or
    from it (about 1/N of them), which is what keeps a group's history where it was. The seed is
    mixed before it salts (mix64(0) is 0, so seed 0 keeps its ranking): added to the replica
    index, seeds that differ by less than N would only shift the replicas' salts by a few indices.

    Raises:
        TypeError, ValueError: ``keys`` is not a 1-D integer array (or sequence), ``num_replicas``
            not an int in [1, 65536], or ``seed`` not one in [0, 2**63 - 1].
    """
    keys = np.asarray(keys)
    if keys.ndim != 1 or (keys.dtype.kind not in "iu" and keys.size):
        raise TypeError(f"keys must be a 1-D array of integers, got dtype {keys.dtype}, shape {keys.shape}")
    num_replicas = check_int("num_replicas", num_replicas, 1, 1 << 16)
    seed = check_int("seed", seed, 0, 2**63 - 1)
    salts = mix64(np.arange(num_replicas, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    salts ^= mix64(np.uint64(seed))
    hashed = mix64(np.asarray(keys, dtype=np.int64).astype(np.uint64))
    return mix64(hashed[:, None] ^ salts[None, :])
