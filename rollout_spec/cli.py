"""The ``rollout-spec`` command: ``bench`` (the main job) and ``replay`` (drafters on a trace).

``bench`` runs S GRPO-style rollout steps: each step samples n responses per prompt with
speculation off and on (same prompts, same seeds, one run), scores them with the task's own
checker, ends the RL step for the drafter, and prints a table; then a summary, optional wandb
panels, a PNG dashboard and a recorded trace. Results (the workload line, the tables) go to
stdout; status (loading, the progress bar, warnings, the files written) goes to stderr, so
``rollout-spec bench > out.md`` keeps only the results.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from rollout_spec.cli_args import (DefaultsParser, check_device, check_output, check_trace_steps, device_arg, float_arg,
                                   int_arg, load_trace_arg, model_arg, task_arg, temperature_arg,
                                   wandb_project_arg)
from rollout_spec.config import DEFAULT_MODEL, SamplingParams
from rollout_spec.files import replaced_on_success
from rollout_spec.metrics import (DrafterProbe, SpecStats, plot_dashboard, step_table, stats_from_outputs,
                                  summary_table)

if TYPE_CHECKING:
    from rollout_spec.replay import Trace

def _top_k_arg(text: str) -> int:
    """An argparse type: ``--top-k`` is -1 (keep all) or a positive count."""
    value = int_arg("--top-k", -1, 1 << 31)(text)  # SamplingParams' range
    if value == 0:
        raise argparse.ArgumentTypeError("--top-k must be -1 (keep all) or >= 1, got 0")
    return value


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_arg, default=DEFAULT_MODEL,
                   help=f"'{DEFAULT_MODEL}', a .gguf file or a safetensors model directory")
    p.add_argument("--device", type=device_arg, default="auto", help="auto, cpu, mps, cuda or cuda:N")
    p.add_argument("--task", type=task_arg, default="gsm_symbolic",
                   help="a reasoning-gym task name, or 'humaneval'")
    p.add_argument("--steps", type=int_arg("--steps", 1, 100_000), default=2, help="RL steps")
    p.add_argument("--prompts", type=int_arg("--prompts", 1, 100_000), default=4, help="prompts per step")
    p.add_argument("--n", type=int_arg("--n", 1, 1024), default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int_arg("--max-new-tokens", 1, 1 << 20), default=128)
    p.add_argument("--temperature", type=temperature_arg("--temperature"), default=1.0,
                   help="0 means greedy")
    p.add_argument("--top-p", type=float_arg("--top-p", 0.0, 1.0, lo_open=True), default=1.0)
    p.add_argument("--top-k", type=_top_k_arg, default=-1, help="-1 keeps all tokens")
    p.add_argument("--draft-tokens", type=int_arg("--draft-tokens", 1, 1024), default=None,
                   help="most draft nodes per request per verify step (default: 32 on CUDA, 8 "
                        "elsewhere); the batch-aware budget picks a size up to it each step")
    p.add_argument("--seed", type=int_arg("--seed", 0, 2**62), default=0)
    p.add_argument("--fresh-prompts", action="store_true",
                   help="new prompts every step (default: the same pool each step, like epochs)")
    p.add_argument("--max-batch", type=int_arg("--max-batch", 1, 1 << 16), default=256,
                   help="most requests decoded at once: KV slots = min(prompts x n, this)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the speculation-off pass (no speedup figure)")
    p.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None,
                   help="(default: offline when wandb is installed, else disabled)")
    p.add_argument("--wandb-project", type=wandb_project_arg, default="rollout-spec",
                   help="the wandb project the run logs to")
    p.add_argument("--plot", type=Path, metavar="PNG", help="write a PNG dashboard here")
    p.add_argument("--record", type=Path, metavar="TRACE.json",
                   help="write the rollouts in the shared trace format (.gz for gzip)")
    p.add_argument("--json", type=Path, metavar="OUT.json", help="write per-step figures as JSON")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rollout-spec`` and its subcommands."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """``build_parser``'s parser, and its subcommands' parsers by name."""
    parser = DefaultsParser(
        prog="rollout-spec", description="Model-free speculative decoding for RL rollouts.")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="GRPO-style rollout steps with speculation on and off",
                           description=__doc__.split("\n\n")[1])
    _add_bench_args(bench)
    replay = sub.add_parser("replay", help="compare drafters in lock-step on a recorded trace")
    replay.add_argument("trace", type=Path, metavar="TRACE.json",
                        help="a recorded trace in the shared format (gzip JSON when it ends in .gz)")
    replay.add_argument("--draft-tokens", type=int_arg("--draft-tokens", 1, 1024), default=8,
                        help="draft budget per request and iteration")
    replay.add_argument("--max-steps", type=int_arg("--max-steps", 1, 1 << 20), default=None,
                        help="replay only the first RL steps of the trace (default: all)")
    return parser, {"bench": bench, "replay": replay}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``rollout-spec`` console script; returns the exit status."""
    top, subcommands = _parsers()
    args = top.parse_args(argv)
    parser = subcommands[args.command]  # later checks report with the subcommand's usage and name
    if args.command == "bench":
        from rollout_spec.metrics import resolve_wandb_mode

        try:
            args.wandb = resolve_wandb_mode(args.wandb)
        except ValueError as exc:
            parser.error(f"--wandb: {exc}")
        check_device(parser, args.device)
        check_task_pool(parser, args)
        if args.draft_tokens is None:
            on_cuda = args.device.startswith("cuda") or (args.device == "auto" and _cuda_available())
            args.draft_tokens = 32 if on_cuda else 8
        if args.record is not None and not args.record.name.endswith((".json", ".json.gz")):
            parser.error(f"--record must end in .json or .json.gz, got {str(args.record)!r}")
        if args.plot is not None and args.plot.suffix.lower() != ".png":
            parser.error(f"--plot must end in .png, got {str(args.plot)!r}")
        if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib: pip install 'rollout-spec[dashboards]'")
        outputs = [(flag, path) for flag, path in (("--plot", args.plot), ("--record", args.record),
                                                   ("--json", args.json)) if path is not None]
        for flag, path in outputs:
            check_output(parser, flag, path)
        for i, (flag, path) in enumerate(outputs):  # one file each: the later would overwrite
            for other, other_path in outputs[i + 1:]:
                if Path(path).resolve() == Path(other_path).resolve():
                    parser.error(f"{flag} and {other} name the same file {str(path)!r}: give each its own")
        try:
            run_bench(args)
        except ContextTooShort as exc:
            parser.error(str(exc))
        except (StepFailed, ModelNotLoaded, OutputsNotWritten) as exc:
            print(f"rollout-spec bench: error: {exc}", file=sys.stderr)
            return 1
        return 0
    # a trace with nothing to replay is refused too: it would print a table without figures
    trace = load_trace_arg(parser, "TRACE.json", args.trace, need_responses=True)
    check_trace_steps(parser, "--max-steps", args.max_steps, args.trace, trace)
    return run_replay(args, trace)


