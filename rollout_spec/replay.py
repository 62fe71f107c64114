"""Rollout traces and the lock-step replay simulator that scores drafters on them.

A trace (the format of ``/work/shared/traces``) holds prompts with their ``group_id`` and, per
RL step, the recorded responses. ``replay`` feeds one step at a time to a drafter exactly as an
engine would: every live request takes one verify per iteration, a draft node is accepted iff it
equals the recorded next token (walking the tree along the trace), and each iteration commits the
accepted tokens plus one bonus token. The drafter keeps its index across steps.

Also here: the baseline drafters the bench compares against -- a vLLM-style prompt-lookup n-gram
written with numpy, and an adapter over arctic-inference's ``SuffixDecodingCache`` when that
package is installed (it is never vendored here).
"""
from __future__ import annotations

import gzip
import json
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from rollout_spec.config import MAX_NEW_TOKENS, check_int, object_without_repeats
from rollout_spec.drafter import takes_noise_keys
from rollout_spec.files import replaced_on_success
from rollout_spec.groups import GROUP_ID_MAX
from rollout_spec.token_ids import MAX_TOKEN_ID
from rollout_spec.tree import DraftBatch, drafter_output

Tree = tuple[Sequence[int], Sequence[int]]  # (tokens, parents) of one request's draft


@dataclass
class Trace:
    """Recorded rollouts: prompts by ``group_id`` and, per RL step, ``(group_id, response_ids)``.

    ``seeds``, when the recording has them (our engine's recordings do, the shared traces do
    not): per step, per response, the seed it was sampled with (noise.py), or None.
    """

    prompts: dict[int, list[int]]
    steps: list[list[tuple[int, list[int]]]]
    meta: dict[str, Any] = field(default_factory=dict)
    seeds: Optional[list[list[Optional[int]]]] = None

    def __post_init__(self) -> None:
        """Seeds, when given, are one list per step with one entry per response (a ValueError
        otherwise: ``save_trace`` would drop the unmatched ones); seeds that name no seed at all
        are no seeds, as ``noise_keys`` then has nothing to tell."""
        self.check_seeds()
        if self.seeds is not None and all(x is None for step in self.seeds for x in step):
            self.seeds = None

    def check_seeds(self) -> None:
        """Raise ValueError unless ``seeds`` is None or matches ``steps`` response for response
        (``save_trace`` checks again: the field may have been set after construction)."""
        if self.seeds is None:
            return
        shape = [len(step) for step in self.steps]
        if [len(step) for step in self.seeds] != shape:
            raise ValueError(f"seeds must hold one list per step with one entry per response "
                             f"({shape}), got {[len(step) for step in self.seeds]}")

    @property
    def num_tokens(self) -> int:
        """Response tokens over all steps."""
        return sum(len(r) for step in self.steps for _, r in step)

    def noise_keys(self, step: int) -> Optional[tuple[list[Optional[int]], float, int]]:
        """(seeds of the step's responses, temperature, vocab_size): what a drafter that takes
        noise keys is told in a replay, so that it aims at the race that picked each recorded
        token. None without recorded seeds, a sampling temperature > 0 and the vocabulary size."""
        temperature = float((self.meta.get("sampling") or {}).get("temperature", 0.0) or 0.0)
        vocab = self.meta.get("vocab_size")
        if self.seeds is None or temperature <= 0.0 or not vocab:
            return None
        return self.seeds[step], temperature, int(vocab)

    def first_responses(self, count: int) -> "Trace":
        """This trace with every step cut to its first ``count`` responses (their seeds alike): a
        shorter replay of the same steps and prompts."""
        check_int("count", count, 1)
        seeds = None if self.seeds is None else [step[:count] for step in self.seeds]
        return Trace(prompts=self.prompts, steps=[step[:count] for step in self.steps],
                     meta=self.meta, seeds=seeds)


