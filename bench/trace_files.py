"""The traces a bench script replays: its ``--trace`` files, else the shared GRPO traces.

Every trace bench took the same steps (fall back to the shared traces, refuse a missing or
malformed file, check ``--steps`` against each trace); they live here once.
"""
from __future__ import annotations

import argparse
import glob
from pathlib import Path
from typing import Optional

from rollout_spec.cli_args import check_trace_steps, load_trace_arg
from rollout_spec.replay import Trace

SHARED = str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "*.json.gz")


def load_traces(parser: argparse.ArgumentParser, paths: Optional[list[str]], steps: Optional[int] = None,
                required: bool = True) -> list[tuple[str, Trace]]:
    """(path, trace) for ``paths`` (the ``--trace`` values), or for the shared traces when none
    were given. Argument errors: no trace at all (with ``required``), a file that is missing,
    malformed or without responses, and ``steps`` beyond a trace's step count."""
    paths = paths or sorted(glob.glob(SHARED))
    if required and not paths:
        parser.error(f"no trace given and none found at {SHARED}")
    traces = [(path, load_trace_arg(parser, "--trace", path, need_responses=True)) for path in paths]
    for path, trace in traces:
        check_trace_steps(parser, "--steps", steps, path, trace)
    return traces


if __name__ == "__main__":
    raise SystemExit("bench/trace_files.py is the bench scripts' trace loader, not a command: run "
                     "bench/drafter_bench.py or another script that takes --trace")
