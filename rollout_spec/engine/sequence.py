"""Per-request state of the engine: one sample of one prompt, from admission to its finish."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rollout_spec.config import SamplingParams


@dataclass
class Sequence:
    """One sample being generated.

    Invariant while running: the KV of ``prompt + output[:-1]`` is cached in ``slot`` at positions
    ``0 .. ctx_len-1`` (``ctx_len = len(prompt) + len(output) - 1``) and ``output[-1]`` is the root
    of the next draft tree (its KV is written by the next verify forward).
    """

    req_id: int  # the drafter's id, unique for the engine's lifetime
    prompt_index: int  # position of the prompt in the caller's list
    sample_index: int  # 0 .. n-1 within the prompt's group
    prompt: list[int]
    params: SamplingParams
    group_id: Optional[int]  # the prompt's identity for the drafter's group scope
    stop_ids: frozenset[int]
    seed: int  # keys the sample's noise (noise.py): its tokens do not depend on the batch or drafts
    slot: int = -1  # KV slot while running, -1 otherwise
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop", "length" or "error"
    error: Optional[str] = None
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    fed: int = 0  # output tokens handed to the drafter so far (``drafter_queue.DrafterFeed``)

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None
