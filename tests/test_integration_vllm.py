"""rollout-spec's vLLM proposer and plugin, tested without vLLM installed.

vLLM's runner, worker and metric objects are stood in for by plain objects with the same
attribute names; tests/test_integration_vllm_real.py repeats the vLLM-facing checks against the
real package when it is importable.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest

from rollout_spec.config import SpecConfig
from rollout_spec.integrations.vllm import SpecDecodeCounters, engine_kwargs, spec_from_vllm_config
from rollout_spec.groups import prompt_group_id, text_group_id
from rollout_spec.integrations.vllm.chains import best_chain, best_chains, explicit_group_id
from rollout_spec.integrations.vllm.config import (PROPOSER_CLASS_PATH, placement_from_vllm_config,
                                                  speculative_config)
import rollout_spec.integrations.vllm.plugin as plugin
from rollout_spec.integrations.vllm.plugin import VllmProposer, check_runner, install
from rollout_spec.integrations.vllm.proposer import RolloutSpecProposer
from rollout_spec.tree import DraftBatch


class RecordingDrafter:
    """Follows the NgramDrafter contract; drafts a 2-branch tree from each request's last token."""

    def __init__(self) -> None:
        self.started: dict[int, tuple[list[int], int]] = {}
        self.context: dict[int, list[int]] = {}
        self.finished: list[int] = []
        self.steps = 0

    def start(self, req_id: int, prompt_ids: np.ndarray, group_id: int | None = None) -> None:
        self.started[req_id] = (list(map(int, prompt_ids)), group_id)
        self.context[req_id] = list(map(int, prompt_ids))

    def extend_batch(self, req_ids: list[int], token_lists: list[list[int]]) -> None:
        for r, toks in zip(req_ids, token_lists):
            self.context[r] += list(toks)

    def propose(self, req_ids: list[int], budgets=None) -> DraftBatch:
        trees = []
        for r in req_ids:
            last = self.context[r][-1]
            # best branch last+1, last+2, last+3; a worse sibling 999 under the root
            trees.append([(last + 1, -1), (999, -1), (last + 2, 0), (last + 3, 2)])
        return DraftBatch.from_lists(trees)

    def finish_batch(self, req_ids: list[int]) -> None:
        self.finished += list(req_ids)

    def end_step(self) -> None:
        self.steps += 1

    def stats(self) -> dict:
        return {"requests": len(self.started)}


def vllm_config(spec: SpecConfig | None = None, k: int = 3, max_model_len: int = 64):
    extra = engine_kwargs(spec or SpecConfig(), k)["additional_config"]
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        additional_config=extra,
    )


class FakeRunner:
    """The attributes of vLLM's GPUModelRunner that the proposer reads."""

    def __init__(self, rows: list[tuple[str, list[int], list[int]]], extra_args=None,
                 params=None, prompt_is_token_ids=None) -> None:
        """``prompt_is_token_ids``: per request id, its prompt positions' mask as vLLM's
        ``CachedRequestState.prompt_is_token_ids`` holds it (False: given as an embedding; the
        row's prompt list then stands for what vLLM leaves there); other prompts are token ids."""
        width = 64
        self.input_batch = SimpleNamespace(
            req_ids=[r for r, _, _ in rows],
            token_ids_cpu=np.zeros((len(rows), width), np.int32),
            is_token_ids=np.zeros((len(rows), width), bool),
            num_tokens_no_spec=np.array([len(p) + len(o) for _, p, o in rows], np.int32),
            num_prompt_tokens=np.array([len(p) for _, p, _ in rows], np.int32),
            req_id_to_index={r: i for i, (r, _, _) in enumerate(rows)},
        )
        for i, (rid, prompt, out) in enumerate(rows):
            seq = prompt + out
            self.input_batch.token_ids_cpu[i, : len(seq)] = seq
            self.input_batch.is_token_ids[i, : len(seq)] = True
            mask = (prompt_is_token_ids or {}).get(rid)
            if mask is not None:
                self.input_batch.is_token_ids[i, : len(prompt)] = mask
        self.requests = {
            r: SimpleNamespace(sampling_params=sampling_params(extra_args=(extra_args or {}).get(r),
                                                               **(params or {}).get(r, {})),
                               num_prompt_tokens=len(p))
            for r, p, _ in rows
        }


def sampling_params(**kw):
    """vLLM's SamplingParams as a worker holds it: no EOS id, stop id or length cap unless given."""
    return SimpleNamespace(**{"extra_args": None, "eos_token_id": None, "ignore_eos": False,
                              "stop_token_ids": [], "min_tokens": 0, "max_tokens": 1000, **kw})


