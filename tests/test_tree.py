"""build_tree_inputs against a per-node Python reference, host_tree_inputs (the C++ build)
against the numpy build it replaced, and their input checks.

``ROLLOUT_SPEC_TEST_DEVICE=cuda`` builds on the GPU, from host and from device roots.
"""
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_spec.tree import DraftBatch, build_tree_inputs, drafter_output, host_tree_inputs, index_arrays

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


def numpy_tree_inputs(batch: DraftBatch, roots: np.ndarray, root_pos: np.ndarray,
                      width: int) -> dict[str, np.ndarray]:
    """The numpy build that host_tree_inputs replaced (slow reference): the same fields, dtypes
    and key order, for a validated batch and int64 roots."""
    valid = np.arange(width) <= batch.sizes()[:, None]
    nodes = valid.copy()
    nodes[:, 0] = False
    cell = np.flatnonzero(nodes)  # node cells in slice order
    tokens = np.zeros(valid.shape, np.int64)
    tokens.reshape(-1)[cell] = batch.tokens
    tokens[:, 0] = roots
    parent_col = np.full(valid.shape, -1, np.int64)
    parent_col.reshape(-1)[cell] = batch.parents + 1
    rows = np.cumsum(valid, axis=None).reshape(valid.shape) - 1  # verify row of valid cells
    row_index = np.where(valid, rows, rows[:, :1])  # padding: its root's row
    # A node's mask row is its parent's row plus itself: one vectorised step per column.
    reach = np.zeros((len(valid), width, width), bool)
    reach[:, :, 0] = True
    parent, every = np.maximum(parent_col, 0), np.arange(len(valid))
    for j in range(1, width):
        reach[:, j] = reach[every, parent[:, j]]
        reach[:, j, j] = valid[:, j]
    depth = reach.sum(axis=2) - 1
    return dict(input_ids=tokens, depth=depth, parent_col=parent_col, row_index=row_index,
                flat_index=np.flatnonzero(valid), valid=valid, tree_mask=reach,
                positions=depth + root_pos[:, None])


def assert_same_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Same keys in the same order, and per key the same dtype, shape and values."""
    assert list(got) == list(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        np.testing.assert_array_equal(got[name], a, err_msg=name)


@st.composite
def batches_and_widths(draw) -> tuple[DraftBatch, np.ndarray, np.ndarray, int]:
    """A random valid batch (B <= 40, trees of 0-63 nodes), int64 roots and a width in
    [1 + largest tree, 64]. Node i's parent is i - 1 - k for a drawn k in [0, i]: chains where
    hypothesis shrinks (k = 0), -1 at k = i."""
    num_req = draw(st.integers(0, 40))
    node = st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 63))
    trees = [[(tok, i - 1 - k % (i + 1)) for i, (tok, k) in enumerate(raw)]
             for raw in draw(st.lists(st.lists(node, max_size=63), min_size=num_req,
                                      max_size=num_req))]
    batch = DraftBatch.from_lists(trees)
    need = 1 + int(batch.sizes().max(initial=0))
    width = draw(st.integers(need, max(need, 64)))
    ints = st.lists(st.integers(0, 2**62), min_size=num_req, max_size=num_req)
    return batch, np.array(draw(ints), np.int64), np.array(draw(ints), np.int64), width


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=batches_and_widths())
def test_host_tree_inputs_match_numpy_build(case):
    batch, roots, root_pos, width = case
    assert_same_arrays(host_tree_inputs(batch, roots, root_pos, width),
                       numpy_tree_inputs(batch, roots, root_pos, width))


@pytest.mark.parametrize("num_req, max_size, extra", [(40, 63, 0), (40, 20, 7), (1, 0, 0),
                                                      (8, 32, 0), (256, 8, 0), (3, 63, 1)])
def test_large_batches_match_numpy_build(num_req, max_size, extra):
    rng = np.random.default_rng(num_req * 100 + max_size)
    batch = random_batch(rng, num_req, max_size, vocab=1 << 20)
    width = 1 + int(batch.sizes().max(initial=0)) + extra
    roots, root_pos = rng.integers(0, 1 << 20, (2, num_req))
    assert_same_arrays(host_tree_inputs(batch, roots, root_pos, width),
                       numpy_tree_inputs(batch, roots, root_pos, width))


def test_other_dtypes_and_strided_arrays_are_converted():
    rng = np.random.default_rng(3)
    batch = random_batch(rng, 6, 9, vocab=100)
    strided = DraftBatch(*(np.repeat(a, 2)[::2] for a in (batch.offsets, batch.tokens,
                                                          batch.parents, batch.probs)))
    strided.validate()
    assert not strided.offsets.flags.c_contiguous
    roots, root_pos = rng.integers(0, 100, (2, 6)).astype(np.int32)
    want = numpy_tree_inputs(batch, roots, root_pos, 11)
    assert_same_arrays(host_tree_inputs(strided, roots, root_pos, 11), want)
    assert_same_arrays(host_tree_inputs(batch, roots[::1].astype(np.uint16), root_pos, 11), want)


@settings(max_examples=300, deadline=None)
@given(offsets=st.lists(st.integers(-3, 8), min_size=0, max_size=5),
       parents=st.lists(st.integers(-3, 6), max_size=8), num_tokens=st.integers(0, 8),
       width=st.integers(-2, 10))
def test_host_tree_inputs_refuses_bad_batches(offsets, parents, num_tokens, width):
    """Arbitrary (unvalidated) CSR arrays: a ValueError exactly when the batch is invalid or the
    width too small, the numpy build's arrays otherwise; never a crash."""
    batch = DraftBatch(offsets=np.array(offsets, np.int32), tokens=np.arange(num_tokens, dtype=np.int32),
                       parents=np.array(parents, np.int32), probs=np.ones(num_tokens, np.float32))
    num_req = max(len(offsets) - 1, 0)
    roots = np.arange(num_req, dtype=np.int64)
    try:
        batch.validate()
        need = 1 + int(batch.sizes().max(initial=0))
    except ValueError:
        need = None
    if need is None or width < need:
        with pytest.raises(ValueError, match="DraftBatch|width"):
            host_tree_inputs(batch, roots, roots, width)
    else:
        assert_same_arrays(host_tree_inputs(batch, roots, roots, width),
                           numpy_tree_inputs(batch, roots, roots, width))


