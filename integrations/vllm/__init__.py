"""rollout-spec inside vLLM: our drafter as a vLLM speculative proposer.

Build an engine with ``vllm.LLM(model, **engine_kwargs(SpecConfig(...)))``; the
``vllm.general_plugins`` entry point (``plugin.register``) is loaded by vLLM in its worker
processes. At every RL step boundary call ``end_step(llm)``; read acceptance with
``counters(llm)``. vLLM itself is imported only inside the functions that need an engine.
"""
from __future__ import annotations

from typing import Any

from rollout_spec.integrations.vllm.config import (
    GROUP_ID_EXTRA_ARG,
    PROPOSER_CLASS_PATH,
    engine_kwargs,
    spec_from_vllm_config,
    speculative_config,
)
from rollout_spec.integrations.vllm.metrics import SpecDecodeCounters

__all__ = [
    "GROUP_ID_EXTRA_ARG",
    "PROPOSER_CLASS_PATH",
    "SpecDecodeCounters",
    "counters",
    "end_step",
    "engine_kwargs",
    "spec_from_vllm_config",
    "speculative_config",
]


def end_step(llm: Any) -> list[dict[str, Any]]:
    """Signal the RL step boundary to every worker's drafter of a ``vllm.LLM``; returns each
    worker's proposer/drafter counters (an empty dict for pipeline stages without a drafter)."""
    return llm.collective_rpc("rollout_spec_end_step")


def counters(llm: Any) -> SpecDecodeCounters:
    """Cumulative spec-decode counters of a ``vllm.LLM`` built with ``disable_log_stats=False``
    (``engine_kwargs`` sets it); subtract two readings for one step's acceptance."""
    return SpecDecodeCounters.from_metrics(llm.get_metrics())
