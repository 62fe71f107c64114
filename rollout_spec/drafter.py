"""NgramDrafter: the Python facade over the C++ multi-scope n-gram drafter (``rollout_spec._core``).

The facade owns validation (clear ValueError/TypeError before any native state changes), the
conversion of Python lists and numpy arrays into the flat int32/int64 arrays the core takes, and
the conversion of native results into ``DraftBatch``. The core does the work with the GIL released.

How a draft is made (docs/drafter.md has the full story): the request's context is matched
against three scopes -- its own prompt and output (prompt lookup), the other samples of its
``group_id`` (siblings in flight, finished ones, and the last ``history_steps`` RL steps) and all
recent rollouts. Each scope yields occurrences of the context's suffix (up to MAX_OCCURRENCES,
GLOBAL_MAX_OCCURRENCES for the global scope; n-gram chains of length 4 and 1 for the request and
its group, 2 and 1 globally, newest first, each match measured backwards), weighted by
``scope_weight * match_len ** 2``; their continuations
form a weighted trie that is expanded best first by estimated path probability. Every proposal
searches the chains afresh (the context's last n-grams are hashed, so it never rescans the
context).
"""
from __future__ import annotations

import json
import os
import weakref
from collections.abc import Mapping, Set as AbstractSet
from dataclasses import asdict
from itertools import chain
from numbers import Integral
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from rollout_spec import _core
from rollout_spec.config import SpecConfig, check_float, check_int
from rollout_spec.files import replaced_on_success
from rollout_spec.groups import GROUP_ID_MAX
from rollout_spec.token_ids import BYTES_LIKE, MAX_TOKEN_ID, int_array, token_array
from rollout_spec.tree import DraftBatch

TokenIds = Union[Sequence[int], np.ndarray]
_MAX_REQ_ID = 2**63 - 1

#: Search constants (tuned on the shared GRPO traces, see docs/drafter.md): occurrences gathered
#: per proposal in the request and in the group scope, and in the global scope; the count below
#: which shorter key lengths are tried (a few long matches are enough evidence; short ones need
#: many); chain records inspected per key length and scope, except the global scope's 1-gram
#: chains (at T=1.0 most evidence is one token matched in other rollouts); the exponent of
#: match_len in an occurrence's weight, and beta of the evidence discount n / (n + beta) applied
#: to a node backed by n occurrences.
MAX_OCCURRENCES = 16
GLOBAL_MAX_OCCURRENCES = 32
ENOUGH_OCCURRENCES = 8
CHAIN_WALK = 16
GLOBAL_UNIGRAM_WALK = 32
MATCH_POWER = 2
EVIDENCE_DISCOUNT = 1.0


_DRAFTERS: "weakref.WeakSet[NgramDrafter]" = weakref.WeakSet()
"""This process's drafters, whose background work a fork waits for (``_finish_background``)."""


def _finish_background() -> None:
    """Before a fork: wait until no drafter has background work (an extend indexing, a proposal
    drafted ahead) queued or running. A child copies the count of queued jobs but not the core's
    thread, so its first call would wait for them forever, and a job caught midway would leave it
    half-indexed state or a held lock."""
    for drafter in list(_DRAFTERS):
        drafter._core.stats()  # returns once the core is idle


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_finish_background)


def _listed(budgets: object) -> object:
    """Budgets in the form the core's list fast paths take: a 1-D numpy array as a list (the
    engine's form), anything else as given (invalid input then takes the validating path)."""
    return budgets.tolist() if isinstance(budgets, np.ndarray) and budgets.ndim == 1 else budgets


def _budget_array(budgets: object, count: int) -> Optional[np.ndarray]:
    """Validated int32 per-request budgets (None stays None: ``num_draft_tokens`` each)."""
    if budgets is None:
        return None
    arr = int_array("budgets", budgets, 0, 1 << 20, kind="draft budgets")
    if len(arr) != count:
        raise ValueError(f"budgets must have one entry per request ({count})")
    return arr.astype(np.int32)