@pytest.mark.parametrize(
    "offsets, parents, width, roots, message",
    [
        ([0, 2], [-1, 0], 2, 1, "width must be >= 1 \\+ largest tree = 3, got 2"),
        ([0, 2], [-1, 0], 0, 1, "width"),
        ([0, 2], [-1, 0], -5, 1, "width"),
        ([0, 2], [-1, 0], 1 << 40, 1, "width"),
        ([0, 3], [-1, 0], 4, 1, "DraftBatch.tokens has 2 entries, offsets say 3"),
        ([0, 2, 1], [-1, 0], 4, 2, "DraftBatch.offsets must be non-decreasing"),
        ([1, 2], [-1, 0], 4, 1, "DraftBatch.offsets must start with 0"),
        ([], [-1, 0], 4, 0, "DraftBatch.offsets"),
        ([0, 2], [-1, 1], 4, 1, "DraftBatch.parents"),
        ([0, 2], [-1], 4, 1, "DraftBatch.parents"),
        ([0, 2], [-1, 0], 4, 2, "root_tokens"),
    ],
)
def test_host_tree_inputs_errors_name_the_field(offsets, parents, width, roots, message):
    batch = DraftBatch(offsets=np.array(offsets, np.int32), tokens=np.array([5, 6], np.int32),
                       parents=np.array(parents, np.int32), probs=np.ones(2, np.float32))
    with pytest.raises(ValueError, match=message):
        host_tree_inputs(batch, np.zeros(roots, np.int64), np.zeros(roots, np.int64), width)


@pytest.mark.parametrize("roots_on", ["numpy", "host", "device"])
@pytest.mark.parametrize("seed", range(5))
def test_matches_reference(seed, roots_on):
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, num_req=7, max_size=9, vocab=50)
    roots = torch.from_numpy(rng.integers(0, 50, 7))
    root_pos = torch.from_numpy(rng.integers(0, 1000, 7))
    width = 1 + int(batch.sizes().max()) + seed % 2  # extra padding column on odd seeds
    width = np.int64(width) if seed % 3 == 0 else width  # numpy integers are ints too
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
        (dict(width=2.0), "width"),
        (dict(width=np.True_), "width"),
        (dict(root_tokens=np.zeros(3, np.int64)), "root_tokens"),
        (dict(root_positions=np.zeros(2, np.float64)), "root_positions"),
        (dict(root_tokens=torch.zeros(2)), "root_tokens"),
        (dict(root_positions=[0, 0]), "root_positions"),
        (dict(root_tokens=np.array([-1, 0])), r"root_tokens must be in \[0, 2147483647\], got -1"),
        (dict(root_tokens=torch.tensor([0, 2**40])), r"root_tokens must be in \[0, 2147483647\], got 1099511627776"),
        (dict(root_tokens=np.array([2**64 - 1, 0], np.uint64)), r"root_tokens must be in .*, got 18446744073709551615"),
        (dict(root_positions=np.array([3, -2])), r"root_positions must be in \[0, 2147483647\], got -2"),
        (dict(root_tokens=np.array([True, False])), "root_tokens"),
        (dict(root_tokens=torch.tensor([True, False])), "root_tokens must be integers"),
        (dict(root_positions=torch.tensor([True, False])), "root_positions must be integers"),
        # device names are checked as the engine's (were torch's RuntimeError/TypeError)
        (dict(device="cuda:x"), "device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got 'cuda:x'"),
        (dict(device="gpu"), "device must be .*, got 'gpu'"),
        (dict(device=3.5), "device must be .*, got 3.5"),
        (dict(device="cuda:99"), "device 'cuda:99': torch sees \\d+ CUDA devices"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, message):
    batch = DraftBatch.from_lists([[(1, -1), (2, 0)], []])
    args = dict(batch=batch, root_tokens=torch.zeros(2, dtype=torch.int64),
                root_positions=torch.zeros(2, dtype=torch.int64))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        build_tree_inputs(**args)


