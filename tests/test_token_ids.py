"""token_ids' validation: integer arrays in range, nothing coerced, a bool among ints included."""
from __future__ import annotations

import numpy as np
import pytest

from rollout_spec.token_ids import int_array, token_array


@pytest.mark.parametrize("values", [
    [5, True], [False, 7], (5, 1, True), [5, np.True_], [np.int64(5), 0, np.False_],
], ids=["bool-last", "bool-first", "tuple", "numpy-bool", "numpy-ints"])
def test_a_bool_among_token_ids_is_refused(values):
    with pytest.raises(TypeError, match=r"^prompt_ids must be .*bool"):
        token_array("prompt_ids", values)


@pytest.mark.parametrize("values", [[[5, 1], [0, True]], [np.array([5, 1]), [False, 2]]],
                         ids=["lists", "array-and-list"])
def test_a_bool_in_a_nested_list_is_refused(values):
    with pytest.raises(TypeError, match=r"^destinations must be a 2-D .*bool"):
        int_array("destinations", values, 0, 9, ndim=2)


def test_a_bool_is_a_type_error_even_out_of_range():
    """False is 0, below the range: still the TypeError of a bool, not a ValueError."""
    with pytest.raises(TypeError, match=r"^lengths must be .*bool"):
        int_array("lengths", [5, False], 1, 9)


def test_zeros_and_ones_that_are_ints_pass():
    assert token_array("t", [1, 0, 2**31 - 1, 1]).tolist() == [1, 0, 2**31 - 1, 1]
    assert int_array("d", [[0, 1], [np.int64(1), 2]], 0, 9, ndim=2).tolist() == [[0, 1], [1, 2]]
    assert int_array("g", [-1, 1, 0], -1, 9).tolist() == [-1, 1, 0]


@pytest.mark.parametrize("values", [bytearray(b"\x05\x01"), memoryview(b"\x05\x01")],
                         ids=["bytearray", "memoryview"])
def test_bytes_like_objects_are_not_token_ids(values):
    """numpy reads their buffer as uint8, which would pass as ids 5 and 1."""
    with pytest.raises(TypeError, match=r"^prompt_ids must be a 1-D array of integers .*bytes"):
        token_array("prompt_ids", values)


def test_a_bool_in_any_sequence_is_refused():
    from collections import deque

    with pytest.raises(TypeError, match=r"^prompt_ids must be .*deque holding a bool"):
        token_array("prompt_ids", deque([5, True]))
    assert token_array("prompt_ids", deque([5, 1])).tolist() == [5, 1]
    assert token_array("prompt_ids", range(3)).tolist() == [0, 1, 2]
