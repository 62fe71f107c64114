"""``SpecConfig.shared_index`` through the real adapter code, replicas in separate Ray processes.

Replica 0 drafts for vLLM (``RolloutSpecProposer``, built from a vLLM config as the vLLM worker
builds it), replica 1 for SGLang (``RolloutSpecCorpus``, configured from the environment as
SGLang's scheduler process builds it). Each generates with its engine's call sequence, ends the
step with its engine's boundary call, and the other proposes the response it never saw. The
embedded engine is covered by two tiny engines sharing through ``attach_shared_index``.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the shared index needs Ray: pip install 'rollout-spec[ray]'")

from rollout_spec.config import SpecConfig  # noqa: E402
from rollout_spec.distributed import (  # noqa: E402
    ReplicaPlacement,
    SharingDrafter,
    destroy_coordinators,
    ensure_coordinators,
    placement_from_env,
    share_drafter,
)
from rollout_spec.distributed.placement import ENV_NUM_REPLICAS, ENV_REPLICA_ID, NAMESPACE  # noqa: E402
from rollout_spec.groups import prompt_group_id  # noqa: E402
from polling import wait_until  # noqa: E402

PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster; its workers get tests/ on their path to import the actor classes."""
    here = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


def _spec(name: str) -> SpecConfig:
    return SpecConfig(num_draft_tokens=8, tree=False, shared_index=name)


@ray.remote(num_cpus=0)
class VllmReplica:
    """vLLM's worker side: the proposer vLLM builds from its config, driven as its runner does."""

    def __init__(self, spec: SpecConfig, placement: ReplicaPlacement) -> None:
        from rollout_spec.integrations.vllm.config import engine_kwargs
        from rollout_spec.integrations.vllm.proposer import RolloutSpecProposer

        extra = engine_kwargs(spec, placement=placement)["additional_config"]
        cfg = SimpleNamespace(additional_config=extra, model_config=SimpleNamespace(max_model_len=4096),
                              speculative_config=SimpleNamespace(num_speculative_tokens=8))
        self.proposer = RolloutSpecProposer(cfg)

    def _rows(self, rid: str, tokens: list[int], sampled: list[int]) -> list[int]:
        """One draft step; ``sampled`` are the tokens this verify step committed."""
        table = np.array([tokens])
        return self.proposer.propose_rows([rid], [sampled], np.array([len(tokens)]), np.array([len(PROMPT)]),
                                          table, lambda _rid, prompt: prompt_group_id(prompt), 8)[0]

    def generate(self, rid: str, response: list[int]) -> None:
        """A request's decode steps, then vLLM's finish and the trainer's step boundary."""
        done = 0
        for end in range(1, len(response) + 1, 5):
            self._rows(rid, PROMPT + response[:end], response[done:end])
            done = end
        self.proposer.finish([rid])
        self.proposer.end_step()

    def propose(self, rid: str, context: list[int]) -> list[int]:
        return self._rows(rid, PROMPT + context, context[-1:])

    def applied(self) -> float:
        return self.proposer.stats()["drafter/shared_index/sequences_applied"]


@ray.remote(num_cpus=0)
class SglangReplica:
    """SGLang's scheduler side: placement and options from the environment, as verl's server sets them."""

    def __init__(self, spec: SpecConfig, placement: ReplicaPlacement) -> None:
        from rollout_spec.integrations.sglang.config import spec_to_env
        from rollout_spec.integrations.sglang.corpus import RolloutSpecCorpus

        placement.to_env()
        spec_to_env(spec)
        self.corpus = RolloutSpecCorpus(draft_token_num=9, forward_hook=False)  # no SGLang worker

    def _get(self, rid: str, tokens: list[int]) -> list[int]:
        from rollout_spec.integrations.sglang.rid import rid_with_group

        ids, _ = self.corpus.batch_get([rid_with_group(rid, PROMPT)], [tokens[-64:]], [len(tokens)])
        return ids[1:].tolist()  # ids[0] is the root (the last committed token); tree=False: a chain

    def generate(self, rid: str, response: list[int]) -> None:
        """batch_get per decode step, erase when the request leaves, reset at the step boundary."""
        for end in range(1, len(response) + 1, 5):
            self._get(rid, PROMPT + response[:end])
        from rollout_spec.integrations.sglang.rid import rid_with_group

        self.corpus.erase_match_state([rid_with_group(rid, PROMPT)])
        self.corpus.reset()

    def propose(self, rid: str, context: list[int]) -> list[int]:
        return self._get(rid, PROMPT + context)

    def applied(self) -> float:
        return self.corpus.stats()["shared_index/sequences_applied"]


