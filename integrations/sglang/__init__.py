"""SGLang integration: our drafter behind SGLang's NGRAM speculative worker.

``RolloutSpecCorpus`` replaces SGLang's ``NgramCorpus``; the SGLang plugin in ``plugin.py``
(entry point ``sglang.srt.plugins: rollout_spec``) puts it in place in every scheduler process
when ``ROLLOUT_SPEC_SGLANG`` is set, and ``server_args`` gives the NGRAM settings to launch with.
SGLang itself is imported lazily.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "RolloutSpecCorpus": "rollout_spec.integrations.sglang.corpus",
    "ENV_VAR": "rollout_spec.integrations.sglang.config",
    "server_args": "rollout_spec.integrations.sglang.config",
    "spec_to_env": "rollout_spec.integrations.sglang.config",
    "spec_from_env": "rollout_spec.integrations.sglang.config",
    "rid_with_group": "rollout_spec.integrations.sglang.rid",
    "group_from_rid": "rollout_spec.integrations.sglang.rid",
    "register": "rollout_spec.integrations.sglang.plugin",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
