"""KVCache and ModelRunner at the cache's edges: bad sizes and steps past ``cache_len`` raise a
ValueError naming the field and the limit, before anything is written or silently truncated.

``ROLLOUT_SPEC_TEST_DEVICE=cuda`` runs the same tests on a GPU, where a write past the cache
would otherwise be a device-side assert that kills the CUDA context.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from rollout_spec.engine.kv_cache import KVCache
from rollout_spec.tree import DraftBatch

DEVICE = torch.device(os.environ.get("ROLLOUT_SPEC_TEST_DEVICE", "cpu"))


def filled_cache(slots: int = 3, max_len: int = 8) -> KVCache:
    """A cache whose every cell holds a distinct value."""
    cache = KVCache(2, slots, 2, max_len, 4, torch.float32, DEVICE)
    cache.kv.copy_(torch.arange(cache.kv.numel(), dtype=torch.float32).view(cache.kv.shape))
    return cache


@pytest.mark.parametrize("field", ["num_layers", "num_slots", "num_kv_heads", "max_len", "head_dim"])
@pytest.mark.parametrize("bad,error,got", [(0, ValueError, "got 0"), (-1, ValueError, "got -1"),
                                           (2.0, TypeError, "got float 2.0"),
                                           (True, TypeError, "got bool True")])
def test_bad_sizes_name_the_field(field: str, bad, error: type, got: str) -> None:
    sizes = dict(num_layers=1, num_slots=2, num_kv_heads=1, max_len=8, head_dim=4)
    sizes[field] = bad
    with pytest.raises(error, match=rf"KVCache {field} must be .*in \[1, inf\], {got}"):
        KVCache(**sizes, dtype=torch.float32, device=DEVICE)


def test_copy_prefix_copies_exactly_length_positions() -> None:
    cache = filled_cache()
    before = cache.kv.clone()
    cache.copy_prefix(0, torch.tensor([2], device=DEVICE), 5)
    torch.testing.assert_close(cache.kv[:, :, 2, :, :5], before[:, :, 0, :, :5], rtol=0, atol=0)
    torch.testing.assert_close(cache.kv[:, :, 2, :, 5:], before[:, :, 2, :, 5:], rtol=0, atol=0)
    torch.testing.assert_close(cache.kv[:, :, :2], before[:, :, :2], rtol=0, atol=0)


@pytest.mark.parametrize("src,length,error,match", [
    (0, 9, ValueError, r"length must be in \[0, 8\], got 9"),  # a slice would copy 8 quietly
    (0, -1, ValueError, r"length must be in \[0, 8\], got -1"),  # a slice would copy 7 quietly
    (3, 4, ValueError, r"src_slot must be in \[0, 2\], got 3"),
    (0.5, 4, TypeError, r"src_slot must be an integer in \[0, 2\], got float 0.5"),
    (0, 4.0, TypeError, r"length must be an integer in \[0, 8\], got float 4.0"),
])
def test_copy_prefix_past_the_cache_raises(src, length, error: type, match: str) -> None:
    cache = filled_cache()
    before = cache.kv.clone()
    with pytest.raises(error, match=match):
        cache.copy_prefix(src, torch.tensor([1], device=DEVICE), length)
    assert torch.equal(cache.kv, before)


def tiny_runner(cache_len: int):
    """A ModelRunner over a random two-layer Llama with ``cache_len`` positions per slot."""
    transformers = pytest.importorskip("transformers")
    from rollout_spec.engine.runner import ModelRunner
    from rollout_spec.engine.weights import build_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    state = {k.removeprefix("model."): v for k, v in ref.state_dict().items()}
    model = build_model(cfg, state, DEVICE, torch.float32)
    return ModelRunner(model, num_slots=2, cache_len=cache_len)


def chain(length: int) -> DraftBatch:
    """One request drafting a chain of ``length`` tokens."""
    return DraftBatch.from_lists([[(1, i - 1) for i in range(length)]])


def test_verify_step_past_the_cache_raises() -> None:
    runner = tiny_runner(cache_len=16)
    slots, roots = np.array([0]), np.array([5])
    runner.verify_forward(slots, np.array([12]), roots, chain(3))  # positions 12..15: the last fit
    before = runner.cache.kv.clone()
    with pytest.raises(ValueError, match=r"ctx_lens: .*position 16 .*cache_len=16"):
        runner.verify_forward(slots, np.array([13]), roots, chain(3))
    with pytest.raises(ValueError, match=r"ctx_lens: .*position 16 .*cache_len=16"):
        runner.verify_forward(slots, np.array([16]), roots, chain(0))  # plain decode
    assert torch.equal(runner.cache.kv, before)


def test_graphed_step_checks_the_bucket_width() -> None:
    """A bucket's padding columns are written too: a step that fits may not fit its bucket."""
    runner = tiny_runner(cache_len=16)
    runner.capture_graphs([1, 2], [1, 4], prefill=([1], [8]))  # eager on CPU, same padding
    runner.verify_forward(np.array([0]), np.array([12]), np.array([5]), chain(1))  # bucket W=4 fits
    with pytest.raises(ValueError, match=r"ctx_lens: .*position 16 .*cache_len=16"):
        runner.verify_forward(np.array([0]), np.array([13]), np.array([5]), chain(1))  # W=2 in W=4
    with pytest.raises(ValueError, match=r"widths: .*position 16 .*cache_len=16"):
        runner.verify_ladder([1], [1, 17])
    with pytest.raises(ValueError, match=r"prefill lengths: .*position 31 .*cache_len=16"):
        runner.capture_graphs([1], [1], prefill=([1], [8, 32]))


