"""The engine refuses bad options and inputs before any work, and a failed call leaves it usable.

Every bad argument raises naming the field (and its range) before a prefill or a weight load,
nothing is coerced, and the next valid call gives what a fresh engine gives. Tiny random models
in fp32 on the CPU (test_engine.py's).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout_spec import SamplingParams, SpecConfig, rollout
from rollout_spec import verify as verify_module
from rollout_spec.drafter import NgramDrafter
from rollout_spec.engine import RolloutEngine
from test_engine import DEVICE, VOCAB, engine, tiny_pair  # noqa: E402  (tests/ is on sys.path under pytest)

PROMPTS = [[1, 2, 3, 4, 5] * 3, [7, 8, 9] * 4, [1, 2, 3, 4, 5, 1, 2], [4, 4, 4, 4]]
GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)
SPEC = SpecConfig(num_draft_tokens=4)


@pytest.fixture(scope="module")
def model():
    return tiny_pair("llama")[1]


@pytest.fixture(scope="module")
def plain(model):
    """The reference tokens: a fresh engine without speculation."""
    return [o.token_ids for o in engine(model).generate(PROMPTS, GREEDY)]


def tokens(eng: RolloutEngine, **kw) -> list[list[int]]:
    return [o.token_ids for o in eng.generate(PROMPTS, GREEDY, **kw)]


class FailsOnce(NgramDrafter):
    """The n-gram drafter, except that the first call of ``method`` raises."""

    def __init__(self, method: str) -> None:
        super().__init__(SPEC)
        self.failed = False
        real = getattr(self, method)

        def fail_once(*args, **kw):
            if not self.failed:
                self.failed = True
                raise RuntimeError(f"injected failure in {method}")
            return real(*args, **kw)

        setattr(self, method, fail_once)  # the instance's attribute shadows the class's method


@pytest.mark.parametrize("mostly_plain", [False, True])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("method", ["start_batch", "extend_batch", "propose", "finish_batch"])
def test_a_call_that_fails_midway_leaves_the_engine_clean(model, plain, method, overlap,
                                                          mostly_plain) -> None:
    """A drafter call failing mid-call (on the worker thread too) fails that call only: its
    deferred hand-offs are dropped and its requests finished, so the next call runs as on a
    fresh engine (before, the next call handed the failed call's tokens over: 'unknown request
    id'). A mostly plain budget defers tokens and hands them to the worker between drafts."""
    steps = iter(range(1 << 20))
    budget = (lambda n: 4 if next(steps) % 10 == 9 else 0) if mostly_plain else (lambda n: 4)
    eng = engine(model, FailsOnce(method), overlap_drafter=overlap, draft_budget=budget)
    with pytest.raises(RuntimeError, match="injected failure"):
        tokens(eng)
    assert tokens(eng) == plain
    assert tokens(eng) == plain
    assert not eng.drafter._live  # the failed call's requests were finished too


def test_bad_group_ids_with_the_worker_raise_up_front_and_leave_the_engine_clean(model) -> None:
    """The auditor's case: overlap on, the default worker_min_batch, 40 prompts, one bad group id."""
    prompts = [[i % 90 + 1, 2, 3, 4, 5] for i in range(40)]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    want = [o.token_ids for o in engine(model, num_slots=64).generate(prompts, params)]
    eng = RolloutEngine(model, None, SPEC, num_slots=64, max_model_len=64, overlap_drafter=True,
                        draft_budget=lambda n: 4)
    with pytest.raises(ValueError, match=r"group_ids\[39\] must be in \[0, 2147483647\], got -1"):
        eng.generate(prompts, params, group_ids=[7] * 39 + [-1])
    assert eng.prefill_tokens == 0
    assert [o.token_ids for o in eng.generate(prompts, params)] == want


@pytest.mark.parametrize("spec", [None, SPEC])
@pytest.mark.parametrize("group_ids, error, match", [
    ([5, -7, 1, 2], ValueError, r"group_ids\[1\] must be in \[0, 2147483647\], got -7"),
    ([1, 2, 3, 2**31], ValueError, r"group_ids\[3\]"),
    (["a", "b", "c", "d"], TypeError, r"group_ids\[0\] must be an integer in \[0, 2147483647\], got str"),
    ([1, 2, 1.5, 3], TypeError, r"group_ids\[2\] must be an integer in \[0, 2147483647\], got float"),
    ([1, True, 2, 3], TypeError, r"group_ids\[1\] must be an integer in \[0, 2147483647\], got bool"),
    ("abcd", TypeError, "group_ids must be None or a sequence"),
    ({40, 3, 17, 5}, TypeError, "group_ids must be None or a sequence in the prompts' order, got set"),
    ({1: "p0", 2: "p1", 3: "p2", 4: "p3"}, TypeError, "got dict, which has no order"),
])
def test_group_ids_are_checked_before_prefill_with_the_callers_index(model, plain, spec, group_ids,
                                                                     error, match) -> None:
    eng = engine(model, spec)
    with pytest.raises(error, match=match):
        tokens(eng, group_ids=group_ids)
    assert eng.prefill_tokens == 0
    assert tokens(eng, group_ids=[None, 2**31 - 1, np.int64(0), 3]) == plain  # None: no group


@pytest.mark.parametrize("eos, error", [
    ([70.9], TypeError), ([-1], ValueError), ([VOCAB], ValueError), (["7"], TypeError),
    ([True], TypeError), (5, TypeError), (None, TypeError), ("7", TypeError)])
def test_eos_token_ids_must_be_token_ids_of_the_vocabulary(model, eos, error) -> None:
    with pytest.raises(error, match="eos_token_ids"):
        engine(model, eos_token_ids=eos)


def test_eos_token_ids_in_range_are_kept_as_given(model) -> None:
    assert engine(model, eos_token_ids=[0, np.int64(VOCAB - 1)]).eos_token_ids == (0, VOCAB - 1)
    with pytest.raises(ValueError, match=rf"eos_token_ids\[0\] .*\[0, {VOCAB}\)"):
        engine(model, eos_token_ids=[VOCAB])


@pytest.mark.parametrize("budget", [8, 0, "4"])
def test_draft_budget_must_be_a_callable_or_none(model, budget) -> None:
    """An int used to pass construction and fail at the first decode (8), or be replaced by the
    default without a word (0)."""
    with pytest.raises(TypeError, match="draft_budget must be None or a callable"):
        engine(model, SPEC, draft_budget=budget)


@pytest.mark.parametrize("answer", [
    lambda n: [1] * (n + 1), lambda n: None, lambda n: float("nan"), lambda n: 3.9,
    lambda n: np.full(n, 2.7), lambda n: True, lambda n: "4", lambda n: [[1]] * n])
def test_a_bad_budget_answer_is_named(model, answer) -> None:
    eng = engine(model, SPEC, draft_budget=answer)
    with pytest.raises(ValueError, match=r"draft_budget returned .* for \d+ running requests"):
        tokens(eng)


@pytest.mark.parametrize("answer", [
    lambda n: np.int64(3), lambda n: 10**30, lambda n: list(range(n)), lambda n: np.arange(n, dtype=np.int32)])
def test_every_integer_budget_answer_works(model, plain, answer) -> None:
    assert tokens(engine(model, SPEC, draft_budget=answer)) == plain


def test_triton_backend_without_triton_fails_at_construction(model, monkeypatch) -> None:
    monkeypatch.setattr(verify_module, "_triton_installed", lambda: False)  # triton may be installed
    with pytest.raises(ImportError, match="verify_backend='triton' needs the triton package"):
        engine(model, verify_backend="triton")


def test_triton_backend_off_cuda_without_the_interpreter_fails_at_construction(model, monkeypatch) -> None:
    """It was accepted, and generate failed inside triton (on a CPU box: "0 active drivers")."""
    monkeypatch.setattr(verify_module, "_triton_installed", lambda: True)  # triton may be absent
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest sets it on a CPU box
    if DEVICE.type == "cuda":  # where the kernels run, the backend is taken
        assert engine(model, verify_backend="triton").verify_backend == "triton"
        return
    with pytest.raises(ValueError,
                       match="^verify_backend='triton' needs a CUDA device or TRITON_INTERPRET=1"):
        engine(model, verify_backend="triton")


@pytest.mark.parametrize("option, value", [
    ("cuda_graphs", "no"), ("cuda_graphs", None), ("batch_aware_budget", "yes"), ("overlap_drafter", 1)])
def test_switches_must_be_bools(model, option, value) -> None:
    with pytest.raises(TypeError, match=option):
        engine(model, **{option: value})


def test_stop_token_ids_outside_the_vocabulary_are_refused(model, plain, monkeypatch) -> None:
    """They could never match: the samples would silently run to max_new_tokens."""
    eng = engine(model)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[3, VOCAB])
    want = rf"stop_token_ids\[1\] must be in \[0, {VOCAB - 1}\], got {VOCAB} .*\[0, {VOCAB}\)"
    attached = []
    monkeypatch.setattr(rollout, "attach_shared_index", attached.append)
    with pytest.raises(ValueError, match=want):
        eng.generate(PROMPTS, params)
    assert eng.prefill_tokens == 0 and attached == []  # refused before the drafter could be wrapped
    monkeypatch.undo()
    assert tokens(eng) == plain


