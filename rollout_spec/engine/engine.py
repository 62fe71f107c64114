"""The embedded rollout engine: continuous batching with speculative tree decoding inside.

``step()`` is the whole loop body: admit waiting samples and prefill them, or run one
propose -> tree forward -> verify -> keep accepted KV -> extend iteration over the running ones.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from typing import Any, Optional, Union

import numpy as np
import torch

from rollout_spec.config import SamplingParams, SpecConfig, check_int
from rollout_spec.engine.model import Transformer
from rollout_spec.engine.runner import ModelRunner
from rollout_spec.engine.scheduler import Scheduler
from rollout_spec.engine.sequence import Sequence
from rollout_spec.tree import DraftBatch
from rollout_spec.verify import VerifyResult, verify

DraftBudget = Callable[[int], Union[int, Seq[int], np.ndarray]]
"""Asked once per decode step with the number of running requests; returns the most draft nodes
per request (one int for all, or one per request in running order). If the object also has
``observe(offered, accepted)``, it is called after every decode step with per-request arrays."""


def pick_device(device: str | torch.device) -> torch.device:
    """``"auto"`` means CUDA when available, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.num_slots = check_int("num_slots", num_slots, 1, 1 << 20)
        limit = model.config.max_position_embeddings
        max_model_len = min(2048, limit) if max_model_len is None else max_model_len
        self.max_model_len = check_int("max_model_len", max_model_len, 2, limit)
        self.max_prefill_tokens = check_int("max_prefill_tokens", max_prefill_tokens, 1, 1 << 30)
        self.max_draft_tokens = check_int("max_draft_tokens", max_draft_tokens, 0, 1024)
        self.drafter = _make_drafter(spec)
        default = spec.num_draft_tokens if isinstance(spec, SpecConfig) else 8
        self.draft_budget: DraftBudget = draft_budget or (lambda _num_running: default)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        # Slack past max_model_len: a padded tree of the widest request is written past the root.
        self.runner = ModelRunner(model, num_slots, self.max_model_len + self.max_draft_tokens + 1)
        self._next_req_id = 0
        if cuda_graphs and self.runner.device.type == "cuda":
            self._setup_gpu(auto_budget=draft_budget is None, max_draft=default if self.drafter else 0)

    def _setup_gpu(self, auto_budget: bool, max_draft: int) -> None:
        """Capture the decode/verify ladder; time it into a DraftBudget unless one was given."""
        from rollout_spec.engine import budget
        from rollout_spec.engine.cuda_graphs import default_ladder, ladder_step_timer
        from rollout_spec.engine.weights import cache_root

        max_draft = min(max_draft, self.max_draft_tokens)
        self.runner.capture_graphs(*default_ladder(self.num_slots, max_draft + 1))
        if auto_budget and max_draft > 0:
            c, dev = self.model.config, self.runner.device
            key = (f"{torch.cuda.get_device_name(dev)}_{c.model_type}-L{c.num_layers}-H{c.hidden_size}"
                   f"-V{c.vocab_size}_{self.runner.dtype}")
            step = ladder_step_timer(self.runner.graphs, self.runner.scratch_slot, self.max_model_len // 4)
            self.draft_budget = budget.auto_budget(step, torch.cuda.synchronize, key, self.num_slots,
                                                   max_draft, cache_root() / "costs")

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

        dtype defaults to bf16 on CUDA and fp32 on CPU; other keyword arguments go to ``__init__``.
        """
        from rollout_spec.engine.weights import load_pretrained

        dev = pick_device(device)
        dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        model, hf_config, tokenizer = load_pretrained(name_or_path, dev, dtype)
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(model, tokenizer, spec, eos_token_ids=eos_ids, **kwargs)

    @property
    def device(self) -> torch.device:
        """The device the model and KV cache live on."""
        return self.runner.device

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
    ) -> list[Any]:
        """n samples per prompt; returns ``RolloutOutput``s ordered by (prompt, sample)."""
        from rollout_spec.rollout import RolloutSession

        return RolloutSession(self, params, progress=progress).run(prompts, group_ids)

    def end_step(self) -> None:
        """RL step boundary: forwards to the drafter (ages and evicts its history)."""
        if self.drafter is not None:
            self.drafter.end_step()

    def step(self, sched: Scheduler, generator: torch.Generator) -> list[Sequence]:
        """One engine iteration (prefill of admitted samples, else one decode); returns finished."""
        groups = sched.admit()
        if groups:
            self._prefill(groups, generator)
        else:
            self._decode(sched.running, generator)
        return sched.release_finished()

    def _prefill(self, groups: list[list[Sequence]], generator: torch.Generator) -> None:
        logits = self.runner.prefill(groups)
        seqs = [s for g in groups for s in g]
        rows = torch.as_tensor([i for i, g in enumerate(groups) for _ in g], device=self.device)
        res = verify(logits[rows], DraftBatch.empty(len(seqs)), _params_of(seqs), generator)
        if self.drafter is not None:
            self.drafter.start_batch(
                [s.req_id for s in seqs], [s.prompt for s in seqs], [s.group_id for s in seqs]
            )
        self._commit(seqs, res, None)

    def _decode(self, seqs: list[Sequence], generator: torch.Generator) -> None:
        batch = self._propose(seqs)
        logits, tree = self.runner.verify_forward(seqs, batch)
        res = verify(logits, batch, _params_of(seqs), generator, tree=tree)
        self._commit(seqs, res, batch)

    def _budgets(self, seqs: list[Sequence]) -> np.ndarray:
        """Per-request node budgets: the pluggable budget, capped by what each request can keep."""
        asked = np.broadcast_to(np.asarray(self.draft_budget(len(seqs)), np.int64), (len(seqs),))
        room = np.array(
            [
                min(s.params.max_new_tokens - len(s.output), self.max_model_len - len(s.prompt) - len(s.output))
                for s in seqs
            ],
            np.int64,
        )
        # A step emits accepted + 1 tokens, so drafting more than room - 1 could not be kept.
        return np.clip(np.minimum(asked, room - 1), 0, self.max_draft_tokens)

    def _propose(self, seqs: list[Sequence]) -> DraftBatch:
        if self.drafter is None:
            return DraftBatch.empty(len(seqs))
        budgets = self._budgets(seqs)
        if not budgets.any():
            return DraftBatch.empty(len(seqs))
        batch = self.drafter.propose([s.req_id for s in seqs], budgets)
        batch.validate()
        if batch.num_requests != len(seqs) or (batch.sizes() > budgets).any():
            raise ValueError(
                f"drafter returned {batch.num_requests} trees of sizes {batch.sizes().tolist()} "
                f"for {len(seqs)} requests with budgets {budgets.tolist()}"
            )
        if batch.num_nodes and int(batch.tokens.max()) >= self.model.config.vocab_size:
            raise ValueError(
                f"drafter proposed token {int(batch.tokens.max())}, vocab_size is "
                f"{self.model.config.vocab_size}"
            )
        return batch

    def _commit(self, seqs: list[Sequence], res: VerifyResult, batch: Optional[DraftBatch]) -> None:
        """Keep accepted KV, append emitted tokens (truncated at stops/limits), feed the drafter."""
        acc_off, acc_nodes, em_off, em_tok, em_lp = _to_host(res)
        if batch is not None:
            self.runner.keep_accepted_kv(seqs, acc_off, acc_nodes)
        sizes = batch.sizes() if batch is not None else np.zeros(len(seqs), np.int64)
        kept_lists = []
        for i, s in enumerate(seqs):
            kept = s.append(em_tok[em_off[i] : em_off[i + 1]], em_lp[em_off[i] : em_off[i + 1]], self.max_model_len)
            kept_lists.append(kept)
            s.num_verify_steps += 1  # prefill counts: TPF is exactly 1.0 without speculation
            if batch is not None:
                s.num_draft_tokens += int(sizes[i])
                s.num_accepted_tokens += min(int(acc_off[i + 1] - acc_off[i]), len(kept))
        observe = getattr(self.draft_budget, "observe", None)
        if batch is not None and observe is not None:  # adaptive budgets learn acceptance
            observe(sizes.astype(np.int64), np.diff(acc_off).astype(np.int64))
        if self.drafter is not None:
            self.drafter.extend_batch([s.req_id for s in seqs], kept_lists)
            done = [s.req_id for s in seqs if s.finished]
            if done:
                self.drafter.finish_batch(done)


def _to_host(res: VerifyResult) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int], list[float]]:
    """The step's verify outcome on the host (verification already computed it there)."""
    h = res.host
    return (h.accepted_offsets, h.accepted_nodes, h.emitted_offsets, h.emitted_tokens.tolist(),
            h.emitted_logprobs.astype(np.float64).tolist())


def _params_of(seqs: list[Sequence]) -> SamplingParams | list[SamplingParams]:
    """One SamplingParams when all sequences share it (the common case), else one per sequence."""
    first = seqs[0].params
    return first if all(s.params is first for s in seqs) else [s.params for s in seqs]


def _make_drafter(spec: Any) -> Any:
    """Build the n-gram drafter from a SpecConfig, accept a ready drafter, or None."""
    if spec is None or (isinstance(spec, SpecConfig) and spec.num_draft_tokens == 0):
        return None
    if isinstance(spec, SpecConfig):
        from rollout_spec.drafter import NgramDrafter

        return NgramDrafter(spec)
    needed = ("start_batch", "extend_batch", "propose", "finish_batch", "end_step")
    missing = [m for m in needed if not callable(getattr(spec, m, None))]
    if missing:
        raise TypeError(f"spec must be a SpecConfig, None or a drafter; {type(spec).__name__} lacks {missing}")
    return spec