def _load_corpus(index: int, path: str) -> np.ndarray:
    """The array in ``external_corpora[index]``'s .npy file; a file that is not one (or holds
    pickled objects, never loaded) is a ValueError naming the entry; one that cannot be read
    (missing, a folder, no permission) is an OSError of the same kind, naming the entry and path."""
    try:
        arr = np.load(path, allow_pickle=False)
    except OSError as exc:  # np.load's own message names the path but not the config field
        raise type(exc)(f"external_corpora[{index}]: cannot read {path} ({exc.strerror or exc})") from None
    except (ValueError, EOFError) as exc:
        raise ValueError(f"external_corpora[{index}]: {path} is not a .npy array of token ids ({exc})") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive: np.load opened it as one
        arr.close()
        raise ValueError(f"external_corpora[{index}]: {path} is an .npz archive, not a .npy array of token ids")
    if arr.ndim != 1:
        raise ValueError(f"external_corpora[{index}]: {path} must hold a 1-D array of token ids, "
                         f"got shape {arr.shape}")
    return arr


def _sized(name: str, values: object) -> int:
    """``len(values)``; TypeError naming ``name`` for anything without a length (None, a number,
    a generator), where ``len`` would not say which argument it was, and for bytes-like objects,
    whose elements would read as small ints (b"\x01" as group id 1 or seed 1)."""
    if isinstance(values, BYTES_LIKE) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a sequence with one entry per request, got {type(values).__name__}")
    return len(values)


def _per_request(name: str, values: object, count: int) -> None:
    """Raise unless ``values`` has one entry per request (TypeError or ValueError naming ``name``)."""
    if _sized(name, values) != count:
        raise ValueError(f"{name} must have one entry per request ({count})")


_UNORDERED = (Mapping, AbstractSet)
"""Collections whose iteration order is not their caller's: a set's items (a list per request,
or a request's tokens) come out in hash order, a mapping's are its keys."""
_NOT_TOKEN_LISTS = (str, *BYTES_LIKE, *_UNORDERED)
"""What is refused as one request's token list: text, bytes-like objects (read item by item, as
numpy reads them, b"\\x07" would be token 7) and unordered collections."""


