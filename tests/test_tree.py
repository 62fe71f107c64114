"""build_tree_inputs against a per-node Python reference, and its input checks.

``ROLLOUT_SPEC_TEST_DEVICE=cuda`` builds on the GPU, from host and from device roots.
"""
import os

import numpy as np
import pytest
import torch

from rollout_spec.tree import DraftBatch, build_tree_inputs, index_arrays

DEVICE = torch.device(os.environ.get("ROLLOUT_SPEC_TEST_DEVICE", "cpu"))


def random_batch(rng: np.random.Generator, num_req: int, max_size: int, vocab: int) -> DraftBatch:
    """Random topologically ordered trees (empty ones included)."""
    trees = []
    for _ in range(num_req):
        size = int(rng.integers(0, max_size + 1))
        trees.append([(int(rng.integers(vocab)), int(rng.integers(-1, i)) if i else -1)
                      for i in range(size)])
    return DraftBatch.from_lists(trees)


def reference_inputs(batch: DraftBatch, roots, root_pos, width):
    """The padded tree inputs, built one node at a time by walking parent pointers."""
    num_req = batch.num_requests
    ids = np.zeros((num_req, width), np.int64)
    pos = np.repeat(np.asarray(root_pos)[:, None], width, 1)
    mask = np.zeros((num_req, width, width), bool)
    mask[:, :, 0] = True
    depth = np.zeros((num_req, width), np.int64)
    flat = []
    for b in range(num_req):
        lo, hi = batch.offsets[b], batch.offsets[b + 1]
        ids[b, 0] = roots[b]
        flat.append(b * width)
        for j in range(hi - lo):
            ids[b, j + 1] = batch.tokens[lo + j]
            col = j + 1
            while col != 0:
                mask[b, j + 1, col] = True
                depth[b, j + 1] += 1
                col = batch.parents[lo + col - 1] + 1
            pos[b, j + 1] += depth[b, j + 1]
            flat.append(b * width + j + 1)
    return ids, pos, mask, depth, np.array(flat)


@pytest.mark.parametrize("roots_on", ["numpy", "host", "device"])
@pytest.mark.parametrize("seed", range(5))
def test_matches_reference(seed, roots_on):
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, num_req=7, max_size=9, vocab=50)
    roots = torch.from_numpy(rng.integers(0, 50, 7))
    root_pos = torch.from_numpy(rng.integers(0, 1000, 7))
    width = 1 + int(batch.sizes().max()) + seed % 2  # extra padding column on odd seeds
    if roots_on == "numpy":  # as the engine's runner holds them
        args = (roots.numpy().astype(np.int32), root_pos.numpy())
    else:
        place = DEVICE if roots_on == "device" else torch.device("cpu")
        args = (roots.to(place), root_pos.to(place))
    ti = build_tree_inputs(batch, *args, DEVICE, width=width)
    ti = type(ti)(**{f: getattr(ti, f).cpu() for f in ti.__dataclass_fields__ if f != "source"},
                  source=ti.source)
    assert ti.source is batch
    ids, pos, mask, depth, flat = reference_inputs(batch, roots.numpy(), root_pos.numpy(), width)
    valid = np.arange(width)[None, :] <= batch.sizes()[:, None]
    assert ti.width == width
    np.testing.assert_array_equal(ti.input_ids.numpy(), ids)
    np.testing.assert_array_equal(ti.positions.numpy(), pos)
    np.testing.assert_array_equal(ti.tree_mask.numpy(), mask)
    np.testing.assert_array_equal(ti.depth.numpy(), depth)
    np.testing.assert_array_equal(ti.valid.numpy(), valid)
    np.testing.assert_array_equal(ti.flat_index.numpy(), flat)
    # row_index inverts flat_index on valid cells; parent_col matches the batch.
    rows = ti.row_index.view(-1)[ti.flat_index]
    np.testing.assert_array_equal(rows.numpy(), np.arange(len(flat)))
    node_cols = ti.parent_col.view(-1)[ti.flat_index]
    expect = np.concatenate([[-1] + list(batch.parents[lo:hi] + 1)
                             for lo, hi in zip(batch.offsets[:-1], batch.offsets[1:])])
    np.testing.assert_array_equal(node_cols.numpy(), expect)
    host = index_arrays(batch, width)  # what verify uploads when it has no TreeInputs
    np.testing.assert_array_equal(host[0][:, 1:], ids[:, 1:])
    np.testing.assert_array_equal(host[1], ti.parent_col.numpy())
    np.testing.assert_array_equal(host[2], ti.row_index.numpy())


