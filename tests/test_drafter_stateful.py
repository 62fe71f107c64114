"""NgramDrafter under random call sequences (hypothesis stateful testing), valid and invalid.

A machine drives one drafter through every public call -- start/start_batch, extend/extend_batch
(in the foreground and the background), propose/propose_ahead, finish/finish_batch, end_step,
add_sequences, set_noise_keys, save/load -- with ids, tokens and budgets in every accepted form
(lists, tuples, numpy arrays and scalars), and mixes in invalid calls. A twin drafter sees only
the valid calls, in the plain form, and never drafts ahead. After every step:

- a proposal for every live request is a valid DraftBatch within its budget and the batch cap,
  and byte for byte the twin's (so an invalid call changed nothing, and no accepted input form
  or background path drafts differently);
- ``is_live`` agrees with a Python set of started, unfinished ids;
- the state's sizes (``stats``) are the twin's, and ``check_integrity`` passes.

An invalid call must raise ValueError or TypeError, nothing else (no crash, no RuntimeError).
A save/load round trip replaces the drafter by the loaded one after checking that both propose
the same trees.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from rollout_spec.config import SpecConfig
from rollout_spec.drafter import NgramDrafter
from rollout_spec.tree import DraftBatch

# Request ids: few enough that starts, finishes and reuses collide, with the extremes of the range.
IDS = (0, 1, 2, 3, 4, 2**31 - 1, 2**32 + 1, 2**63 - 1)
NEVER_STARTED = 5
VOCAB = 16  # the noise keys' vocabulary (the largest token is beyond it: the core must cope)
STATE_STATS = ("num_requests", "num_sequences", "index_tokens", "step", "num_groups",
               "request_records", "group_records", "global_records", "evictions")

# Tokens 0..4 so that n-grams repeat, and the largest token id the drafter stores.
TOKENS = (0, 1, 2, 3, 4, 2**31 - 1)
token_st = st.sampled_from(TOKENS)
tokens_st = st.lists(token_st, max_size=12)
long_tokens_st = st.one_of(
    st.lists(token_st, min_size=40, max_size=120),
    # more than capacity_tokens (1024) at once, drawn from a seed (hypothesis draws long lists slowly)
    st.integers(0, 2**32 - 1).map(lambda seed: np.random.default_rng(seed).choice(TOKENS[:5], 1500).tolist()),
)
group_st = st.sampled_from([None, 0, 1, 2**31 - 1])
config_st = st.builds(
    SpecConfig,
    num_draft_tokens=st.integers(0, 8),
    max_batch_draft_tokens=st.integers(0, 24),
    max_depth=st.integers(1, 6),
    tree=st.booleans(),
    adaptive_budget=st.booleans(),
    history_steps=st.integers(0, 2),
    capacity_tokens=st.just(1024),
    propose_threads=st.just(1),
)


def token_form(tokens: list[int], form: str) -> Any:
    """``tokens`` in one of the accepted input forms."""
    if form == "tuple":
        return tuple(tokens)
    if form in ("int32", "int64", "uint32"):
        return np.array(tokens, dtype=form)
    if form == "npscalars":
        return [np.int64(t) for t in tokens]
    return list(tokens)


def id_form(ids: list[int], form: str) -> Any:
    """Request ids in one of the accepted input forms."""
    if form == "int64":
        return np.array(ids, dtype=np.int64)
    if form == "tuple":
        return tuple(ids)
    if form == "npscalars":
        return [np.int64(i) for i in ids]
    return list(ids)


form_st = st.sampled_from(["list", "tuple", "int32", "int64", "uint32", "npscalars"])
id_form_st = st.sampled_from(["list", "tuple", "int64", "npscalars"])


def check_batch(batch: DraftBatch, count: int, budgets: list[int], cap: int) -> None:
    """The DraftBatch contract for a ``propose`` of ``count`` requests: CSR trees, each within its
    budget, all together within ``max_batch_draft_tokens``."""
    DraftBatch(offsets=batch.offsets, tokens=batch.tokens, parents=batch.parents, probs=batch.probs).validate()
    assert batch.num_requests == count
    sizes = batch.sizes().tolist()
    assert all(size <= budget for size, budget in zip(sizes, budgets)), (sizes, budgets)
    assert sum(sizes) <= cap
    assert np.isin(batch.tokens, TOKENS).all(), "a drafted token that was never shown to the drafter"


def small_bytes(ids: list[int]) -> bytes:
    """The ids below 256 as bytes: what a caller passing a bytes object would name."""
    return bytes(i for i in ids if i < 256)


def same_batch(a: DraftBatch, b: DraftBatch) -> bool:
    """Byte-identical batches."""
    return all(getattr(a, n).tobytes() == getattr(b, n).tobytes() for n in ("offsets", "tokens", "parents", "probs"))


class DrafterMachine(RuleBasedStateMachine):
    """A drafter and its twin under random valid and invalid calls (module docstring)."""

    @initialize(cfg=config_st)
    def make(self, cfg: SpecConfig) -> None:
        self.cfg = cfg
        self.d = NgramDrafter(cfg)
        self.twin = NgramDrafter(cfg)
        self.live: set[int] = set()
        self.ahead: tuple[list[int], Any] = ([], None)
        self.folder = tempfile.TemporaryDirectory()

    def teardown(self) -> None:
        folder = getattr(self, "folder", None)
        if folder is not None:
            folder.cleanup()

    # ------------------------------------------------------------------ helpers
    def free_ids(self) -> list[int]:
        """Ids that are not live: never started or finished (a start may reuse them)."""
        return [i for i in IDS if i not in self.live]

    def unknown_id(self) -> int:
        """An id no live request holds: the last free one, else one never started."""
        free = self.free_ids()
        return free[-1] if free else NEVER_STARTED

    def pick(self, data: Any, pool: list[int], min_size: int = 0) -> list[int]:
        """Distinct ids from ``pool`` in a drawn order (none when the pool is empty)."""
        return data.draw(st.lists(st.sampled_from(pool), min_size=min_size, unique=True)) if pool else []

    def budgets(self, data: Any, count: int) -> tuple[Any, list[int]]:
        """(budgets in some form, the per-request budgets they mean)."""
        kind = data.draw(st.sampled_from(["none", "list", "int32", "int64"]))
        if kind == "none":
            return None, [self.cfg.num_draft_tokens] * count
        values = data.draw(st.lists(st.sampled_from([0, 1, 2, 5, 9, 1 << 20]), min_size=count, max_size=count))
        return (values if kind == "list" else np.array(values, dtype=kind)), values

    def invalid(self, call: Callable[[NgramDrafter], object], raises: bool = True) -> None:
        """Run a bad call on the drafter only: a ValueError or TypeError, or (``raises=False``)
        possibly nothing; the invariants then check the drafter is still its twin."""
        try:
            call(self.d)
        except (ValueError, TypeError):
            return
        assert not raises, "an invalid call was accepted"

    # ------------------------------------------------------------------ valid calls
    @rule(data=st.data(), single=st.booleans(), form=form_st, ids_as=id_form_st)
    def start(self, data, single, form, ids_as):
        """start or start_batch (possibly of no request), prompts possibly empty."""
        ids = self.pick(data, self.free_ids())
        single = single and bool(ids)
        prompts = [data.draw(tokens_st) for _ in ids]
        groups = [data.draw(group_st) for _ in ids]
        if single:
            self.d.start(ids[0], token_form(prompts[0], form), groups[0])
            self.twin.start(ids[0], prompts[0], groups[0])
            ids = ids[:1]
        else:
            plain = all(g is None for g in groups) and data.draw(st.booleans())
            self.d.start_batch(id_form(ids, ids_as), [token_form(p, form) for p in prompts],
                               None if plain else groups)
            self.twin.start_batch(ids, prompts, groups)
        self.live.update(ids)

    @rule(data=st.data(), form=form_st, ids_as=id_form_st, background=st.booleans(), long=st.booleans())
    def extend(self, data, form, ids_as, background, long):
        """extend_batch of some live requests (possibly none), in the foreground or background."""
        ids = self.pick(data, sorted(self.live))
        lists = [data.draw(long_tokens_st if long else tokens_st) for _ in ids]
        self.d.extend_batch(id_form(ids, ids_as), [token_form(t, form) for t in lists], background=background)
        self.twin.extend_batch(ids, lists)

    @rule(data=st.data(), ids_as=id_form_st, as_ahead=st.booleans())
    def propose(self, data, ids_as, as_ahead):
        """With ``as_ahead``, the arguments of the last ``propose_ahead``, live ids only."""
        ids, given = self.ahead
        if as_ahead and set(ids) <= self.live:
            budgets = [self.cfg.num_draft_tokens] * len(ids) if given is None else list(given)
        else:
            ids = self.pick(data, sorted(self.live))
            given, budgets = self.budgets(data, len(ids))
        got = self.d.propose(id_form(ids, ids_as), given)
        check_batch(got, len(ids), budgets, self.cfg.max_batch_draft_tokens)
        assert same_batch(got, self.twin.propose(ids, budgets))

    @rule(data=st.data())
    def propose_ahead(self, data):
        """Drafted ahead on the drafter only: the next matching propose must equal the twin's."""
        ids = self.pick(data, sorted(self.live))
        given, _ = self.budgets(data, len(ids))
        self.d.propose_ahead(ids, given)
        self.ahead = (ids, given)

    @rule(data=st.data(), single=st.booleans(), ids_as=id_form_st)
    def finish(self, data, single, ids_as):
        """finish, or finish_batch of some live requests (possibly none)."""
        ids = self.pick(data, sorted(self.live), min_size=1 if single else 0)
        if single and ids:
            self.d.finish(ids[0])
            self.twin.finish(ids[0])
            ids = ids[:1]
        else:
            self.d.finish_batch(id_form(ids, ids_as))
            self.twin.finish_batch(ids)
        self.live.difference_update(ids)

    @rule()
    def end_step(self):
        self.d.end_step()
        self.twin.end_step()

    @rule(data=st.data(), pinned=st.booleans(), form=form_st)
    def add_sequences(self, data, pinned, form):
        """Up to three sequences, pinned or not, grouped or global only."""
        seqs = data.draw(st.lists(st.one_of(tokens_st, long_tokens_st), max_size=3))
        groups = [data.draw(group_st) for _ in seqs]
        self.d.add_sequences(groups, [token_form(s, form) for s in seqs], pinned=pinned)
        self.twin.add_sequences(groups, seqs, pinned=pinned)

    @rule(data=st.data(), vocab=st.sampled_from([VOCAB, VOCAB, 1000, 5000]))
    def set_noise_keys(self, data, vocab):
        """A vocabulary of another noise layout is refused while requests outside the call are
        keyed with the first one: both drafters must agree on whether the call is valid."""
        ids = self.pick(data, sorted(self.live))
        seeds = [data.draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))) for _ in ids]
        temps = [data.draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in ids]
        outcomes = []
        for d in (self.twin, self.d):
            try:
                d.set_noise_keys(ids, seeds, temps, vocab)
                outcomes.append(None)
            except ValueError as exc:
                outcomes.append(str(exc))
        assert outcomes[0] == outcomes[1]

    @rule(data=st.data())
    def save_and_load(self, data):
        """A checkpoint round trip: the loaded drafter proposes what the saved one does, then
        takes its place (so later calls run on a loaded drafter)."""
        path = Path(self.folder.name) / "drafter.bin"
        self.d.save(path)
        loaded = NgramDrafter.load(path)
        loaded.check_integrity()
        ids = sorted(self.live)
        given, _ = self.budgets(data, len(ids))
        assert same_batch(loaded.propose(ids, given), self.d.propose(ids, given))
        self.d = loaded

    # ------------------------------------------------------------------ invalid calls
    @rule(data=st.data())
    def bad_start(self, data):
        """start/start_batch with a live or repeated id, bad ids, tokens or group ids."""
        free, live = self.free_ids(), sorted(self.live)
        fresh = free[0] if free else None
        calls = [
            lambda d: d.start(-1, [1]),
            lambda d: d.start(2**63, [1]),
            lambda d: d.start(True, [1]) if fresh is None else d.start_batch([fresh, True], [[1], [2]]),
            lambda d: d.start_batch(np.array([0.0]), [[1]]),
            lambda d: d.start_batch(small_bytes(free[:1]), [[1]] * len(small_bytes(free[:1]))),
            lambda d: d.start_batch(free[:1], [[1]] * len(free[:1]), bytes(len(free[:1]))),
        ]
        if live:
            calls += [lambda d: d.start(live[0], [1]),
                      lambda d: d.start_batch([live[0]] + free[:1], [[1]] * (1 + len(free[:1])))]
        if fresh is not None:
            calls += [
                lambda d: d.start_batch([fresh, fresh], [[1], [2]]),
                lambda d: d.start_batch([fresh], [[1], [2]]),
                lambda d: d.start_batch([fresh], [[1]], [1, 2]),
                lambda d: d.start(fresh, [1, -1]),
                lambda d: d.start(fresh, [2**31]),
                lambda d: d.start(fresh, [1, True]),
                lambda d: d.start(fresh, np.array([1.0, 2.0])),
                lambda d: d.start(fresh, np.array([True, False])),
                lambda d: d.start(fresh, np.array([1, 2**40], np.int64)),
                lambda d: d.start(fresh, np.array([2**63], np.uint64)),
                lambda d: d.start(fresh, np.array([[1, 2]])),
                lambda d: d.start(fresh, [[1, 2]]),
                lambda d: d.start(fresh, "abc"),
                lambda d: d.start(fresh, None),
                lambda d: d.start(fresh, [1], group_id=-1),
                lambda d: d.start(fresh, [1], group_id=2**31),
                lambda d: d.start(fresh, [1], group_id=True),
                lambda d: d.start(fresh, [1], group_id=1.0),
            ]
        self.invalid(data.draw(st.sampled_from(calls)))

    @rule(data=st.data(), background=st.booleans())
    def bad_extend(self, data, background):
        """extend/extend_batch with unknown or repeated ids, wrong lengths, bad tokens or flags."""
        live = sorted(self.live)
        unknown = self.unknown_id()
        calls = [
            lambda d: d.extend(unknown, [1]),
            lambda d: d.extend_batch([unknown], [[1]], background=background),
            lambda d: d.extend_batch(np.array([unknown]), [np.array([1])], background=background),
            lambda d: d.extend_batch([-1], [[1]], background=background),
            lambda d: d.extend_batch([1.0], [[1]], background=background),
            lambda d: d.extend_batch(live, [[1]] * len(live), background=1),
            lambda d: d.extend_batch(bytearray(small_bytes(live[:1])), [[1]] * len(small_bytes(live[:1])),
                                     background=background),
        ]
        if live:
            r = live[0]
            calls += [
                lambda d: d.extend_batch([r, r], [[1], [2]], background=background),
                lambda d: d.extend_batch([r, unknown], [[1], [2]], background=background),
                lambda d: d.extend_batch([r], [[1], [2]], background=background),
                lambda d: d.extend_batch([r], [], background=background),
                lambda d: d.extend_batch([r], [[1, -1]], background=background),
                lambda d: d.extend_batch([r], [[2**31]], background=background),
                lambda d: d.extend_batch([r], [[1, True]], background=background),
                lambda d: d.extend_batch([r], [[1.5]], background=background),
                lambda d: d.extend_batch([r], [np.array([1.0])], background=background),
                lambda d: d.extend_batch([r], [np.array([True])], background=background),
                lambda d: d.extend_batch([r], [np.array([2**40], np.int64)], background=background),
                lambda d: d.extend_batch([r], [np.array([2**64 - 1], np.uint64)], background=background),
                lambda d: d.extend_batch(np.array([r]), [[1, -1]], background=background),
                lambda d: d.extend_batch(np.array([r], np.float64), [[1]], background=background),
                lambda d: d.extend_batch([r], ["ab"], background=background),
                lambda d: d.extend_batch([r], [None], background=background),
                lambda d: d.extend(r, [[1, 2]]),
                lambda d: d.extend(r, 3),
            ]
        self.invalid(data.draw(st.sampled_from(calls)))

    @rule(data=st.data())
    def bad_propose(self, data):
        """propose with unknown or repeated ids, bad budgets; propose_ahead with bad budgets."""
        live = sorted(self.live)
        unknown = self.unknown_id()
        calls = [
            lambda d: d.propose([unknown]),
            lambda d: d.propose(np.array([unknown])),
            lambda d: d.propose([-1]),
            lambda d: d.propose([True]),
            lambda d: d.propose(np.array([0.0])),
            lambda d: d.propose(None),
            lambda d: d.propose(0),
            lambda d: d.propose(small_bytes(live[:2])),
            lambda d: d.propose_ahead(b""),
        ]
        if live:
            r = live[0]
            calls += [
                lambda d: d.propose([r, r]),
                lambda d: d.propose([r, unknown]),
                lambda d: d.propose([r], [-1]),
                lambda d: d.propose([r], [(1 << 20) + 1]),
                lambda d: d.propose([r], [1, 2]),
                lambda d: d.propose([r], []),
                lambda d: d.propose([r], [True]),
                lambda d: d.propose([r], [1.5]),
                lambda d: d.propose([r], np.array([1.0])),
                lambda d: d.propose([r], np.array([2**63], np.uint64)),
                lambda d: d.propose([r], np.array([-1], np.int8)),
                lambda d: d.propose([r], np.array([[1]])),
                lambda d: d.propose([r], 4),
                lambda d: d.propose_ahead([r], [-1]),
                lambda d: d.propose_ahead([r], [1, 2]),
                lambda d: d.propose_ahead([r], np.array([1.0])),
                lambda d: d.propose_ahead([r], [True]),
            ]
        self.invalid(data.draw(st.sampled_from(calls)))

    @rule(data=st.data())
    def bad_propose_ahead_ids(self, data):
        """Unknown or repeated ids may raise here or only in the propose that names them."""
        live = sorted(self.live)
        unknown = self.unknown_id()
        calls = [lambda d: d.propose_ahead([unknown]), lambda d: d.propose_ahead([-1])]
        if live:
            calls += [lambda d: d.propose_ahead([live[0], live[0]]),
                      lambda d: d.propose_ahead(live + [unknown])]
        self.invalid(data.draw(st.sampled_from(calls)), raises=False)

    @rule(data=st.data())
    def bad_finish(self, data):
        """finish/finish_batch naming an unknown, repeated or malformed id beside live ones."""
        live = sorted(self.live)
        unknown = self.unknown_id()
        calls = [
            lambda d: d.finish(unknown),
            lambda d: d.finish(-1),
            lambda d: d.finish_batch(0),
            lambda d: d.finish_batch([1.0]),
            lambda d: d.finish_batch(np.array([unknown])),
            lambda d: d.finish_batch(memoryview(small_bytes(live[:1]))),
        ]
        if live:
            calls += [
                lambda d: d.finish_batch(live + [unknown]),
                lambda d: d.finish_batch([live[0], live[0]]),
                lambda d: d.finish_batch([live[0], True]),
                lambda d: d.finish_batch(np.array(live, np.float64)),
            ]
        self.invalid(data.draw(st.sampled_from(calls)))

    @rule(data=st.data())
    def bad_add_or_keys(self, data):
        """add_sequences and set_noise_keys with wrong lengths, ranges or types."""
        live = sorted(self.live)
        unknown = self.unknown_id()
        calls = [
            lambda d: d.add_sequences([1, 2], [[1]]),
            lambda d: d.add_sequences([1], [[1, -1]]),
            lambda d: d.add_sequences([-1], [[1]]),
            lambda d: d.add_sequences([2**31], [[1]]),
            lambda d: d.add_sequences([None], [[1, True]]),
            lambda d: d.add_sequences([None], [np.array([0.5])]),
            lambda d: d.add_sequences([None], [[1]], pinned=1),
            lambda d: d.add_sequences(None, [[1]]),
            lambda d: d.add_sequences(b"\x01", [[1]]),
            lambda d: d.set_noise_keys(live[:1], bytes(len(live[:1])), [1.0] * len(live[:1]), VOCAB),
            lambda d: d.set_noise_keys([unknown], [1], [1.0], VOCAB),
        ]
        if live:
            r = live[0]
            calls += [
                lambda d: d.set_noise_keys([r, r], [1, 1], [1.0, 1.0], VOCAB),
                lambda d: d.set_noise_keys([r, unknown], [1, 1], [1.0, 1.0], VOCAB),
                lambda d: d.set_noise_keys([r], [-1], [1.0], VOCAB),
                lambda d: d.set_noise_keys([r], [1], [0.0], VOCAB),
                lambda d: d.set_noise_keys([r], [1], [float("nan")], VOCAB),
                lambda d: d.set_noise_keys([r], [1], [1.0], 0),
                lambda d: d.set_noise_keys([r], [1], [1.0], True),
                lambda d: d.set_noise_keys([r], [1, 2], [1.0], VOCAB),
                lambda d: d.set_noise_keys([r], [True], [1.0], VOCAB),
            ]
        self.invalid(data.draw(st.sampled_from(calls)))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def is_live_matches_the_model(self):
        """is_live is the Python model's membership, for every id of the pool and one never used."""
        if hasattr(self, "d"):
            for i in IDS + (NEVER_STARTED,):
                assert self.d.is_live(i) == (i in self.live), i

    @invariant()
    def same_state_and_proposals_as_the_twin(self):
        """Integrity, the twin's state sizes and the twin's proposals for every live request."""
        if not hasattr(self, "d"):
            return
        self.d.check_integrity()
        ours, theirs = self.d.stats(), self.twin.stats()
        assert {k: ours[k] for k in STATE_STATS} == {k: theirs[k] for k in STATE_STATS}
        ids = sorted(self.live)
        budgets = [self.cfg.num_draft_tokens] * len(ids)
        got = self.d.propose(ids)
        check_batch(got, len(ids), budgets, self.cfg.max_batch_draft_tokens)
        assert same_batch(got, self.twin.propose(ids))


DrafterMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestDrafterUnderRandomCalls = DrafterMachine.TestCase


@pytest.mark.parametrize("call", [
    lambda d: d.propose(b"\x00"),
    lambda d: d.propose_ahead(b""),
    lambda d: d.extend_batch(bytearray(b"\x00"), [[1]]),
    lambda d: d.finish_batch(memoryview(b"\x00")),
    lambda d: d.start_batch(b"\x05", [[1]]),
    lambda d: d.start_batch([5], [[1]], b"\x01"),
    lambda d: d.add_sequences(b"\x01", [[1]]),
    lambda d: d.set_noise_keys([0], b"\x01", [1.0], VOCAB),
], ids=["propose", "propose_ahead", "extend_batch", "finish_batch", "start_batch", "group_ids",
        "add_sequences", "seeds"])
def test_bytes_are_not_request_ids_group_ids_or_seeds(call):
    """A bytes-like object is refused as it is for token ids (token_ids.py): read element by
    element it would name request 0 (b"\\x00"), group 1 or seed 1 (b"\\x01"). The machine found
    ``finish_batch(memoryview(b"\\x00"))`` finishing request 0."""
    d, twin = NgramDrafter(), NgramDrafter()
    for drafter in (d, twin):
        drafter.start_batch([0], [[1, 2, 1]], [1])
    with pytest.raises(TypeError, match="bytes|bytearray|memoryview"):
        call(d)
    assert d.is_live(0) and not d.is_live(5)
    assert same_batch(d.propose([0]), twin.propose([0]))
    assert d.stats()["num_sequences"] == twin.stats()["num_sequences"]
