"""Validated, immutable configuration objects shared by the drafter, the engine and the adapters.

Every field is checked once, at construction; an error names the field and its allowed range.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Optional

from rollout_spec.token_ids import BYTES_LIKE


def int_interval(lo: int, hi: Optional[int] = None) -> str:
    """``[lo, hi]`` as error messages write it (``inf`` for no upper bound)."""
    return f"[{lo}, {'inf' if hi is None else hi}]"


def float_interval(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> str:
    """The interval as error messages write it: ``(`` and ``)`` for open ends."""
    return f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def check_int(name: str, value: object, lo: int, hi: Optional[int] = None) -> int:
    """Return ``value`` as an int if it is an integer in ``[lo, hi]``, else raise naming ``name``."""
    if type(value) is int and lo <= value and (hi is None or value <= hi):
        return value  # the common case, without the ABC check (per-step callers: ~2 us each)
    interval = int_interval(lo, hi)
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an integer in {interval}, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return value


def check_float(
    name: str, value: object, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> float:
    """Return ``value`` as a float inside the stated interval, else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number in {float_interval(lo, hi, lo_open, hi_open)}, "
                        f"got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float is outside every interval here
        raise ValueError(f"{name} must be in {float_interval(lo, hi, lo_open, hi_open)}, "
                         "got an integer beyond a float's range") from None
    too_low = number <= lo if lo_open else number < lo
    too_high = number >= hi if hi_open else number > hi
    if math.isnan(number) or too_low or too_high:
        raise ValueError(f"{name} must be in {float_interval(lo, hi, lo_open, hi_open)}, got {number}")
    return number


MIN_TEMPERATURE = 0.01
"""Smallest positive sampling temperature (0 is greedy). The race and the logprobs work on
logits / T in float32, whose spacing grows with it. Two tied logits of 50 at T = 0.01 (5,000
scaled): 56 of 10^6 draws differ from T = 1's on the same noise, and the logprob is off by 2e-4.
At 1e-3 the logprob is off by 2e-3; at 1e-4 (logits of 30) the tied tokens were drawn
50.3 / 49.7 where T = 1 drew 49.9 / 50.1 on the same noise (400k draws); at 1e-6 (logits of 10)
62 / 38, with logprobs off by 0.3. Near-greedy sampling below 0.01 is thus refused rather than
drawn from another law; use 0 for greedy."""

DEFAULT_MODEL = "smollm2-135m"
"""The named model every command loads unless told otherwise (``engine.weights.KNOWN_MODELS``
maps it to its GGUF file). It lives here, not in weights.py, so that a command line can name its
default without importing torch."""

MAX_NEW_TOKENS = 1 << 24
"""The most tokens one sample may be asked for (``SamplingParams``; a trace's
``sampling.max_new_tokens``)."""


def check_temperature(name: str, value: object) -> float:
    """A sampling temperature: 0 (greedy) or in [MIN_TEMPERATURE, 100], else raise naming ``name``."""
    rule = f"0 (greedy) or in [{MIN_TEMPERATURE}, 100.0]"
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, {rule}, got {type(value).__name__} {value!r}")
    try:
        temperature = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be {rule}, got an integer beyond a float's range") from None
    if not (temperature == 0.0 or MIN_TEMPERATURE <= temperature <= 100.0):  # NaN fails both
        raise ValueError(f"{name} must be {rule}, got {temperature!r}")
    return temperature