def check_task_pool(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The prompts a run asks for, checked before any model loads: HumanEval has a fixed number
    of problems, and a reasoning-gym task must make its pool at ``--seed``
    (``workloads.checked_gym_dataset``); either failure is an argument error."""
    from rollout_spec.workloads import HUMANEVAL, checked_gym_dataset, humaneval_size

    count = args.prompts * (args.steps if args.fresh_prompts else 1)
    if args.task != HUMANEVAL:
        try:
            checked_gym_dataset(args.task, count, args.seed)
        except ValueError as exc:
            parser.error(f"--task {args.task} with --seed {args.seed}: {exc}")
        return
    available = humaneval_size()
    if count > available:
        what = "--prompts x --steps (with --fresh-prompts)" if args.fresh_prompts else "--prompts"
        parser.error(f"{what} must be <= {available} for humaneval, got {count}")


def replay_drafters(budget: int, widest_step: int) -> dict[str, Callable[[], Any]]:
    """Makers of the drafters compared on a trace: ours and the peers that are installed."""
    from rollout_spec import replay as rp
    from rollout_spec.config import SpecConfig
    from rollout_spec.drafter import NgramDrafter

    # Every live request drafts in every lock-step iteration, so the batch cap must fit them all.
    config = SpecConfig(num_draft_tokens=budget,
                        max_batch_draft_tokens=min(max(budget * widest_step, 1), 1 << 24))
    makers: dict[str, Callable[[], Any]] = {
        "rollout-spec": lambda: NgramDrafter(config),
        "prompt-lookup": rp.PromptLookupDrafter,
    }
    if rp.arctic_available():
        makers["arctic suffix (chain)"] = rp.ArcticDrafter
    return makers


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run_replay(args: argparse.Namespace, trace: Trace) -> int:
    """``rollout-spec replay``: every drafter replays ``trace`` (loaded from ``args.trace``)
    lock-step; TPF per step, cost. A spinner on stderr names the drafter replaying (one step of a
    shared trace takes ~25 s on a 2-core CPU)."""
    from rich.console import Console
    from rich.table import Table

    from rollout_spec import replay as rp

    steps = list(range(len(trace.steps) if args.max_steps is None else args.max_steps))
    widest = max((len(trace.steps[s]) for s in steps), default=1)
    keyed = trace.noise_keys(steps[0]) is not None if steps else False
    table = Table(title=f"{args.trace.name}: lock-step replay, draft budget {args.draft_tokens}"
                        + (", our drafter told the recorded noise keys" if keyed else ""),
                  title_justify="left")
    table.add_column("drafter")
    for s in steps:
        table.add_column(f"TPF step {s}", justify="right")
    for name in ("accept", "us/req-iter"):
        table.add_column(name, justify="right")
    status = Console(stderr=True)
    for name, make in replay_drafters(args.draft_tokens, widest).items():
        with status.status(f"replaying {len(steps)} steps with {name} ..."):
            results = rp.replay(make(), trace, budget=args.draft_tokens, steps=steps)
        drafted = sum(r.drafted for r in results)
        cost = 1e6 * sum(r.drafter_seconds for r in results) / max(sum(r.request_iterations for r in results), 1)
        table.add_row(name, *[f"{r.tpf:.2f}" if r.verify_steps else "-" for r in results],
                      f"{sum(r.accepted for r in results) / drafted:.1%}" if drafted else "-", f"{cost:.1f}")
    Console().print(table)
    return 0


@dataclass
class Engines:
    """The engine with speculation and, for the speedup figure, the same model without it."""

    spec: Any
    base: Optional[Any]


def engine_sizes(args: argparse.Namespace, tokenizer: Any, model_limit: int) -> dict[str, int]:
    """KV slots, context length and draft cap sized to this run, not the engine's defaults.

    The static cache holds ``num_slots x max_model_len`` tokens per engine; sizing it to
    P x n requests of (longest prompt + max_new_tokens) keeps the CPU default in a few GB.
    ``max_draft_tokens`` is ``--draft-tokens``: the engine's own cap (64) would cut a larger
    budget silently.

    Raises:
        ContextTooShort: the longest prompt plus ``--max-new-tokens`` exceeds ``model_limit``
            (the engine would end those samples early, as if they had reached the limit).
    """
    from rollout_spec.workloads import Workload

    workload = Workload(args.task, tokenizer, args.prompts, seed=args.seed,
                        fresh_each_step=args.fresh_prompts, max_steps=args.steps)
    longest = max(len(p.prompt_ids) for p in workload.prompts)
    if longest + args.max_new_tokens > model_limit:
        raise ContextTooShort(
            f"--max-new-tokens must be at most {model_limit - longest} for --model {args.model} "
            f"(its context holds {model_limit} tokens, the longest prompt of --task {args.task} "
            f"has {longest}), got {args.max_new_tokens}")
    return {"num_slots": min(args.prompts * args.n, args.max_batch),
            "max_model_len": min(longest + args.max_new_tokens + 1, model_limit),
            "max_draft_tokens": args.draft_tokens}


def open_engines(args: argparse.Namespace) -> Engines:
    """The speculative engine and, unless ``--no-baseline``, a plain engine on the same model.

    Both engines wrap one ``Transformer`` (weights loaded once); only the drafter differs, so the
    speedup compares speculation against nothing else.
    """
    from rollout_spec.config import SpecConfig
    from rollout_spec.engine import RolloutEngine
    from rollout_spec.engine.weights import TOKENIZER_FILES, load_config, load_tokenizer, resolve_model_dir

    with loading_model(args.model):
        model_dir = str(resolve_model_dir(args.model))
        limit = load_config(Path(model_dir)).max_position_embeddings
        tokenizer = load_tokenizer(Path(model_dir))
    if tokenizer is None:
        raise ModelNotLoaded(f"cannot load --model {args.model}: {model_dir} has no tokenizer "
                             f"(one of {', '.join(TOKENIZER_FILES)})")
    sizes = engine_sizes(args, tokenizer, limit)
    # the batch-aware budget on every device: on a CPU a fixed budget made speculation a loss
    with loading_model(args.model):
        spec = RolloutEngine.from_pretrained(
            model_dir, device=args.device, spec=SpecConfig(num_draft_tokens=args.draft_tokens),
            batch_aware_budget=True, **sizes)
    spec.drafter = DrafterProbe(spec.drafter)
    base = None
    if not args.no_baseline:
        base = RolloutEngine(spec.model, spec.tokenizer, None, eos_token_ids=spec.eos_token_ids, **sizes)
    return Engines(spec=spec, base=base)


def _timed(fn: Callable[..., Any], *a: Any, **kw: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - start


def _sampling(args: argparse.Namespace, step: int) -> SamplingParams:
    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, seed=args.seed + step)


def drafter_figures(engine: Any, outputs: Sequence[Any]) -> dict:
    """Drafter CPU time per request step and index size, from the engine's (timed) drafter.

    Time comes from a ``DrafterProbe`` wrapped around the drafter (reset here, once per step);
    index figures from ``drafter.stats()`` when it reports them.
    """
    drafter = getattr(engine, "drafter", None)
    if drafter is None:
        return {}
    out: dict = {}
    stats = drafter.stats() if callable(getattr(drafter, "stats", None)) else None
    if stats is not None:
        stats = stats if isinstance(stats, dict) else vars(stats)
        out = {"index_tokens": stats.get("index_tokens"), "index_bytes": stats.get("memory_bytes")}
    request_steps = sum(o.num_verify_steps for o in outputs)
    if isinstance(drafter, DrafterProbe) and request_steps:
        out["us_per_request"] = drafter.take_seconds() * 1e6 / request_steps
    return {k: v for k, v in out.items() if v is not None}


def _take_depths(engine: Any) -> Optional[tuple]:
    drafter = getattr(engine, "drafter", None)
    return drafter.take_depths() if isinstance(drafter, DrafterProbe) else None


def run_step(step: int, args: argparse.Namespace, engines: Engines, workload: Any,
             recorder: Optional[Any]) -> SpecStats:
    """One RL step: baseline and speculative generation, rewards, the drafter's step boundary."""
    prompts = workload.batch(step)
    ids = [list(p.prompt_ids) for p in prompts]
    groups = [p.group_id for p in prompts]
    params = _sampling(args, step)

    def spec_pass() -> tuple[Any, float]:
        return _timed(engines.spec.generate, ids, params, group_ids=groups)

    def base_pass() -> tuple[Any, float]:
        return _timed(engines.base.generate, ids, params) if engines.base else (None, None)

    # Alternate which pass goes first so warm caches and clocks favour neither side.
    if step % 2 == 0:
        (base_out, base_s), (spec_out, spec_s) = base_pass(), spec_pass()
    else:
        (spec_out, spec_s), (base_out, base_s) = spec_pass(), base_pass()
    _raise_on_errors(step, spec_out if base_out is None else [*spec_out, *base_out])
    texts = engines.spec.tokenizer.batch_decode([o.token_ids for o in spec_out], skip_special_tokens=True)
    rewards = workload.score_many([prompts[o.prompt_index] for o in spec_out], texts)
    stats = stats_from_outputs(step, spec_out, spec_s, draft_budget=args.draft_tokens,
                               base_outputs=base_out, base_seconds=base_s, rewards=rewards,
                               drafter=drafter_figures(engines.spec, spec_out),
                               depths=_take_depths(engines.spec))
    engines.spec.end_step()
    if recorder is not None:
        recorder.add_step(prompts, [(o.prompt_index, o.token_ids) for o in spec_out],
                          seeds=[o.seed for o in spec_out])
    return stats


class ModelNotLoaded(RuntimeError):
    """``--model`` could not be loaded: a file missing or damaged, a package not installed, a
    model of a family or feature the engine does not run."""


@contextmanager
def loading_model(model: str) -> Iterator[None]:
    """Turn what loading ``--model`` raises for a missing, damaged or unsupported model (OSError,
    ValueError, ImportError; ``engine.weights`` turns unreadable GGUF and safetensors files into
    ValueErrors naming them) into ModelNotLoaded naming it."""
    try:
        yield
    except (OSError, ValueError, ImportError) as exc:
        raise ModelNotLoaded(f"cannot load --model {model}: {exc}") from exc


class ContextTooShort(ValueError):
    """The longest prompt plus ``--max-new-tokens`` does not fit ``--model``'s context: an
    argument error, found once the tokenizer and the model's config are read."""


class OutputsNotWritten(RuntimeError):
    """A file of ``--plot``, ``--record`` or ``--json`` could not be written after the steps ran
    (the others were, and the tables printed hold every figure)."""


class StepFailed(RuntimeError):
    """Requests of a bench step ended in error: its figures would have holes, so the bench
    stops there (the finished steps' results are still written)."""


def _raise_on_errors(step: int, outputs: Sequence[Any]) -> None:
    """The engine reports a bad prompt per request; a benchmark with holes would mislead."""
    errors = [o for o in outputs if o.finish_reason == "error"]
    if errors:
        raise StepFailed(f"step {step}: {len(errors)} requests failed, e.g. prompt "
                         f"{errors[0].prompt_index}: {getattr(errors[0], 'error', None)}")


def _warm_up(engines: Engines, prompt_ids: list[int], args: argparse.Namespace) -> None:
    """One short untimed generation per engine (lazy init, allocator, kernels) with the steps'
    own sampling and n, so that step 0 does not pay for compiling their kernels. The speculative
    engine then gets a fresh drafter of the same config: step 0 starts from an empty index, not
    from the warm-up's tokens (at temperature 0 they would be step 0's own)."""
    params = replace(_sampling(args, 0), max_new_tokens=min(args.max_new_tokens, 16))
    for engine in (engines.base, engines.spec):
        if engine is not None:
            engine.generate([prompt_ids], params, group_ids=[None])
    probe = getattr(engines.spec, "drafter", None)
    if probe is not None:
        from rollout_spec.drafter import NgramDrafter

        engines.spec.drafter = DrafterProbe(NgramDrafter(probe.config))


def run_bench(args: argparse.Namespace, console: Optional[Any] = None,
              status: Optional[Any] = None) -> list[SpecStats]:
    """The main job: ``args.steps`` RL steps; prints tables, logs panels, writes the plot, the
    trace and the JSON. When a step fails (or is interrupted), what the steps before it
    measured is still summarised and written before the error propagates. Results go to
    ``console`` (default: stdout), the spinner, progress bar and status lines to ``status``
    (default: stderr)."""
    from rich.console import Console
    from rich.progress import Progress

    from rollout_spec.metrics import make_sink, wandb_metrics
    from rollout_spec.workloads import TraceRecorder, Workload

    console = console or Console()
    status = status or Console(stderr=True)
    with status.status(f"loading {args.model} ..."):
        engines = open_engines(args)
        tok = engines.spec.tokenizer
        workload = Workload(args.task, tok, args.prompts, seed=args.seed,
                            fresh_each_step=args.fresh_prompts, max_steps=args.steps)
        _warm_up(engines, list(workload.batch(0)[0].prompt_ids), args)
    console.print(workload_line(args, engines.spec.num_slots, str(engines.spec.device)))
    recorder = None if args.record is None else TraceRecorder(
        args.model, vars(_sampling(args, 0)), getattr(tok, "eos_token_id", None),
        vocab_size=engines.spec.model.config.vocab_size)
    sink = make_sink(args.wandb, args.wandb_project, _jsonable(vars(args)))
    history: list[SpecStats] = []
    try:
        with Progress(console=status, transient=True, redirect_stdout=False,
                      redirect_stderr=False) as progress:
            bar = progress.add_task("RL steps", total=args.steps)
            tables = progress.console if _one_terminal(console, status) else console
            for step in range(args.steps):
                stats = run_step(step, args, engines, workload, recorder)
                history.append(stats)
                sink.log(wandb_metrics(stats), step=step)
                tables.print(step_table(stats))
                progress.advance(bar)
    finally:  # the files first: a sink that fails to close (wandb) cannot lose them
        try:
            unwritten = _write_results(args, history, recorder, console, status)
        finally:
            sink.finish()
    if unwritten:
        raise OutputsNotWritten(f"results not written: {'; '.join(unwritten)} (the tables above "
                                f"hold them)")
    return history


def _one_terminal(console: Any, status: Any) -> bool:
    """Whether the results console and the status console write to one terminal: then a table
    printed during the progress bar goes through the bar's console, which draws it above the bar
    (printed to the other stream, it would land in the middle of the bar's line)."""
    if not (console.is_terminal and status.is_terminal):
        return False
    try:
        return os.path.samestat(os.fstat(console.file.fileno()), os.fstat(status.file.fileno()))
    except (AttributeError, OSError, ValueError):  # a stream without a file descriptor
        return False


def _write_results(args: argparse.Namespace, history: list[SpecStats], recorder: Optional[Any],
                   console: Any, status: Any) -> list[str]:
    """The summary table (to ``console``), and the plot, trace and JSON asked for, of the steps
    that finished; what was written, or why not, to ``status``. A file that cannot be written
    (a full disk, a folder removed during the run) does not stop the others: returns the
    failures, each naming its option."""
    if not history:
        status.print("no RL step finished: no summary, plot, trace or JSON written")
        return []
    if len(history) < args.steps:
        status.print(f"[bold red]the bench stopped after {len(history)} of {args.steps} RL steps; "
                     f"the results are theirs[/]")
    console.print(summary_table(history))
    failures = []
    for flag, write in _result_writers(args, history, recorder):
        try:
            status.print(write())
        except OSError as exc:
            failures.append(f"{flag} {getattr(args, flag[2:])}: {exc}")
            status.print(f"[bold red]{failures[-1]}[/]", highlight=False)
    return failures


def _result_writers(args: argparse.Namespace, history: list[SpecStats],
                    recorder: Optional[Any]) -> list[tuple[str, Callable[[], str]]]:
    """The files asked for, as (option, a function that writes its file and says where)."""
    def write_json() -> str:
        with replaced_on_success(args.json) as tmp:  # a failed write keeps the file there before
            tmp.write_text(json.dumps([s.to_dict() for s in history], indent=1))
        return f"figures: {args.json}"

    writers: list[tuple[str, Callable[[], str]]] = []
    if args.plot is not None:
        writers.append(("--plot", lambda: f"dashboard: {plot_dashboard(history, args.plot, title=_title(args))}"))
    if recorder is not None:
        writers.append(("--record", lambda: f"trace: {recorder.save(args.record)}"))
    if args.json is not None:
        writers.append(("--json", write_json))
    return writers


def workload_line(args: argparse.Namespace, num_slots: int, device: str) -> str:
    """What one step runs, said before the first: the samples, how many decode at once, and so
    whether a step is one synchronous batch (it lasts as long as its slowest sample, which
    speculation barely shortens at high temperature: docs/bench.md) or queues the rest."""
    samples = args.prompts * args.n
    batching = ("one synchronous batch" if samples <= num_slots
                else f"the other {samples - num_slots} wait for a slot")
    return (f"{args.model} on {device}: {args.prompts} prompts x n={args.n} = {samples} samples per step, "
            f"at most {num_slots} decoded at once ({batching}); T={args.temperature}, "
            f"{args.max_new_tokens} new tokens, up to {args.draft_tokens} draft nodes per request")


def _title(args: argparse.Namespace) -> str:
    return (f"{args.model} on {args.task}: {args.prompts} prompts x n={args.n}, "
            f"T={args.temperature}, {args.draft_tokens} draft tokens")


def _jsonable(d: dict) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


if __name__ == "__main__":
    sys.exit(main())
