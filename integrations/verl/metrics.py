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


def from_vllm_stats(stats: Any) -> dict[str, int]:
    """verl's three counters from vLLM's per-request ``request_spec_decode_stats``.

    None (a vLLM that does not report them) gives no fields, so verl logs no acceptance metric
    rather than a made-up zero.
    """
    if stats is None:
        logger.warning("vLLM returned no request_spec_decode_stats; rollout/spec_* metrics are skipped")
        return {}
    return {
        "spec_num_draft_tokens": int(stats.num_draft_tokens),
        "spec_num_accepted_tokens": int(stats.num_accepted_tokens),
        "spec_num_verify_steps": int(stats.num_verify_steps),
    }
