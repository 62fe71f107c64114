"""The vLLM plugin against the real vLLM package (the ``[vllm]`` extra); skipped without it.

What runs on a CPU-only machine: plugin discovery through vLLM's own loader, vLLM's
SpeculativeConfig accepting our config and choosing the custom_class method, vLLM's
custom-proposer factory building our proposer, the patched GPUModelRunner.propose_draft_token_ids
driven with vLLM's real InputBatch/CachedRequestState/SchedulerOutput, and vLLM's Prometheus
spec-decode counters read back. What needs a GPU and is NOT run here: a full engine step (model
forward, rejection sampling, the scheduler feeding SpecDecodingStats from real verification).
"""
from __future__ import annotations

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed (pip install 'rollout-spec[vllm]'); CI does not install "
    "it because it pins its own torch build"
)
torch = pytest.importorskip("torch")

from rollout_spec.config import SpecConfig  # noqa: E402
from rollout_spec.integrations.vllm import SpecDecodeCounters, engine_kwargs  # noqa: E402
from rollout_spec.integrations.vllm.config import speculative_config  # noqa: E402
from rollout_spec.integrations.vllm.proposer import RolloutSpecProposer  # noqa: E402


@pytest.fixture(scope="module")
def plugged():
    """vLLM's own general-plugin loader, as its worker processes run it."""
    from vllm.plugins import load_plugins_by_group
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert "rollout_spec" in plugins, sorted(plugins)
    plugins["rollout_spec"]()
    return GPUModelRunner, Worker


def real_vllm_config(spec: SpecConfig, k: int):
    from types import SimpleNamespace

    from vllm.config import SpeculativeConfig

    kw = engine_kwargs(spec, k)
    return SimpleNamespace(
        speculative_config=SpeculativeConfig(**kw["speculative_config"]),
        model_config=SimpleNamespace(max_model_len=64),
        additional_config=kw["additional_config"],
    )


def test_speculative_config_selects_custom_class_and_builds_our_proposer(plugged):
    from vllm.config import SpeculativeConfig
    from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer

    from rollout_spec.integrations.vllm.plugin import VllmProposer

    sc = SpeculativeConfig(**speculative_config(SpecConfig(), 5))
    assert sc.method == "custom_class" and sc.num_speculative_tokens == 5
    proposer = create_custom_proposer(real_vllm_config(SpecConfig(num_draft_tokens=4), 4))
    assert isinstance(proposer, VllmProposer)
    assert proposer.spec.num_draft_tokens == 4 and proposer.num_speculative_tokens == 4


def test_plugin_patches_the_real_runner_and_worker(plugged):
    runner_cls, worker_cls = plugged
    assert getattr(runner_cls.propose_draft_token_ids, "_rollout_spec_wrapped", False)
    assert getattr(runner_cls._update_states, "_rollout_spec_wrapped", False)
    assert callable(worker_cls.rollout_spec_end_step) and callable(worker_cls.rollout_spec_stats)


def _input_batch(monkeypatch):
    import vllm.v1.worker.gpu_input_batch as gib

    monkeypatch.setattr(gib, "PIN_MEMORY", False)  # no pinned allocator without a GPU
    return gib.InputBatch(
        max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64, device=torch.device("cpu"),
        vocab_size=1000, block_sizes=[16], kernel_block_sizes=[16], max_num_blocks_per_req=[4],
    )


def _add(batch, requests, req_id, prompt, extra_args=None):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    state = CachedRequestState(
        req_id=req_id, prompt_token_ids=prompt, mm_features=[],
        sampling_params=SamplingParams(extra_args=extra_args), generator=None,
        block_ids=([0],), num_computed_tokens=0, output_token_ids=[],
    )
    requests[req_id] = state
    batch.add_request(state)


def _commit(batch, sampled):
    """What GPUModelRunner._bookkeeping_sync does with each row's sampled tokens."""
    for i, toks in enumerate(sampled):
        end = int(batch.num_tokens_no_spec[i]) + len(toks)
        batch.token_ids_cpu[i, end - len(toks):end] = toks
        batch.num_tokens_no_spec[i] = end


