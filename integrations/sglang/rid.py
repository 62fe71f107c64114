"""Carry a request's group (its prompt) inside SGLang's request id.

SGLang hands the NGRAM corpus only request ids and the last few tokens of each request, so a
group the caller knows travels in the id: ``"<rid>|rsg=<8 hex digits>"``. Ids without the suffix
carry no group; the corpus then takes one from the request's prompt, as the forward hook hands it
the request (``RolloutSpecCorpus._group_of``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from rollout_spec.config import check_int
from rollout_spec.groups import GROUP_ID_MAX, prompt_group_id

GROUP_SEPARATOR = "|rsg="
"""Marks the group suffix of a request id."""


def rid_with_group(request_id: str, prompt_ids: Sequence[int] | np.ndarray) -> str:
    """``request_id`` tagged with the stable group id of ``prompt_ids`` (kept as it is when it
    carries a group already).

    Identical prompts give the same group in every process and RL step, so verl's n samples of
    one prompt (one ``uid``) and the same prompt in later epochs share a group.
    """
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
    if group_from_rid(request_id) is not None:
        return request_id
    return rid_with_group_id(request_id, prompt_group_id(prompt_ids))


def rid_with_group_id(request_id: str, group_id: int) -> str:
    """``request_id`` tagged with ``group_id`` (kept as it is when it carries a group already):
    for a caller that knows the group some other way than by hashing this request's prompt, as
    verl's server does for a sample's later turns (``rollout_spec.prompt_roots``).

    Raises:
        TypeError / ValueError: ``request_id`` not a str, ``group_id`` not an int in
            [0, GROUP_ID_MAX].
    """
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
    group_id = check_int("group_id", group_id, 0, GROUP_ID_MAX)
    if group_from_rid(request_id) is not None:
        return request_id
    return f"{request_id}{GROUP_SEPARATOR}{group_id:08x}"


def group_from_rid(rid: str) -> Optional[int]:
    """The group id a request id carries, or None when it carries none.

    Any request id works, as with SGLang's own corpus: one whose text after the last
    ``GROUP_SEPARATOR`` is not ours (8 lowercase hex digits of a 31-bit id) carries no group.
    SGLang renames a batch request's one id ``f"{rid}_{i}"``; that index is allowed after the
    digits, so the group survives it.

    Raises:
        TypeError: ``rid`` is not a str (SGLang's request ids are).
    """
    if not isinstance(rid, str):
        raise TypeError(f"rid must be a str, got {type(rid).__name__}")
    _, sep, tail = rid.rpartition(GROUP_SEPARATOR)
    tag, underscore, index = tail.partition("_")
    if (not sep or len(tag) != 8 or any(c not in _HEX for c in tag)
            or (underscore and not (index and all(c in _DIGITS for c in index)))):
        return None
    group = int(tag, 16)
    return group if group <= GROUP_ID_MAX else None


_HEX, _DIGITS = frozenset("0123456789abcdef"), frozenset("0123456789")