def _response(seed: int, length: int = 40) -> list[int]:
    return np.random.default_rng(seed).choice(np.arange(1000, 30000), size=length, replace=False).tolist()


def test_vllm_and_sglang_replicas_propose_each_others_samples(ray_cluster) -> None:
    name = f"wire-{uuid.uuid4().hex[:8]}"
    spec = _spec(name)
    first = ensure_coordinators(spec, num_replicas=2)  # the driver, as the verl/OpenRLHF hooks do
    again = ensure_coordinators(spec, num_replicas=2)  # hooks may run once per replica object: same actors
    assert [h._actor_id for h in again] == [h._actor_id for h in first]
    vllm = VllmReplica.remote(spec, ReplicaPlacement(0, 2))
    sglang = SglangReplica.remote(spec, ReplicaPlacement(1, 2))
    first, second = _response(1), _response(2)
    assert ray.get(sglang.propose.remote("b0", first[:6]))[:3] != first[6:9]  # never seen there
    ray.get(vllm.generate.remote("a0", first))
    wait_until(lambda: ray.get(sglang.applied.remote()), "the SGLang replica did not ingest the vLLM sample",
               until=lambda applied: applied >= 1, timeout_s=30.0)
    assert ray.get(sglang.propose.remote("b1", first[:6]))[:8] == first[6:14]
    ray.get(sglang.generate.remote("b2", second))
    wait_until(lambda: ray.get(vllm.applied.remote()), "the vLLM replica did not ingest the SGLang sample",
               until=lambda applied: applied >= 1, timeout_s=30.0)
    assert ray.get(vllm.propose.remote("a1", second[:10]))[:8] == second[10:18]
    for actor in (vllm, sglang):
        ray.kill(actor)
    destroy_coordinators(name, 1, namespace=NAMESPACE)


def test_embedded_engines_share_through_attach_shared_index(ray_cluster) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from rollout_spec.config import SamplingParams
    from rollout_spec.engine import RolloutEngine
    from rollout_spec.engine.weights import build_model
    from rollout_spec.rollout import attach_shared_index

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model = build_model(cfg, {k.removeprefix("model."): v for k, v in ref.state_dict().items()},
                        torch.device("cpu"), torch.float32)
    name = f"emb-{uuid.uuid4().hex[:8]}"
    ensure_coordinators(_spec(name), num_replicas=2)

    def engine(spec: SpecConfig) -> RolloutEngine:
        return RolloutEngine(model, None, spec, num_slots=4, max_model_len=128, draft_budget=lambda _n: 8)

    a, b, alone = engine(_spec(name)), engine(_spec(name)), engine(SpecConfig(num_draft_tokens=8, tree=False))
    shared_b = attach_shared_index(b, ReplicaPlacement(1, 2), poll_interval_s=0.02)
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=48)
    with pytest.raises(ValueError, match=ENV_REPLICA_ID):
        a.generate([PROMPT], greedy)  # a session attaches from the environment, which is not set here
    assert isinstance(attach_shared_index(a, ReplicaPlacement(0, 2)), SharingDrafter)
    out_a = a.generate([PROMPT], greedy)
    a.end_step()  # the RL step boundary publishes
    wait_until(lambda: shared_b.stats()["shared_index/sequences_applied"], "engine b did not ingest a's 2 samples",
               until=lambda applied: applied >= 2, timeout_s=30.0)
    single = SamplingParams(n=1, temperature=0.0, max_new_tokens=48)
    out_b, out_alone = b.generate([PROMPT], single)[0], alone.generate([PROMPT], single)[0]
    assert out_b.token_ids == out_a[0].token_ids == out_alone.token_ids  # lossless either way
    assert out_b.num_accepted_tokens >= 0.6 * len(out_b.token_ids) > out_alone.num_accepted_tokens
    for sharing in (a.drafter, shared_b):  # their pullers must not outlive the cluster
        sharing.index.close()
    destroy_coordinators(name, 1, namespace=NAMESPACE)


class _FakeIndex:
    """What SharingDrafter needs of SharedIndexClient, recorded."""

    def __init__(self, latest_step: int = -1, step_at_join: int = -1) -> None:
        self.latest_step, self.step_at_join = latest_step, step_at_join
        self.recorded, self.published = [], []

    def record(self, group_id: int, tokens: list[int]) -> None:
        self.recorded.append((group_id, list(tokens)))

    def join(self) -> None:
        """Its first pull has returned: ``step_at_join`` is what the test set."""

    def publish(self, step: int) -> None:
        self.published.append(step)

    def stats(self) -> dict:
        return {"publishes": float(len(self.published))}


