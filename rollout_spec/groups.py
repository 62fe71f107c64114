"""Stable group ids: one prompt maps to one id in every process, adapter and RL step.

The drafter stores group ids as int32, so ids live in ``[0, GROUP_ID_MAX]``; Python's ``hash`` is
salted per process, so ids are derived from bytes with blake2b instead. A collision only merges
two groups' statistics.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from rollout_spec.token_ids import token_array

GROUP_ID_MAX = (1 << 31) - 1


def hashed_group_id(data: bytes) -> int:
    """The group id of an identity given as bytes (a uid string's UTF-8, a prompt's token bytes)."""
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") & GROUP_ID_MAX


def text_group_id(text: str) -> int:
    """The group id of an identity given as a string (a framework's uid): its UTF-8 hashed, a
    lone surrogate (text decoded with ``surrogateescape``) kept as is rather than refused.
    Anything but a str raises TypeError."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return hashed_group_id(text.encode("utf-8", "surrogatepass"))


def prompt_group_id(prompt_ids: np.ndarray | Sequence[int]) -> int:
    """The group id of a prompt's token ids (hashed as int32), shared by its n samples and by the
    same prompt in later RL steps, whichever engine, adapter or replica computes it.

    ``prompt_ids`` must be a 1-D sequence or array of integer token ids in [0, 2**31 - 1]:
    TypeError for floats, bools, strings or other shapes, ValueError out of range (never
    truncated or wrapped into another prompt's id).
    """
    return hashed_group_id(np.ascontiguousarray(token_array("prompt_ids", prompt_ids)).tobytes())
