"""DraftBatch's CSR contract: construction helpers and validation errors."""
import numpy as np
import pytest

from rollout_spec.tree import DraftBatch


def test_from_lists_builds_csr():
    b = DraftBatch.from_lists([[(5, -1), (6, 0), (7, 0)], [], [(9, -1)]])
    assert b.offsets.tolist() == [0, 3, 3, 4]
    assert b.parents.tolist() == [-1, 0, 0, -1]
    assert b.sizes().tolist() == [3, 0, 1]
    assert b.num_requests == 3 and b.num_nodes == 4


def test_empty_batch():
    b = DraftBatch.empty(4)
    b.validate()
    assert b.num_requests == 4 and b.num_nodes == 0


@pytest.mark.parametrize(
    "tree, message",
    [
        ([[(1, 0)]], "topological"),
        ([[(1, -1), (2, 2)]], "topological"),
        ([[(1, -2)]], "parents"),
        ([[(-3, -1)]], "tokens"),
    ],
)
def test_malformed_trees_are_rejected(tree, message):
    with pytest.raises(ValueError, match=message):
        DraftBatch.from_lists(tree)


def test_mismatched_lengths_are_rejected():
    b = DraftBatch(
        offsets=np.array([0, 2], np.int32),
        tokens=np.array([1], np.int32),
        parents=np.array([-1, 0], np.int32),
        probs=np.ones(2, np.float32),
    )
    with pytest.raises(ValueError, match="tokens"):
        b.validate()


@pytest.mark.parametrize("field, value, message", [
    ("offsets", np.array([0, 1], np.int64), "DraftBatch.offsets must be a 1-D int32"),
    ("parents", np.array([[-1]], np.int32), "DraftBatch.parents must be a 1-D int32"),
    ("tokens", [5], "DraftBatch.tokens must be a 1-D int32"),
    ("tokens", np.array([-5], np.int32), "DraftBatch.tokens must be non-negative"),
])
def test_a_batch_built_directly_is_checked_field_by_field(field, value, message):
    """The constructor takes arrays as given (from_lists converts); validate names the field
    that breaks the contract and does not remember the batch as valid."""
    arrays = dict(offsets=np.array([0, 1], np.int32), tokens=np.array([5], np.int32),
                  parents=np.array([-1], np.int32), probs=np.ones(1, np.float32))
    bad = DraftBatch(**{**arrays, field: value})
    for _ in range(2):
        with pytest.raises(ValueError, match=message):
            bad.validate()
