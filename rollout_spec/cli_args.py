"""Argument types and up-front checks shared by ``rollout-spec`` and the bench/example scripts.

Every command-line number is range-checked as it is parsed, with an error naming the option and
its range; devices, output paths and trace files are checked before any work starts, so that a
long run never fails at its end over something it could have refused at once.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from rollout_spec.config import MIN_TEMPERATURE, check_float, check_int, check_temperature, float_interval, int_interval

if TYPE_CHECKING:
    from rollout_spec.replay import Trace

DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
DEFAULT_IN_HELP = "%(default)s"  # argparse fills it in when help is printed, from the action's default


def states_default(default: Any) -> bool:
    """Whether ``--help`` should state ``default``: not for an unset option (None), an off flag
    (False) or an empty list, whose help says in words what leaving them out does."""
    return default is not None and default is not False and default != [] and default is not argparse.SUPPRESS


class DefaultsParser(argparse.ArgumentParser):
    """The ``argparse.ArgumentParser`` of ``rollout-spec`` and every bench script: each option's
    help ends with "(default: VALUE)", one rule for all, so no help text restates (or misstates)
    a default by hand. Help that already holds ``%(default)s`` places it itself; options whose
    default is unset, an off flag or an empty list (``states_default``) say nothing. Unlike
    ``argparse.ArgumentDefaultsHelpFormatter``, an option without help text shows its default
    too, and the parser's own formatter (raw text, raw description) stays free to choose.
    Subcommand parsers made by ``add_subparsers().add_parser`` are of this class as well; options
    added through ``add_argument_group`` are not covered (none of these parsers uses a group)."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """``argparse.ArgumentParser.add_argument``, with the default appended to an option's help."""
        action = super().add_argument(*args, **kwargs)
        shown = action.help is not argparse.SUPPRESS and DEFAULT_IN_HELP not in (action.help or "")
        if action.option_strings and shown and states_default(action.default):
            action.help = f"{action.help or ''} (default: {shown_default(action.default)})".lstrip()
        return action


def shown_default(default: Any) -> str:
    """How ``--help`` writes ``default``: a list (an ``nargs`` option's) as its values separated by
    spaces, as they are typed; anything else through argparse's own ``%(default)s``."""
    if isinstance(default, (list, tuple)):
        return " ".join(str(v) for v in default).replace("%", "%%")
    return DEFAULT_IN_HELP


def _checked_arg(convert: Callable[[str], Any], check: Callable[[Any], Any], expected: str) -> Callable[[str], Any]:
    """An argparse type: ``check(convert(text))``. Text that does not convert reads "``expected``,
    got 'text'"; a converted value the check refuses reads as the check's own message."""

    def parse(text: str) -> Any:
        try:
            return check(convert(text))
        except ValueError as exc:  # conversion failures and range failures read the same way
            msg = str(exc) if "must be" in str(exc) else f"{expected}, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None

    return parse


def int_arg(name: str, lo: int, hi: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi], with an error naming the option and range."""
    return _checked_arg(int, lambda value: check_int(name, value, lo, hi),
                        f"{name} must be an integer in {int_interval(lo, hi)}")


def float_arg(name: str, lo: float, hi: float, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a float inside the stated interval."""
    return _checked_arg(float, lambda value: check_float(name, value, lo, hi, lo_open=lo_open),
                        f"{name} must be a number in {float_interval(lo, hi, lo_open)}")


def temperature_arg(name: str) -> Callable[[str], float]:
    """An argparse type: a sampling temperature, 0 (greedy) or in [MIN_TEMPERATURE, 100]."""
    return _checked_arg(float, lambda value: check_temperature(name, value),
                        f"{name} must be 0 (greedy) or a number in [{MIN_TEMPERATURE}, 100.0]")


def numbers_arg(name: str, kind: type, lo: float, hi: float) -> Callable[[str], list]:
    """An argparse type: one or more distinct comma-separated ``kind`` (int or float) values in
    [lo, hi]."""

    def parse(text: str) -> list:
        values = _comma_values(name, text, kind)
        bad = [v for v in values if not lo <= v <= hi]  # NaN fails both comparisons
        if bad:
            raise argparse.ArgumentTypeError(f"every {name} value must be in [{lo}, {hi}], got {bad[0]}")
        return _distinct(name, values)

    return parse


def temperatures_arg(name: str) -> Callable[[str], list[float]]:
    """An argparse type: one or more distinct comma-separated sampling temperatures, each 0
    (greedy) or in [MIN_TEMPERATURE, 100]; an error names the option and that rule, not a plain
    [0, 100] range that would let a temperature the sampler refuses through to the run."""

    def parse(text: str) -> list[float]:
        values = _comma_values(name, text, float)
        try:
            values = [check_temperature(f"every {name} value", v) for v in values]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return _distinct(name, values)

    return parse


def _comma_values(name: str, text: str, kind: type) -> list:
    """``text``'s comma-separated values as ``kind`` (int or float); an argparse error naming
    ``name`` when one does not convert."""
    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        noun = "integers" if kind is int else "numbers"
        raise argparse.ArgumentTypeError(f"{name} must be comma-separated {noun}, got {text!r}") from None


