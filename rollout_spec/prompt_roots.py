"""The group of a sample's later calls: that of the first prompt it extends.

A multi-turn agent loop sends a sample's next turn as its prompt + its output so far + the tool's
output, and a client that resumes an aborted request resends prompt + tokens so far, each under a
fresh request id: only the token ids tie such a call to its sample. :class:`PromptRoots` keeps the
prompts first seen (the roots) and gives a call that extends one the root's group, so the call
drafts with its siblings and the prompt's earlier steps instead of under a group of its own.

Prefixes are found in O(len(prompt)): a vectorised 64-bit polynomial hash of every prefix of the
incoming prompt, looked up only at the lengths some root has; a hit is confirmed with the
prefix's own group id (:func:`prompt_group_id`), so two prompts whose polynomial hashes collide
are never merged.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Optional

import numpy as np

from rollout_spec.config import check_int
from rollout_spec.groups import prompt_group_id
from rollout_spec.token_ids import token_array

DEFAULT_MAX_ROOTS = 10_000
"""Roots a registry keeps by default: far more distinct prompts than one server holds in flight."""

MAX_ROOTS_LIMIT = 1 << 24
"""Largest ``max_roots`` accepted (each root costs a few hundred bytes)."""

_HASH_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd, so its powers never reach 0 mod 2**64


def prefix_hashes(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    """uint64[n] whose element ``L - 1`` hashes ``tokens[:L]``: ``sum(t_j * B**j) mod 2**64``.

    One cumulative product and one cumulative sum, wrapping mod 2**64 as numpy's unsigned
    integer arithmetic does; equal prefixes hash equal in every process (no salt). ``tokens``
    are token ids as :func:`token_array` takes them (a float or negative id would otherwise be
    cast to another id's hash); anything else raises naming ``tokens``.
    """
    tokens = token_array("tokens", tokens)
    powers = np.full(len(tokens), _HASH_BASE, dtype=np.uint64)
    if len(tokens):
        powers[0] = 1
    return np.cumsum(tokens.astype(np.uint64) * np.cumprod(powers), dtype=np.uint64)


class PromptRoots:
    """Registry of root prompts, least recently used first out, mapping a prompt to its root's group.

    :meth:`group_of` gives a prompt that extends (or equals) registered roots the group of the
    longest of them, and registers any other prompt as a new root. A prompt that extends a root is
    never registered itself, so a sample's third turn still finds the dataset prompt, not its
    second turn's prompt. A first call, an exact root, gets its own ``prompt_group_id``, as
    without the registry. Not thread-safe: one registry per server, used from its event loop.

    Args:
        max_roots: roots kept; registering one more evicts the least recently used (a lookup
            that finds a root refreshes it).

    Raises:
        TypeError / ValueError: ``max_roots`` not an integer in [1, MAX_ROOTS_LIMIT].
    """

    def __init__(self, max_roots: int = DEFAULT_MAX_ROOTS) -> None:
        self._max_roots = check_int("max_roots", max_roots, 1, MAX_ROOTS_LIMIT)
        self._roots: OrderedDict[tuple[int, int, int], None] = OrderedDict()  # (length, hash, group), LRU order
        self._hashed: Counter[tuple[int, int]] = Counter()  # (length, hash) -> roots with it
        self._length_counts = np.zeros(1, dtype=np.int64)  # [L]: roots of length L

    def __len__(self) -> int:
        """Roots held."""
        return len(self._roots)

    def group_of(self, prompt_ids: np.ndarray | Sequence[int]) -> int:
        """The group of the longest registered root that ``prompt_ids`` starts with, else the
        prompt's own ``prompt_group_id``, registering it as a root (an empty prompt never is: it
        would be a prefix of every prompt).

        Raises:
            TypeError / ValueError: as :func:`prompt_group_id`, for ``prompt_ids`` that are not a
                1-D sequence of token ids in [0, 2**31 - 1].
        """
        tokens = token_array("prompt_ids", prompt_ids)
        if tokens.size == 0:
            return prompt_group_id(tokens)
        hashes = prefix_hashes(tokens)
        group = self._longest_root_group(tokens, hashes)
        if group is None:
            group = prompt_group_id(tokens)
            self._register((len(tokens), int(hashes[-1]), group))
        return group

    def _longest_root_group(self, tokens: np.ndarray, hashes: np.ndarray) -> Optional[int]:
        """The group of the longest root ``tokens`` starts with (refreshed), or None.

        Only lengths some root has are looked up; a (length, hash) hit counts only when the
        prefix's own group id matches a root's, which a mere hash collision does not give.
        """
        counts = self._length_counts[1:len(tokens) + 1]
        for length in np.flatnonzero(counts)[::-1] + 1:
            length = int(length)
            prefix_hash = int(hashes[length - 1])
            if (length, prefix_hash) not in self._hashed:
                continue
            root = (length, prefix_hash, prompt_group_id(tokens[:length]))
            if root in self._roots:
                self._roots.move_to_end(root)
                return root[2]
        return None

    def _register(self, root: tuple[int, int, int]) -> None:
        """Add ``root`` (length, hash, group) as the most recent, evicting the oldest at capacity."""
        if len(self._roots) >= self._max_roots:
            self._forget(self._roots.popitem(last=False)[0])
        self._roots[root] = None
        self._hashed[root[:2]] += 1
        length = root[0]
        if length >= len(self._length_counts):
            grown = np.zeros(max(length + 1, 2 * len(self._length_counts)), dtype=np.int64)
            grown[:len(self._length_counts)] = self._length_counts
            self._length_counts = grown
        self._length_counts[length] += 1

    def _forget(self, root: tuple[int, int, int]) -> None:
        """Drop an evicted root from the hash and length counts."""
        key = root[:2]
        self._hashed[key] -= 1
        if self._hashed[key] == 0:
            del self._hashed[key]
        self._length_counts[root[0]] -= 1