def test_a_device_name_means_what_it_means_to_the_engine():
    """"auto" is the engine's (CUDA where torch sees one, else the CPU), not an error."""
    batch = DraftBatch.from_lists([[(1, -1)]])
    ti = build_tree_inputs(batch, np.array([4]), np.array([2]), "auto")
    assert ti.input_ids.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert ti.input_ids.cpu().tolist() == [[4, 1]] and ti.positions.cpu().tolist() == [[2, 3]]


def test_malformed_batch_is_rejected():
    bad = DraftBatch(offsets=np.array([0, 2], np.int32), tokens=np.array([1, 2], np.int32),
                     parents=np.array([-1, 1], np.int32), probs=np.ones(2, np.float32))
    for _ in range(2):  # a failed check is not remembered as valid
        with pytest.raises(ValueError, match="parents"):
            build_tree_inputs(bad, torch.zeros(1, dtype=torch.int64),
                              torch.zeros(1, dtype=torch.int64))


def test_a_bad_parent_is_named_with_its_request_and_node():
    """validate says which request's node breaks the parents rule, not only the rule."""
    bad = DraftBatch(offsets=np.array([0, 1, 3], np.int32), tokens=np.array([1, 2, 3], np.int32),
                     parents=np.array([-1, -1, 1], np.int32), probs=np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"topological order\): request 1's node 1 has parent 1"):
        bad.validate()


def test_drafter_output_reads_list_trees_as_a_batch():
    """A list of (tokens, parents) pairs (as_trees' other form) becomes the batch from_lists
    builds from the same nodes, checked like a drafter's DraftBatch."""
    trees = [([5, 6, 7], [-1, 0, 0]), ([], []), ((9,), np.array([-1]))]
    got = drafter_output(trees, np.array([3, 0, 1]))
    want = DraftBatch.from_lists([[(5, -1), (6, 0), (7, 0)], [], [(9, -1)]])
    for name in ("offsets", "tokens", "parents", "probs"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
        assert getattr(got, name).dtype == getattr(want, name).dtype
    batch = DraftBatch.from_lists([[(1, -1)], []])
    assert drafter_output(batch, [1, 0]) is batch


@pytest.mark.parametrize("result, budgets, error, message", [
    (object(), [1], TypeError, "drafter returned object, not a DraftBatch or a list of"),
    ("ab", [1], TypeError, "drafter returned str, not a DraftBatch"),
    ([[(1, -1)]], [1], TypeError, r"tree for request 0 must be a \(tokens, parents\) pair"),
    ([([], []), ([1, 2], [-1])], [2, 2], ValueError, "request 1 has 2 tokens and 1 parents"),
    ([([1], [-1])], [1, 1], ValueError, "drafter returned 1 trees for 2 requests"),
    ([([1], [-1]), ([1, 2], [-1, 0])], [1, 1], ValueError,
     "drafter's tree for request 1 has 2 nodes, over its budget of 1"),
    ([([1], [-1]), ([1, 2], [-1, 1])], [2, 2], ValueError, "request 1's node 1 has parent 1"),
    ([([-3], [-1])], [1], ValueError, "the drafter's tokens must hold token ids"),
    ([([1.5], [-1])], [1], TypeError, "the drafter's tokens must be"),
    (DraftBatch.from_lists([[(1, -1)], [(2, -1), (3, 0)]]), np.array([1, 1]), ValueError,
     "drafter's tree for request 1 has 2 nodes, over its budget of 1"),
])
def test_drafter_output_names_the_request_and_the_rule(result, budgets, error, message):
    """Either form is refused naming the request's position in the call and the broken rule."""
    with pytest.raises(error, match=message):
        drafter_output(result, budgets)


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
