"""The traces a bench script replays: its ``--trace`` files, else the shared GRPO traces.

Every trace bench took the same steps (the ``--trace`` option, fall back to the shared traces,
refuse a missing or malformed file, check ``--steps`` against each trace, say on stderr when a
trace's replays are done); they live here once.
"""
from __future__ import annotations

import argparse
import glob
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from rollout_spec.cli_args import check_distinct, check_trace_steps, load_trace_arg
from rollout_spec.replay import Trace

SHARED = str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "*.json.gz")


def add_trace_option(parser: argparse.ArgumentParser, fallback: str = "the shared traces") -> None:
    """``--trace``, repeatable: the trace files ``load_traces`` reads (``fallback`` says what runs
    without one)."""
    parser.add_argument("--trace", action="append", help=f"trace file, repeatable (default: {fallback})")


@contextmanager
def replay_status(label: str) -> Iterator[None]:
    """Print ``  [label: replayed in Xs]`` on stderr when the block ends: a bench's one-line
    progress per trace, kept off stdout so its tables stay clean."""
    start = time.perf_counter()
    yield
    print(f"  [{label}: replayed in {time.perf_counter() - start:.1f}s]", file=sys.stderr, flush=True)


def load_traces(parser: argparse.ArgumentParser, paths: Optional[list[str]], steps: Optional[int] = None,
                required: bool = True) -> list[tuple[str, Trace]]:
    """(path, trace) for ``paths`` (the ``--trace`` values), or for the shared traces when none
    were given. Argument errors: no trace at all (with ``required``), a file given twice (its
    rows would only be replayed again), a file that is missing, malformed or without responses,
    and ``steps`` beyond a trace's step count."""
    paths = paths or sorted(glob.glob(SHARED))
    if required and not paths:
        parser.error(f"no trace given and none found at {SHARED}")
    check_distinct(parser, "--trace", [Path(path).resolve() for path in paths])
    traces = [(path, load_trace_arg(parser, "--trace", path, need_responses=True)) for path in paths]
    for path, trace in traces:
        check_trace_steps(parser, "--steps", steps, path, trace)
    return traces


if __name__ == "__main__":
    raise SystemExit("bench/trace_files.py is the bench scripts' trace loader, not a command: run "
                     "bench/drafter_bench.py or another script that takes --trace")
