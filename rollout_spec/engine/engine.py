"""The embedded rollout engine: continuous batching with speculative tree decoding inside.

``step()`` is the whole loop body: admit waiting samples and prefill them, or run one
propose -> tree forward -> verify -> keep accepted KV -> extend iteration over the running ones.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from typing import Any, Optional, Union

import contextlib
import inspect
import os
import platform
import time

import numpy as np
import torch

from rollout_spec.config import SamplingParams, SpecConfig, check_int
from rollout_spec.drafter import proposes_ahead, takes_noise_keys
from rollout_spec.engine.commit import RunningBatch, plan_commit, reason_name, stop_mask
from rollout_spec.engine.cuda_graphs import default_ladder
from rollout_spec.engine.drafter_queue import DrafterFeed, DrafterQueue
from rollout_spec.engine.inputs import check_dtype, check_options, checked_budget, pick_device, vocab_ids
from rollout_spec.engine.model import Transformer
from rollout_spec.engine.runner import ModelRunner
from rollout_spec.engine.scheduler import Scheduler
from rollout_spec.engine.sequence import Sequence
from rollout_spec.engine.shadow_acceptance import ShadowAcceptance
from rollout_spec.noise import NoiseKeys
from rollout_spec.prompt_roots import PromptRoots
from rollout_spec.tree import DraftBatch, drafter_output, to_device
from rollout_spec.verify import NonFiniteLogits, VerifyResult, verify

DraftBudget = Callable[[int], Union[int, Seq[int], np.ndarray]]
"""Asked once per decode step, while the GPU runs the decode step before it, with the number of
requests running then (a ``generate``'s first decode step asks for itself, and the answer its
last one got goes unused); returns the most draft nodes per request (one int for all, or one
per request in running order: such an answer is asked again when the running requests have
changed meanwhile). If the object also has
``observe(offered, accepted)``, it is called after every decode step with per-request arrays;
if it has ``observe_plain(accepted)``, plain steps measure acceptance for it with shadow
proposals (``shadow_acceptance``) and pass it ``accepted[r, k]``, the nodes request r would have
kept at every draft size k; if it has ``observe_requests(req_ids, offered, accepted)``, drafting
steps pass it their per-request figures with the requests' ids; if it has
``set_running(req_ids, room, draining)``, every ask is preceded by the running requests' ids,
the tokens each may still emit, and whether no sample waits for a slot (the call then ends with
its slowest request)."""


class RolloutEngine:
    """Batched sampling of n responses per prompt, with an optional model-free drafter.

    Args:
        model: a loaded ``Transformer``.
        tokenizer: used for string prompts and the chat template (optional).
        spec: a ``SpecConfig`` (builds an ``NgramDrafter``), any object with the drafter
            interface (start_batch/extend_batch/propose/finish_batch/end_step/stats), or None to
            decode without speculation.
        num_slots: KV slots, i.e. the most requests running at once.
        max_model_len: the most tokens (prompt + output) of one request; default
            ``min(2048, max_position_embeddings)``.
        max_prefill_tokens: bound on the padded tokens of one prefill forward.
        draft_budget: per-step budget callable (see ``DraftBudget``); default
            ``spec.num_draft_tokens`` per request.
        eos_token_ids: default stop tokens when ``SamplingParams.stop_token_ids`` is None.
        cuda_graphs: on CUDA, capture decode/verify steps for a ladder of (B, W) buckets and,
            with a drafter and no ``draft_budget``, time them into a batch-aware
            ``budget.DraftBudget`` (cached under the cache dir); False keeps every step eager.
        batch_aware_budget: with a drafter and no ``draft_budget``, whether the engine times
            its steps at start (or reads them from the cache) into a ``budget.DraftBudget``,
            which drafts only where speculation pays. None (default): on CUDA, with
            ``cuda_graphs``. True on a CPU times eager steps (tens of seconds once per CPU kind,
            thread count and model): there a verify step's LM head and verification cost
            several decodes, and a fixed budget of 8 made ``rollout-spec bench`` 0.57x as fast
            as plain decoding on the 2-core dev box. Without it every step drafts
            ``spec.num_draft_tokens`` per request.
        overlap_drafter: run the plain steps' drafter calls on a worker thread
            (``drafter_queue``): every 8th plain step hands the previous steps' tokens to it
            right after launching its forward, so the C++ extend (GIL released) runs while
            verification waits for the GPU; prefills index their prompts there by the same
            rule on the running batch's size. Drafting steps, and plain steps of fewer than
            ``worker_min_batch`` requests, call the drafter on the engine's thread: a drafting
            step's extend and next proposal lie on its critical path either way, and handing
            them to the worker and waiting for it cost more than the calls (B=256 on the H100
            host: 1.26 ms of waiting against ~1 ms of C++). Outputs are identical either way. None
            (default): on where the model is on CUDA (measured on an H100), off on CPU, where the forward is not
            asynchronous and the hand-offs only add work (docs/gpu.md). Without it, plain steps
            feed the drafter nothing (unless the budget has ``observe_plain``: its shadow rounds
            take them every 8th plain step); their tokens go over in one batch before the next
            proposal or when ``generate`` ends (``DrafterFeed``).
        verify_backend: ``verify``'s backend ("auto": the fused Triton walk on CUDA, "torch",
            "triton": off CUDA only through triton's interpreter, TRITON_INTERPRET=1).
        worker_min_batch: with ``overlap_drafter``, the fewest running requests whose plain
            steps use the worker (below it, their hand-offs are a few requests' worth of work).

    ``phase_seconds`` accumulates the decode steps' wall time by phase (budget + propose,
    tree inputs + forward + verification, commit), their count, and the prefill steps' wall
    time, for profiling.
    ``prompt_roots`` keeps the prompts ``generate`` saw without given group ids (least recently
    used out), so that a prompt extending one of them takes its group.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Any = None,
        spec: Any = None,
        *,
        num_slots: int = 64,
        max_model_len: Optional[int] = None,
        max_prefill_tokens: int = 16384,
        draft_budget: Optional[DraftBudget] = None,
        eos_token_ids: Seq[int] = (),
        max_draft_tokens: int = 64,
        cuda_graphs: bool = True,
        batch_aware_budget: Optional[bool] = None,
        overlap_drafter: Optional[bool] = None,
        verify_backend: str = "auto",
        worker_min_batch: int = 32,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        device = next(model.parameters()).device
        sizes = check_options(
            device, spec, num_slots=num_slots, max_model_len=max_model_len,
            max_prefill_tokens=max_prefill_tokens, draft_budget=draft_budget,
            max_draft_tokens=max_draft_tokens, cuda_graphs=cuda_graphs,
            batch_aware_budget=batch_aware_budget, overlap_drafter=overlap_drafter,
            verify_backend=verify_backend, worker_min_batch=worker_min_batch)
        self.num_slots, self.max_prefill_tokens = sizes["num_slots"], sizes["max_prefill_tokens"]
        self.max_draft_tokens, self.worker_min_batch = sizes["max_draft_tokens"], sizes["worker_min_batch"]
        limit = model.config.max_position_embeddings
        max_model_len = min(2048, limit) if max_model_len is None else max_model_len
        self.max_model_len = check_int("max_model_len", max_model_len, 2, limit)
        self.eos_token_ids = vocab_ids("eos_token_ids", eos_token_ids, model.config.vocab_size)
        self.verify_backend = verify_backend
        self._drafter = _make_drafter(spec)
        if overlap_drafter is None:
            overlap_drafter = device.type == "cuda"
        self._queue = DrafterQueue(overlap_drafter)
        self._feed = DrafterFeed(self._queue)
        self._flush_seconds = 0.0  # time this step spent handing deferred tokens to the drafter
        self._drafted_last = False  # whether the last decode step fed the drafter and drafted ahead
        self._switch_from: Optional[float] = None  # clock at a switch step's proposal (see _propose)
        self._asked: Optional[tuple[np.ndarray, Any]] = None  # (request ids, budget's answer) for the next step
        self._draining = False  # no sample waits for a slot: the call ends with its slowest request
        self._unaccounted: Optional[tuple] = None  # the last decode step's figures, for _account_last
        self.clock: Callable[[], float] = time.perf_counter  # injectable for tests
        self.phase_seconds: dict[str, float] = dict.fromkeys(
            ("propose", "forward_verify", "commit", "steps", "prefill"), 0.0)
        default = spec.num_draft_tokens if isinstance(spec, SpecConfig) else 8
        self.draft_budget: DraftBudget = (
            (lambda _num_running: default) if draft_budget is None else draft_budget)
        shadow_budget = min(default, self.max_draft_tokens)
        self._shadow = (ShadowAcceptance(shadow_budget)
                        if self._drafter is not None and shadow_budget else None)
        # Slack past max_model_len: a padded tree of the widest request is written past the root.
        self.runner = ModelRunner(model, self.num_slots, self.max_model_len + self.max_draft_tokens + 1)
        self._next_req_id = 0
        self.prompt_roots = PromptRoots()
        on_cuda = self.runner.device.type == "cuda"
        if batch_aware_budget is None:
            batch_aware_budget = on_cuda and cuda_graphs
        auto = batch_aware_budget and draft_budget is None and self._drafter is not None
        max_draft = min(default, self.max_draft_tokens) if self._drafter is not None else 0
        if cuda_graphs and on_cuda:
            self.runner.capture_graphs(*default_ladder(self.num_slots, max_draft + 1))
        if auto and max_draft > 0:
            self._time_budget(max_draft)

    def _time_budget(self, max_draft: int) -> None:
        """Time the step grid into ``budget.auto_budget`` (cached per device, model and dtype):
        the captured ladder on CUDA, eager steps padded the same way elsewhere."""
        from rollout_spec.engine import budget
        from rollout_spec.engine.cuda_graphs import ladder_step_timer
        from rollout_spec.engine.weights import cache_root

        runner, c = self.runner, self.model.config
        ladder = runner.graphs  # eager where nothing was captured: the same buckets, run as is
        if ladder is None:
            ladder = runner.verify_ladder(*default_ladder(self.num_slots, max_draft + 1), eager=True)
        if runner.device.type == "cuda":
            where = torch.cuda.get_device_name(runner.device)
        else:
            where = f"{runner.device.type}-{platform.machine()}-{os.cpu_count()}cpu-{torch.get_num_threads()}t"
        syncs = {"cuda": torch.cuda.synchronize, "mps": getattr(getattr(torch, "mps", None), "synchronize", None)}
        sync = syncs.get(runner.device.type) or (lambda: None)  # a CPU step is done when it returns
        context = self.max_model_len // 4  # the timed steps' cached context
        # every shape a step's time depends on: two models alike in layers and width differ here
        key = (f"{where}_{c.model_type}-L{c.num_layers}-H{c.hidden_size}-I{c.intermediate_size}"
               f"-A{c.num_heads}x{c.head_dim}-KV{c.num_kv_heads}-V{c.vocab_size}_ctx{context}_{runner.dtype}")
        step = ladder_step_timer(ladder, runner.scratch_slot, context)
        self.draft_budget = budget.auto_budget(step, sync, key, self.num_slots, max_draft, cache_root() / "costs")

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        device: str | torch.device = "auto",
        dtype: Optional[torch.dtype] = None,
        spec: Any = SpecConfig(),
        **kwargs: Any,
    ) -> "RolloutEngine":
        """Load ``"smollm2-135m"``, a GGUF file or a safetensors directory and build an engine.

        dtype defaults to bf16 on CUDA and fp32 on CPU; other keyword arguments go to ``__init__``
        (eos_token_ids defaults to the model config's). The device, the dtype and every option
        that needs no model are checked before the weights load (a GGUF conversion takes minutes).
        """
        from rollout_spec.engine.weights import load_pretrained

        dev = pick_device(device)
        check_dtype(dtype)
        try:
            options = inspect.signature(cls).bind(None, None, spec, **kwargs)
        except TypeError as err:  # an unknown or repeated keyword
            raise TypeError(f"{cls.__name__}: {err}") from None
        options.apply_defaults()
        check_options(dev, **options.arguments)
        dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        model, hf_config, tokenizer = load_pretrained(name_or_path, dev, dtype)
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(model, tokenizer, spec, **{"eos_token_ids": eos_ids, **kwargs})

    @property
    def drafter(self) -> Any:
        """The drafter, once every committed token and queued call has reached it (None without
        speculation)."""
        self._settle_drafter()
        return self._drafter

    @drafter.setter
    def drafter(self, value: Any) -> None:
        """Replace the drafter (e.g. by a wrapper that times it) after the queued calls ran."""
        self._settle_drafter()
        self._drafter = value

    def _settle_drafter(self) -> None:
        """Hand the drafter every deferred token and wait for its queued calls (errors raise)."""
        if self._drafter is not None:
            self._feed.flush(self._drafter)
        self._queue.drain()

    @property
    def device(self) -> torch.device:
        """The device the model and KV cache live on."""
        return self.runner.device

    @property
    def shadow_rounds(self) -> int:
        """Shadow proposals queued on plain steps so far (``shadow_acceptance``)."""
        return self._shadow.rounds if self._shadow is not None else 0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens run through prefill so far (each shared prefill counts once)."""
        return self.runner.prefill_tokens

    def new_request_id(self) -> int:
        """A drafter request id never used before by this engine."""
        self._next_req_id += 1
        return self._next_req_id - 1

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        params: SamplingParams = SamplingParams(),
        group_ids: Optional[Seq[Optional[int]]] = None,
        progress: bool = False,
        max_running: Optional[int] = None,
    ) -> list[Any]:
        """n samples per prompt; returns ``RolloutOutput``s ordered by (prompt, sample).

        ``group_ids`` gives each prompt's group for the drafter's group scope, one entry per
        prompt: an int in ``[0, groups.GROUP_ID_MAX]``, or None for a prompt in no group (-1 is
        refused: pass None). Without it, a prompt's group is the hash of its tokens
        (``groups.prompt_group_id``), or the group of an earlier prompt of this engine's that it
        extends (``prompt_roots``: a multi-turn sample's later turn, sent as prompt + output +
        tool output, drafts with its first turn's siblings). ``max_running`` caps the samples
        decoded at once (default and most: ``num_slots``); the others wait for a slot, so e.g.
        GRPO's n samples of a prompt can run one after another.

        Bad arguments raise before any prefill (which prompts become an ``"error"`` output
        instead: ``RolloutSession``); a call that fails midway leaves the engine ready for the
        next.
        """
        from rollout_spec.rollout import RolloutSession

        session = RolloutSession(self, params, progress=progress)  # checks params
        first_req_id = self._next_req_id
        try:
            with self._queue.responsive():  # the drafter's worker gets the GIL without a 5 ms wait
                return session.run(prompts, group_ids, max_running)  # checks the rest first
        except BaseException:
            if self._next_req_id != first_req_id:  # else it failed its checks, before queueing
                self._abandon(range(first_req_id, self._next_req_id))
            raise

    def _abandon(self, req_ids: range) -> None:
        """After a call failed midway: drop its deferred hand-offs, queued calls, shadow rounds and
        budget figures, so the next call starts as on a fresh engine, and finish the call's
        requests the drafter still holds (where it says which, with ``is_live``). Best effort:
        the call's own error is the one raised."""
        self._feed = DrafterFeed(self._queue)
        self._asked = self._unaccounted = self._switch_from = None
        self._drafted_last = False
        if self._shadow is not None:
            self._shadow.drop_pending()
        with contextlib.suppress(Exception):  # the failed call's own calls: its error is raised
            self._queue.drain()
        is_live = getattr(self._drafter, "is_live", None)
        live = [r for r in req_ids if is_live(r)] if is_live is not None else []
        if live:
            with contextlib.suppress(Exception):
                self._drafter.finish_batch(live)

    def end_step(self) -> None:
        """RL step boundary: forwards to the drafter (ages and evicts its history)."""
        if self.drafter is not None:  # the property hands over everything pending first
            self._drafter.end_step()

    def step(self, sched: Scheduler) -> list[Sequence]:
        """One engine iteration (prefill of admitted samples, else one decode); returns finished.
        Every sample draws its noise by its own ``seed`` (noise.py)."""
        groups = sched.admit()
        if groups:
            t0 = self.clock()
            self._prefill(groups, len(sched.running))
            self.phase_seconds["prefill"] += self.clock() - t0
        else:
            self._draining = not sched.waiting
            self._decode(sched.running)
        finished = sched.release_finished()
        if sched.done:  # the call is over: the budget and the drafter get everything
            self._account_last()
            self._asked = None  # asked for a step that will not come
            self._drafted_last = False  # nothing of the next call is drafted ahead
            if self._drafter is not None:
                self._settle_drafter()
                observe = self._shadow_observer()
                if observe is not None:
                    self._shadow.harvest(observe)  # every round's requests have finished
        return finished

    def _prefill(self, groups: list[list[Sequence]], num_running: int) -> None:
        """Prefill the admitted groups; the drafter indexes their prompts meanwhile: on the
        worker where plain steps of ``num_running`` requests use it (a large admission's
        indexing can outlast the forward), else on this thread while the GPU works."""
        logits = self.runner.prefill(groups)
        seqs = [s for g in groups for s in g]
        if self._drafter is not None:
            ids = [s.req_id for s in seqs]
            self._queue.use_worker(num_running >= self.worker_min_batch)
            self._queue.submit(self._drafter.start_batch, ids, [s.prompt for s in seqs],
                               [s.group_id for s in seqs])
            if takes_noise_keys(self._drafter):  # its drafts then aim at the race each row runs
                self._queue.submit(self._drafter.set_noise_keys, ids,
                                   [None if s.params.greedy else s.seed for s in seqs],
                                   [s.params.temperature for s in seqs], self.model.config.vocab_size)
        rows, seeds, last = to_device([np.array([i for i, g in enumerate(groups) for _ in g]),
                                       np.array([s.seed for s in seqs], np.int64),
                                       np.array([len(s.prompt) - 1 for s in seqs], np.int64)],
                                      self.device)
        res = self._verify(seqs, logits[rows], DraftBatch.empty(len(seqs)), keys=NoiseKeys(seeds, last))
        zeros = np.zeros(len(seqs), np.int64)
        run = RunningBatch(zeros, np.array([len(s.prompt) for s in seqs], np.int64), zeros, zeros,
                           np.array([s.req_id for s in seqs], np.int64),
                           np.array([s.params.max_new_tokens for s in seqs], np.int64))
        self._commit(seqs, res, None, run)

    def _decode(self, seqs: list[Sequence]) -> None:
        """One propose -> forward -> verify -> commit step."""
        t0 = self.clock()
        run = RunningBatch.of(seqs)
        budgets = self._budgets(run)
        batch = self._propose(run, budgets)
        t1 = self.clock()
        catch_up = self._flush_seconds if self._switch_from is None else t1 - self._switch_from
        logits, tree = self.runner.verify_forward(run.slot, run.ctx_len, run.root, batch)
        if batch.num_nodes == 0 and self._feed.due():
            self._plain_hand_off(seqs, run)
        self._account_last()  # the previous step's bookkeeping, while the GPU runs this one
        self._ask_budget(run)  # and the next step's budget, decided on what that taught
        if batch.num_nodes and self._shadow is not None and self._shadow.drafting_step():
            self._drafting_shadow(seqs, run)
        # With drafts, the fused walk hands its rows to the KV compaction before the readback.
        compact = self.runner.compact_kv if batch.num_nodes else None
        res = self._verify(seqs, logits, batch, keys=self.runner.noise_keys(), tree=tree, on_walk=compact)
        t2 = self.clock()
        ahead = batch.num_nodes > 0 or self._next_step_drafts()
        accepted, emitted = self._commit(seqs, res, batch, run, feed_now=ahead)
        t3 = self.clock()
        self._unaccounted = (run, budgets, batch, accepted, emitted, (t0, t1, t2, t3), catch_up)
        self._drafted_last = ahead

    def _verify(self, seqs: list[Sequence], logits: torch.Tensor, batch: DraftBatch, **kw: Any) -> VerifyResult:
        """``verify`` of one step's rows; logits the model made non-finite are named by the
        caller's prompt and sample rather than a place in the step's batch."""
        try:
            return verify(logits, batch, _params_of(seqs), backend=self.verify_backend, **kw)
        except NonFiniteLogits as err:
            s = seqs[err.request]
            raise ValueError(f"the model's logits for prompt {s.prompt_index}, sample {s.sample_index} "
                             f"are not finite (a NaN or +inf logit, or every logit -inf)") from None

    def _shadow_observer(self) -> Optional[Callable[[np.ndarray], None]]:
        """The budget's ``observe_plain`` when shadow rounds run for it, else None."""
        if self._shadow is None:
            return None
        return getattr(self.draft_budget, "observe_plain", None)

    def _plain_hand_off(self, seqs: list[Sequence], run: RunningBatch) -> None:
        """A plain step, every ``DrafterFeed.flush_every``: with the worker, hand it the deferred
        tokens while verification waits for the GPU; with a budget that takes acceptance from
        plain steps, queue a shadow round behind them and pass on the rounds that are ready."""
        observe = self._shadow_observer()
        if not self._queue.threaded and observe is None:
            return
        self._feed.flush(self._drafter)
        if observe is not None:
            self._shadow.harvest(observe)
            self._shadow.propose(self._queue, self._drafter, seqs, run, self.max_model_len)

    def _drafting_shadow(self, seqs: list[Sequence], run: RunningBatch) -> None:
        """A shadow round on a drafting step, queued while the GPU runs its forward (the drafter
        has every token up to ``run``, as its proposal needed): the step measures only the size
        it offered, the round measures every size up to the largest (``ShadowAcceptance``), at
        most 16 trees every 8 drafting steps."""
        observe = self._shadow_observer()
        if observe is None:
            return
        self._shadow.harvest(observe)
        self._shadow.propose(self._queue, self._drafter, seqs, run, self.max_model_len)

    def _account_last(self) -> None:
        """Feed the budget (acceptance, step wall time) and the per-phase clock with the last
        decode step's figures. Deferred to the next step's GPU wait: the budget then decides
        one step behind, and the host work leaves the critical path."""
        if self._unaccounted is None:
            return
        (run, budgets, batch, accepted, emitted, marks, catch_up), self._unaccounted = self._unaccounted, None
        t0, t1, t2, t3 = marks
        for name, secs in zip(("propose", "forward_verify", "commit"), (t1 - t0, t2 - t1, t3 - t2)):
            self.phase_seconds[name] += secs
        self.phase_seconds["steps"] += 1
        offered = int(budgets.sum())
        if offered:  # adaptive budgets learn acceptance from steps that offered drafts
            kept = np.minimum(accepted, budgets)
            observe = getattr(self.draft_budget, "observe", None)
            if observe is not None:
                observe(budgets, kept)
            per_request = getattr(self.draft_budget, "observe_requests", None)
            if per_request is not None:
                per_request(run.req_id, budgets, kept)
        record = getattr(self.draft_budget, "record_step", None)
        if record is not None and 0.0 <= catch_up <= t3 - t0:  # else the clock stepped back: no figure
            width = 1 + int(batch.sizes().max(initial=0))
            record(len(run.slot), offered, batch.num_nodes, width, t3 - t0,
                   tokens=emitted, catch_up=catch_up)

    def _ask_budget(self, run: RunningBatch) -> None:
        """Ask the budget for the next decode step now, while the GPU runs this one (``run``):
        it knows then what it would know at the next step's start (the last step's figures
        reach it in ``_account_last``, one step behind), and its ~0.1 ms leaves the GPU's idle
        gap."""
        if self._drafter is not None:
            self._asked = (run.req_id.copy(), self._ask(run))

    def _ask(self, run: RunningBatch) -> Union[int, np.ndarray]:
        """The budget's answer for ``run``'s requests, checked (``inputs.checked_budget``); a
        budget with ``set_running`` is told who they are first."""
        set_running = getattr(self.draft_budget, "set_running", None)
        if set_running is not None:
            set_running(run.req_id, run.room(self.max_model_len), self._draining)
        num_running = len(run.slot)
        return checked_budget(self.draft_budget(num_running), num_running, self.max_draft_tokens)

    def _budgets(self, run: RunningBatch) -> np.ndarray:
        """Per-request node budgets: the pluggable budget's answer, capped by what each request
        can keep. The answer asked in the last step's GPU wait stands, unless it holds one size
        per request and the running requests have changed since (after a prefill, or when
        requests ended: a batch of the same size may hold others); then, or when there is none,
        the budget is asked now."""
        num = len(run.slot)
        if self._drafter is None:
            return np.zeros(num, np.int64)
        ready, self._asked = self._asked, None
        if ready is not None and (np.ndim(ready[1]) == 0 or np.array_equal(ready[0], run.req_id)):
            asked = ready[1]
        else:
            asked = self._ask(run)
        if isinstance(asked, int) and asked == 0:  # the plain path: nothing to cap
            return np.zeros(num, np.int64)
        return self._capped(asked, run.room(self.max_model_len))

    def _capped(self, asked: Any, room: np.ndarray) -> np.ndarray:
        """The budget's answer (one size, or one per request) capped per request: a step emits
        accepted + 1 tokens, so drafting more than ``room - 1`` could not be kept."""
        cap = np.minimum(room - 1, self.max_draft_tokens)
        if np.ndim(asked) == 0:
            return np.clip(cap, 0, max(int(asked), 0))
        return np.clip(np.minimum(np.asarray(asked, np.int64), cap), 0, None)

    def _propose(self, run: RunningBatch, budgets: np.ndarray) -> DraftBatch:
        """The step's draft trees, and the thread of its drafter calls: the worker takes plain
        steps' hand-offs only (see ``overlap_drafter``)."""
        self._flush_seconds, self._switch_from = 0.0, None
        if not budgets.any():
            self._queue.use_worker(len(budgets) >= self.worker_min_batch)
            return DraftBatch.empty(len(budgets))
        t0, deferred = self.clock(), self._feed.pending
        self._queue.use_worker(False)  # waits for the worker's hand-offs, like ``ready`` below
        self._feed.ready(self._drafter)  # the drafter must have seen every committed token
        # Catching up after steps without drafts: a run of drafting steps feeds the drafter
        # every step, overlapped, and drafts each proposal ahead (``_propose_next``), so the
        # budget prices drafting without this. A step right after a plain one (a switch) catches
        # up for its whole proposal phase (``_decode`` reads it off the step's clock); any other
        # for the deferred tokens alone.
        if not self._drafted_last:
            self._switch_from = t0
        elif deferred:
            self._flush_seconds = self.clock() - t0
        return self._checked(self._drafter.propose(run.req_id.tolist(), budgets), budgets)

    def _next_step_drafts(self) -> bool:
        """Whether the budget's answer for the next step (asked in this step's GPU wait) drafts
        and the drafter can draft it ahead: then even a plain step feeds the drafter at its
        commit and starts that proposal, as a drafting step does, so the switch back to drafting
        does not catch up on the deferred tokens and the whole proposal at its own start (B=256,
        T=1.0 on the H100: such a step took 1.6 ms more than a drafting step after another)."""
        asked = self._asked[1] if self._asked is not None else 0
        return np.ndim(asked) == 0 and int(asked) > 0 and proposes_ahead(self._drafter)

    def _propose_next(self, run: RunningBatch, keep: np.ndarray, reason: np.ndarray) -> None:
        """Right after a feeding step's extend: where the drafter can (``proposes_ahead``) and
        the next step's budget is known (asked in this step's GPU wait, one size for all) and
        drafts, start the next step's proposal on the drafter's background thread, so that it is
        built while this step commits. The next ``_propose`` asks for exactly these trees (the
        requests that did not end here, with ``_budgets``' caps after this step's tokens); after
        a prefill in between it asks for others, and the drafter proposes afresh (same drafts)."""
        if not self._next_step_drafts():
            return
        alive = reason == 0
        budgets = self._capped(self._asked[1], run.room(self.max_model_len)[alive] - keep[alive])
        self._queue.submit(self._drafter.propose_ahead, run.req_id[alive].tolist(), budgets)

    def _checked(self, proposal: object, budgets: np.ndarray) -> DraftBatch:
        """The drafter's proposal as a DraftBatch, after checking it against the budgets
        (``drafter_output``, the replay's checker too) and the vocabulary."""
        batch = drafter_output(proposal, budgets)
        if batch.num_nodes and int(batch.tokens.max()) >= self.model.config.vocab_size:
            raise ValueError(
                f"drafter proposed token {int(batch.tokens.max())}, vocab_size is "
                f"{self.model.config.vocab_size}"
            )
        return batch

    def _commit(self, seqs: list[Sequence], res: VerifyResult, batch: Optional[DraftBatch],
                run: RunningBatch, feed_now: bool = False) -> tuple[np.ndarray, int]:
        """Keep accepted KV, append emitted tokens (cut at stops/limits) and feed the drafter:
        at once, then drafting the next proposal ahead, with ``feed_now`` (a step that drafted,
        or whose next step will), else deferred (``DrafterFeed``). Returns the accepted draft
        nodes kept per request and the tokens the step added in all (a stop or a limit among
        the accepted nodes leaves the bonus token and the rest out)."""
        h = res.host
        if batch is not None and batch.num_nodes and res.walk is None:  # else compacted on the device
            self.runner.keep_accepted_kv(run.slot, run.ctx_len, h.accepted_offsets, h.accepted_nodes)
        em_off = h.emitted_offsets
        req_of = np.repeat(np.arange(len(seqs)), np.diff(em_off))
        left = self.max_model_len - run.prompt_len - run.out_len
        keep, reason = plan_commit(em_off, h.emitted_tokens, stop_mask(seqs, req_of, h.emitted_tokens),
                                   run.out_len, run.max_new, left)
        accepted = np.minimum(np.diff(h.accepted_offsets), keep)
        tokens = h.emitted_tokens.tolist()
        starts, stops = em_off[:-1].tolist(), (em_off[:-1] + keep).tolist()
        kept = [tokens[a:b] for a, b in zip(starts, stops)]
        if self._drafter is not None:
            finished = [seqs[i] for i in np.flatnonzero(reason)] if reason.any() else []
            self._feed.committed(self._drafter, seqs, kept, finished, now=feed_now)
            if feed_now:
                self._propose_next(run, keep, reason)
        _apply(seqs, kept, starts, reason, h.emitted_logprobs.astype(np.float64).tolist(),
               batch.sizes().tolist() if batch is not None else None, accepted.tolist())
        return accepted, int(keep.sum())


def _apply(seqs: list[Sequence], kept: list[list[int]], starts: list[int], reason: np.ndarray,
           logprobs: list[float], sizes: Optional[list[int]], accepted: list[int]) -> None:
    """Append each sequence's kept tokens, their logprobs and the step's counters."""
    for i, (s, toks, a, why) in enumerate(zip(seqs, kept, starts, reason.tolist())):
        s.output += toks
        s.logprobs += logprobs[a : a + len(toks)]
        s.num_verify_steps += 1  # prefill counts: TPF is exactly 1.0 without speculation
        if sizes is not None:
            s.num_draft_tokens += sizes[i]
            s.num_accepted_tokens += accepted[i]
        if why:
            s.finish_reason = reason_name(why)


def _params_of(seqs: list[Sequence]) -> SamplingParams | list[SamplingParams]:
    """One SamplingParams when all sequences share it (the common case), else one per sequence."""
    first = seqs[0].params
    return first if all(s.params is first for s in seqs) else [s.params for s in seqs]


def _make_drafter(spec: Any) -> Any:
    """Build the n-gram drafter from a SpecConfig, accept a ready drafter (checked by
    ``inputs.check_options``), or None."""
    if spec is None or (isinstance(spec, SpecConfig) and spec.num_draft_tokens == 0):
        return None
    if isinstance(spec, SpecConfig):
        from rollout_spec.drafter import NgramDrafter

        return NgramDrafter(spec)
    return spec