SPEC_TOKENS = 1024
"""``num_spec_tokens_to_schedule`` of a scheduler without a dynamic schedule: vLLM sends its
``num_speculative_tokens``; this bound stands for it whatever the test's proposer was built with."""


def sched(finished=(), k=SPEC_TOKENS, cached=(), new=()):
    """A scheduler output; ``cached`` lists (req_id, num_output_tokens) of scheduled running
    requests, ``new`` the ids of the requests scheduled as new."""
    return SimpleNamespace(
        finished_req_ids=set(finished), num_spec_tokens_to_schedule=k,
        scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_output_tokens=[n for _, n in cached]),
    )


def test_engine_kwargs_round_trip_and_name_the_proposer():
    spec = SpecConfig(num_draft_tokens=6, group_weight=2.0, external_corpora=("a.npy",))
    kw = engine_kwargs(spec)
    assert kw["speculative_config"] == {
        "method": "custom_class", "model": PROPOSER_CLASS_PATH, "num_speculative_tokens": 6
    }
    assert kw["disable_log_stats"] is False
    assert spec_from_vllm_config(SimpleNamespace(additional_config=kw["additional_config"])) == spec
    assert spec_from_vllm_config(SimpleNamespace(additional_config=None)) == SpecConfig()
    assert PROPOSER_CLASS_PATH == f"{VllmProposer.__module__}.{VllmProposer.__name__}"


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        speculative_config(SpecConfig(), 0)
    with pytest.raises(ValueError, match="num_draft_tokens is 0"):
        speculative_config(SpecConfig(num_draft_tokens=0))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['typo'\]"):
        spec_from_vllm_config(SimpleNamespace(additional_config={"rollout_spec": {"typo": 1}}))
    with pytest.raises(ValueError, match=r"^additional_config\['rollout_spec'\]: max_depth must be in"):
        spec_from_vllm_config(SimpleNamespace(additional_config={"rollout_spec": {"max_depth": 0}}))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['a', 1\]"):  # keys of mixed types
        spec_from_vllm_config(SimpleNamespace(additional_config={"rollout_spec": {1: 2, "a": 3}}))


@pytest.mark.parametrize("extra", [["rollout_spec"], "rollout_spec", 3, "", 0, False, []])
def test_an_additional_config_that_is_no_dict_is_refused_by_type(extra):
    """vLLM's ``additional_config`` carries our options as a dict: another type is named, not read
    as "no options" (which would draft with the defaults)."""
    for read in (spec_from_vllm_config, placement_from_vllm_config):
        with pytest.raises(TypeError, match=f"^vLLM additional_config must be a dict, got {type(extra).__name__}$"):
            read(SimpleNamespace(additional_config=extra))


def test_the_replica_placement_travels_in_additional_config():
    """``engine_kwargs(placement=...)`` is read back by the proposer; none given is None, and a
    malformed one names the keys it needs."""
    from rollout_spec.distributed import ReplicaPlacement
    from rollout_spec.integrations.vllm.config import REPLICA_CONFIG_KEY

    kw = engine_kwargs(SpecConfig(shared_index="x"), placement=ReplicaPlacement(1, 3))
    assert placement_from_vllm_config(SimpleNamespace(**kw)) == ReplicaPlacement(1, 3)
    assert placement_from_vllm_config(SimpleNamespace(**engine_kwargs(SpecConfig()))) is None
    assert placement_from_vllm_config(SimpleNamespace(additional_config=None)) is None
    with pytest.raises(ValueError, match=r"replica placement must be \{'replica_id': int, 'num_replicas': int\}"):
        placement_from_vllm_config(SimpleNamespace(additional_config={REPLICA_CONFIG_KEY: {"replica_id": 1}}))
    with pytest.raises(ValueError, match=r"replica_id must be in \[0, 2\], got 3"):
        placement_from_vllm_config(SimpleNamespace(additional_config={
            REPLICA_CONFIG_KEY: {"replica_id": 3, "num_replicas": 3}}))


def test_best_chain_follows_first_children_and_stops_at_the_cap():
    batch = DraftBatch.from_lists([
        [(5, -1), (6, -1), (7, 0), (8, 1), (9, 2)],  # 5 -> 7 -> 9 is the first-child path
        [],
        [(1, -1), (2, 0), (3, 1), (4, 2)],
    ])
    assert best_chains(batch, [8, 8, 2]) == [[5, 7, 9], [], [1, 2]]
    assert best_chain(np.array([-1, -1, 1], np.int32), np.array([4, 5, 6], np.int32), 0) == []
    with pytest.raises(ValueError, match="max_lens has 1 entries"):
        best_chains(batch, [1])


