"""Bad input to NgramDrafter: clear errors naming the problem, and the drafter's state unchanged."""
from __future__ import annotations

import numpy as np
import pytest

from rollout_spec.config import SpecConfig
from rollout_spec.drafter import NgramDrafter


@pytest.fixture
def drafter() -> NgramDrafter:
    d = NgramDrafter()
    d.add_sequences([1], [[1, 2, 3, 4]])
    d.start_batch([0, 1], [[1, 2], [5, 1, 2]], [1, None])
    return d


def snapshot(d: NgramDrafter):
    b = d.propose([0, 1])
    # proposals count calls (this snapshot makes one), not state
    stats = {k: v for k, v in d.stats().items() if k != "proposals"}
    return stats, b.tokens.tolist(), b.parents.tolist(), b.offsets.tolist()


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda d: d.start(0, [1]), ValueError, "already live"),
        (lambda d: d.start_batch([5, 5], [[1], [2]]), ValueError, "repeat"),
        (lambda d: d.start(5, [1, -2]), ValueError, "token ids"),
        (lambda d: d.start(5, [1.5]), TypeError, "integers"),
        (lambda d: d.start(5, np.array([1.0, 2.0])), TypeError, "integer"),
        (lambda d: d.start(5, "abc"), TypeError, "sequence"),
        (lambda d: d.start(5, [1], group_id=-3), ValueError, "group_ids"),
        (lambda d: d.start(5, [1], group_id=1.0), TypeError, "group_ids"),
        (lambda d: d.start(-1, [1]), ValueError, "req_ids"),
        (lambda d: d.start(5, [2**31]), ValueError, "token ids"),
        (lambda d: d.start_batch([5, 6], [[1]]), ValueError, "one token list per request"),
        (lambda d: d.start_batch([5], [[1]], [1, 2]), ValueError, "group_ids"),
        (lambda d: d.extend(7, [1]), ValueError, "unknown"),
        (lambda d: d.extend_batch([0, 0], [[1], [2]]), ValueError, "repeat"),
        (lambda d: d.extend_batch([0, 1], [[1], [-1]]), ValueError, "token ids"),
        (lambda d: d.extend(0, [[1, 2]]), TypeError, "integers"),
        (lambda d: d.finish(9), ValueError, "unknown"),
        (lambda d: d.finish_batch([0, 9]), ValueError, "unknown"),
        (lambda d: d.propose([0, 9]), ValueError, "unknown"),
        (lambda d: d.propose([0, 0]), ValueError, "repeat"),
        (lambda d: d.propose([0], budgets=[-1]), ValueError, "budgets"),
        (lambda d: d.propose([0], budgets=[1, 2]), ValueError, "budgets"),
        (lambda d: d.propose([0], budgets=[1.5]), TypeError, "budgets"),
        (lambda d: d.propose([1.0]), TypeError, "req_ids"),
        (lambda d: d.add_sequences([1, 2], [[1]]), ValueError, "same length"),
        (lambda d: d.add_sequences([1], [[1, -5]]), ValueError, "token ids"),
        # numpy reads a bool among ints as 0 or 1: refused wherever it stands
        (lambda d: d.start_batch([5, 6], [[3], [2, True]]), TypeError, "prompts .*bool"),
        (lambda d: d.extend_batch([0, 1], [[3], [2, False]]), TypeError, "token_ids .*bool"),
        (lambda d: d.extend_batch([0, 1], [np.array([3]), [True, 2]]), TypeError, r"token_ids\[1\] .*bool"),
        (lambda d: d.extend_batch(np.array([0, 1]), [(3,), (2, np.True_)]), TypeError, "token_ids .*bool"),
        (lambda d: d.add_sequences([1, None], [[3, 4], [1, True]]), TypeError, "sequences .*bool"),
        (lambda d: d.add_sequences([None], [[3, 4]], pinned=1), TypeError, "pinned must be a bool, got int"),
        (lambda d: d.finish_batch([0, True]), TypeError, "req_ids .*bool"),
        (lambda d: d.propose([0, 1], budgets=[4, True]), TypeError, "budgets .*bool"),
        # bytes-like objects, sets and mappings as token lists: read item by item they would be
        # tokens 7 and 8, tokens in hash order, a dict's keys (the docs refuse them by name)
        (lambda d: d.start(5, bytearray(b"\x07\x08")), TypeError, r"prompts\[0\] .*got bytearray"),
        (lambda d: d.extend(0, memoryview(b"\x07")), TypeError, r"token_ids\[0\] .*got memoryview"),
        (lambda d: d.extend_batch(np.array([0]), [{7: 1}]), TypeError, r"token_ids\[0\] .*got dict"),
        (lambda d: d.add_sequences([1], [{7, 8}]), TypeError, r"sequences\[0\] .*got set"),
        (lambda d: d.extend_batch([0, 1], {(3,), (4,)}), TypeError, "token_ids must be a sequence of token lists.*got set"),
        (lambda d: d.start_batch([5], {0: [1]}), TypeError, "prompts must be a sequence of token lists.*got dict"),
        # arguments that are not sequences at all (a single id, None): named, not len()'s error
        (lambda d: d.propose(0), TypeError, "req_ids must be a sequence of request ids, got int"),
        (lambda d: d.propose(None), TypeError, "req_ids must be a sequence of request ids, got NoneType"),
        (lambda d: d.propose_ahead(None), TypeError, "req_ids must be a sequence"),
        (lambda d: d.finish_batch(0), TypeError, "req_ids must be a sequence"),
        (lambda d: d.extend_batch(0, [[1]]), TypeError, "req_ids must be a sequence"),
        (lambda d: d.extend_batch([0], None), TypeError, "token_ids must be a sequence of token lists"),
        (lambda d: d.extend_batch(np.array([0]), None), TypeError, "token_ids must be a sequence"),
        (lambda d: d.start_batch(5, [[1]]), TypeError, "req_ids must be a sequence"),
        (lambda d: d.start_batch([5], None), TypeError, "prompts must be a sequence of token lists"),
        (lambda d: d.start_batch([5], [[1]], 3), TypeError, "group_ids must be a sequence .*got int"),
        (lambda d: d.add_sequences(None, [[1]]), TypeError, "group_ids must be a sequence"),
        (lambda d: d.add_sequences([1], None), TypeError, "sequences must be a sequence"),
        (lambda d: d.set_noise_keys([0], None, [1.0], 5), TypeError, "seeds must be a sequence"),
        (lambda d: d.set_noise_keys([0], [1], 1.0, 5), TypeError, "temperatures must be a sequence"),
    ],
)
def test_bad_input_raises_and_leaves_state_unchanged(drafter, call, error, match):
    before = snapshot(drafter)
    with pytest.raises(error, match=match):
        call(drafter)
    assert snapshot(drafter) == before
    drafter.check_integrity()


