"""Keep what verl's servers drop: the engine's per-request speculative counters.

verl's ``generate`` awaits the engine's output and keeps only tokens and logprobs. Wrapping the
engine's generate call on the one engine object a server owns records the final output's
counters by request id, for our ``generate`` to put into ``TokenOutput.extra_fields``.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Callable

MAX_KEPT = 1 << 16
"""Most requests' counters kept. Our ``generate`` pops each request's entry; requests that reach
the same engine over verl's HTTP app never are, so the oldest entries go past this many."""


def _keep(store: dict, key: str, value: Any) -> None:
    """``store[key] = value``, dropping the oldest entries beyond ``MAX_KEPT``."""
    store[key] = value
    while len(store) > MAX_KEPT:
        store.pop(next(iter(store)))


def record_sglang_meta(tokenizer_manager: Any, store: dict[str, dict]) -> None:
    """Make ``tokenizer_manager.generate_request`` save each output's ``meta_info`` under its rid."""
    original: Callable[..., AsyncIterator[Any]] = tokenizer_manager.generate_request

    async def generate_request(obj: Any, request: Any = None) -> AsyncIterator[Any]:
        async for out in original(obj, request):
            if isinstance(out, dict):
                _keep(store, str(obj.rid), dict(out.get("meta_info") or {}))
            yield out

    tokenizer_manager.generate_request = generate_request


def record_vllm_stats(engine: Any, store: dict[str, Any]) -> None:
    """Make ``engine.generate`` save each request's latest per-request speculative counters
    (``vllm_spec_stats``)."""
    original: Callable[..., AsyncIterator[Any]] = engine.generate

    async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        request_id = kwargs.get("request_id", args[2] if len(args) > 2 else None)
        async for out in original(*args, **kwargs):
            _keep(store, str(request_id), vllm_spec_stats(out))
            yield out

    engine.generate = generate


def vllm_spec_stats(output: Any) -> Any:
    """A vLLM ``RequestOutput``'s per-request speculative counters, or None.

    vLLM 0.29-0.33 put them on the sample, ``outputs[0].spec_decode_metrics`` (a
    ``RequestSpecDecodeMetrics``, filled on the final output when the engine runs with
    ``per_request_spec_decode_metrics``); verl's MTP path reads ``metrics.request_spec_decode_stats``,
    which those versions do not have and which is taken first where it exists.
    """
    stats = getattr(getattr(output, "metrics", None), "request_spec_decode_stats", None)
    if stats is not None:
        return stats
    samples = getattr(output, "outputs", None) or ()
    return getattr(samples[0], "spec_decode_metrics", None) if samples else None