def test_group_ids_are_stable_and_explicit_ones_are_checked():
    assert prompt_group_id([1, 2, 3]) == prompt_group_id(np.array([1, 2, 3], np.int32))
    assert prompt_group_id([1, 2, 3]) != prompt_group_id([1, 2, 4])
    assert 0 <= prompt_group_id([7]) < 2**31
    assert explicit_group_id(42) == 42
    # a string's id is its blake2b digest, the same in every process and release (Python's hash()
    # is salted per process), so replicas and later RL steps agree on the group
    assert explicit_group_id("prompt-17") == text_group_id("prompt-17") == 292762764
    assert explicit_group_id("prompt-17") != explicit_group_id("prompt-18")
    with pytest.raises(TypeError, match="rollout_spec_group"):
        explicit_group_id(1.5)
    with pytest.raises(ValueError, match="rollout_spec_group"):
        explicit_group_id(-1)


def test_proposer_lifecycle_over_vllm_steps():
    drafter = RecordingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=3), drafter=drafter)
    # step 1: "a" sampled its first token; "b" is still prefilling (no sampled token)
    runner = FakeRunner([("a", [10, 11], [20]), ("b", [10, 11, 12], [])],
                        extra_args={"a": {"rollout_spec_group": 5}})
    assert prop.propose_for_runner(runner, sched(), [[20], []]) == [[21, 22, 23], []]
    assert drafter.started[0] == ([10, 11], 5)
    # step 2: "a" accepted two tokens plus a bonus; "b" starts with its prompt-hash group
    runner = FakeRunner([("a", [10, 11], [20, 21, 22, 30]), ("b", [10, 11, 12], [40])])
    assert prop.propose_for_runner(runner, sched(k=2), [[21, 22, 30], [40]]) == [[31, 32], [41, 42]]
    assert drafter.context[0] == [10, 11, 20, 21, 22, 30]
    assert drafter.started[1] == ([10, 11, 12], prompt_group_id([10, 11, 12]))
    # step 3: "a" finished last step (the runner's state update says so); "b" is near
    # max_model_len=64
    prop.update_states(runner, sched(finished={"a"}))  # the runner of step 2: "a" is still in it
    assert drafter.finished == [0]
    runner = FakeRunner([("b", [10, 11, 12], [40] + [1] * 58)])  # 62 of 64: room for 1
    assert prop.propose_for_runner(runner, sched(), [[1]]) == [[2]]
    assert drafter.finished == [0]
    stats = prop.end_step()
    assert drafter.finished == [0, 1] and drafter.steps == 1
    assert stats["requests_started"] == 2 and stats["active_requests"] == 0
    assert stats["drafter/requests"] == 2


def test_a_later_turn_drafts_under_the_group_of_the_prompt_it_extends():
    """A multi-turn agent (OpenRLHF's, or any client) sends the next turn as a new request whose
    prompt is the first prompt + output + tool output: it gets the first prompt's group, the turn
    after it too; a prompt extending none keeps its own hash, and an explicit group still wins."""
    drafter = RecordingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=2), drafter=drafter)
    first, other = [10, 11, 12], [10, 11, 13]
    turn2 = first + [20, 21] + [50, 51]
    rows = [("t1", first, [20]), ("x", other, [7]), ("t2", turn2, [22]), ("t3", turn2 + [22, 52], [23]),
            ("mine", turn2, [5])]
    prop.propose_for_runner(FakeRunner(rows, extra_args={"mine": {"rollout_spec_group": 9}}), sched(),
                            [o for _, _, o in rows])
    groups = [drafter.started[i][1] for i in range(len(rows))]
    assert groups == [prompt_group_id(first), prompt_group_id(other), prompt_group_id(first),
                      prompt_group_id(first), 9]


def test_a_prompt_given_as_embeddings_starts_empty_and_in_no_group():
    """vLLM leaves an embeddings prompt's positions in its token table unwritten (stale ids of the
    row's earlier requests, zeros in a fresh row), and a mixed prompt's embedding positions hold a
    placeholder id: such a request starts with an empty prompt, drafts from its output only, and
    joins a group only where the caller named one; a prompt of token ids is as before."""
    drafter = RecordingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=2), drafter=drafter)
    placeholder = [0, 0, 0]
    rows = [("e1", placeholder, [20]), ("e2", placeholder, [30]), ("mixed", [5, 0, 6], [40]),
            ("named", placeholder, [50]), ("ids", [0, 0, 0], [60])]
    masks = {"e1": [False] * 3, "e2": [False] * 3, "mixed": [True, False, True],
             "named": [False] * 3}
    runner = FakeRunner(rows, extra_args={"named": {"rollout_spec_group": 9}},
                        prompt_is_token_ids=masks)
    drafts = prop.propose_for_runner(runner, sched(), [o for _, _, o in rows])
    assert [drafter.started[i] for i in range(len(rows))] == [
        ([], None), ([], None), ([], None), ([], 9), ([0, 0, 0], prompt_group_id([0, 0, 0]))]
    assert drafter.context[0] == [20] and drafts[0] == [21, 22]
    # the next step commits only the new output: the prompt's positions count as taken
    runner = FakeRunner([("e1", placeholder, [20, 21, 7])], prompt_is_token_ids=masks)
    prop.propose_for_runner(runner, sched(), [[21, 7]])
    assert drafter.context[0] == [20, 21, 7]