def test_deep_chain_needs_every_jump():
    chain = [(i, i - 1) for i in range(40)]
    ti = build_tree_inputs(DraftBatch.from_lists([chain]), torch.tensor([7]), torch.tensor([3]))
    assert ti.tree_mask[0].numpy().tolist() == np.tril(np.ones((41, 41), bool)).tolist()
    assert ti.positions[0].tolist() == list(range(3, 44))


def test_empty_batch_is_roots_only():
    ti = build_tree_inputs(DraftBatch.empty(3), torch.tensor([4, 5, 6]), torch.tensor([0, 1, 2]))
    assert ti.input_ids.tolist() == [[4], [5], [6]]
    assert ti.tree_mask.all() and ti.flat_index.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(root_tokens=torch.zeros(3, dtype=torch.int64)), "root_tokens"),
        (dict(root_positions=torch.zeros(2, 1, dtype=torch.int64)), "root_positions"),
        (dict(width=2), "width"),
        (dict(root_tokens=np.zeros(3, np.int64)), "root_tokens"),
        (dict(root_positions=np.zeros(2, np.float64)), "root_positions"),
        (dict(root_tokens=torch.zeros(2)), "root_tokens"),
        (dict(root_positions=[0, 0]), "root_positions"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, message):
    batch = DraftBatch.from_lists([[(1, -1), (2, 0)], []])
    args = dict(batch=batch, root_tokens=torch.zeros(2, dtype=torch.int64),
                root_positions=torch.zeros(2, dtype=torch.int64))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        build_tree_inputs(**args)


def test_malformed_batch_is_rejected():
    bad = DraftBatch(offsets=np.array([0, 2], np.int32), tokens=np.array([1, 2], np.int32),
                     parents=np.array([-1, 1], np.int32), probs=np.ones(2, np.float32))
    for _ in range(2):  # a failed check is not remembered as valid
        with pytest.raises(ValueError, match="parents"):
            build_tree_inputs(bad, torch.zeros(1, dtype=torch.int64),
                              torch.zeros(1, dtype=torch.int64))


def test_byte_packing_round_trips():
    from rollout_spec.tree import pack_bytes, unpack_bytes

    arrays = [np.arange(5, dtype=np.int64), np.array([1.5, -2.0, 3.25], np.float32),
              np.eye(3, dtype=bool), np.zeros(0, np.int64), np.array([7, 8, 9], np.int32)]
    buf, spans = pack_bytes(arrays)
    assert all(start % 16 == 0 for start, _ in spans)  # Triton specialises on 16-byte alignment
    for a, t in zip(arrays, unpack_bytes(torch.from_numpy(buf), arrays, spans)):
        np.testing.assert_array_equal(t.numpy(), a)
        assert t.shape == a.shape


def test_byte_packing_keeps_views_aligned():
    """Odd sizes, runs of one dtype, empties between: every view starts 16-byte aligned."""
    from rollout_spec.tree import pack_bytes, unpack_bytes

    arrays = [np.arange(3, dtype=np.int64).reshape(3, 1), np.zeros(0, np.int64),
              np.arange(5, dtype=np.int64) - 9, np.ones((2, 3), bool), np.eye(3, dtype=bool),
              np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.array([2.5], np.float32)]
    buf, spans = pack_bytes(arrays)
    base = torch.from_numpy(buf)
    for a, t in zip(arrays, unpack_bytes(base, arrays, spans)):
        np.testing.assert_array_equal(t.numpy(), a)
        assert t.shape == a.shape and t.dtype == torch.from_numpy(a).dtype
        if t.numel():
            assert (t.data_ptr() - base.data_ptr()) % 16 == 0