def test_sharing_drafter_records_grouped_responses_and_numbers_steps_like_the_job() -> None:
    from rollout_spec.drafter import NgramDrafter

    index = _FakeIndex(latest_step=6, step_at_join=5)  # restarted in step 6, which a peer has ended
    shared = SharingDrafter(NgramDrafter(SpecConfig()), index)
    shared.start_batch([1, 2], [[5, 6], [5, 6]], [9, None])
    shared.extend_batch([1, 2], [[7, 8], [7]])
    shared.extend(1, np.array([9]))
    shared.finish_batch([1, 2])
    shared.start(3, [5], group_id=4)
    shared.finish(3)  # nothing committed: nothing recorded
    assert index.recorded == [(9, [7, 8, 9])]  # the groupless request is not shared
    shared.end_step()
    shared.end_step()
    assert index.published == [6, 7] and shared.stats()["shared_index/publishes"] == 2.0
    assert shared.is_live(1) is False  # everything else reaches the wrapped drafter


def test_a_sharing_drafter_without_its_fields_raises_attribute_error_not_recursion() -> None:
    """``__getattr__`` forwards to ``drafter``: on an instance whose fields are not set yet (as
    copy and pickle make it before restoring its state) asking for them must raise
    AttributeError, or the forward would recurse until RecursionError."""
    import copy

    from rollout_spec.drafter import NgramDrafter

    bare = SharingDrafter.__new__(SharingDrafter)
    for name in ("drafter", "index", "is_live"):
        with pytest.raises(AttributeError, match="^(drafter|index)$"):
            getattr(bare, name)
    shared = SharingDrafter(NgramDrafter(SpecConfig()), _FakeIndex())
    clone = copy.copy(shared)
    assert clone.drafter is shared.drafter and clone.index is shared.index
    assert clone.is_live(1) is False


def test_no_coordinators_are_made_without_a_shared_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """The framework hooks call ``ensure_coordinators`` whatever the config: without
    ``shared_index`` it returns [] and never joins Ray."""
    from rollout_spec.distributed import sharing

    monkeypatch.setattr(sharing, "_join_ray", lambda: pytest.fail("joined Ray"))
    assert ensure_coordinators(SpecConfig(), num_replicas=2) == []


@pytest.mark.parametrize("latest_at_end", [3, 2], ids=["a-peer-ended-first", "it-ends-first"])
def test_a_replica_restarted_mid_step_labels_it_as_the_step_it_is_in(latest_at_end: int) -> None:
    """Joined when step 2 was the newest published, it generates for step 3: labelled 3 whether
    or not a peer has ended step 3 first (labelled 2, the coordinators would evict it with step 2's
    publications, one step early), then 4, 5 as the job goes on."""
    from rollout_spec.drafter import NgramDrafter

    index = _FakeIndex(latest_step=latest_at_end, step_at_join=2)
    shared = SharingDrafter(NgramDrafter(SpecConfig()), index)
    shared.end_step()
    index.latest_step = 4  # the peers are ahead again by its next boundary: it follows them
    shared.end_step()
    shared.end_step()
    assert index.published == [3, 4, 5]
    fresh = _FakeIndex()  # a job's first step: no step published when it joined
    SharingDrafter(NgramDrafter(SpecConfig()), fresh).end_step()
    assert fresh.published == [0]


class _StoppedPullerIndex(_FakeIndex):
    """An index whose puller stopped: ``publish`` raises its error until the owner restarts it."""

    def __init__(self) -> None:
        super().__init__()
        self.stopped = False

    def publish(self, step: int) -> None:
        if self.stopped:
            raise RuntimeError("shared-index puller thread failed")
        super().publish(step)


def test_a_step_whose_publish_failed_still_counts() -> None:
    """Steps 1 and 2 end with the puller stopped: the drafter ages and the boundary raises. After
    the restart the replica is in step 3 and labels it 3; labelled 1 (its peers at 3), the
    coordinators would evict it two steps early, or drop it as stale at ``history_steps`` 1."""
    from rollout_spec.drafter import NgramDrafter

    index = _StoppedPullerIndex()
    drafter = NgramDrafter(SpecConfig())
    shared = SharingDrafter(drafter, index)
    shared.end_step()
    index.stopped = True
    for _ in range(2):
        with pytest.raises(RuntimeError, match="puller thread failed"):
            shared.end_step()
    index.stopped = False  # the owner called restart(); no peer's step 3 reached it yet
    shared.end_step()
    assert index.published == [0, 3] and drafter.stats()["step"] == 4


def test_sharing_drafter_takes_group_ids_as_an_array() -> None:
    """Group ids as numpy arrays (as the engine may pass them) are followed like a list's."""
    from rollout_spec.drafter import NgramDrafter

    index = _FakeIndex(latest_step=0)
    shared = SharingDrafter(NgramDrafter(SpecConfig()), index)
    shared.start_batch(np.array([1, 2]), [[5, 6], [5, 6]], np.array([9, 9]))
    shared.extend_batch([1, 2], [[7], [8]])
    shared.finish_batch([1, 2])
    assert index.recorded == [(9, [7]), (9, [8])]