def parse_bool(name: str, text: str) -> bool:
    """A yes/no setting given as text (an environment variable, a command-line value): 1/0,
    true/false, yes/no or on/off in any case; anything else raises naming ``name`` (TypeError
    for a value that is not a str)."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str (1/0, true/false, yes/no, on/off), "
                        f"got {type(text).__name__} {text!r}")
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be one of 1/0, true/false, yes/no, on/off, got {text!r}")


def object_without_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; ValueError naming a key it holds twice (``json.load`` would keep
    the last silently). Pass it as ``object_pairs_hook``."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key!r} appears twice")
        obj[key] = value
    return obj


def check_token_ids(name: str, value: object, hi: int = 2**31 - 1) -> tuple[int, ...]:
    """``value`` (a short sequence of token ids, such as stop ids) as a tuple of ints in
    ``[0, hi]``, each checked by name (``name[i]``). Text, bytes-like objects (whose items
    would read as ids), mappings (whose keys would) and non-iterables raise TypeError."""
    refused = (str, *BYTES_LIKE, Mapping)
    try:
        items = None if isinstance(value, refused) else iter(value)
    except TypeError:  # not iterable, or a 0-d numpy array
        items = None
    if items is None:
        raise TypeError(f"{name} must be a sequence of token ids in [0, {hi}], "
                        f"got {type(value).__name__} {value!r}")
    return tuple(check_int(f"{name}[{i}]", t, 0, hi) for i, t in enumerate(items))


@dataclass(frozen=True)
class SpecConfig:
    """How the n-gram/suffix drafter proposes draft trees and keeps its index.

    Budgets bound the work per step; scope weights rank candidates from the request's own
    context, its group (siblings and earlier RL steps of the same prompt) and all recent rollouts.
    """

    num_draft_tokens: int = 8
    """Draft nodes proposed for one request in one step where no budget is given: budgets passed
    to ``NgramDrafter.propose`` or an engine's ``draft_budget`` replace it; the engine's own
    budgets never exceed it (0 disables speculation in the engine)."""
    max_batch_draft_tokens: int = 65536
    """Most draft nodes proposed by one batched ``propose`` call, over all requests (requests late
    in the call get smaller drafts once it is spent; the default covers 8192 requests x 8). In
    [0, 2**24]; 0 proposes nothing, as ``num_draft_tokens=0`` does."""
    max_depth: int = 24
    """Longest root-to-leaf path of a draft tree."""
    max_match_len: int = 32
    """Longest context suffix matched against the index."""
    min_match_len: int = 1
    """Shortest context suffix whose continuations may be proposed."""
    min_token_prob: float = 0.02
    """Path-probability floor of proposed nodes (applied when adaptive_budget is on); low, because
    at temperature 1.0 even 5-10% candidates pay for their verify slot (docs/drafter.md)."""
    tree: bool = True
    """Propose branching trees; False proposes a single chain per request."""
    adaptive_budget: bool = True
    """Shrink a request's draft to what its match confidence supports."""
    request_weight: float = 3.0
    """Scope prior for the request's own prompt and output (0 disables the scope); a sample repeats
    itself more reliably than it follows its siblings (docs/drafter.md)."""
    group_weight: float = 1.0
    """Scope prior for samples of the same group_id, this step and history_steps before (0 disables)."""
    global_weight: float = 0.5
    """Scope prior for all recent rollouts and external corpora (0 disables)."""
    history_steps: int = 4
    """How many earlier RL steps of a group stay in its group scope."""
    capacity_tokens: int = 4_000_000
    """Memory bound of the shared indexes, in stored tokens (66 and 148 bytes each, indexes
    included, on the shared T=0.6 and T=1.0 traces); least-recently-used steps go first."""
    external_corpora: tuple[str, ...] = field(default_factory=tuple)
    """Token files (one int32 array per file, .npy) added to the global scope at start."""
    shared_index: Optional[str] = None
    """Name of the shared-index coordinators (``rollout_spec.distributed``): each rollout replica's
    drafter publishes its finished samples at every RL step boundary and ingests the other
    replicas' in the background. None keeps the index local to the replica. The replica's rank
    and the replica count come from the framework hook (docs/scale_out.md)."""
    propose_threads: int = 0
    """Threads one ``propose`` call of 64 or more requests is split over (0 = auto: half the
    hardware threads, at most 8; 1 = the calling thread only). Drafts are identical for every
    count (docs/drafter.md)."""

    def __post_init__(self) -> None:
        """Check every field; numbers are stored as plain int/float (a numpy scalar would not
        survive the JSON that carries a config to a framework's workers)."""
        check_fields(self, ints={
            "num_draft_tokens": (0, 1024), "max_batch_draft_tokens": (0, 1 << 24), "max_depth": (1, 1024),
            "max_match_len": (1, 1024), "history_steps": (0, 1 << 20), "capacity_tokens": (1024, 1 << 40),
            "propose_threads": (0, 256)})
        _store(self, "min_match_len", check_int("min_match_len", self.min_match_len, 1, self.max_match_len))
        _store(self, "min_token_prob", check_float("min_token_prob", self.min_token_prob, 0.0, 1.0))
        for name in ("tree", "adaptive_budget"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_fields(self, floats=dict.fromkeys(("request_weight", "group_weight", "global_weight"), (0.0, 1e6)))
        corpora = self.external_corpora
        if not isinstance(corpora, (list, tuple)) or not all(isinstance(p, str) for p in corpora):
            raise TypeError("external_corpora must be a list or tuple of file paths (str), "
                            f"got {type(corpora).__name__} {corpora!r}")
        _store(self, "external_corpora", tuple(corpora))
        if self.shared_index is not None and not isinstance(self.shared_index, str):
            raise TypeError(f"shared_index must be None or a name (str) of 1 to 128 characters, "
                            f"got {type(self.shared_index).__name__} {self.shared_index!r}")
        if self.shared_index is not None and not 1 <= len(self.shared_index) <= 128:
            raise ValueError(f"shared_index must be None or a name of 1 to 128 characters, got "
                             f"{len(self.shared_index)} characters")


def _store(config: object, name: str, value: object) -> None:
    """Set a field of a frozen config to its checked, normalised value."""
    object.__setattr__(config, name, value)


def check_fields(config: object, ints: Optional[dict[str, tuple[int, Optional[int]]]] = None,
                 floats: Optional[dict[str, tuple[float, float]]] = None) -> None:
    """Check the named fields of a frozen dataclass, integers in ``[lo, hi]`` (hi None: no upper
    bound) and then numbers in ``[lo, hi]``, and store each as the plain int or float the check
    returns; the first bad field raises, naming itself and its range."""
    for name, (lo, hi) in (ints or {}).items():
        _store(config, name, check_int(name, getattr(config, name), lo, hi))
    for name, (lo, hi) in (floats or {}).items():
        _store(config, name, check_float(name, getattr(config, name), lo, hi))


@dataclass(frozen=True)
class SamplingParams:
    """How one prompt's samples are generated; ``temperature=0`` means greedy."""

    n: int = 1
    """Samples per prompt (GRPO's group size)."""
    temperature: float = 1.0
    """0 (greedy) or in [MIN_TEMPERATURE, 100]."""
    top_p: float = 1.0
    """Nucleus mass kept, in (0, 1]; 1 keeps everything."""
    top_k: int = -1
    """Most tokens kept; -1 keeps all."""
    max_new_tokens: int = 512
    """Most tokens generated per sample, in [1, MAX_NEW_TOKENS]."""
    stop_token_ids: Optional[tuple[int, ...]] = None
    """Tokens that end a sample (kept in the output); None means the model's EOS."""
    seed: Optional[int] = 0
    """Seed of the call's sampling noise: sample i of prompt p draws by ``noise.sample_seed(seed,
    p, i)``, so identical calls reproduce, with or without a drafter. None draws fresh entropy.
    Give each RL step its own seed (e.g. ``seed + step``): a fixed one races the same noise for
    the same (prompt, sample) at every step."""

    def __post_init__(self) -> None:
        """Check every field, storing numbers as plain int/float and stop ids as a tuple."""
        _store(self, "n", check_int("n", self.n, 1, 1 << 16))
        _store(self, "temperature", check_temperature("temperature", self.temperature))
        _store(self, "top_p", check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        _store(self, "top_k", check_int("top_k", self.top_k, -1, 1 << 31))
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (keep all) or in [1, 2147483648], got 0")
        _store(self, "max_new_tokens", check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS))
        if self.stop_token_ids is not None:
            _store(self, "stop_token_ids", check_token_ids("stop_token_ids", self.stop_token_ids))
        if self.seed is not None:
            _store(self, "seed", check_int("seed", self.seed, 0, 2**63 - 1))

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax."""
        return self.temperature == 0.0