@pytest.mark.parametrize("args, error, match", [
    (dict(device="bogus"), ValueError, "device must be"),
    (dict(device="cuda:99"), ValueError, "CUDA devices here"),
    (dict(dtype="bfloat16"), TypeError, "dtype must be None or one of"),
    (dict(dtype=torch.int8), TypeError, "dtype must be None or one of"),
    (dict(num_slots=0), ValueError, "num_slots"),
    (dict(max_model_len=1), ValueError, "max_model_len"),
    (dict(bogus_kw=1), TypeError, "bogus_kw"),
    (dict(spec="ngram"), TypeError, "spec must be a SpecConfig"),
    (dict(draft_budget=8), TypeError, "draft_budget"),
    (dict(verify_backend="TORCH"), ValueError, "verify_backend"),
])
def test_from_pretrained_checks_its_arguments_before_loading(monkeypatch, args, error, match) -> None:
    from rollout_spec.engine import weights

    def no_load(*a, **kw):
        raise AssertionError("weights loaded before the arguments were checked")

    monkeypatch.setattr(weights, "load_pretrained", no_load)
    args = {"device": "cpu", "spec": None, **args}
    with pytest.raises(error, match=match):
        RolloutEngine.from_pretrained("smollm2-135m", **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
def test_from_pretrained_on_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="torch sees 0 CUDA devices"):
        RolloutEngine.from_pretrained("smollm2-135m", device="cuda", spec=None)