def test_placement_comes_from_the_hook_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = object()
    assert share_drafter(plain, SpecConfig(), None) is plain  # no shared_index: nothing changes
    monkeypatch.delenv(ENV_REPLICA_ID, raising=False)
    monkeypatch.delenv(ENV_NUM_REPLICAS, raising=False)
    assert placement_from_env() is None
    with pytest.raises(ValueError, match=ENV_NUM_REPLICAS):
        share_drafter(plain, SpecConfig(shared_index="x"), None)
    monkeypatch.setenv(ENV_REPLICA_ID, "3")
    with pytest.raises(ValueError, match="both"):
        placement_from_env()
    monkeypatch.setenv(ENV_NUM_REPLICAS, "3")
    with pytest.raises(ValueError, match="replica_id must be in"):
        placement_from_env()
    monkeypatch.setenv(ENV_NUM_REPLICAS, "4")
    assert placement_from_env() == ReplicaPlacement(3, 4)
    assert ReplicaPlacement.from_dict(ReplicaPlacement(3, 4).as_dict()) == ReplicaPlacement(3, 4)
    with pytest.raises(ValueError, match="replica placement"):
        ReplicaPlacement.from_dict({"replica_id": 1})
    with pytest.raises(ValueError, match="shared_index"):
        SpecConfig(shared_index="")


def test_sglang_corpus_refuses_a_shared_index_under_tensor_parallelism(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_spec.integrations.sglang import corpus

    monkeypatch.setattr(corpus, "_tensor_parallel_size", lambda: 2)
    with pytest.raises(ValueError, match="tensor parallelism"):
        corpus.RolloutSpecCorpus(spec=SpecConfig(shared_index="x"))
    assert corpus.RolloutSpecCorpus(spec=SpecConfig()).spec.shared_index is None  # no index: TP is fine


def test_sglang_corpus_shares_its_drafter_once_on_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """With tp_size 1 the corpus wraps its drafter through ``share_drafter`` (placement from the
    environment: None); a drafter that already shares is kept as it is, not wrapped twice."""
    from rollout_spec.distributed import sharing
    from rollout_spec.drafter import NgramDrafter
    from rollout_spec.integrations.sglang import corpus

    spec = SpecConfig(shared_index="x")
    wrapped = SharingDrafter(NgramDrafter(spec), _FakeIndex())
    calls = []
    monkeypatch.setattr(corpus, "_tensor_parallel_size", lambda: 1)
    monkeypatch.setattr(sharing, "share_drafter", lambda *args: calls.append(args) or wrapped)
    plain = NgramDrafter(spec)
    assert corpus.RolloutSpecCorpus(spec=spec, drafter=plain, forward_hook=False).drafter is wrapped
    assert corpus.RolloutSpecCorpus(spec=spec, drafter=wrapped, forward_hook=False).drafter is wrapped
    assert calls == [(plain, spec, None)]


class _PlainDrafter:
    """A drafter whose ``extend_batch`` takes no ``background`` (records its calls)."""

    def __init__(self) -> None:
        self.extended: list[tuple[list[int], list[list[int]]]] = []

    def start_batch(self, req_ids, prompts, group_ids=None) -> None:
        pass

    def extend_batch(self, req_ids, token_lists) -> None:
        self.extended.append((list(req_ids), [list(t) for t in token_lists]))


def test_sharing_drafter_passes_background_only_to_a_drafter_that_indexes_in_background() -> None:
    from rollout_spec.drafter import NgramDrafter, indexes_in_background

    plain = SharingDrafter(_PlainDrafter(), _FakeIndex(latest_step=0))
    assert not indexes_in_background(plain)
    plain.start_batch([1], [[5, 6]], [3])
    plain.extend_batch([1], [[7]], background=True)  # no TypeError: extended at once
    assert plain.drafter.extended == [([1], [[7]])]

    ngram, alone = SharingDrafter(NgramDrafter(SpecConfig()), _FakeIndex(latest_step=0)), NgramDrafter(SpecConfig())
    assert indexes_in_background(ngram)
    for d, background in ((ngram, True), (alone, False)):
        d.start_batch([1], [[5, 6, 5]], [3])
        d.extend_batch([1], [[6, 5]], background=background)
    assert ngram.drafter.stats() == alone.stats()  # stats wait for the indexing, like any later call
    assert ngram.propose([1]).tokens.tolist() == alone.propose([1]).tokens.tolist() == [6, 5, 6, 5]
