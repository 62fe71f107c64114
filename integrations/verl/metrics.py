"""Per-request speculative counters under the names verl's trainer aggregates.

verl turns ``TokenOutput.extra_fields['spec_num_draft_tokens' | 'spec_num_accepted_tokens' |
'spec_num_verify_steps']`` into ``rollout/spec_accept_rate`` and ``rollout/spec_accept_length``.
Its servers fill them only for MTP rollouts, so this hook fills them for ours.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

logger = logging.getLogger(__name__)

SPEC_FIELDS = ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_verify_steps")
SGLANG_META_KEYS = ("spec_num_proposed_drafts", "spec_num_correct_drafts", "spec_verify_ct")
"""SGLang's ``meta_info`` keys for the same three counters (sglang >= 0.5.2x)."""


def from_sglang_meta(meta_info: Mapping[str, Any]) -> dict[str, int]:
    """verl's three counters from one SGLang response's ``meta_info``.

    SGLang omits the keys for a request that never ran a verify step (e.g. one output token),
    which is zero of each. SGLang counts every verified slot as drafted (its tree has a fixed
    size), so unfilled slots count as drafted and rejected.
    """
    if "spec_verify_ct" not in meta_info:
        if meta_info.get("completion_tokens", 0) > 1:
            logger.warning("SGLang meta_info has no spec_verify_ct for a %s-token response; keys: %s",
                           meta_info.get("completion_tokens"), sorted(meta_info))
        return dict.fromkeys(SPEC_FIELDS, 0)
    return {ours: int(meta_info.get(theirs, 0)) for ours, theirs in zip(SPEC_FIELDS, SGLANG_META_KEYS)}


_warned_no_vllm_stats = False


def from_vllm_stats(stats: Any, response_tokens: int) -> dict[str, int]:
    """verl's three counters from vLLM's per-request counters (``capture.vllm_spec_stats``) and
    the length of the response they belong to.

    A ``RequestSpecDecodeMetrics`` (vLLM 0.29-0.33) holds a histogram of accepted drafts per
    verify step that had drafts: ``sum(j * count)`` is the accepted tokens. The
    ``request_spec_decode_stats`` form verl reads has the three counts. vLLM counts only the
    steps that drafted; SGLang, and verl's accept length (1 + accepted / verify steps), count
    every decode forward, so the verify steps here are the response's decode forwards: one per
    token after the prefill's, less the accepted ones (at least vLLM's own count). A request the
    drafter never drafted for then reads 1 token per forward, not verl's 0 for no verify step.
    None (the engine reported nothing) gives no fields, so verl logs no acceptance metric rather
    than a made-up zero; that is logged once per process, not per request. A response with no
    tokens (verl's aborted or refused request, which may never reach the engine) ran no verify
    step: zero of each, as SGLang's, so that every sample of a batch carries the three fields
    (verl's v0 trainer fails on a batch where only some do, its v1 trainer logs nothing).
    """
    global _warned_no_vllm_stats
    if stats is None and response_tokens == 0:
        return dict.fromkeys(SPEC_FIELDS, 0)
    if stats is None:
        if not _warned_no_vllm_stats:
            _warned_no_vllm_stats = True
            logger.warning("vLLM reported no per-request speculative counters (is "
                           "per_request_spec_decode_metrics on?); rollout/spec_* metrics are skipped")
        return {}
    histogram = getattr(stats, "histogram", None)
    if histogram is not None:
        accepted = sum(j * int(count) for j, count in enumerate(histogram))
        verified = sum(int(count) for count in histogram)
    else:
        accepted, verified = int(stats.num_accepted_tokens), int(stats.num_verify_steps)
    return {
        "spec_num_draft_tokens": int(stats.num_draft_tokens),
        "spec_num_accepted_tokens": accepted,
        "spec_num_verify_steps": max(verified, response_tokens - 1 - accepted),
    }
