"""Validation of integer arrays from callers, token ids above all: numpy only, so that the router
and the shared index use it without loading the native drafter core.

Vectorised (a dtype check, one min and one max), because token lists are checked on hot paths;
nothing is coerced: floats, strings, bytes-like objects (numpy would read a bytearray or a
memoryview as uint8), bools, ints beyond int64 and ragged nesting are a TypeError, a value out of
range a ValueError, both naming the argument. numpy reads a sequence that mixes bools with ints as
ints, a bool as 0 or 1, so a sequence's elements are typed where its array holds a 0 or a 1 (and
only there: the check costs nothing unless those occur).
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

MAX_TOKEN_ID = 2**31 - 1
"""Largest token id the drafter stores (int32)."""

BYTES_LIKE = (bytes, bytearray, memoryview)
"""Objects whose items numpy and iteration read as small ints (``b"\\x01"`` as 1): never ids."""

_BOOL_TYPES = frozenset((bool, np.bool_))


def int_array(name: str, values: object, lo: int, hi: int, ndim: int = 1,
              kind: str = "integers") -> np.ndarray:
    """``values`` as an ``ndim``-D integer numpy array with every element in ``[lo, hi]``.

    A dtype check, one min and one max, and for a sequence holding a 0 or a 1 a look at
    those elements (see the module's note on what is refused); errors name ``name`` and say what
    it must hold (``kind``). An empty input of any dtype gives an empty int64 array.
    """
    if isinstance(values, BYTES_LIKE):
        raise _not_integers(name, values, ndim, lo, hi, "(bytes are not integers)")
    try:
        arr = values if isinstance(values, np.ndarray) else np.asarray(values)
    except ValueError:  # ragged nesting
        arr = None
    if arr is not None and arr.ndim == ndim and arr.size == 0:
        return np.zeros(arr.shape, np.int64)
    if arr is None or arr.ndim != ndim or arr.dtype.kind not in "iu":
        got = "a ragged nesting" if arr is None else f"dtype {arr.dtype}, shape {arr.shape}"
        raise _not_integers(name, values, ndim, lo, hi, f"of {got}")
    low, high = int(arr.min()), int(arr.max())
    if low <= 1 and high >= 0 and isinstance(values, Sequence) and _holds_bool(values, arr):
        raise _not_integers(name, values, ndim, lo, hi, "holding a bool")
    if low < lo or high > hi:
        raise ValueError(f"{name} must hold {kind} in [{lo}, {hi}], got values from {low} to {high}")
    return arr


def _not_integers(name: str, values: object, ndim: int, lo: int, hi: int, got: str) -> TypeError:
    """The TypeError of a ``values`` that is not an ``ndim``-D array of integers (``got`` says why)."""
    return TypeError(f"{name} must be a {ndim}-D array of integers in [{lo}, {hi}], "
                     f"got {type(values).__name__} {got}")


def _holds_bool(values: Sequence, arr: np.ndarray) -> bool:
    """Whether ``values`` holds a bool (Python's or numpy's) where ``arr``, numpy's reading of it,
    holds a 0 or a 1: only those elements can be bools that numpy read as ints, and they are
    fetched and typed without a Python loop."""
    leaves = values
    for _ in range(arr.ndim - 1):  # nested lists: their elements in arr's (C) order
        leaves = list(chain.from_iterable(leaves))
    candidates = ((arr == 0) | (arr == 1)).ravel().nonzero()[0].tolist()
    return not _BOOL_TYPES.isdisjoint(map(type, map(leaves.__getitem__, candidates)))


def token_array(name: str, values: object) -> np.ndarray:
    """``values`` as a 1-D int32 array of token ids in ``[0, MAX_TOKEN_ID]`` (see :func:`int_array`)."""
    return int_array(name, values, 0, MAX_TOKEN_ID, kind="token ids").astype(np.int32, copy=False)
