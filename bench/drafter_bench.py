"""Replay rollout traces lock-step and print, per RL step, TPF and drafter cost side by side.

Drafters, all in one run: ours (NgramDrafter; default adaptive budget, and "ours-full" filling
the whole budget), arctic-inference's SuffixDecodingCache (vLLM defaults: depth 24,
min_token_prob 0.1, chain; only if `arctic_inference` is importable -- it is never vendored),
and a vLLM-style prompt-lookup n-gram (n in [2, 5]).

    python bench/drafter_bench.py                       # the shared traces, or a synthetic one
    python bench/drafter_bench.py --trace T.json.gz --max-live 512 --drafters ours,arctic
    python bench/drafter_bench.py --max-live 512 --drafters ours --propose-threads 1,4
    python bench/drafter_bench.py --max-live 512 --drafters ours,arctic --repeat 5

Cost is microseconds of propose + extend per live request per iteration, measured around the
drafter's calls only: the process's CPU time when every drafter runs on one thread (the
default: "ours" is made with propose_threads=1, whatever the machine), or wall time when
--propose-threads names any other count ("ours@N": propose calls of >= 64 requests, and the
indexing of extends as large, split over N threads, 0 = auto; a list runs ours once per count,
rows side by side; the drafts are identical, so TPF is too). The other drafters run on one
thread.

On a shared machine one replay's cost can be 10-30% off the next: --repeat N replays every trace
N times with fresh drafters, in turns (ours, arctic, ours, arctic, ...), and prints each row's
median run with the range of all N. The drafts must be the same every time: a drafter whose
counts change between replays is an error.
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_spec.cli_args import DefaultsParser, int_arg, names_arg, numbers_arg  # noqa: E402
from rollout_spec.config import SpecConfig  # noqa: E402
from rollout_spec.drafter import NgramDrafter  # noqa: E402
from rollout_spec.replay import (ArcticDrafter, PromptLookupDrafter, ReplayDrafter, StepResult,  # noqa: E402
                                 Trace, arctic_available, replay)
from synthetic_trace import make_synthetic_trace  # noqa: E402
from trace_files import add_trace_option, load_traces  # noqa: E402



def make_drafter(name: str, budget: int) -> ReplayDrafter:
    """Fresh drafter by bench name: ``ours`` runs on one thread (SpecConfig's default, 0, would
    pick half the machine's hardware threads), ``ours@4`` splits its calls over 4 threads."""
    base, _, threads = name.partition("@")
    extra = {"propose_threads": int(threads) if threads else 1}
    if base == "ours":
        return NgramDrafter(SpecConfig(num_draft_tokens=budget, max_batch_draft_tokens=1 << 24, **extra))
    if base == "ours-full":
        return NgramDrafter(SpecConfig(num_draft_tokens=budget, max_batch_draft_tokens=1 << 24,
                                       adaptive_budget=False, **extra))
    if name == "arctic":
        return ArcticDrafter(max_depth=24, min_token_prob=0.1)
    if name == "prompt-lookup":
        return PromptLookupDrafter(2, 5)
    raise ValueError(f"unknown drafter {name!r}; choose from ours, ours-full, arctic, prompt-lookup")


def median_run(name: str, runs: list[StepResult]) -> StepResult:
    """The run of one step whose cost is the median of ``runs`` (the upper one of an even count).

    Raises RuntimeError if the runs drafted differently: a replay is deterministic, so they must
    agree on every count but the timings."""
    counts = {(r.tokens, r.verify_steps, r.drafted, r.accepted, r.request_iterations) for r in runs}
    if len(counts) > 1:
        raise RuntimeError(f"{name}: step {runs[0].step} drafted differently in {len(runs)} replays "
                           f"(tokens, verify steps, drafted, accepted, request iterations: {sorted(counts)})")
    ordered = sorted(runs, key=lambda r: r.us_per_request_iteration)
    return ordered[len(ordered) // 2]


def run_trace(label: str, trace: Trace, names: list[str], budget: int, max_live: int | None,
              clock: Callable[[], float] = time.process_time, repeat: int = 1) -> None:
    """Replay ``trace`` ``repeat`` times with every drafter (in turns) and print one table row
    per (step, drafter): its median run, and with ``repeat`` > 1 the range of all runs' costs."""
    runs: dict[str, list[list[StepResult]]] = {name: [] for name in names}
    notes: dict[str, str] = {}
    for r in range(repeat):
        for name in names:
            t0, kernel0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
            drafter = make_drafter(name, budget)
            runs[name].append(replay(drafter, trace, budget=budget, max_live=max_live, clock=clock))
            kernel = resource.getrusage(resource.RUSAGE_SELF).ru_stime - kernel0
            turn = f" (run {r + 1}/{repeat})" if repeat > 1 else ""
            print(f"  [{label}] {name}{turn}: replayed in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            if isinstance(drafter, NgramDrafter):
                st = drafter.stats()
                notes[name] = (f"{name}: {st['memory_bytes'] / max(st['index_tokens'], 1):.0f} bytes per stored token; "
                               f"{kernel:.2f} s of kernel time in the process during its last replay (mostly "
                               f"first touches of new memory, which a VM may make costly: docs/drafter.md)")
    live = "all" if max_live is None else str(max_live)
    ranged = repeat > 1
    print(f"\n## {label}: {len(trace.prompts)} prompts, {len(trace.steps)} steps, "
          f"{trace.num_tokens} tokens; budget {budget}; live requests: {live}"
          + (f"; median of {repeat} runs" if ranged else ""))
    print("| step | drafter | TPF | TPF / arctic | accept rate | us / request / iteration | propose + extend |"
          + (" range of runs |" if ranged else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if ranged else ""))
    for s in range(len(trace.steps)):
        step_runs = {name: [run[s] for run in runs[name]] for name in names}
        median = {name: median_run(name, step_runs[name]) for name in names}
        ref = median["arctic"].tpf if "arctic" in median and median["arctic"].verify_steps else None
        for name in names:
            r = median[name]
            ratio = f"{r.tpf / ref:.2f}x" if ref and r.verify_steps else "n/a"
            tpf = f"{r.tpf:.3f}" if r.verify_steps else "-"  # a step of empty responses verifies nothing
            rate = r.accepted / max(r.drafted, 1)
            split = (f"{r.propose_us_per_request_iteration:.2f} + "
                     f"{r.us_per_request_iteration - r.propose_us_per_request_iteration:.2f}")
            row = f"| {s} | {name} | {tpf} | {ratio} | {rate:.3f} | {r.us_per_request_iteration:.2f} | {split} |"
            if ranged:
                costs = [x.us_per_request_iteration for x in step_runs[name]]
                row += f" {min(costs):.2f}-{max(costs):.2f} |"
            print(row)
    for note in notes.values():
        print(f"\n{note}")


DRAFTERS = ("ours", "ours-full", "arctic", "prompt-lookup")


def drafter_names(ap: argparse.ArgumentParser, drafters: list[str], counts: list[int] | None) -> list[str]:
    """Table names of the drafters to run: ``ours``/``ours-full`` once per thread count (``ours@N``);
    arctic is dropped, with a note, where it is not importable. Refuses (``ap.error``) thread
    counts with no ours drafter, and a list left empty (their types refuse repeated values)."""
    ours = [n for n in drafters if n in ("ours", "ours-full")]
    if counts is not None and not ours:
        ap.error("--propose-threads sets the threads of ours and ours-full, and --drafters names neither")
    names = []
    for n in drafters:
        # One thread keeps the plain name (and the tables of earlier runs comparable).
        names += [n if c == 1 else f"{n}@{c}" for c in counts or [1]] if n in ours else [n]
    if "arctic" in names and not arctic_available():
        why = "arctic-inference is not installed (import arctic_inference.suffix_decoding failed)"
        if names == ["arctic"]:
            ap.error(f"--drafters arctic: {why}, and no other drafter was named")
        print(f"NOTE: {why}; its column is skipped.", file=sys.stderr)
        names.remove("arctic")
    return names


def main(argv: list[str] | None = None) -> None:
    """Parse options, pick traces, run the drafters, print the tables."""
    ap = DefaultsParser(description=__doc__.splitlines()[0])
    add_trace_option(ap, "the shared traces, else a synthetic one")
    ap.add_argument("--synthetic", action="store_true", help="also replay a synthetic trace")
    ap.add_argument("--budget", type=int_arg("--budget", 1, 1024), default=8, help="draft tokens per request")
    ap.add_argument("--max-live", type=int_arg("--max-live", 1, 1 << 20), default=None,
                    help="cap on concurrent requests (default: all of a step's requests)")
    ap.add_argument("--drafters", type=names_arg("--drafters", DRAFTERS), default=",".join(DRAFTERS),
                    help=f"comma-separated, from {', '.join(DRAFTERS)}")
    ap.add_argument("--propose-threads", type=numbers_arg("--propose-threads", int, 0, 256), default=None,
                    help="comma-separated thread counts for ours/ours-full (0 = auto) (default: 1)")
    ap.add_argument("--repeat", type=int_arg("--repeat", 1, 1000), default=1,
                    help="replays of every trace per drafter, in turns; rows show the median run")
    args = ap.parse_args(argv)
    counts = args.propose_threads or [1]
    names = drafter_names(ap, args.drafters, args.propose_threads)
    for n in names:
        try:
            make_drafter(n, args.budget)  # fail fast on a bad name, budget or thread count
        except ValueError as e:
            ap.error(str(e))
    traces = [(Path(path).name, trace) for path, trace in load_traces(ap, args.trace, required=False)]
    # One thread each: CPU time. With a pool, every row is timed by the wall (its latency).
    clock = time.process_time if counts == [1] else time.perf_counter
    print(f"# drafter bench on {platform.node()} ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs), propose threads {','.join(map(str, counts))}, "
          f"{'CPU' if clock is time.process_time else 'wall'} time, {time.strftime('%Y-%m-%d %H:%M')}")
    for label, trace in traces:
        run_trace(label, trace, names, args.budget, args.max_live, clock, args.repeat)
    if args.synthetic or not traces:
        run_trace("synthetic (seed 0)", make_synthetic_trace(), names, args.budget, args.max_live, clock,
                  args.repeat)


if __name__ == "__main__":
    main()
