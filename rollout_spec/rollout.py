"""One rollout call: prompts in, n samples per prompt out, with speculation counters.

``RolloutSession`` validates the prompts (a bad prompt becomes an ``"error"`` output; the rest
of the batch still runs), queues the samples on the engine, drives ``engine.step`` until every
sample finishes and returns ``RolloutOutput``s in (prompt, sample) order.

With ``SpecConfig.shared_index`` set, the engine's drafter shares its index with the other
rollout replicas (:func:`attach_shared_index`; the session attaches it on first use, placed by
``ROLLOUT_SPEC_REPLICA_ID``/``ROLLOUT_SPEC_NUM_REPLICAS``): finished samples are recorded as
they finish and published at ``engine.end_step()``, the RL step boundary.
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from rollout_spec.config import SamplingParams, SpecConfig, check_int
from rollout_spec.engine.inputs import check_group_ids, vocab_ids
from rollout_spec.engine.scheduler import Scheduler
from rollout_spec.engine.sequence import Sequence
from rollout_spec.noise import sample_seed
from rollout_spec.token_ids import BYTES_LIKE

if TYPE_CHECKING:
    from rollout_spec.engine.engine import RolloutEngine


@dataclass(frozen=True)
class RolloutOutput:
    """One finished sample; the counters are what verl aggregates into its spec panels.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the distribution it was
    sampled from (temperature, top-k, top-p applied; raw log-softmax for greedy).
    """

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop", "length" or "error"
    num_verify_steps: int  # target forwards that produced tokens for this sample (prefill included)
    num_draft_tokens: int  # draft nodes verified
    num_accepted_tokens: int  # draft nodes accepted and kept
    error: Optional[str] = None  # why, when finish_reason == "error"
    seed: Optional[int] = None  # the seed its noise was keyed by (noise.py): it reproduces the sample

    @staticmethod
    def of(seq: Sequence) -> "RolloutOutput":
        """Freeze a finished engine sequence."""
        return RolloutOutput(
            seq.prompt_index, seq.sample_index, list(seq.output), list(seq.logprobs),
            seq.finish_reason or "error", seq.num_verify_steps, seq.num_draft_tokens,
            seq.num_accepted_tokens, seq.error, seq.seed,
        )


def attach_shared_index(engine: "RolloutEngine", placement: Any = None, **client_options: Any) -> Optional[Any]:
    """Wrap the engine's drafter so it shares its index when its ``SpecConfig.shared_index`` is set.

    Returns the ``SharingDrafter`` (also when it was attached before), or None for an engine
    without speculation or without a shared index. ``placement`` is a ``ReplicaPlacement``
    (default: from the environment); ``client_options`` go to ``SharedIndexConfig``.

    Raises:
        ValueError: a shared index is configured but no placement is known.
    """
    drafter = getattr(engine, "drafter", None)
    if drafter is None:
        return None
    from rollout_spec.distributed.sharing import SharingDrafter, share_drafter

    if isinstance(drafter, SharingDrafter):
        return drafter
    spec = getattr(drafter, "config", None)
    if not isinstance(spec, SpecConfig) or spec.shared_index is None:
        return None
    engine.drafter = share_drafter(drafter, spec, placement, **client_options)
    return engine.drafter


def _is_token_sequence(prompt: Any) -> bool:
    """Whether a prompt entry is read as token ids: a list, tuple or 1-D array. Bytes are not
    token ids (a memoryview too: abc.Sequence counts it as one), a set or dict has no token order,
    None and numbers are not prompts."""
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 1
    return isinstance(prompt, Seq) and not isinstance(prompt, (str, *BYTES_LIKE))


class RolloutSession:
    """Runs one ``generate`` call on an engine (see module docstring)."""

    def __init__(self, engine: "RolloutEngine", params: SamplingParams, progress: bool = False) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if type(progress) is not bool:  # a truthy "no" would draw the bar
            raise TypeError(f"progress must be a bool, got {type(progress).__name__} {progress!r}")
        if params.stop_token_ids:
            vocab_ids("stop_token_ids", params.stop_token_ids, engine.model.config.vocab_size)
        self.engine, self.params, self.progress = engine, params, progress
        attach_shared_index(engine)  # after the checks: it wraps the engine's drafter for good
        stops = params.stop_token_ids if params.stop_token_ids is not None else engine.eos_token_ids
        self.stop_ids = frozenset(stops)

    def run(
        self, prompts: Seq[Seq[int]] | Seq[str], group_ids: Optional[Seq[Optional[int]]] = None,
        max_running: Optional[int] = None,
    ) -> list[RolloutOutput]:
        """Generate ``params.n`` samples for every prompt, at most ``max_running`` at once
        (None: all of the engine's slots; else in [1, num_slots]); outputs ordered by (prompt,
        sample). ``group_ids`` as ``RolloutEngine.generate`` takes them; bad ones raise before
        any sample is queued."""
        token_prompts = self._tokenize(prompts)
        group_ids = check_group_ids(group_ids)
        if group_ids is not None and len(group_ids) != len(token_prompts):
            raise ValueError(f"group_ids has {len(group_ids)} entries, prompts has {len(token_prompts)}")
        num_slots = self.engine.num_slots
        running = (num_slots if max_running is None
                   else check_int("max_running", max_running, 1, num_slots))
        sched = Scheduler(running, self.engine.max_prefill_tokens)
        call_seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        seqs: list[Sequence] = []
        for p, prompt in enumerate(token_prompts):
            error = self._check_prompt(prompt, prompts[p])  # before its group id: that needs valid ids
            if group_ids is not None:
                gid = group_ids[p]
            else:
                gid = None if error else self.engine.prompt_roots.group_of(prompt)
            for i in range(self.params.n):
                seq = Sequence(self.engine.new_request_id(), p, i, list(prompt or ()), self.params, gid,
                               self.stop_ids, sample_seed(call_seed, p, i))
                if error:
                    seq.finish_reason, seq.error = "error", error
                else:
                    sched.add(seq)
                seqs.append(seq)
        self._drive(sched, sum(1 for s in seqs if not s.finished))
        return [RolloutOutput.of(s) for s in seqs]

    def _drive(self, sched: Scheduler, total: int) -> None:
        """Step the engine until every queued sample has finished."""
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="rollout", unit="sample")
        try:
            while not sched.done:
                finished = self.engine.step(sched)
                if bar is not None and finished:
                    bar.update(len(finished))
        finally:
            if bar is not None:
                bar.close()

    def _tokenize(self, prompts: Seq[Seq[int]] | Seq[str]) -> list[Optional[list[int]]]:
        """Token ids for every prompt (strings go through the engine's tokenizer); None for an
        entry that is neither a string nor a sequence of token ids (``_check_prompt`` says why)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Seq):
            raise TypeError(f"prompts must be a list of token-id lists or a list of strings, "
                            f"got {type(prompts).__name__}")
        if any(isinstance(p, str) for p in prompts) and self.engine.tokenizer is None:
            raise ValueError("string prompts need a tokenizer; this engine has none")
        return [self.engine.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str)
                else list(p) if _is_token_sequence(p) else None for p in prompts]

    def _check_prompt(self, prompt: Optional[list[int]], given: Any) -> Optional[str]:
        """Why the prompt entry ``given`` (read by ``_tokenize`` as ``prompt``) cannot run, or
        None. Errors stay per request."""
        if prompt is None:
            shape = f" of shape {given.shape}" if isinstance(given, np.ndarray) else ""
            return f"a prompt must be a string or a sequence of token ids, got {type(given).__name__}{shape}"
        vocab, limit = self.engine.model.config.vocab_size, self.engine.max_model_len
        if not prompt:
            return "empty prompt: a prompt needs at least one token"
        if len(prompt) >= limit:
            return f"prompt has {len(prompt)} tokens; max_model_len={limit} leaves no room to generate"
        bad = [t for t in prompt
               if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            return f"prompt token ids must be integers in [0, {vocab}), got {bad[:3]}"
        return None
