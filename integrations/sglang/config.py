"""How a rollout-spec ``SpecConfig`` reaches SGLang: server arguments and one environment variable.

SGLang's NGRAM worker builds its corpus inside each scheduler process; those processes inherit
the launcher's environment, so our options travel as JSON in ``ROLLOUT_SPEC_SGLANG``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, MutableMapping, Optional

from rollout_spec.config import SpecConfig, object_without_repeats
from rollout_spec.integrations.vllm.config import spec_from_dict, spec_to_dict

ENV_VAR = "ROLLOUT_SPEC_SGLANG"
"""JSON object of SpecConfig fields; its presence is what makes a scheduler process use us."""
MIN_TAIL_TOKENS = 64
"""Fewest trailing tokens per request SGLang passes to the corpus (its default is 18)."""


def spec_to_env(spec: SpecConfig, environ: Optional[MutableMapping[str, str]] = None) -> str:
    """Store ``spec`` in ``environ`` (default ``os.environ``) for scheduler processes; returns the JSON."""
    text = json.dumps(spec_to_dict(spec), sort_keys=True)
    (os.environ if environ is None else environ)[ENV_VAR] = text
    return text


def spec_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[SpecConfig]:
    """The SpecConfig stored by ``spec_to_env``, or None when the variable is unset.

    Raises:
        ValueError: the variable is not JSON (or nests deeper than Python's recursion limit),
            names a field twice (JSON would keep the last silently) or names an unknown/invalid
            field.
        TypeError: the JSON is not an object, or a field has the wrong type.
    """
    text = (os.environ if environ is None else environ).get(ENV_VAR)
    if text is None:
        return None
    try:
        options = json.loads(text, object_pairs_hook=object_without_repeats)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and repeats are ValueErrors
        raise ValueError(f"{ENV_VAR} must hold a JSON object of SpecConfig fields: {exc}") from None
    return spec_from_dict(options, source=ENV_VAR)


def server_args(spec: SpecConfig) -> dict[str, Any]:
    """SGLang ``ServerArgs`` fields that run the NGRAM worker sized for ``spec``.

    SGLang's tree has a fixed ``speculative_num_draft_tokens`` slots, the first being the last
    committed token, hence ``num_draft_tokens + 1``. The worker hands the corpus the last
    ``speculative_ngram_max_trie_depth`` tokens of each request: they must cover the tokens one
    verify step commits (else the adapter sees a gap) and our longest match, and on a request's
    first step they are all of its prompt the request scope gets. A chain-only config asks SGLang
    for breadth 1 (some attention backends need it).

    Raises:
        ValueError: ``spec.num_draft_tokens`` is 0 (speculation off: launch without these args).
    """
    if spec.num_draft_tokens == 0:
        raise ValueError(
            "num_draft_tokens is 0 (speculation disabled); launch SGLang without speculative args"
        )
    args: dict[str, Any] = {
        "speculative_algorithm": "NGRAM",
        "speculative_num_draft_tokens": spec.num_draft_tokens + 1,
        "speculative_ngram_max_trie_depth": max(MIN_TAIL_TOKENS, spec.max_match_len, spec.num_draft_tokens + 2),
    }
    if not spec.tree:
        args["speculative_ngram_max_bfs_breadth"] = 1
    return args