def test_a_runner_without_the_token_id_mask_reads_every_prompt_as_token_ids():
    """vLLM releases whose input batch has no ``is_token_ids`` take no prompt embeddings."""
    drafter = RecordingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=2), drafter=drafter)
    runner = FakeRunner([("a", [10, 11], [20])])
    del runner.input_batch.is_token_ids
    assert prop.propose_for_runner(runner, sched(), [[20]]) == [[21, 22]]
    assert drafter.started[0] == ([10, 11], prompt_group_id([10, 11]))


def test_plain_custom_class_call_refuses_without_the_plugin():
    prop = RolloutSpecProposer(vllm_config(), drafter=RecordingDrafter())
    with pytest.raises(RuntimeError, match="general_plugins entry point is not active"):
        prop.propose([[1]], np.zeros(1), np.zeros((1, 4)))


def make_runner_cls():
    class Runner:
        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata):
            return "vllm's own path"

        def _update_states(self, scheduler_output):
            self.updated = scheduler_output

    return Runner


def test_plugin_routes_only_our_proposer_and_is_idempotent():
    runner_cls, worker_cls = make_runner_cls(), type("Worker", (), {})
    install(runner_cls, worker_cls)
    wrapped = runner_cls.propose_draft_token_ids, runner_cls._update_states
    install(runner_cls, worker_cls)
    assert (runner_cls.propose_draft_token_ids, runner_cls._update_states) == wrapped
    other = runner_cls()
    other.drafter = object()
    assert other.propose_draft_token_ids(sched(), [[1]], None) == "vllm's own path"
    ours = FakeRunner([("a", [3, 4], [5])])
    ours.__class__ = type("R", (runner_cls,), {"__init__": lambda self: None})
    ours.drafter = RolloutSpecProposer(vllm_config(), drafter=RecordingDrafter())
    assert ours.propose_draft_token_ids(sched(), [[5]], None) == [[6, 7, 8]]
    worker = worker_cls()
    worker.model_runner = ours
    assert worker.rollout_spec_end_step()["steps_ended"] == 1
    worker.model_runner = other
    with pytest.raises(RuntimeError, match="not rollout-spec's proposer"):
        worker.rollout_spec_stats()


def test_tokens_of_skipped_draft_steps_and_their_finishes_reach_the_drafter():
    """vLLM skips the draft step for the whole batch while any row is within k tokens of
    max_model_len (and runs steps without a forward to deliver finishes): the tokens committed
    meanwhile arrive with the next draft step, read from the runner's token table, and the
    finishes through the runner's state update, which runs every step."""
    runner_cls = make_runner_cls()
    install(runner_cls, type("Worker", (), {}))
    drafter = RecordingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=3), drafter=drafter)

    def step(rows, sampled, finished=()):
        runner = FakeRunner(rows)
        runner.__class__ = type("R", (runner_cls,), {"__init__": lambda self: None})
        runner.drafter = prop
        runner._update_states(sched(finished=finished))
        assert runner.updated.finished_req_ids == set(finished)  # vLLM's own update still runs
        return runner.propose_draft_token_ids(sched(), sampled, None) if sampled is not None else None

    step([("a", [1, 2], [3]), ("b", [7], [8])], [[3], [8]])
    # two steps without a draft step: "a" commits 4, then 5 and 6; "b" commits 9 and finishes
    step([("a", [1, 2], [3, 4]), ("b", [7], [8, 9])], None)
    step([("a", [1, 2], [3, 4, 5, 6]), ("b", [7], [8, 9])], None, finished={"b"})
    assert drafter.finished == [1] and drafter.context[1] == [7, 8, 9]  # 9 taken at its finish
    step([("a", [1, 2], [3, 4, 5, 6, 7])], [[7]])
    assert drafter.context[0] == [1, 2, 3, 4, 5, 6, 7]
    # finishes are taken in the batch's row order, not the set's (which moves with the hash seed)
    step([("z", [5], [6]), ("c", [5], [7]), ("a", [1, 2], [3, 4, 5, 6, 7])], [[6], [7], []])
    step([("z", [5], [6]), ("c", [5], [7]), ("a", [1, 2], [3, 4, 5, 6, 7])], None, finished={"a", "c", "z"})
    assert drafter.finished == [1, 2, 3, 0]