def _flatten(name: str, lists: Sequence[TokenIds], count: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-request token lists into (int32 tokens, int64 offsets[count+1]);
    TypeError naming ``name`` (or its entry) for an unordered collection of lists or a token list
    of ``_NOT_TOKEN_LISTS``."""
    if isinstance(lists, _UNORDERED) or not hasattr(lists, "__len__"):
        raise TypeError(f"{name} must be a sequence of token lists, one per request, got {type(lists).__name__}")
    if isinstance(lists, (str, bytes)) or len(lists) != count:
        raise ValueError(f"{name} must have one token list per request ({count})")
    any_array = False
    for i, part in enumerate(lists):
        if isinstance(part, np.ndarray):
            if part.ndim != 1 or (part.size and part.dtype.kind not in "iu"):
                raise TypeError(f"{name}[{i}] must be a 1-D integer array, got dtype {part.dtype}")
            any_array = True
        elif isinstance(part, _NOT_TOKEN_LISTS) or not hasattr(part, "__len__"):
            raise TypeError(f"{name}[{i}] must be a sequence of token ids, got {type(part).__name__}")
    offsets = np.zeros(count + 1, np.int64)
    np.cumsum([len(p) for p in lists], out=offsets[1:])
    if any_array:  # big arrays: concatenate without boxing every token as a Python int
        return np.concatenate([token_array(f"{name}[{i}]", p) for i, p in enumerate(lists)]), offsets
    # Python lists (prompts, and extends the core did not convert): one conversion for the whole batch
    return token_array(name, list(chain.from_iterable(lists))), offsets


def _group_id(name: str, value: Optional[int]) -> int:
    """-1 for None, else the validated group id."""
    return -1 if value is None else check_int(name, value, 0, GROUP_ID_MAX)


def _core_config(config: SpecConfig) -> "_core.CoreConfig":
    """Copy SpecConfig's fields into the native config struct."""
    c = _core.CoreConfig()
    for name in ("num_draft_tokens", "max_batch_draft_tokens", "max_depth", "max_match_len",
                 "min_match_len", "min_token_prob", "tree", "adaptive_budget", "history_steps",
                 "capacity_tokens", "propose_threads"):
        setattr(c, name, getattr(config, name))
    c.set_scope_weights(config.request_weight, config.group_weight, config.global_weight)
    c.max_occurrences = MAX_OCCURRENCES
    c.global_max_occurrences = GLOBAL_MAX_OCCURRENCES
    c.enough_occurrences = ENOUGH_OCCURRENCES
    c.chain_walk = CHAIN_WALK
    c.global_unigram_walk = GLOBAL_UNIGRAM_WALK
    c.match_power = MATCH_POWER
    c.evidence_discount = EVIDENCE_DISCOUNT
    return c


def indexes_in_background(drafter: object) -> bool:
    """Whether ``drafter.extend_batch`` takes ``background=True``. A drafter says so with an
    ``indexes_in_background`` attribute that is True (``NgramDrafter``); a wrapper reports the
    drafter it wraps and passes the flag on only then, so callers never probe signatures."""
    return getattr(drafter, "indexes_in_background", False) is True


def proposes_ahead(drafter: object) -> bool:
    """Whether ``drafter`` has ``propose_ahead(req_ids, budgets)``, said by a ``proposes_ahead``
    attribute that is True (``NgramDrafter``; wrappers report the drafter they wrap)."""
    return getattr(drafter, "proposes_ahead", False) is True


def takes_noise_keys(drafter: object) -> bool:
    """Whether ``drafter`` has ``set_noise_keys(req_ids, seeds, temperatures, vocab_size)``, said
    by a ``takes_noise_keys`` attribute that is True (``NgramDrafter``; a wrapper that forwards
    unknown attributes, like ``SharingDrafter``, reports the drafter it wraps)."""
    return getattr(drafter, "takes_noise_keys", False) is True


def unverified_propose(drafter: object) -> Callable[..., Any]:
    """The call for trees the engine will not verify (shadow rounds that measure acceptance on
    plain steps): ``drafter.propose_unverified`` where a wrapper that counts verified trees (the
    bench's ``DrafterProbe``) offers it, else ``drafter.propose`` (same trees either way)."""
    return getattr(drafter, "propose_unverified", None) or drafter.propose


def background_kwargs(drafter: object, background: bool) -> dict[str, bool]:
    """What a wrapper passes on to ``drafter.extend_batch`` when asked for ``background``: the
    flag where the drafter indexes in the background, nothing otherwise (same result, at once)."""
    return {"background": True} if background and indexes_in_background(drafter) else {}


class NgramDrafter:
    """Model-free drafter: proposes draft trees from the request, group and global n-gram scopes.

    Thread safety: one thread may ``extend`` while another ``propose``s (the core serialises
    calls with a mutex and releases the GIL); ``start``/``finish`` belong to one thread. A
    ``propose`` of 64 or more requests is itself split over ``config.propose_threads`` threads
    of a pool the core keeps (the drafts do not depend on the count).
    """

    indexes_in_background = True  # ``extend_batch(..., background=True)``: see that method
    proposes_ahead = True  # ``propose_ahead``: see that method
    takes_noise_keys = True  # ``set_noise_keys``: see that method

    def __init__(self, config: Optional[SpecConfig] = None, *, _load_from: Optional[str] = None):
        """Create an empty drafter; ``config.external_corpora`` .npy files go into the global scope.

        Raises:
            TypeError: config is not a SpecConfig, or a corpus file's array is not of integers.
            ValueError: a corpus file is not a .npy array (an .npz archive, pickled objects),
                holds an array that is not 1-D, or token ids outside [0, 2**31-1].
            OSError: a corpus file cannot be read (FileNotFoundError when it is missing); the
                message names the ``external_corpora`` entry and the path.
        """
        if config is None:
            config = SpecConfig()
        if not isinstance(config, SpecConfig):
            raise TypeError(f"config must be a SpecConfig, got {type(config).__name__}")
        self.config = config
        self._core = _core.DrafterCore(_core_config(config))
        _DRAFTERS.add(self)
        self._live: set[int] = set()
        if _load_from is None:
            for i, path in enumerate(config.external_corpora):
                self._add(np.array([-1], np.int32), *_flatten(f"corpus {path}", [_load_corpus(i, path)], 1),
                          pinned=True)

    # ----------------------------------------------------------------- request lifecycle
    def start(self, req_id: int, prompt_ids: TokenIds, group_id: Optional[int] = None) -> None:
        """Register a live request with its prompt; ``group_id`` identifies the prompt across samples and RL steps."""
        self.start_batch([req_id], [prompt_ids], [group_id])

    def start_batch(self, req_ids: Sequence[int], prompts: Sequence[TokenIds],
                    group_ids: Optional[Sequence[Optional[int]]] = None) -> None:
        """Batch form of ``start``.

        Raises:
            ValueError: a request id is live already or repeated, lengths differ, bad token ids.
            TypeError: ids or tokens are not integers.
        """
        ids = self._ids(req_ids, must_be_live=False)
        if group_ids is None:
            group_ids = [None] * len(ids)
        _per_request("group_ids", group_ids, len(ids))
        groups = np.array([_group_id(f"group_ids[{i}]", g) for i, g in enumerate(group_ids)], np.int32)
        tokens, offsets = _flatten("prompts", prompts, len(ids))
        self._core.start(ids, groups, tokens, offsets)
        self._live.update(ids.tolist())

    def set_noise_keys(self, req_ids: Sequence[int], seeds: Sequence[Optional[int]],
                       temperatures: Sequence[float], vocab_size: int) -> None:
        """Tell the drafter the verifier's noise keys (noise.py) of live requests: the seed each
        samples with (None for greedy requests) and the temperature it samples at, over a
        vocabulary of ``vocab_size``.

        A sampled token is the winner of a race between ``log p(v)`` and noise keyed by (seed,
        position, token), and that noise is known before the target's logits are: a request's
        proposals then rank siblings by their chances in the race they will meet, not by their
        evidence alone (docs/drafter.md, "Race-aware proposals"). What is sampled does not
        change, only how much of it the drafts guess.

        Raises:
            ValueError: unknown or repeated ids, lengths differ, a seed outside [0, 2**63-1], a
                seeded request's temperature outside (0, 1e6], vocab_size outside [1, 2**31-1]
                or of another noise layout (``noise.quarter_block``) than the one live requests
                outside this call were keyed with (one layout per drafter).
            TypeError: ids, seeds or vocab_size are not integers.
        """
        from rollout_spec.noise import quarter_block

        ids = self._ids(req_ids, must_be_live=True)
        for name, values in (("seeds", seeds), ("temperatures", temperatures)):
            _per_request(name, values, len(ids))
        keys = np.array([-1 if s is None else check_int(f"seeds[{i}]", s, 0, _MAX_REQ_ID)
                         for i, s in enumerate(seeds)], np.int64)
        # A greedy request races no noise: it has seed None, and its temperature is not read.
        temps = np.array([1.0 if s is None else check_float(f"temperatures[{i}]", t, 0.0, 1e6, lo_open=True)
                          for i, (s, t) in enumerate(zip(seeds, temperatures))], np.float64)
        vocab = check_int("vocab_size", vocab_size, 1, MAX_TOKEN_ID)
        self._core.set_noise(ids, keys, temps, quarter_block(vocab))

    def extend(self, req_id: int, token_ids: TokenIds) -> None:
        """Append newly committed tokens (accepted + bonus) to a live request."""
        self.extend_batch([req_id], [token_ids])

    def extend_batch(self, req_ids: Sequence[int], token_lists: Sequence[TokenIds], *,
                     background: bool = False) -> None:
        """Batch form of ``extend``; raises ValueError for unknown or repeated ids or bad tokens.

        With ``background``, it returns once the input is checked and the tokens are stored:
        their indexing (most of an extend's cost) runs on the core's own thread, without the
        GIL, and every later call on this drafter waits for it first, so results are the same
        as after a plain ``extend_batch`` (an engine uses the time for its own bookkeeping).
        ``background`` must be a bool (TypeError otherwise).
        """
        if type(background) is not bool:
            raise TypeError(f"background must be a bool, got {type(background).__name__} {background!r}")
        # Ids and token lists as lists of Python ints (the decode loop's form) are converted
        # natively; anything else, including every invalid input, takes the validating path.
        if self._core.extend_pylists(req_ids, token_lists, background):
            return
        ids = self._ids(req_ids, must_be_live=True, core_checks=True)
        # Other id forms (numpy arrays) with token lists of Python ints: the lists are still
        # converted natively; anything else goes through the validating path below.
        if self._core.extend_lists(ids, token_lists, background):
            return
        tokens, offsets = _flatten("token_ids", token_lists, len(ids))
        self._core.extend(ids, tokens, offsets, background)

    def finish(self, req_id: int) -> None:
        """End a request: its tokens stay in the group and global scopes, its own index is freed."""
        self.finish_batch([req_id])

    def finish_batch(self, req_ids: Sequence[int]) -> None:
        """Batch form of ``finish``."""
        ids = self._ids(req_ids, must_be_live=True)
        self._core.finish(ids)
        self._live.difference_update(ids.tolist())

    # ----------------------------------------------------------------- proposals
    def propose(self, req_ids: Sequence[int],
                budgets: Union[Sequence[int], np.ndarray, None] = None) -> DraftBatch:
        """Draft trees for ``req_ids``, in that order.

        Args:
            req_ids: live request ids, no repeats.
            budgets: most nodes per request (default ``num_draft_tokens``); the whole call is also
                capped by ``max_batch_draft_tokens``, filled in request order.
        Returns:
            A DraftBatch; siblings are ordered best first, ``probs`` are path probabilities.
        """
        # Lists of Python ints are converted natively; anything else, including every invalid
        # input, takes the validating path below with the arguments as given.
        fast = self._core.propose_lists(req_ids, _listed(budgets))
        if fast is not None:
            return DraftBatch.trusted(*fast)
        ids = self._ids(req_ids, must_be_live=True, core_checks=True)
        return DraftBatch.trusted(*self._core.propose(ids, _budget_array(budgets, len(ids))))

    def propose_ahead(self, req_ids: Sequence[int],
                      budgets: Union[Sequence[int], np.ndarray, None] = None) -> None:
        """Start ``propose(req_ids, budgets)`` on the core's background thread and return at once.

        The next ``propose`` with the same arguments returns those trees, exactly what it would
        have built then, waiting only for what is left of the work. A call that changes what
        proposals read (``start``, ``extend``, ``set_noise_keys``, ``add_sequences``,
        ``end_step``, ``load``, a ``finish`` that evicts) drops them, and so does a ``propose``
        with other arguments (it proposes afresh). The engine calls this right after a drafting
        step's extend, so that the next step's proposal is built while the engine commits this
        one. Malformed arguments raise here; unknown or repeated ids raise in the ``propose``
        that names them.
        """
        if self._core.propose_ahead_lists(req_ids, _listed(budgets)):
            return
        ids = self._ids(req_ids, must_be_live=True, core_checks=True)
        self._core.propose_ahead(ids, _budget_array(budgets, len(ids)))

    # ----------------------------------------------------------------- shared scopes
    def add_sequences(self, group_ids: Sequence[Optional[int]], sequences: Sequence[TokenIds], *,
                      pinned: bool = False) -> None:
        """Ingest finished responses produced elsewhere (another replica, a recorded step).

        They enter the group scope of their group id (None: global only) and the global scope as
        if generated in the current RL step; every position of them is indexed, so pass the
        response tokens (a prompt prefix, if included, is indexed as well). ``pinned`` ones are
        kept like ``SpecConfig.external_corpora``: never aged or evicted (a corpus loaded at run
        time, e.g. through SGLang's API).
        """
        if type(pinned) is not bool:
            raise TypeError(f"pinned must be a bool, got {type(pinned).__name__}")
        if _sized("group_ids", group_ids) != _sized("sequences", sequences):
            raise ValueError(f"group_ids and sequences must have the same length ({len(group_ids)} != {len(sequences)})")
        groups = np.array([_group_id(f"group_ids[{i}]", g) for i, g in enumerate(group_ids)], np.int32)
        self._add(groups, *_flatten("sequences", sequences, len(groups)), pinned=pinned)

    def _add(self, groups: np.ndarray, tokens: np.ndarray, offsets: np.ndarray, *, pinned: bool) -> None:
        self._core.add_sequences(groups, tokens, offsets, pinned)

    def end_step(self) -> None:
        """RL step boundary: advance the step counter and drop group entries older than ``history_steps``."""
        self._core.end_step()

    # ----------------------------------------------------------------- introspection
    def stats(self) -> dict:
        """Sizes and memory: num_requests, index_tokens, memory_bytes, step, per-scope record counts."""
        return dict(self._core.stats())

    def check_integrity(self) -> None:
        """Run the core's invariant checks (chains, slots, counts); RuntimeError on a violation."""
        problem = self._core.check_integrity()
        if problem:
            raise RuntimeError(f"drafter integrity check failed: {problem}")

    def is_live(self, req_id: int) -> bool:
        """Whether ``req_id`` (an integer; any value outside the id range is simply not live) was
        started and not finished. A bool or a float raises TypeError, as everywhere else an id
        goes: ``True`` would otherwise ask about request 1."""
        if isinstance(req_id, bool) or not isinstance(req_id, Integral):
            raise TypeError(f"req_id must be an integer, got {type(req_id).__name__} {req_id!r}")
        return req_id in self._live

    # ----------------------------------------------------------------- checkpoints
    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the whole drafter state (config, sequences, indexes, live requests) to ``path``.

        Written beside ``path`` and renamed into place: a save that fails or is interrupted
        leaves the checkpoint that was there before (RuntimeError when writing fails).
        """
        meta = json.dumps({"config": asdict(self.config), "live": sorted(self._live)})
        target = _checkpoint_path(path)
        try:
            with replaced_on_success(target) as tmp:
                self._core.save(os.fspath(tmp), meta)
        except OSError as exc:  # the rename: onto a directory, across devices, no permission
            raise RuntimeError(f"cannot write the checkpoint {target!r}: {exc.strerror or exc}") from exc

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "NgramDrafter":
        """Restore a drafter written by ``save``; it proposes exactly what the saved one would.

        Raises:
            RuntimeError: the file cannot be read, is no drafter checkpoint, is of a format this
                build does not read, or is corrupt: a checksum that does not match (format 7:
                any damaged or cut-off file), truncated, a count larger than the file, or fields
                that decode but break the core's invariants (``check_integrity``).
        """
        # The checkpoint's header carries its SpecConfig: the core is built from it, then loads.
        path = _checkpoint_path(path)
        if os.path.isdir(path):
            raise RuntimeError(f"drafter checkpoint {path!r} is a directory, not a checkpoint file")
        header = _core.DrafterCore.read_meta(path)
        try:
            meta = json.loads(header.decode())
            config = dict(meta["config"], external_corpora=tuple(meta["config"]["external_corpora"]))
            spec, live = SpecConfig(**config), set(meta["live"])
            if not all(type(i) is int and 0 <= i <= _MAX_REQ_ID for i in live):
                raise ValueError("live request ids must be integers in [0, 2**63-1]")
        # JSON and UTF-8 errors are ValueErrors; a deeply nested header is a RecursionError.
        except (KeyError, TypeError, ValueError, RecursionError) as err:
            raise RuntimeError(f"drafter checkpoint {path!r} is corrupt (its header: "
                               f"{type(err).__name__}: {err})") from None
        drafter = cls(spec, _load_from=path)
        drafter._core.load(path)
        core_live = drafter._core.stats()["num_requests"]
        if len(live) != core_live or not all(map(drafter._core.has_request, live)):
            raise RuntimeError(f"drafter checkpoint {path!r} is corrupt (its header's live "
                               "requests are not the core's)")
        drafter._live = live
        return drafter

    # ----------------------------------------------------------------- helpers
    def _ids(self, req_ids: Iterable[int], *, must_be_live: bool, core_checks: bool = False) -> np.ndarray:
        """Validated int64 id array: integers in range, no repeats, live (or not) as required.

        ``core_checks``: leave the repeat and liveness checks to the native call, which makes
        them (ValueError, before any state changes) with one hash lookup per id.
        """
        if not hasattr(req_ids, "__iter__"):  # None, a single id: list() would not name the argument
            raise TypeError(f"req_ids must be a sequence of request ids, got {type(req_ids).__name__} {req_ids!r}")
        # Arrays and bytes-like objects go to int_array as given: it refuses bytes (a list of
        # them would read as small ints, so b"\x00" would name request 0).
        as_given = isinstance(req_ids, (np.ndarray, *BYTES_LIKE))
        ids = int_array("req_ids", req_ids if as_given else list(req_ids), 0, _MAX_REQ_ID, kind="request ids")
        if core_checks:
            return ids.astype(np.int64, copy=False)
        as_list = ids.tolist()
        unique = set(as_list)
        if len(unique) != len(as_list):
            raise ValueError("req_ids must not repeat a request id")
        if must_be_live:
            unknown = unique - self._live
            if unknown:
                raise ValueError(f"req_ids: unknown request id(s) {sorted(unknown)[:5]}")
        else:
            taken = unique & self._live
            if taken:
                raise ValueError(f"req_ids: request id(s) {sorted(taken)[:5]} already live")
        return ids.astype(np.int64, copy=False)


def _checkpoint_path(path: Union[str, bytes, os.PathLike]) -> str:
    """``path`` as the str the core opens: bytes decoded as the OS does; an empty path is refused,
    and so is a NUL byte, since the core's C file calls would stop at it and use another file."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str, bytes or os.PathLike, got {type(path).__name__}")
    text = os.fsdecode(path)
    if not text:  # else the temporary beside it is named from Path("."), whose error names no path
        raise ValueError("path must name a file, got an empty path")
    if "\0" in text:
        raise ValueError(f"path must not contain a NUL byte, got {text!r}")
    try:
        text.encode("utf-8")  # the core takes UTF-8; bytes that are not decode to surrogates
    except UnicodeEncodeError:
        raise ValueError(f"path must be valid UTF-8, got {path!r}") from None
    return text