def test_from_pretrained_takes_eos_token_ids(monkeypatch, model) -> None:
    """The config's EOS is the default; a caller's eos_token_ids replaces it (it used to be a
    'multiple values' TypeError after the load)."""
    from types import SimpleNamespace

    from rollout_spec.engine import weights

    monkeypatch.setattr(weights, "load_pretrained", lambda *a: (model, SimpleNamespace(eos_token_id=3), None))
    assert RolloutEngine.from_pretrained("x", device="cpu", spec=None).eos_token_ids == (3,)
    assert RolloutEngine.from_pretrained("x", device="cpu", spec=None, eos_token_ids=[5]).eos_token_ids == (5,)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_running": 0}, ValueError, r"max_running must be in \[1, 8\], got 0"),  # was: all slots
    ({"max_running": True}, TypeError, r"max_running must be an integer in \[1, 8\], got bool"),
    ({"group_ids": [1, True, 2, 3]}, TypeError, r"group_ids\[1\] must be an integer .* got bool"),
    ({"group_ids": [1, 2, 3, -1]}, ValueError, r"group_ids\[3\] must be in \[0, 2147483647\]"),
])
def test_a_session_called_directly_checks_its_arguments_before_queueing(model, plain, kwargs, error,
                                                                         match):
    """``RolloutSession`` is public: its run checks what ``generate`` checks, before any prefill."""
    eng = engine(model, SPEC)
    with pytest.raises(error, match=match):
        rollout.RolloutSession(eng, GREEDY).run(PROMPTS, **kwargs)
    assert tokens(eng) == plain


@pytest.mark.parametrize("params", [None, {"temperature": 0.0}, SpecConfig()])
def test_a_session_refuses_params_that_are_not_sampling_params(model, params) -> None:
    """``RolloutSession(engine, params)``: anything but a SamplingParams is named by type."""
    with pytest.raises(TypeError, match=f"params must be a SamplingParams, got {type(params).__name__}"):
        rollout.RolloutSession(engine(model, SPEC), params)


@pytest.mark.parametrize("progress", ["no", None, 1])
def test_progress_must_be_a_bool(model, progress) -> None:
    """``generate(progress=...)`` is a switch: a truthy "no" is refused, not read as True."""
    with pytest.raises(TypeError, match=f"progress must be a bool, got {type(progress).__name__}"):
        engine(model, SPEC).generate(PROMPTS, GREEDY, progress=progress)


@pytest.mark.parametrize("prompts, shown", [("1 2 3", "str"), (b"\x01\x02", "bytes"), (42, "int"),
                                            ({0: [1, 2]}, "dict")])
def test_a_session_refuses_prompts_that_are_not_a_list_before_queueing(model, prompts, shown) -> None:
    """A bare string is one prompt given where a list is wanted; it and a non-sequence are refused
    by type before a request id is taken or anything queued."""
    eng = engine(model, SPEC)
    next_id = eng.new_request_id()
    with pytest.raises(TypeError, match=rf"prompts must be a list of token-id lists or a list of strings, "
                                        rf"got {shown}$"):
        rollout.RolloutSession(eng, GREEDY).run(prompts)
    assert eng.new_request_id() == next_id + 1  # no request was created