def test_tokens_vllm_discards_after_the_draft_step_are_taken_back():
    """A failed KV load makes vLLM's scheduler drop tokens the runner sampled (and our draft step
    saw); it reports the shorter output in ``scheduled_cached_reqs.num_output_tokens`` and the
    runner truncates its token table. The drafter must not keep the dropped token, nor skip the
    one sampled in its place at the same position."""
    drafter = RecordingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=3), drafter=drafter)
    prop.propose_for_runner(FakeRunner([("a", [1, 2], [3])]), sched(), [[3]])
    runner = FakeRunner([("a", [1, 2], [3, 4])])
    prop.propose_for_runner(runner, sched(), [[4]])
    prop.update_states(runner, sched(cached=[("a", 1)]))  # token 4 was dropped
    # vLLM recomputes "a" (a prefill chunk, no draft), then samples 9 where 4 was
    assert prop.propose_for_runner(FakeRunner([("a", [1, 2], [3])]), sched(), [[]]) == [[]]
    assert prop.propose_for_runner(FakeRunner([("a", [1, 2], [3, 9])]), sched(), [[9]]) == [[10, 11, 12]]
    assert drafter.context[prop._ids["a"]] == [1, 2, 3, 9]
    assert drafter.finished == [0]  # the stale copy is let go, not kept live
    prop.update_states(runner, sched(cached=[("a", 2)]))  # nothing dropped: no restart
    assert drafter.finished == [0]


def test_a_streaming_sessions_next_input_chunk_starts_over_from_its_rebuilt_row():
    """A resumable request's input chunk ends at a stop that vLLM's scheduler does not report
    finished (here one our stop rule does not cover, as its ``repetition_detection``). Its next
    chunk comes back under the same id as a new request, its row rebuilt: the output but the last
    token (4) is now prompt, then the new input (6, 7), with the new chunk's sampling params. The
    drafter must not keep 4 nor skip 6, and must stop the request by the new params."""
    drafter = RecordingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=3), drafter=drafter)
    prop.propose_for_runner(FakeRunner([("s", [1, 2], [3])]), sched(), [[3]])
    first = FakeRunner([("s", [1, 2], [3, 4])])
    prop.propose_for_runner(first, sched(), [[4]])  # vLLM stops the chunk at 4
    prop.update_states(first, sched(new=["s"]))  # the next chunk, scheduled as new
    assert drafter.finished == [0] and drafter.context[0] == [1, 2, 3, 4]
    rebuilt = [("s", [1, 2, 3, 6, 7], [])]
    assert prop.propose_for_runner(FakeRunner(rebuilt), sched(), [[]]) == [[]]  # its prefill
    capped = {"s": {"max_tokens": 2}}
    assert prop.propose_for_runner(
        FakeRunner([("s", [1, 2, 3, 6, 7], [8])], params=capped), sched(), [[8]]) == [[9, 10, 11]]
    assert drafter.started[1] == ([1, 2, 3, 6, 7], drafter.started[0][1])  # its group kept
    assert drafter.context[1] == [1, 2, 3, 6, 7, 8]
    last = FakeRunner([("s", [1, 2, 3, 6, 7], [8, 9])], params=capped)
    assert prop.propose_for_runner(last, sched(), [[9]]) == [[]]  # the chunk's max_tokens
    assert drafter.finished == [0, 1]
    prop.update_states(last, sched(new=["s"]))  # a chunk after one we finished: nothing held
    assert drafter.finished == [0, 1]


def test_a_request_vllm_runs_on_past_our_stop_rule_is_not_restarted_at_every_step():
    """vLLM 0.29 caps a streaming session's chunks by the first chunk's max_tokens, while our
    stop rule reads the chunk's own: where that is smaller, vLLM runs the request on after the
    proposer finished it. It stays finished, undrafted, until vLLM reports it finished or lists
    it as new; it is not started over (its whole row indexed again) at every step."""
    drafter = RecordingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=2), drafter=drafter)
    capped = {"s": {"max_tokens": 1}}
    prop.propose_for_runner(FakeRunner([("s", [1, 2], [3])], params=capped), sched(), [[3]])
    assert drafter.finished == [0]
    for out in ([3, 4], [3, 4, 5]):  # vLLM runs on
        runner = FakeRunner([("s", [1, 2], out), ("t", [7], [8])], params=capped)
        assert prop.propose_for_runner(runner, sched(), [[out[-1]], [8]]) == [[], [9, 10]]
    assert sorted(drafter.started) == [0, 1] and drafter.finished == [0]
    prop.update_states(runner, sched(finished={"s"}))  # vLLM finishes it: forgotten
    prop.propose_for_runner(FakeRunner([("s", [1, 2, 3, 4, 5], [6])]), sched(), [[6]])
    assert drafter.started[2] == ([1, 2, 3, 4, 5], drafter.started[0][1])  # a next chunk starts