def repeated(values: Sequence[Any]) -> list[str]:
    """The values that occur more than once in ``values``, as text, in order of first occurrence."""
    seen: set = set()
    twice: dict[str, None] = {}
    for v in values:
        if v in seen:
            twice[str(v)] = None
        seen.add(v)
    return list(twice)


def _distinct(name: str, values: list) -> list:
    """``values``, unless one occurs twice: an argparse error naming ``name`` and the value (each
    value of a bench's list makes its own rows, so a repeat would only run them again)."""
    twice = repeated(values)
    if twice:
        raise argparse.ArgumentTypeError(f"{name} lists {', '.join(twice)} more than once")
    return values


def check_distinct(parser: argparse.ArgumentParser, flag: str, values: Sequence[Any]) -> None:
    """Refuse ``values`` (the values of ``flag``, e.g. an ``nargs`` option's) with a repeat."""
    try:
        _distinct(flag, list(values))
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))


def names_arg(name: str, allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: one or more distinct comma-separated names, each one of ``allowed``."""

    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",")]
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"every {name} value must be one of {', '.join(allowed)}; "
                                             f"got {bad[0]!r}")
        return _distinct(name, values)

    return parse


def task_arg(text: str) -> str:
    """An argparse type: a task name the workloads accept (reasoning-gym's registry or humaneval)."""
    from rollout_spec.workloads import task_names

    try:
        names = task_names()
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "reasoning_gym":
            raise
        raise argparse.ArgumentTypeError(
            f"task {text!r}: the task registry needs reasoning-gym, not installed: "
            f"pip install 'rollout-spec[workloads]'") from None
    if text not in names:
        raise argparse.ArgumentTypeError(
            f"task must be a reasoning-gym task or 'humaneval' (e.g. gsm_symbolic, basic_arithmetic, "
            f"chain_sum; {len(names)} in all), got {text!r}")
    return text


def device_arg(text: str) -> str:
    """An argparse type: a torch device name rollout-spec runs on (auto, cpu, mps, cuda[:N])."""
    if not DEVICE_RE.match(text):
        raise argparse.ArgumentTypeError(f"device must be auto, cpu, mps, cuda or cuda:N, got {text!r}")
    return text


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """The bench scripts' ``--device``: a name ``device_arg`` accepts, default ``auto`` (CUDA where
    torch sees one, else CPU; ``check_device`` resolves it), one definition for every script."""
    parser.add_argument("--device", type=device_arg, default="auto",
                        help="cpu, cuda, cuda:N, mps or auto (cuda where available, else cpu)")


def model_arg(text: str) -> str:
    """An argparse type: a model the engine can load (``weights.model_kind``), checked without
    loading it."""
    from rollout_spec.engine.weights import model_kind, unknown_model

    if model_kind(text) is None:
        raise argparse.ArgumentTypeError(unknown_model(text))
    return text


def check_device(parser: argparse.ArgumentParser, device: str, flag: str = "--device") -> str:
    """The device ``device`` names, ``auto`` resolved (CUDA where torch sees one, else CPU); a
    device this machine lacks is an argument error, raised before any model is built."""
    if device.startswith("cuda"):
        import torch

        index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
        if index >= count:
            parser.error(f"{flag} {device}: no CUDA device is visible here (use cpu)" if count == 0 else
                         f"{flag} {device}: torch sees {count} CUDA devices here (cuda:0 to cuda:{count - 1})")
    from rollout_spec.engine.inputs import pick_device

    try:
        return str(pick_device(device))
    except ValueError as exc:  # e.g. mps where it is not available
        parser.error(f"{flag}: {exc}")


def check_triton_backend(parser: argparse.ArgumentParser, flag: str, device: str) -> None:
    """Refuse the Triton backend (``flag triton``) where its kernels cannot run, before any model
    is built: without the triton package, or on ``device`` (a resolved ``check_device`` name)
    other than CUDA, unless ``TRITON_INTERPRET=1`` has triton's interpreter run them on the CPU."""
    import torch

    from rollout_spec.engine import triton_attention
    from rollout_spec.verify import triton_runs_on

    if not triton_attention.is_available():
        parser.error(f"{flag} triton: the triton package is not installed (use auto or torch)")
    if not triton_runs_on(torch.device(device)):
        parser.error(f"{flag} triton: the Triton kernels run on CUDA, not on --device {device} (use auto "
                     f"or torch, or set TRITON_INTERPRET=1 to interpret them on the CPU, slowly)")


WANDB_PROJECT_MAX_CHARS = 128
WANDB_PROJECT_BAD_CHARS = "/\\#?%:"


def wandb_project_arg(text: str) -> str:
    """An argparse type: ``--wandb-project`` as wandb accepts it (at most 128 characters, none of
    ``/ \\ # ? % :``), refused as it is parsed rather than by ``wandb.init`` after the model
    has loaded."""
    if len(text) > WANDB_PROJECT_MAX_CHARS:
        raise argparse.ArgumentTypeError(
            f"--wandb-project must be at most {WANDB_PROJECT_MAX_CHARS} characters, got {len(text)}")
    found = sorted({c for c in text if c in WANDB_PROJECT_BAD_CHARS})
    if found:
        raise argparse.ArgumentTypeError(
            f"--wandb-project must not contain any of {' '.join(WANDB_PROJECT_BAD_CHARS)}, got "
            f"{text!r} (with {' '.join(found)})")
    return text


def path_arg(text: str) -> Path:
    """An argparse type: a path, not an empty one (``Path("")`` is the current folder, so an unset
    shell variable in ``--out "$DIR"`` would write there)."""
    if not text:
        raise argparse.ArgumentTypeError("must be a path, got ''")
    return Path(text)


def unwritable(path: Path) -> Optional[str]:
    """Why a file could not be written at ``path``, or None."""
    try:
        problem = name_too_long(path)
        if problem:
            return problem
        if path.is_dir():
            return "is a directory"
        folder = path.parent
        if not folder.is_dir():
            return f"{folder} is not a folder" if folder.exists() else f"folder {folder} does not exist"
    except OSError as exc:  # a path too long for the system, a loop of symbolic links
        return exc.strerror
    if not os.access(folder, os.W_OK):
        return f"folder {folder} is not writable"
    return None


def name_too_long(path: Path) -> Optional[str]:
    """Why the file name of ``path`` is too long for its folder's filesystem, or None (also when
    the folder does not exist: the caller says that). ``Path.is_dir`` raises for such a name."""
    try:
        limit = os.pathconf(path.parent, "PC_NAME_MAX")
    except (OSError, ValueError):  # no such folder, or a system that does not say
        return None
    size = len(os.fsencode(path.name))
    if size > limit:
        return f"the file name is {size} bytes, its filesystem allows at most {limit}"
    return None


def check_output(parser: argparse.ArgumentParser, flag: str, path: Optional[Path]) -> None:
    """Refuse an output path that could not be written, before the work that would fill it."""
    problem = None if path is None else unwritable(Path(path))
    if problem:
        parser.error(f"{flag} {path}: {problem}")


def load_trace_arg(parser: argparse.ArgumentParser, flag: str, path: str | Path,
                   need_responses: bool = False) -> "Trace":
    """The trace at ``path``; a missing or malformed file, or a directory, is an argument error
    naming it, and so, with ``need_responses``, is one without steps, with a step that holds no
    responses, or whose responses are all empty (every figure would be 0/0: a table of dashes).
    Steps of only empty responses in a trace with tokens elsewhere are named in a note on stderr."""
    from rollout_spec.replay import load_trace

    problem = unreadable_trace(Path(path))
    if problem:
        parser.error(f"{flag} {path}: {problem}")
    try:
        trace = load_trace(path)
    except (OSError, ValueError) as exc:
        parser.error(f"{flag} {exc}")
    if need_responses:
        check_trace_responses(parser, flag, path, trace)
    return trace


def unreadable_trace(path: Path) -> Optional[str]:
    """Why ``path`` names no trace file to read, or None: a directory, no file, or a name or
    path too long for the system (``Path.is_dir`` raises for those)."""
    try:
        problem = name_too_long(path)
        if problem:
            return problem
        if path.is_dir():
            return "is a directory, not a trace file"
        if not path.is_file():
            return "trace file not found"
    except OSError as exc:  # a path too long for the system, a loop of symbolic links
        return exc.strerror
    return None


def check_trace_responses(parser: argparse.ArgumentParser, flag: str, path: str | Path, trace: "Trace") -> None:
    """Refuse a trace without steps, with a step of no responses, or whose responses are all
    empty; name the steps of only empty responses in a note (they show no figures). ``path``
    names the trace in both: a tool that replays part of a trace says which part there."""
    if not trace.steps or not all(trace.steps):
        parser.error(f"{flag} {path}: every step must hold responses (it has {len(trace.steps)} steps)")
    tokenless = [s for s, step in enumerate(trace.steps) if not any(ids for _, ids in step)]
    if len(tokenless) == len(trace.steps):
        parser.error(f"{flag} {path}: every response is empty (no tokens to replay)")
    if tokenless:  # a step that decodes nothing is a fact to show, not an error
        print(f"NOTE: {path}: every response of step{'s' if len(tokenless) > 1 else ''} "
              f"{', '.join(map(str, tokenless))} is empty; no figures for "
              f"{'them' if len(tokenless) > 1 else 'it'} (shown as -)", file=sys.stderr)


def check_trace_steps(parser: argparse.ArgumentParser, flag: str, steps: Optional[int],
                      path: str | Path, trace: "Trace") -> None:
    """Refuse ``steps`` (the value of ``flag``, None for all) beyond the trace's step count."""
    if steps is not None and steps > len(trace.steps):
        parser.error(f"{flag} {steps}: trace {path} has only {len(trace.steps)} steps")
