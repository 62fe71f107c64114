"""Validation of integer arrays from callers, token ids above all: numpy only, so that the router
and the shared index use it without loading the native drafter core.

Vectorised (a dtype check, one min and one max), because token lists are checked on hot paths;
nothing is coerced: floats, strings, all-bool lists, ints beyond int64 (numpy makes them floats)
and ragged nesting are a TypeError, a value out of range a ValueError, both naming the argument.
One case is not caught: numpy turns a list that mixes bools with ints into ints (a per-element
check would cost the hot paths a Python loop).
"""
from __future__ import annotations

import numpy as np

MAX_TOKEN_ID = 2**31 - 1
"""Largest token id the drafter stores (int32)."""


def int_array(name: str, values: object, lo: int, hi: int, ndim: int = 1,
              kind: str = "integers") -> np.ndarray:
    """``values`` as an ``ndim``-D integer numpy array with every element in ``[lo, hi]``.

    A dtype check, one min and one max (see the module's note on what is refused); errors name
    ``name`` and say what it must hold (``kind``). An empty input of any dtype gives an empty
    int64 array.
    """
    try:
        arr = values if isinstance(values, np.ndarray) else np.asarray(values)
    except ValueError:  # ragged nesting
        arr = None
    if arr is not None and arr.ndim == ndim and arr.size == 0:
        return np.zeros(arr.shape, np.int64)
    if arr is None or arr.ndim != ndim or arr.dtype.kind not in "iu":
        got = "a ragged nesting" if arr is None else f"dtype {arr.dtype}, shape {arr.shape}"
        raise TypeError(f"{name} must be a {ndim}-D array of integers in [{lo}, {hi}], "
                        f"got {type(values).__name__} of {got}")
    low, high = int(arr.min()), int(arr.max())
    if low < lo or high > hi:
        raise ValueError(f"{name} must hold {kind} in [{lo}, {hi}], got values from {low} to {high}")
    return arr


def token_array(name: str, values: object) -> np.ndarray:
    """``values`` as a 1-D int32 array of token ids in ``[0, MAX_TOKEN_ID]`` (see :func:`int_array`)."""
    return int_array(name, values, 0, MAX_TOKEN_ID, kind="token ids").astype(np.int32, copy=False)
