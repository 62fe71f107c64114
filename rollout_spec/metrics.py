"""Per-step speculation figures, their wandb panels, rich tables and a PNG dashboard.

Figures follow DESIGN.md: TPF = generated tokens / verify steps, accept rate = accepted /
drafted tokens, speedup = tokens/s with speculation / without (same run, prompts and seeds).
The two verl metrics keep verl's own definition (a mean over samples of per-sample ratios), so
our curves sit beside a verl run's.
"""
from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from numbers import Real
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from rollout_spec.config import check_float, check_int
from rollout_spec.drafter import background_kwargs
from rollout_spec.files import replaced_on_success
from rollout_spec.replay import accepted_length, as_trees

WANDB_MODES = ("offline", "online", "disabled")
DRAFTER_FIGURES = ("us_per_request", "index_tokens", "index_bytes")
"""The keys ``stats_from_outputs`` reads from its ``drafter`` dict."""
_OPTIONAL = ("base_tokens", "base_seconds", "mean_reward", "drafter_us_per_request",
             "index_tokens", "index_bytes", "same_samples")
"""SpecStats fields that may be None (not measured)."""


@dataclass(frozen=True)
class SpecStats:
    """One RL step's rollout figures: speculation on, and the same step without it."""

    step: int
    num_requests: int
    spec_tokens: int
    """Tokens generated with speculation."""
    spec_seconds: float
    verify_steps: int
    """Target forwards summed over requests (a request's prefill counts as one)."""
    draft_tokens: int
    accepted_tokens: int
    verl_accept_rate: float
    """verl's ``rollout/spec_accept_rate``: mean over samples of accepted / drafted."""
    verl_accept_length: float
    """verl's ``rollout/spec_accept_length``: mean over samples of 1 + accepted / verify steps."""
    draft_budget: int
    """Most draft nodes per request per verify step (``SpecConfig.num_draft_tokens``)."""
    base_tokens: Optional[int] = None
    """Tokens generated without speculation (None when the baseline was not run)."""
    base_seconds: Optional[float] = None
    mean_reward: Optional[float] = None
    depth_drafted: Optional[tuple[int, ...]] = None
    """Verify steps whose draft reached depth d+1, when the engine counts them."""
    depth_accepted: Optional[tuple[int, ...]] = None
    """Verify steps that accepted at least d+1 draft tokens, when the engine counts them."""
    drafter_us_per_request: Optional[float] = None
    index_tokens: Optional[int] = None
    index_bytes: Optional[int] = None
    same_samples: Optional[int] = None
    """Samples whose tokens equal the baseline's sample of the same (prompt, sample): with keyed
    noise every one of them, except where the two forwards round a near-tie differently."""

    def __post_init__(self) -> None:
        """Check every field (an error names it and its allowed range); numbers are stored as
        plain int/float and the depth counters as tuples, so the frozen instance hashes."""
        for name in ("step", "num_requests", "spec_tokens", "verify_steps", "draft_tokens",
                     "draft_budget", "base_tokens", "index_tokens", "index_bytes"):
            self._check(name, check_int, 0)
        for name in ("spec_seconds", "base_seconds", "drafter_us_per_request", "verl_accept_length"):
            self._check(name, check_float, 0.0, math.inf, hi_open=True)
        self._check("accepted_tokens", check_int, 0, self.draft_tokens)
        self._check("same_samples", check_int, 0, self.num_requests)
        self._check("verl_accept_rate", check_float, 0.0, 1.0)
        self._check("mean_reward", check_float, -math.inf, math.inf, lo_open=True, hi_open=True)
        drafted, accepted = self.depth_drafted, self.depth_accepted
        if (drafted is None) != (accepted is None):
            raise ValueError("depth_drafted and depth_accepted must both be given or both be None")
        if drafted is not None:
            drafted = _depth_tuple("depth_drafted", drafted)
            accepted = _depth_tuple("depth_accepted", accepted, drafted)
            object.__setattr__(self, "depth_drafted", drafted)
            object.__setattr__(self, "depth_accepted", accepted)

    def _check(self, name: str, check: Callable[..., Any], *bounds: Any, **kw: Any) -> None:
        """Store field ``name`` as ``check`` returns it (None stays None: not measured)."""
        value = getattr(self, name)
        if value is not None or name not in _OPTIONAL:
            object.__setattr__(self, name, check(name, value, *bounds, **kw))

    @property
    def spec_tokens_per_s(self) -> float:
        """Throughput with speculation."""
        return self.spec_tokens / self.spec_seconds if self.spec_seconds > 0 else 0.0

    @property
    def base_tokens_per_s(self) -> Optional[float]:
        """Throughput without speculation, if measured."""
        if self.base_tokens is None or not self.base_seconds:
            return None
        return self.base_tokens / self.base_seconds

    @property
    def speedup(self) -> Optional[float]:
        """Tokens/s with speculation over tokens/s without; None unless both passes were timed."""
        base = self.base_tokens_per_s
        return self.spec_tokens_per_s / base if base and self.spec_seconds > 0 else None

    @property
    def same_rate(self) -> Optional[float]:
        """Fraction of samples identical to the baseline's, if it ran."""
        if self.same_samples is None or not self.num_requests:
            return None
        return self.same_samples / self.num_requests

    @property
    def tpf(self) -> float:
        """Tokens per target forward."""
        return self.spec_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def accept_rate(self) -> Optional[float]:
        """Accepted draft tokens over drafted tokens, pooled over the step; None when nothing was
        drafted (a plain step has no acceptance to report, not an acceptance of zero)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def budget_used(self) -> Optional[float]:
        """Fraction of the draft budget the drafter filled (drafted / (verify steps x budget));
        None when there was no budget to fill."""
        room = self.verify_steps * self.draft_budget
        return self.draft_tokens / room if room else None

    @property
    def accept_by_depth(self) -> Optional[list[Optional[float]]]:
        """P(at least d draft tokens accepted | the draft reached depth d), for d = 1, 2, ...;
        None at a depth no draft reached."""
        if self.depth_drafted is None or self.depth_accepted is None:
            return None
        return [a / d if d else None for a, d in zip(self.depth_accepted, self.depth_drafted)]

    def to_dict(self) -> dict:
        """Plain fields plus derived figures, for JSON output."""
        out = asdict(self)
        for name in ("spec_tokens_per_s", "base_tokens_per_s", "speedup", "tpf", "accept_rate",
                     "budget_used", "accept_by_depth", "same_rate"):
            out[name] = getattr(self, name)
        return out


def _depth_tuple(name: str, counts: Any, highs: Optional[tuple[int, ...]] = None) -> tuple[int, ...]:
    """``counts`` as a tuple of ints >= 0; with ``highs``, one per entry of it and each at most
    its entry (accepted at a depth <= drafted at that depth)."""
    if isinstance(counts, (str, bytes)) or not hasattr(counts, "__iter__"):
        raise TypeError(f"{name} must be a sequence of counts, got {type(counts).__name__}")
    counts = tuple(counts)
    if highs is not None and len(counts) != len(highs):
        raise ValueError(f"{name} must have one count per depth of depth_drafted ({len(highs)}), "
                         f"got {len(counts)}")
    return tuple(check_int(f"{name}[{d}]", c, 0, None if highs is None else highs[d])
                 for d, c in enumerate(counts))


def _check_outputs(name: str, outputs: Any, counters: tuple[str, ...]) -> None:
    """TypeError naming ``name`` or its first bad entry unless it is a sequence of
    RolloutOutput-likes: each with a sized ``token_ids`` and the attributes ``counters`` (their
    values are checked where they are summed)."""
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence):
        raise TypeError(f"{name} must be a sequence (list, tuple) of RolloutOutput, "
                        f"got {type(outputs).__name__}")
    for i, out in enumerate(outputs):
        missing = [a for a in ("token_ids", *counters) if not hasattr(out, a)]
        if missing:
            raise TypeError(f"{name}[{i}] must be a RolloutOutput, got {type(out).__name__} "
                            f"without {', '.join(missing)}")
        if isinstance(out.token_ids, (str, bytes)) or not hasattr(out.token_ids, "__len__"):
            raise TypeError(f"{name}[{i}].token_ids must be a sequence of token ids, "
                            f"got {type(out.token_ids).__name__}")


def _mean_reward(rewards: Sequence[float]) -> float:
    """The mean of a non-empty ``rewards``; TypeError naming its first entry that is no number."""
    try:
        return sum(rewards) / len(rewards)
    except TypeError:
        bad = next((i for i, r in enumerate(rewards) if not isinstance(r, Real)), None)
        if bad is None:
            raise
        raise TypeError(f"rewards[{bad}] must be a number, got {type(rewards[bad]).__name__}") from None


def _sum_attr(outputs: Sequence[Any], name: str) -> int:
    return sum(check_int(f"spec_outputs[{i}].{name}", getattr(o, name), 0)
               for i, o in enumerate(outputs))


def _depth_counts(outputs: Sequence[Any], name: str) -> Optional[tuple[int, ...]]:
    """Sum per-request per-depth counters (ragged lists) when every output carries them."""
    rows = [getattr(o, name, None) for o in outputs]
    if not rows or any(r is None for r in rows):
        return None
    rows = [_depth_tuple(f"spec_outputs[{i}].{name}", row) for i, row in enumerate(rows)]
    totals = [0] * max(map(len, rows))
    for row in rows:
        for d, count in enumerate(row):
            totals[d] += count
    return tuple(totals)


def _verl_ratios(outputs: Sequence[Any]) -> tuple[float, float]:
    """verl's two per-sample means; each sample's accepted tokens must lie in [0, its drafted]
    (the step's totals alone let one sample's excess hide behind another's rejections)."""
    rates, lengths = [], []
    for i, o in enumerate(outputs):
        drafted, verifies = o.num_draft_tokens, o.num_verify_steps
        accepted = check_int(f"spec_outputs[{i}].num_accepted_tokens", o.num_accepted_tokens, 0,
                             drafted)
        rates.append(accepted / drafted if drafted else 0.0)
        lengths.append(1.0 + accepted / verifies if verifies else 0.0)
    return sum(rates) / len(outputs), sum(lengths) / len(outputs)


def stats_from_outputs(
    step: int, spec_outputs: Sequence[Any], spec_seconds: float, *, draft_budget: int,
    base_outputs: Optional[Sequence[Any]] = None, base_seconds: Optional[float] = None,
    rewards: Optional[Sequence[float]] = None, drafter: Optional[dict] = None,
    depths: Optional[tuple[Sequence[int], Sequence[int]]] = None,
) -> SpecStats:
    """Aggregate one step's ``RolloutOutput`` lists (with and without speculation) into SpecStats.

    ``base_outputs`` and ``rewards``, when given, hold one entry per spec output (same order);
    ``drafter`` is a dict with optional keys DRAFTER_FIGURES (``us_per_request``,
    ``index_tokens``, ``index_bytes``); ``depths`` the (drafted, accepted) per-depth counters of a
    ``DrafterProbe``, else they are read from the outputs when the engine reports them.

    Raises:
        ValueError/TypeError naming the argument or SpecStats field that is out of range or of
            the wrong type (also an output without a RolloutOutput's fields); a ValueError for
            no ``spec_outputs`` (verl logs no acceptance for an empty batch).
    """
    _check_outputs("spec_outputs", spec_outputs,
                   ("num_verify_steps", "num_draft_tokens", "num_accepted_tokens"))
    if not len(spec_outputs):
        raise ValueError("spec_outputs must hold at least one output, got none")
    if base_outputs is not None:
        _check_outputs("base_outputs", base_outputs, ())
    if rewards is not None and (isinstance(rewards, (str, bytes)) or not hasattr(rewards, "__len__")):
        raise TypeError(f"rewards must be a sequence of numbers, got {type(rewards).__name__}")
    for name, other in (("base_outputs", base_outputs), ("rewards", rewards)):
        if other is not None and len(other) != len(spec_outputs):
            raise ValueError(f"{name} must have one entry per spec output ({len(spec_outputs)}), "
                             f"got {len(other)}")
    if drafter is None:
        drafter = {}
    elif not isinstance(drafter, Mapping):
        raise TypeError(f"drafter must be a dict with keys among {DRAFTER_FIGURES}, "
                        f"got {type(drafter).__name__}")
    unknown = sorted(map(str, set(drafter) - set(DRAFTER_FIGURES)))
    if unknown:
        raise ValueError(f"drafter has unknown keys {unknown}; allowed: {DRAFTER_FIGURES}")
    if depths is None:
        depths = tuple(_depth_counts(spec_outputs, n) for n in ("num_drafted_by_depth",
                                                                 "num_accepted_by_depth"))
    elif not isinstance(depths, Sequence) or len(depths) != 2:
        raise ValueError("depths must be a (drafted, accepted) pair of per-depth counters")
    # Counters first: they check each output's (whole, non-negative) counts by name.
    counters = {name: _sum_attr(spec_outputs, f"num_{name}")
                for name in ("verify_steps", "draft_tokens", "accepted_tokens")}
    rate, length = _verl_ratios(spec_outputs)
    return SpecStats(
        step=step, num_requests=len(spec_outputs),
        spec_tokens=sum(len(o.token_ids) for o in spec_outputs), spec_seconds=spec_seconds,
        **counters, verl_accept_rate=rate, verl_accept_length=length, draft_budget=draft_budget,
        base_tokens=None if base_outputs is None else sum(len(o.token_ids) for o in base_outputs),
        base_seconds=base_seconds,
        mean_reward=None if rewards is None or not len(rewards) else _mean_reward(rewards),
        depth_drafted=depths[0], depth_accepted=depths[1],
        drafter_us_per_request=drafter.get("us_per_request"),
        index_tokens=drafter.get("index_tokens"), index_bytes=drafter.get("index_bytes"),
        same_samples=None if base_outputs is None else sum(
            list(a.token_ids) == list(b.token_ids) for a, b in zip(spec_outputs, base_outputs)),
    )


def wandb_metrics(stats: SpecStats) -> dict[str, float]:
    """The step's panels: verl's two ``rollout/`` names, counters, and ``spec/`` figures.

    Figures that were not measured (no baseline, no per-depth counters, no drafter timing,
    nothing drafted: no acceptance) are left out rather than logged as zeros. verl's two names
    keep verl's own rule, which counts a request without drafts as 0.

    Raises:
        TypeError: ``stats`` is not a SpecStats.
    """
    if not isinstance(stats, SpecStats):
        raise TypeError(f"stats must be SpecStats, got {type(stats).__name__}")
    out: dict[str, float] = {
        "rollout/spec_accept_rate": stats.verl_accept_rate,
        "rollout/spec_accept_length": stats.verl_accept_length,
        "rollout/spec_num_draft_tokens": stats.draft_tokens,
        "rollout/spec_num_accepted_tokens": stats.accepted_tokens,
        "rollout/spec_num_verify_steps": stats.verify_steps,
        "spec/tpf": stats.tpf,
        "spec/tokens_per_s": stats.spec_tokens_per_s,
    }
    optional = {
        "spec/accept_rate": stats.accept_rate,
        "spec/draft_budget_used": stats.budget_used,
        "spec/tokens_per_s_baseline": stats.base_tokens_per_s,
        "spec/speedup": stats.speedup,
        "spec/same_samples": stats.same_rate,
        "spec/drafter_us_per_request": stats.drafter_us_per_request,
        "spec/index_tokens": stats.index_tokens,
        "spec/index_bytes": stats.index_bytes,
        "critic/score/mean": stats.mean_reward,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    for depth, value in enumerate(stats.accept_by_depth or [], start=1):
        if value is not None:
            out[f"spec/accept_by_depth/{depth}"] = value
    return out


class MetricsSink(Protocol):
    """Where per-step metrics go (wandb, a test double, nothing)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record one RL step's metrics under that step's number."""

    def finish(self) -> None:
        """Flush and close the sink at the end of a run."""


class NullSink:
    """Drops every metric: ``--wandb disabled``."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Ignore ``metrics``."""

    def finish(self) -> None:
        """Nothing to close."""


class WandbSink:
    """Logs to a wandb run (offline runs land under ``dir``/wandb and sync later)."""

    def __init__(self, mode: str, project: str, config: dict, run_dir: Optional[str] = None) -> None:
        if mode not in ("offline", "online"):
            raise ValueError(f"wandb mode must be 'offline' or 'online' for WandbSink, got {mode!r}")
        import wandb

        self.run = wandb.init(project=project, mode=mode, config=config, dir=run_dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log one step's metrics."""
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        """Close the run (writes the offline files)."""
        self.run.finish()


def wandb_available() -> bool:
    """True when the wandb package can be imported."""
    return importlib.util.find_spec("wandb") is not None


def wandb_credentials_found() -> bool:
    """True when wandb finds an API key or identity token (environment, netrc, settings),
    checked without prompting and without the network."""
    import wandb

    try:
        return bool(wandb.login(prompt=False, verify=False))
    except TypeError:  # wandb before ``login(prompt=...)`` (0.2x): its deprecated key lookup
        return wandb.api.api_key is not None


def resolve_wandb_mode(requested: Optional[str]) -> str:
    """The mode to use: ``requested``, or offline when wandb is installed, else disabled. Online
    mode without credentials is refused here, before a model loads, not at ``wandb.init``.

    Raises:
        ValueError: an unknown mode, offline/online asked for without wandb installed, or online
            without a configured W&B API key.
    """
    if requested is None:
        return "offline" if wandb_available() else "disabled"
    if requested not in WANDB_MODES:
        raise ValueError(f"wandb mode must be one of {WANDB_MODES}, got {requested!r}")
    if requested != "disabled" and not wandb_available():
        raise ValueError(
            f"wandb mode {requested!r} needs the wandb package: pip install 'rollout-spec[dashboards]'"
        )
    if requested == "online" and not wandb_credentials_found():
        raise ValueError("wandb mode 'online' needs a W&B API key (run `wandb login` or set "
                         "WANDB_API_KEY), or use offline")
    return requested


def make_sink(mode: str, project: str, config: dict, run_dir: Optional[str] = None) -> MetricsSink:
    """A sink for an already resolved wandb mode."""
    if mode == "disabled":
        return NullSink()
    return WandbSink(mode, project, config, run_dir)


def plot_dashboard(history: Sequence[SpecStats], path: str | Path, title: str = "rollout-spec") -> Path:
    """Write a PNG: acceptance and TPF per step, speedup per step, acceptance by draft depth.

    Panels whose figures were not measured say so in the panel instead of drawing zeros.
    ``history`` is a non-empty sequence of SpecStats, ``path`` a file path ending in .png.
    """
    _check_history(history)
    if not history:
        raise ValueError("history must hold at least one step to plot")
    if not isinstance(path, (str, Path)) or Path(path).suffix.lower() != ".png":
        raise ValueError(f"path must be a file path ending in .png, got {path!r}")
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on CI or GPU hosts
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [s.step for s in history]
    fig, (ax_acc, ax_speed, ax_depth) = plt.subplots(1, 3, figsize=(15, 4.2))
    drafted = [s for s in history if s.accept_rate is not None]  # plain steps have no rate
    ax_acc.plot([s.step for s in drafted], [s.accept_rate for s in drafted], "o-", label="accept rate")
    ax_acc.set_xlabel("RL step"), ax_acc.set_ylabel("accept rate"), ax_acc.set_ylim(0, 1)
    ax_tpf = ax_acc.twinx()
    ax_tpf.plot(steps, [s.tpf for s in history], "s--", color="tab:orange", label="TPF")
    ax_tpf.set_ylabel("tokens per forward")
    ax_acc.set_title("acceptance per step")
    ax_acc.legend(loc="upper left"), ax_tpf.legend(loc="upper right")
    _plot_speedup(ax_speed, history)
    _plot_depth(ax_depth, history)
    for ax in (ax_acc, ax_speed, ax_depth):  # steps and depths are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with replaced_on_success(path) as tmp:  # a failed write keeps the file there before
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path


def _check_history(history: Any) -> None:
    """TypeError naming ``history`` unless it is a sequence (read more than once) of SpecStats."""
    if isinstance(history, (str, bytes)) or not isinstance(history, Sequence):
        raise TypeError(f"history must be a sequence (list, tuple) of SpecStats, "
                        f"got {type(history).__name__}")
    bad = next((i for i, s in enumerate(history) if not isinstance(s, SpecStats)), None)
    if bad is not None:
        raise TypeError(f"history[{bad}] must be SpecStats, got {type(history[bad]).__name__}")


def _plot_speedup(ax: Any, history: Sequence[SpecStats]) -> None:
    measured = [s for s in history if s.speedup is not None]
    ax.set_title("speedup per step (spec on / off)")
    ax.set_xlabel("RL step")
    if not measured:
        ax.text(0.5, 0.5, "baseline not run", ha="center", va="center", transform=ax.transAxes)
        return
    ax.bar([s.step for s in measured], [s.speedup for s in measured], color="tab:green")
    ax.axhline(1.0, color="gray", lw=1, ls=":")
    ax.set_ylabel("speedup (x)")


def _plot_depth(ax: Any, history: Sequence[SpecStats]) -> None:
    ax.set_title("acceptance by draft depth")
    ax.set_xlabel("draft depth")
    curves = [(s.step, s.accept_by_depth) for s in history if s.accept_by_depth]
    if not curves:
        ax.text(0.5, 0.5, "engine reports no per-depth counters", ha="center", va="center",
                transform=ax.transAxes)
        return
    for step, curve in curves:
        reached = [(depth, p) for depth, p in enumerate(curve, start=1) if p is not None]
        ax.plot([d for d, _ in reached], [p for _, p in reached], "o-", label=f"step {step}")
    ax.set_ylabel("P(accept | depth reached)"), ax.set_ylim(0, 1)
    ax.legend()


def _fmt(value: Optional[float], spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def step_table(stats: SpecStats) -> Any:
    """A rich table of one step: tokens/s both ways, speedup, TPF, accept rate, reward, and how
    many samples came out identical to the baseline's."""
    from rich.table import Table

    table = Table(title=f"step {stats.step}  ({stats.num_requests} requests)", title_justify="left")
    for name in ("tok/s spec", "tok/s base", "speedup", "TPF", "accept", "budget used", "reward",
                 "same samples"):
        table.add_column(name, justify="right")
    same = "-" if stats.same_samples is None else f"{stats.same_samples}/{stats.num_requests}"
    table.add_row(
        _fmt(stats.spec_tokens_per_s, ".1f"), _fmt(stats.base_tokens_per_s, ".1f"),
        _fmt(stats.speedup, ".2f", "x"), _fmt(stats.tpf), _fmt(stats.accept_rate, ".1%"),
        _fmt(stats.budget_used, ".1%"), _fmt(stats.mean_reward, ".3f"), same,
    )
    return table


def summary_table(history: Sequence[SpecStats]) -> Any:
    """A rich table with one row per step and a pooled total row."""
    from rich.table import Table

    table = Table(title="summary", title_justify="left")
    for name in ("step", "tokens", "tok/s spec", "tok/s base", "speedup", "TPF", "accept", "reward"):
        table.add_column(name, justify="right")
    for s in history:
        table.add_row(str(s.step), str(s.spec_tokens), _fmt(s.spec_tokens_per_s, ".1f"),
                      _fmt(s.base_tokens_per_s, ".1f"), _fmt(s.speedup, ".2f", "x"), _fmt(s.tpf),
                      _fmt(s.accept_rate, ".1%"), _fmt(s.mean_reward, ".3f"))
    total = pooled(history)
    table.add_row("all", str(total["spec_tokens"]), _fmt(total["spec_tokens_per_s"], ".1f"),
                  _fmt(total["base_tokens_per_s"], ".1f"), _fmt(total["speedup"], ".2f", "x"),
                  _fmt(total["tpf"]), _fmt(total["accept_rate"], ".1%"),
                  _fmt(total["mean_reward"], ".3f"), style="bold")
    return table


def pooled(history: Sequence[SpecStats]) -> dict[str, Optional[float]]:
    """Figures pooled over all steps (sums of tokens, seconds and counters, then ratios).

    Raises:
        TypeError: ``history`` is not a sequence of SpecStats, naming it or its first bad entry.
    """
    _check_history(history)
    spec_tokens = sum(s.spec_tokens for s in history)
    spec_s = sum(s.spec_seconds for s in history)
    based = [s for s in history if s.base_tokens is not None and s.base_seconds]
    base_tps = (sum(s.base_tokens for s in based) / sum(s.base_seconds for s in based)) if based else None
    spec_tps = spec_tokens / spec_s if spec_s > 0 else 0.0
    verifies = sum(s.verify_steps for s in history)
    drafted = sum(s.draft_tokens for s in history)
    rewards = [s.mean_reward for s in history if s.mean_reward is not None]
    # The speedup compares only steps that ran both ways, so a missing baseline cannot skew it.
    matched_s = sum(s.spec_seconds for s in based)
    matched_tps = sum(s.spec_tokens for s in based) / matched_s if matched_s > 0 else 0.0
    return {
        "spec_tokens": spec_tokens, "spec_tokens_per_s": spec_tps, "base_tokens_per_s": base_tps,
        "speedup": matched_tps / base_tps if base_tps and matched_s > 0 else None,
        "tpf": spec_tokens / verifies if verifies else 0.0,
        "accept_rate": sum(s.accepted_tokens for s in history) / drafted if drafted else None,
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
    }


def tree_depth(parents: Sequence[int]) -> int:
    """Longest root-to-leaf path of a tree given by parent indices (-1 is the root).

    Raises:
        ValueError / TypeError: ``parents[i]`` is not an integer in [-1, i - 1] (DraftBatch's
            topological order), naming it, rather than an IndexError or another tree's depth.
    """
    depths: list[int] = []
    # Python ints take the fast test below (the probe's numpy trees as lists: numpy scalars cost
    # ~1 us a node); anything else goes through check_int, which raises unless it is valid
    for i, parent in enumerate(parents.tolist() if hasattr(parents, "tolist") else parents):
        if type(parent) is not int or not -1 <= parent < i:
            parent = check_int(f"parents[{i}]", parent, -1, i - 1)
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return max(depths, default=0)


class DrafterProbe:
    """Wraps an engine's drafter: times its calls and counts acceptance by draft depth.

    The engine proposes a tree per request, verifies, then extends the drafter with exactly the
    tokens it committed; walking each tree along those tokens gives the accepted depth, so the
    per-depth counters need nothing from the engine (the walk is the replay simulator's
    ``accepted_length``). Bookkeeping runs outside the timed calls. The time is the calling
    thread's: work the core does on its own thread (background indexing, proposals drafted
    ahead) counts only where a later call waits for it.
    """

    TIMED = ("start_batch", "finish_batch", "start", "extend", "finish", "propose_ahead", "set_noise_keys")

    def __init__(self, drafter: Any) -> None:
        if drafter is None:
            raise ValueError("drafter must be a drafter object, got None (speculation is off)")
        self._drafter = drafter
        self._seconds = 0.0
        self._pending: dict[int, tuple[Sequence[int], Sequence[int]]] = {}
        self._drafted: list[int] = []
        self._accepted: list[int] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._drafter, name)
        return self._timed(attr) if name in self.TIMED and callable(attr) else attr

    def _timed(self, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._seconds += time.perf_counter() - start

        return call

    def propose(self, req_ids: Sequence[int], *args: Any, **kwargs: Any) -> Any:
        """Propose through the drafter and remember each request's tree until it is extended."""
        result = self._timed(self._drafter.propose)(req_ids, *args, **kwargs)
        for rid, tree in zip(req_ids, as_trees(result, len(req_ids))):  # either form of proposal
            if len(tree[0]):
                self._pending[int(rid)] = tree
        return result

    def propose_unverified(self, req_ids: Sequence[int], *args: Any, **kwargs: Any) -> Any:
        """Propose through the drafter (timed) trees the engine will not verify (its shadow
        rounds, ``rollout_spec.drafter.unverified_propose``): not counted by depth, and the
        request's pending verified tree is kept."""
        return self._timed(self._drafter.propose)(req_ids, *args, **kwargs)

    def extend_batch(self, req_ids: Sequence[int], token_lists: Sequence[Sequence[int]], *,
                     background: bool = False) -> Any:
        """Extend through the drafter (``background`` passed on where it indexes in the
        background), then score the pending trees against the committed tokens."""
        out = self._timed(self._drafter.extend_batch)(req_ids, token_lists,
                                                      **background_kwargs(self._drafter, background))
        for rid, committed in zip(req_ids, token_lists):
            tree = self._pending.pop(int(rid), None)
            if tree is not None:
                self._count(tree_depth(tree[1]), accepted_length(tree[0], tree[1], list(committed)))
        return out

    def _count(self, depth: int, accepted: int) -> None:
        while len(self._drafted) < depth:
            self._drafted.append(0)
            self._accepted.append(0)
        for d in range(depth):
            self._drafted[d] += 1
            self._accepted[d] += d < accepted

    def take_seconds(self) -> float:
        """Seconds spent in the drafter since the last call, and reset the sum."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def take_depths(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(verify steps whose draft reached depth d+1, of those how many accepted d+1), reset."""
        out = (tuple(self._drafted), tuple(self._accepted))
        self._drafted, self._accepted = [], []
        return out