def test_real_runner_step_drafts_from_a_sibling(plugged, monkeypatch):
    from vllm.v1.core.sched.output import SchedulerOutput

    runner_cls, _ = plugged
    runner = object.__new__(runner_cls)  # only the attributes the draft step reads
    runner.input_batch, runner.requests = _input_batch(monkeypatch), {}
    runner.drafter = RolloutSpecProposer(real_vllm_config(SpecConfig(num_draft_tokens=4), 4))
    prompt = [101, 102, 103, 104, 105, 106]
    answer = [7, 8, 9, 10, 11, 12, 13, 14]
    _add(runner.input_batch, runner.requests, "0_sibling", prompt)
    _add(runner.input_batch, runner.requests, "1_sibling", prompt)
    out = SchedulerOutput.make_empty()
    out.num_spec_tokens_to_schedule = 4  # what vLLM's scheduler sends without a dynamic schedule
    args = (None,) * 7  # sampling metadata, hidden states, ...: unused by our proposer
    # sibling 0 writes the whole answer; sibling 1 has only sampled its first token
    for t in range(len(answer)):
        sampled = [[answer[t]], [answer[0]] if t == 0 else []]
        _commit(runner.input_batch, sampled)
        drafts = runner.propose_draft_token_ids(out, sampled, *args)
        assert drafts[1] == [], "a row that sampled nothing this step gets no draft"
    sampled = [[], [answer[1]]]  # sibling 0 is done; sibling 1 commits its second token
    _commit(runner.input_batch, sampled)
    drafts = runner.propose_draft_token_ids(out, sampled, *args)
    # same prompt -> same group: sibling 1 is drafted the continuation sibling 0 wrote
    assert drafts[0] == [] and 1 <= len(drafts[1]) <= 4, drafts
    assert drafts[1] == answer[2 : 2 + len(drafts[1])], drafts
    stats = runner.drafter.end_step()
    assert stats["requests_started"] == 2 and stats["requests_finished"] == 2


def test_counters_read_vllms_own_spec_decode_metrics():
    from vllm.config import SpeculativeConfig
    from vllm.v1.metrics.reader import get_metrics_snapshot
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    before = SpecDecodeCounters.from_metrics(get_metrics_snapshot())
    prom = SpecDecodingProm(SpeculativeConfig(**speculative_config(SpecConfig(), 3)),
                            ["model_name", "engine"], {0: ["m", "0"]})
    stats = SpecDecodingStats.new(3)
    stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
    stats.observe_draft(num_draft_tokens=2, num_accepted_tokens=0)
    prom.observe(stats, engine_idx=0)
    step = SpecDecodeCounters.from_metrics(get_metrics_snapshot()) - before
    assert (step.num_drafts, step.num_draft_tokens, step.num_accepted_tokens) == (2, 5, 2)
    assert step.accepted_per_pos[:3] == (1, 1, 0)
    assert step.accept_rate == pytest.approx(0.4)


def test_verl_reads_vllms_per_request_counters():
    """The verl hook turns vLLM's own per-request counters into verl's three fields, and the
    engine argument that fills them exists."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    from rollout_spec.integrations.verl import metrics

    assert "per_request_spec_decode_metrics" in AsyncEngineArgs.__dataclass_fields__
    counters = RequestSpecDecodeMetrics.new(4)
    counters.observe(num_draft_tokens=4, num_accepted=3)
    counters.observe(num_draft_tokens=2, num_accepted=0)
    # the prefill's token, then two drafted steps emitting 1 + 3 and 1 + 0
    assert metrics.from_vllm_stats(counters, response_tokens=6) == {
        "spec_num_draft_tokens": 6, "spec_num_accepted_tokens": 3, "spec_num_verify_steps": 2}
    # three more forwards that drafted nothing, one token each
    assert metrics.from_vllm_stats(counters, response_tokens=9)["spec_num_verify_steps"] == 5