class RefusingDrafter(RecordingDrafter):
    """Refuses a whole ``extend_batch`` holding a request id of ``refused``, as NgramDrafter does
    with an id it does not hold: every id is checked before any token is stored."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: set[int] = set()

    def extend_batch(self, req_ids: list[int], token_lists: list[list[int]]) -> None:
        bad = self.refused.intersection(req_ids)
        if bad:
            raise ValueError(f"req_ids: unknown request id {min(bad)}")
        super().extend_batch(req_ids, token_lists)


def test_a_refused_extend_leaves_every_row_to_be_extended_again():
    """The drafter refuses a draft step's extend over one row's id: no row's tokens reached it,
    so the next draft step sends them all again (none is counted as held)."""
    drafter = RefusingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=3), drafter=drafter)
    prop.propose_for_runner(FakeRunner([("a", [1, 2], [3]), ("b", [7], [8])]), sched(), [[3], [8]])
    step2 = FakeRunner([("a", [1, 2], [3, 4]), ("b", [7], [8, 9])])
    drafter.refused = {1}
    with pytest.raises(ValueError, match="unknown request id 1"):
        prop.propose_for_runner(step2, sched(), [[4], [9]])
    assert drafter.context == {0: [1, 2, 3], 1: [7, 8]}
    drafter.refused = set()
    assert prop.propose_for_runner(step2, sched(), [[4], [9]]) == [[5, 6, 7], [10, 11, 12]]
    assert drafter.context == {0: [1, 2, 3, 4], 1: [7, 8, 9]}


def test_a_refused_extend_at_the_finish_leaves_the_tokens_unheld():
    """A refused extend of finished requests' last tokens stores none of them: the proposer
    keeps counting them as unsent, so a retried state update delivers them."""
    drafter = RefusingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=3), drafter=drafter)
    prop.propose_for_runner(FakeRunner([("a", [1, 2], [3]), ("b", [7], [8])]), sched(), [[3], [8]])
    runner = FakeRunner([("a", [1, 2], [3, 4]), ("b", [7], [8, 9])])
    drafter.refused = {1}
    with pytest.raises(ValueError, match="unknown request id 1"):
        prop.update_states(runner, sched(finished={"a", "b"}))
    drafter.refused = set()
    prop.update_states(runner, sched(finished={"a", "b"}))
    assert drafter.context == {0: [1, 2, 3, 4], 1: [7, 8, 9]} and drafter.finished == [0, 1]


EOS = 2


def test_tokens_after_a_stop_in_a_verify_step_stay_out_of_the_drafter():
    """vLLM's runner writes every accepted token of a step into its token table, also those after
    the EOS; its scheduler drops them only after our draft step. "a" accepts [21, EOS] and the
    bonus token 22 after it: the drafter gets [21, EOS], "a" no draft, and the scheduler's finish
    next step adds nothing. "b", with ignore_eos, keeps drafting through its EOS."""
    drafter = RecordingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=3), drafter=drafter)
    params = {"a": {"eos_token_id": EOS}, "b": {"eos_token_id": EOS, "ignore_eos": True}}
    step1 = FakeRunner([("a", [10, 11], [20]), ("b", [12], [20])], params=params)
    assert prop.propose_for_runner(step1, sched(), [[20], [20]]) == [[21, 22, 23], [21, 22, 23]]
    step2 = FakeRunner([("a", [10, 11], [20, 21, EOS, 22]), ("b", [12], [20, EOS, 5])], params=params)
    assert prop.propose_for_runner(step2, sched(), [[21, EOS, 22], [EOS, 5]]) == [[], [6, 7, 8]]
    assert drafter.context[0] == [10, 11, 20, 21, EOS]
    assert drafter.context[1] == [12, 20, EOS, 5]
    assert drafter.finished == [0]  # finished at its EOS, as vLLM's scheduler does next
    prop.update_states(step2, sched(finished={"a"}))
    assert drafter.context[0] == [10, 11, 20, 21, EOS] and drafter.finished == [0]
    assert prop.stats()["requests_finished"] == 1


@pytest.mark.parametrize("params, kept", [
    ({"stop_token_ids": [7]}, [20, 7]),
    # vLLM's check_stop tests stop ids before min_tokens (a grammar that allows only a stop id
    # gets it unmasked): a stop id sampled before min_tokens stops the request too
    ({"stop_token_ids": [7], "min_tokens": 3}, [20, 7]),
    ({"eos_token_id": 7, "min_tokens": 4}, [20, 7]),
    ({"max_tokens": 3}, [20, 7, 30]),
    ({"eos_token_id": EOS, "max_tokens": 5}, [20, 7, 30, 7, 31]),
    ({"eos_token_id": 7, "ignore_eos": True}, [20, 7, 30, 7, 31, 32]),  # not stopped
])
def test_a_request_is_cut_where_vllms_check_stop_stops_it(params, kept):
    """Stop token ids, min_tokens and max_tokens, applied to each output token in turn."""
    drafter = RecordingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=4), drafter=drafter)
    prop.propose_for_runner(FakeRunner([("a", [1], [20])], params={"a": params}), sched(), [[20]])
    runner = FakeRunner([("a", [1], [20, 7, 30, 7, 31, 32])], params={"a": params})
    draft = prop.propose_for_runner(runner, sched(), [[7, 30, 7, 31, 32]])
    assert drafter.context[0] == [1] + kept
    assert draft == ([[]] if len(kept) < 6 else [[33, 34, 35]])
    assert drafter.finished == ([0] if len(kept) < 6 else [])


def test_the_schedulers_number_of_spec_tokens_bounds_the_chains():
    """vLLM's dynamic speculative decoding (``num_speculative_tokens_per_batch_size``) sets
    ``num_spec_tokens_to_schedule`` per step, 0 included: then no row gets a draft (vLLM's own
    ngram proposer gives none), but the committed tokens and stops still reach the drafter."""
    drafter = RecordingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=3), drafter=drafter)
    params = {"b": {"eos_token_id": EOS}}
    step1 = FakeRunner([("a", [10], [20]), ("b", [11], [30])], params=params)
    assert prop.propose_for_runner(step1, sched(k=0), [[20], [30]]) == [[], []]
    assert drafter.context == {0: [10, 20], 1: [11, 30]} and prop.stats()["rows_drafted"] == 0
    step2 = FakeRunner([("a", [10], [20, 21]), ("b", [11], [30, EOS])], params=params)
    assert prop.propose_for_runner(step2, sched(k=2), [[21], [EOS]]) == [[22, 23], []]
    assert drafter.context == {0: [10, 20, 21], 1: [11, 30, EOS]} and drafter.finished == [1]


def test_a_stop_in_a_skipped_draft_step_is_cut_at_the_finish():
    """vLLM skipped the draft step (a row near max_model_len) in which "a" sampled EOS and a
    token after it; the scheduler reports "a" finished: only the tokens up to the EOS reach the
    drafter."""
    drafter = RecordingDrafter()
    prop = RolloutSpecProposer(vllm_config(k=3), drafter=drafter)
    params = {"a": {"eos_token_id": EOS}}
    prop.propose_for_runner(FakeRunner([("a", [10, 11], [20])], params=params), sched(), [[20]])
    runner = FakeRunner([("a", [10, 11], [20, 21, EOS, 22])], params=params)
    prop.update_states(runner, sched(finished={"a"}))
    assert drafter.context[0] == [10, 11, 20, 21, EOS] and drafter.finished == [0]


def test_plugin_refuses_a_changed_upstream_signature():
    class Runner:
        def propose_draft_token_ids(self, sampled_token_ids, scheduler_output):
            return None

    with pytest.raises(RuntimeError, match="propose_draft_token_ids starts with .*expected \\('self', 'scheduler_output'"):
        check_runner(Runner)
    runner = make_runner_cls()
    del runner._update_states
    with pytest.raises(RuntimeError, match="GPUModelRunner._update_states is gone"):
        check_runner(runner)
    runner._update_states = lambda self, new_reqs, scheduler_output: None  # its arguments changed
    with pytest.raises(RuntimeError, match=r"_update_states starts with \('self', 'new_reqs'\)"):
        check_runner(runner)


def test_counters_from_a_metrics_snapshot():
    def metric(name, **kw):
        return SimpleNamespace(name=name, labels={}, **kw)

    snap = [
        metric("vllm:spec_decode_num_drafts", value=10),
        metric("vllm:spec_decode_num_draft_tokens", value=40),
        metric("vllm:spec_decode_num_accepted_tokens", value=20),
        metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[9, 6, 4, 1]),
        metric("vllm:spec_decode_num_drafts", value=2),  # a second engine
        metric("vllm:num_requests_running", value=3),
    ]
    c = SpecDecodeCounters.from_metrics(snap)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (12, 40, 20)
    assert c.accepted_per_pos == (9, 6, 4, 1)
    assert c.accept_rate == 0.5 and c.accept_length == pytest.approx(1 + 20 / 12)
    step = c - SpecDecodeCounters(2, 10, 2, (2,))
    assert step.as_log_dict()["rollout/spec_accept_rate"] == pytest.approx(18 / 30)
    assert SpecDecodeCounters().accept_rate == 0.0 and SpecDecodeCounters().accept_length == 1.0


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "rollout_spec"]
    assert ours, "reinstall rollout-spec (pip install -e .) to register the vLLM plugin"
    from rollout_spec.integrations.vllm.plugin import register

    assert ours[0].load() is register


def test_real_drafter_drafts_a_siblings_continuation():
    from rollout_spec.drafter import NgramDrafter

    prop = RolloutSpecProposer(vllm_config(SpecConfig(num_draft_tokens=4), k=4))
    assert isinstance(prop.drafter, NgramDrafter)
    prompt, answer = [101, 102, 103, 104, 105, 106], [7, 8, 9, 10, 11, 12, 13, 14]
    for t in range(len(answer)):  # sibling "0_p" writes its answer while "1_p" is prefilling
        runner = FakeRunner([("0_p", prompt, answer[: t + 1])])
        prop.propose_for_runner(runner, sched(), [[answer[t]]])
    runner = FakeRunner([("1_p", prompt, answer[:2])])
    [draft] = prop.propose_for_runner(runner, sched(finished={"0_p"}), [answer[:2]])
    # how far the drafter trusts one sibling is its policy; the draft must continue the sibling
    assert 1 <= len(draft) <= 4 and draft == answer[2 : 2 + len(draft)], draft


def test_chain_fast_path_matches_the_tree_walk():
    rng = np.random.default_rng(1)
    trees = []
    for _ in range(200):
        n = int(rng.integers(0, 7))
        if rng.random() < 0.5:
            trees.append([(int(rng.integers(0, 50)), i - 1) for i in range(n)])  # a chain
        else:
            trees.append([(int(rng.integers(0, 50)), int(rng.integers(-1, i))) for i in range(n)])
    batch = DraftBatch.from_lists(trees)
    caps = [int(c) for c in rng.integers(0, 8, len(trees))]
    walked = [best_chain(np.array([p for _, p in t], np.int32).reshape(-1),
                         np.array([tok for tok, _ in t], np.int32).reshape(-1), c)
              for t, c in zip(trees, caps)]
    assert best_chains(batch, caps) == walked


def test_vllm_builds_our_proposer_only_where_the_plugin_patched_the_runner(monkeypatch):
    monkeypatch.setattr(plugin, "_install_error", "ImportError: no GPU model runner")
    with pytest.raises(RuntimeError, match="plugin is not active in this process \\(ImportError"):
        VllmProposer(vllm_config())
    monkeypatch.setattr(plugin, "_install_error", None)
    assert isinstance(VllmProposer(vllm_config()), RolloutSpecProposer)


@pytest.mark.parametrize("value", ["0", "false", " Off ", "NO"])
def test_register_keeps_vllm_usable_when_it_cannot_patch(monkeypatch, value):
    monkeypatch.setenv(plugin.DISABLE_ENV, value)
    monkeypatch.setattr(plugin, "install", lambda *a: pytest.fail("patched although disabled"))
    plugin.register()
    assert plugin._install_error == f"{plugin.DISABLE_ENV}={value} in this process"


def test_register_refuses_a_plugin_switch_that_is_not_yes_or_no(monkeypatch):
    monkeypatch.setenv(plugin.DISABLE_ENV, "disable")
    with pytest.raises(ValueError, match="ROLLOUT_SPEC_VLLM_PLUGIN must be one of 1/0, true/false, "
                                         "yes/no, on/off, got 'disable'"):
        plugin.register()


def test_register_without_vllm_logs_instead_of_raising(monkeypatch):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: tests/test_integration_vllm_real.py covers register()")
    monkeypatch.setattr(plugin, "_install_error", None)
    plugin.register()
    assert plugin._install_error.startswith("ModuleNotFoundError: No module named 'vllm")


def test_shared_index_is_refused_with_vllm_data_parallel_engines():
    """Each data-parallel engine's first tensor-parallel rank would share its own index under the
    one replica id; a replica never pulls its own publications, so they would not learn each other's."""
    cfg = vllm_config(SpecConfig(shared_index="job"))
    cfg.parallel_config = SimpleNamespace(data_parallel_size=2)
    with pytest.raises(ValueError, match="shared_index needs data_parallel_size=1, got 2"):
        RolloutSpecProposer(cfg)
    assert RolloutSpecProposer(cfg, share_index=False).drafter is not None  # a rank that does not share
