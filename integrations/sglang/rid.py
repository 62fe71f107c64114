"""Carry a request's group (its prompt) inside SGLang's request id.

SGLang hands the NGRAM corpus only request ids and the last few tokens of each request, so the
group travels in the id: ``"<rid>|rsg=<8 hex digits>"``. Ids without the suffix have no group
(their request and the global scopes still draft).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from rollout_spec.groups import GROUP_ID_MAX, prompt_group_id

GROUP_SEPARATOR = "|rsg="
"""Marks the group suffix of a request id."""


def rid_with_group(request_id: str, prompt_ids: Sequence[int] | np.ndarray) -> str:
    """``request_id`` tagged with the stable group id of ``prompt_ids``.

    Identical prompts give the same group in every process and RL step, so verl's n samples of
    one prompt (one ``uid``) and the same prompt in later epochs share a group.
    """
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
    if GROUP_SEPARATOR in request_id:
        return request_id
    return f"{request_id}{GROUP_SEPARATOR}{prompt_group_id(prompt_ids):08x}"


def group_from_rid(rid: str) -> Optional[int]:
    """The group id a request id carries, or None when it carries none.

    Raises:
        ValueError: the suffix is present but is not 8 lowercase hex digits of a 31-bit id.
    """
    head, sep, tail = rid.rpartition(GROUP_SEPARATOR)
    if not sep:
        return None
    if len(tail) != 8 or any(c not in "0123456789abcdef" for c in tail) or int(tail, 16) > GROUP_ID_MAX:
        raise ValueError(f"request id {rid!r}: group suffix must be 8 lowercase hex digits <= 7fffffff")
    return int(tail, 16)