def test_config_must_be_a_spec_config():
    with pytest.raises(TypeError, match="SpecConfig"):
        NgramDrafter({"num_draft_tokens": 8})


def test_corpus_file_must_hold_token_ids(tmp_path):
    path = tmp_path / "c.npy"
    np.save(path, np.array([0.5, 1.5]))
    with pytest.raises(TypeError, match=r"corpus .*c\.npy\[0\] must be a 1-D .*float64"):  # file, dtype
        NgramDrafter(SpecConfig(external_corpora=(str(path),)))


@pytest.mark.parametrize("content", [b"not an array", np.array(["a"], object)], ids=["garbage", "pickled"])
def test_corpus_file_must_be_a_npy_array(tmp_path, content):
    good, bad = tmp_path / "good.npy", tmp_path / "bad.npy"
    np.save(good, np.array([1, 2, 3]))
    if isinstance(content, bytes):
        bad.write_bytes(content)
    else:
        np.save(bad, content, allow_pickle=True)
    with pytest.raises(ValueError, match=r"external_corpora\[1\]: .*bad.npy is not a .npy array of token ids"):
        NgramDrafter(SpecConfig(external_corpora=(str(good), str(bad))))


def test_a_missing_corpus_file_names_the_entry_and_the_path(tmp_path):
    """Still a FileNotFoundError (callers catching OSError keep working), now naming the field."""
    good, missing = tmp_path / "good.npy", tmp_path / "gone.npy"
    np.save(good, np.array([1, 2, 3]))
    with pytest.raises(FileNotFoundError) as got:
        NgramDrafter(SpecConfig(external_corpora=(str(good), str(missing))))
    assert str(got.value) == f"external_corpora[1]: cannot read {missing} (No such file or directory)"


def test_a_folder_as_corpus_file_names_the_entry(tmp_path):
    with pytest.raises(IsADirectoryError, match=r"^external_corpora\[0\]: cannot read .* \(Is a directory\)$"):
        NgramDrafter(SpecConfig(external_corpora=(str(tmp_path),)))


def test_corpus_file_must_hold_one_1d_array(tmp_path):
    """A 2-D array or an .npz archive is named as such, not by a dtype it does not have."""
    flat, archive = tmp_path / "flat.npy", tmp_path / "two.npz"
    np.save(flat, np.zeros((2, 3), np.int32))
    np.savez(archive, a=np.array([1, 2]))
    with pytest.raises(ValueError, match=r"external_corpora\[0\]: .*flat.npy must hold a 1-D array of "
                                         r"token ids, got shape \(2, 3\)"):
        NgramDrafter(SpecConfig(external_corpora=(str(flat),)))
    with pytest.raises(ValueError, match=r"external_corpora\[0\]: .*two.npz is an .npz archive"):
        NgramDrafter(SpecConfig(external_corpora=(str(archive),)))


def test_finished_request_id_can_be_reused(drafter):
    drafter.finish(0)
    assert not drafter.is_live(0)
    drafter.start(0, [1, 2], group_id=1)
    assert drafter.propose([0]).num_nodes > 0


@pytest.mark.parametrize("field", ["chain_walk", "global_unigram_walk"])
@pytest.mark.parametrize("walk", [0, 4097])
def test_core_rejects_a_chain_walk_it_cannot_store(field, walk):
    """Chains keep only the records a search reads, in blocks of at most 4095 older ones."""
    from rollout_spec import _core
    from rollout_spec.drafter import _core_config
    cfg = _core_config(SpecConfig())
    setattr(cfg, field, walk)
    with pytest.raises(ValueError, match=rf"^{field} must be in \[1, 4096\]"):
        _core.DrafterCore(cfg)


@pytest.mark.parametrize("req_id", [True, 1.0, "1", None])
def test_is_live_refuses_what_is_not_an_id(req_id):
    """Before, ``is_live(True)`` and ``is_live(1.0)`` answered for request 1."""
    d = NgramDrafter()
    d.start(1, [1, 2, 3])
    with pytest.raises(TypeError, match="req_id must be an integer"):
        d.is_live(req_id)
    assert d.is_live(1) and d.is_live(np.int64(1)) and not d.is_live(-1) and not d.is_live(2**70)