def test_graph_ladders_refuse_sizes_that_are_no_integers() -> None:
    """``capture_graphs`` and ``verify_ladder`` name the ladder whose size is a float or a bool
    (it was truncated, or read as 1) before anything is captured."""
    runner = tiny_runner(cache_len=16)
    with pytest.raises(TypeError, match=r"prefill lengths\[1\] must be an integer in \[1, inf\], "
                                        r"got float 8\.5"):
        runner.capture_graphs([1], [1], prefill=([1], [4, 8.5]))
    with pytest.raises(TypeError, match=r"prefill groups\[0\] must be an integer .*got bool True"):
        runner.capture_graphs([1], [1], prefill=([True], [8]))
    with pytest.raises(TypeError, match=r"widths\[1\] must be an integer in \[1, inf\], got float 2\.5"):
        runner.verify_ladder([1], [1, 2.5])
    assert runner.graphs is None and runner.prefill_graphs is None


@pytest.mark.parametrize("call", ["noise_keys", "compact_kv"])
def test_reading_the_last_step_before_any_verify_is_a_runtime_error(call: str) -> None:
    """Both read the last ``verify_forward``'s rows; called first, they raise a RuntimeError
    naming the call (an assert guarded it, gone under ``python -O``)."""
    runner = tiny_runner(cache_len=16)
    args = (torch.zeros(1, 2, dtype=torch.int32, device=DEVICE),) if call == "compact_kv" else ()
    with pytest.raises(RuntimeError, match=rf"^{call} called before any verify_forward"):
        getattr(runner, call)(*args)


def test_prefill_past_the_cache_raises() -> None:
    from rollout_spec.config import SamplingParams
    from rollout_spec.engine.sequence import Sequence

    runner = tiny_runner(cache_len=16)
    seq = Sequence(req_id=0, prompt_index=0, sample_index=0, prompt=list(range(17)),
                   params=SamplingParams(), group_id=None, stop_ids=frozenset(), seed=0, slot=0)
    with pytest.raises(ValueError, match=r"prompt lengths: .*position 16 .*cache_len=16"):
        runner.prefill([[seq]])