def load_trace(path: str | Path) -> Trace:
    """Read a trace (gzip JSON when the name ends in .gz).

    Raises:
        ValueError: the file is not (gzip) JSON, an object in it repeats a key (JSON would keep
            the last silently), or a field is missing or malformed; the message names the file
            and the key or field (e.g. ``steps[1][4].response_ids[7]``).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            raw = json.load(f, object_pairs_hook=object_without_repeats)
    # JSON, UTF-8: ValueErrors; JSON nested deeper than Python's recursion limit: RecursionError
    except (ValueError, RecursionError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path}: not a {'gzip ' if path.suffix == '.gz' else ''}JSON trace ({exc})") from None
    if not isinstance(raw, dict) or "prompts" not in raw or "steps" not in raw:
        raise ValueError(f"{path}: a trace needs 'prompts' and 'steps'")
    prompts: dict[int, list[int]] = {}
    for i, p in enumerate(_list_field(raw["prompts"], "prompts", path)):
        if not isinstance(p, dict) or "group_id" not in p or "prompt_ids" not in p:
            raise ValueError(f"{path}: prompts[{i}] needs group_id and prompt_ids")
        g = _group_id(p["group_id"], f"prompts[{i}].group_id", path)
        if g in prompts:
            raise ValueError(f"{path}: prompts[{i}].group_id {g} repeats an earlier prompt's")
        prompts[g] = _token_ids(p["prompt_ids"], f"prompts[{i}].prompt_ids", path)
    steps, seeds = [], []
    for s, step in enumerate(_list_field(raw["steps"], "steps", path)):
        rows, step_seeds = [], []
        for j, r in enumerate(_list_field(step, f"steps[{s}]", path)):
            where = f"steps[{s}][{j}]"
            if not isinstance(r, dict) or "group_id" not in r or "response_ids" not in r:
                raise ValueError(f"{path}: {where} needs group_id and response_ids")
            g = _group_id(r["group_id"], f"{where}.group_id", path)
            if g not in prompts:
                raise ValueError(f"{path}: {where}.group_id {g} has no prompt")
            rows.append((g, _token_ids(r["response_ids"], f"{where}.response_ids", path)))
            seed = r.get("seed")
            if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
                raise ValueError(f"{path}: {where}.seed must be an integer in [0, 2**63), got {seed!r}")
            step_seeds.append(seed)
        steps.append(rows)
        seeds.append(step_seeds)
    meta = {k: v for k, v in raw.items() if k not in ("prompts", "steps")}
    _check_meta(meta, path)
    meta["prompt_records"] = raw["prompts"]
    return Trace(prompts=prompts, steps=steps, meta=meta, seeds=seeds)


def _check_meta(meta: dict, path: Path) -> None:
    """The fields a replay reads, when present: ``sampling`` an object whose ``temperature`` is a
    number in [0, 100] and ``max_new_tokens`` an integer in [1, 2**24] (SamplingParams' range),
    ``vocab_size`` an integer in [1, 2**31-1], ``eos_token_id`` null or a token id in [0, 2**31)
    (below ``vocab_size`` when that is given). Other ``sampling`` entries only describe the run."""
    sampling = meta.get("sampling")
    if sampling is not None and not isinstance(sampling, dict):
        raise ValueError(f"{path}: sampling must be an object, got {type(sampling).__name__}")
    temperature = (sampling or {}).get("temperature")
    if temperature is not None and (type(temperature) not in (int, float) or not 0 <= temperature <= 100):
        raise ValueError(f"{path}: sampling.temperature must be a number in [0, 100], got {temperature!r}")
    max_new = (sampling or {}).get("max_new_tokens")
    if max_new is not None and (type(max_new) is not int or not 1 <= max_new <= MAX_NEW_TOKENS):
        raise ValueError(f"{path}: sampling.max_new_tokens must be an integer in [1, 2**24], got {max_new!r}")
    vocab = meta.get("vocab_size")
    if vocab is not None and (type(vocab) is not int or not 1 <= vocab <= 2**31 - 1):
        raise ValueError(f"{path}: vocab_size must be an integer in [1, 2**31-1], got {vocab!r}")
    eos = meta.get("eos_token_id")
    if eos is not None and (type(eos) is not int or not 0 <= eos <= MAX_TOKEN_ID):
        raise ValueError(f"{path}: eos_token_id must be null or a token id in [0, 2**31), got {eos!r}")
    if eos is not None and vocab is not None and eos >= vocab:
        raise ValueError(f"{path}: eos_token_id must be below vocab_size ({vocab}), got {eos}")


def _list_field(value: Any, where: str, path: Path) -> list:
    """``value`` if it is a list, else a ValueError naming the field."""
    if not isinstance(value, list):
        raise ValueError(f"{path}: {where} must be a list, got {type(value).__name__}")
    return value


def _group_id(value: Any, where: str, path: Path) -> int:
    """A group id: an integer in [0, 2**31) (the drafter's range; JSON booleans and floats are
    not integers)."""
    if type(value) is not int or not 0 <= value <= GROUP_ID_MAX:
        raise ValueError(f"{path}: {where} must be an integer in [0, 2**31), got {value!r}")
    return value


def _token_ids(value: Any, where: str, path: Path) -> list[int]:
    """A token list: integers in [0, 2**31) (the drafter's range), else ValueError naming the
    first bad entry. Checked element by element, unlike ``token_ids.token_array`` (vectorised
    for hot paths), because a trace is read once and its errors point into a file."""
    for i, t in enumerate(_list_field(value, where, path)):
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"{path}: {where}[{i}] must be a token id in [0, 2**31), got {t!r}")
    return value


def save_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` in the shared format (gzip JSON when the name ends in .gz), whole or not
    at all (``files.replaced_on_success``)."""
    path = Path(path)
    trace.check_seeds()
    meta = dict(trace.meta)
    records = {int(p["group_id"]): p for p in meta.pop("prompt_records", [])}
    prompts = []
    for g, ids in trace.prompts.items():
        rec = dict(records.get(g, {"kind": "synthetic", "source": "", "text": "", "answer": None}))
        rec.update(group_id=g, prompt_ids=list(ids))
        prompts.append(rec)
    steps = []
    for s, step in enumerate(trace.steps):
        rows = [{"group_id": g, "response_ids": list(r)} for g, r in step]
        if trace.seeds is not None:
            for row, seed in zip(rows, trace.seeds[s]):
                if seed is not None:
                    row["seed"] = int(seed)
        steps.append(rows)
    raw = {**meta, "prompts": prompts, "steps": steps}
    opener = gzip.open if path.suffix == ".gz" else open
    with replaced_on_success(path) as tmp, opener(tmp, "wt") as f:
        json.dump(raw, f)


class ReplayDrafter(Protocol):
    """What ``replay`` needs from a drafter (NgramDrafter satisfies it as is)."""

    def start_batch(self, req_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                    group_ids: Sequence[Optional[int]]) -> None: ...
    def extend_batch(self, req_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> None: ...
    def propose(self, req_ids: Sequence[int], budgets: Sequence[int]) -> Any: ...
    def finish_batch(self, req_ids: Sequence[int]) -> None: ...
    def end_step(self) -> None: ...


def as_trees(result: Any, count: int) -> list[Tree]:
    """Per-request (tokens, parents) from a DraftBatch or from a list of trees."""
    if isinstance(result, DraftBatch):
        off, tok, par = result.offsets.tolist(), result.tokens.tolist(), result.parents.tolist()
        return [(tok[off[b]:off[b + 1]], par[off[b]:off[b + 1]]) for b in range(count)]
    return list(result)


def accepted_path(tokens: Sequence[int], parents: Sequence[int], target: Sequence[int]) -> list[int]:
    """The nodes accepted when the true continuation is ``target``: walk the tree along it,
    taking at each node its first child holding the next token.

    Nodes are topological, so one forward pass suffices: a child of the current node always
    comes after it (and the path's indices increase).
    """
    path: list[int] = []
    cur = -1
    for i in range(len(tokens)):
        if len(path) == len(target):
            break
        if parents[i] == cur and tokens[i] == target[len(path)]:
            cur = i
            path.append(i)
    return path


def accepted_length(tokens: Sequence[int], parents: Sequence[int], target: Sequence[int]) -> int:
    """Draft tokens accepted when the true continuation is ``target`` (``accepted_path``'s length)."""
    return len(accepted_path(tokens, parents, target))


@dataclass
class StepResult:
    """Replay figures of one RL step for one drafter."""

    step: int
    tokens: int = 0
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    request_iterations: int = 0
    drafter_seconds: float = 0.0  # propose + extend
    propose_seconds: float = 0.0  # the propose share of drafter_seconds

    @property
    def tpf(self) -> float:
        """Tokens per target forward."""
        return self.tokens / max(self.verify_steps, 1)

    @property
    def us_per_request_iteration(self) -> float:
        """CPU microseconds of propose + extend per live request per iteration (every thread's,
        with the default clock: a drafter's own pool included)."""
        return 1e6 * self.drafter_seconds / max(self.request_iterations, 1)

    @property
    def propose_us_per_request_iteration(self) -> float:
        """The propose part of ``us_per_request_iteration`` (the rest is extend)."""
        return 1e6 * self.propose_seconds / max(self.request_iterations, 1)


def replay_step(drafter: ReplayDrafter, trace: Trace, step: int, budget: int, first_id: int,
                max_live: Optional[int] = None, clock: Callable[[], float] = time.process_time,
                on_tree: Optional[Callable[[Tree, Sequence[int]], None]] = None) -> StepResult:
    """Replay one step lock-step; requests get ids ``first_id, first_id + 1, ...``.

    Every iteration is one verify step per live request. A request's first one stands for its
    prefill and asks for no draft: an engine draws the first token from the prompt's forward
    (until session 73 it drafted there too, which let a drafter that knows a group's earlier
    openings emit up to ``budget + 1`` tokens from the prefill).

    ``max_live`` caps concurrent requests (admitting waiting ones as others finish), as an
    engine's batch limit would; None runs all of the step's requests at once. ``clock`` times the
    drafter's calls: by default the process's CPU time, which counts every thread's work (a
    drafter that splits its calls over a pool of threads is charged for all of them; the calling
    thread's time alone would miss the pool's share), or ``time.perf_counter`` for wall time.
    ``on_tree(tree, continuation)``, if given, sees every proposed tree with the response tokens
    still to come (outside the timed calls), except a prefill's: it asks for no draft, so its
    empty tree would count as a draft that found nothing. Where the trace recorded its samples'
    seeds, a drafter that takes noise keys is told them at start (``Trace.noise_keys``).
    """
    if not trace.steps:
        raise ValueError("the trace has no steps to replay")
    step = check_int("step", step, 0, len(trace.steps) - 1)
    budget = check_int("budget", budget, 0, 1 << 20)
    if max_live is not None:
        max_live = check_int("max_live", max_live, 1)
    rows = trace.steps[step]
    res = StepResult(step=step)
    # A recording with seeds: a drafter that takes noise keys is told them, as the engine does.
    keys = trace.noise_keys(step) if takes_noise_keys(drafter) else None
    waiting = list(range(len(rows)))[::-1]
    live: dict[int, int] = {}  # req id -> committed response tokens
    while waiting or live:
        admit = []
        while waiting and (max_live is None or len(live) + len(admit) < max_live):
            admit.append(waiting.pop())
        if admit:
            ids = [first_id + j for j in admit]
            drafter.start_batch(ids, [trace.prompts[rows[j][0]] for j in admit], [rows[j][0] for j in admit])
            if keys is not None:
                drafter.set_noise_keys(ids, [keys[0][j] for j in admit], [keys[1]] * len(ids), keys[2])
            empty = [i for i, j in zip(ids, admit) if not rows[j][1]]
            if empty:  # nothing to generate: no verify step (an engine emits at least one token)
                drafter.finish_batch(empty)
            live.update((i, 0) for i, j in zip(ids, admit) if rows[j][1])
            if not live:
                continue
        ids = list(live)
        # A request's first iteration stands for its prefill, which draws the first token from
        # the prompt's forward without a draft (as the engine does): budget 0 there.
        budgets = [budget if live[i] else 0 for i in ids]
        t0 = clock()
        result = drafter.propose(ids, budgets)
        t1 = clock()
        # Checked untimed, as no drafter's own cost: the replay referees the equal budget, so a
        # tree over it, a missing tree (its request charged a verify that emits nothing) and a
        # non-topological tree (``accepted_path`` would walk it wrongly) are errors.
        trees = as_trees(drafter_output(result, budgets), len(ids))
        emitted, done = [], []
        for rid, tree in zip(ids, trees):
            resp, pos = rows[rid - first_id][1], live[rid]
            if on_tree is not None and pos:
                on_tree(tree, resp[pos:])
            acc = accepted_length(tree[0], tree[1], resp[pos:])
            n = min(acc + 1, len(resp) - pos)
            emitted.append(resp[pos:pos + n])
            res.drafted += len(tree[0])
            res.accepted += min(acc, n)
            live[rid] = pos + n
            if pos + n >= len(resp):
                done.append(rid)
        t2 = clock()
        drafter.extend_batch(ids, emitted)
        t3 = clock()
        res.drafter_seconds += (t1 - t0) + (t3 - t2)
        res.propose_seconds += t1 - t0
        res.request_iterations += len(ids)
        res.verify_steps += len(ids)
        res.tokens += sum(len(e) for e in emitted)
        if done:
            drafter.finish_batch(done)
            for rid in done:
                del live[rid]
    return res


def replay(drafter: ReplayDrafter, trace: Trace, budget: int = 8,
           max_live: Optional[int] = None, steps: Optional[Sequence[int]] = None,
           clock: Callable[[], float] = time.process_time,
           on_tree: Optional[Callable[[Tree, Sequence[int]], None]] = None) -> list[StepResult]:
    """Replay the trace's steps in order (index kept across them); one StepResult per step.
    ``clock``, ``on_tree``: as in ``replay_step``."""
    results, next_id = [], 0
    for s in (range(len(trace.steps)) if steps is None else steps):
        results.append(replay_step(drafter, trace, s, budget, next_id, max_live, clock, on_tree))
        next_id += len(trace.steps[s])
        drafter.end_step()
    return results


class PromptLookupDrafter:
    """vLLM-style prompt-lookup n-gram: copy what followed the latest earlier occurrence of the
    context's last n tokens (n from ``max_n`` down to ``min_n``) in the request's own tokens."""

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        """Match lengths tried, longest first."""
        self.min_n, self.max_n = min_n, max_n
        self.ctx: dict[int, list[int]] = {}

    def start_batch(self, req_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                    group_ids: Optional[Sequence[Optional[int]]] = None) -> None:
        """Remember each request's prompt."""
        for r, p in zip(req_ids, prompts):
            self.ctx[r] = list(p)

    def extend_batch(self, req_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> None:
        """Append committed tokens."""
        for r, t in zip(req_ids, token_lists):
            self.ctx[r].extend(t)

    def propose_one(self, ctx: np.ndarray, k: int) -> list[int]:
        """Chain draft of at most ``k`` tokens for one context."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ctx) <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
            hits = np.flatnonzero((windows == ctx[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ctx[start:start + k].tolist()
        return []

    def propose(self, req_ids: Sequence[int], budgets: Sequence[int]) -> list[Tree]:
        """One chain per request; none, without a search, where nothing is asked (a prefill)."""
        out = []
        for r, k in zip(req_ids, budgets):
            if k == 0:
                out.append(([], []))
                continue
            toks = self.propose_one(np.asarray(self.ctx[r], dtype=np.int32), int(k))
            out.append((toks, list(range(-1, len(toks) - 1))))
        return out

    def finish_batch(self, req_ids: Sequence[int]) -> None:
        """Forget finished requests."""
        for r in req_ids:
            del self.ctx[r]

    def end_step(self) -> None:
        """Nothing is kept across steps."""


def arctic_available() -> bool:
    """Whether arctic-inference's suffix decoding extension can be imported."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except ImportError:
        return False
    return True


class ArcticDrafter:
    """Adapter over arctic-inference's ``SuffixDecodingCache`` with vLLM's defaults
    (tree depth 24, ``min_token_prob`` 0.1, chain drafts); ImportError if not installed."""

    def __init__(self, max_depth: int = 24, min_token_prob: float = 0.1, tree: bool = False,
                 max_cached_requests: int = 100_000) -> None:
        """Build the cache; the context passed to ``speculate`` is the last ``max_depth`` tokens."""
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=max_depth, max_cached_requests=max_cached_requests)
        self.max_depth, self.min_token_prob, self.tree = max_depth, min_token_prob, tree
        self.ctx: dict[int, list[int]] = {}

    def start_batch(self, req_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                    group_ids: Optional[Sequence[Optional[int]]] = None) -> None:
        """start_request per request (its prompt goes into the request's local tree)."""
        for r, p in zip(req_ids, prompts):
            self.cache.start_request(r, np.asarray(p, dtype=np.int32))
            self.ctx[r] = list(p)

    def extend_batch(self, req_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> None:
        """add_active_response per request."""
        for r, t in zip(req_ids, token_lists):
            self.cache.add_active_response(r, t)
            self.ctx[r].extend(t)

    def propose(self, req_ids: Sequence[int], budgets: Sequence[int]) -> list[Tree]:
        """speculate per request, on the last ``max_depth`` tokens as a list: Arctic takes lists
        natively, and a numpy copy made here for each call would charge Arctic for our adapter
        (vLLM hands it a view of its token buffer)."""
        out = []
        for r, k in zip(req_ids, budgets):
            if k == 0:  # nothing asked (a request's prefill): no call
                out.append(([], []))
                continue
            d = self.cache.speculate(r, self.ctx[r][-self.max_depth:], max_spec_tokens=int(k),
                                     min_token_prob=self.min_token_prob, use_tree_spec=self.tree)
            out.append((d.token_ids, d.parents))
        return out

    def finish_batch(self, req_ids: Sequence[int]) -> None:
        """stop_request: the response stays in the global tree."""
        for r in req_ids:
            self.cache.stop_request(r)
            del self.ctx[r]

    def end_step(self) -> None:
        """Arctic has no notion of RL steps."""
