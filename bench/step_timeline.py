"""Where a decode step's host time goes: exclusive main-thread time per engine function.

Wraps the engine's step functions (and ``Tensor.cpu``, where the host waits for the GPU) with
timers, runs ``engine_bench``'s workload at one batch size and temperature on the plain and on
the speculative engine (interleaved, new prompts per call), and prints per function the
exclusive milliseconds per decode step of each engine, and the part of it spent while the GPU
idles: between a step's readback and the next graph replay. Only that part delays the GPU, so
it is what a drafting step must shrink; the rest overlaps the forward. Timers add ~1 us per
wrapped call, so absolute step times read a little high; compare the two columns.

Examples::

    python bench/step_timeline.py --device cuda --batch-size 8 --temperature 0.6
    python bench/step_timeline.py --device cuda --batch-size 256 --temperature 1.0 --fixed-budget 4
    python bench/step_timeline.py --device cpu --random-weights --batch-size 2 --max-new-tokens 8
"""
from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

import torch

import engine_bench as eb
from rollout_spec.cli_args import (DefaultsParser, add_device_option, float_arg, int_arg,
                                   temperature_arg)

WAIT = "Tensor.cpu"  # the host's wait for the GPU (verification's readback) ends here
REPLAY = "GraphLadder.replay"  # the GPU starts a step's forward


class Timeline:
    """Exclusive seconds per wrapped function on the main thread, in total and in GPU-idle gaps."""

    def __init__(self) -> None:
        self.main = threading.get_ident()
        self.total: dict[str, float] = defaultdict(float)
        self.gap: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []
        self._gpu_idle = True

    def clear(self) -> None:
        """Forget what was measured (the wrappers stay)."""
        self.total.clear()
        self.gap.clear()

    def timed(self, label: str, fn: Any) -> Any:
        """``fn`` wrapped: its exclusive time on the main thread goes to ``label``."""
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.main:
                return fn(*args, **kwargs)
            if label == REPLAY:
                self._gpu_idle = False
            t0 = time.perf_counter()
            self._stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                own = spent - self._stack.pop()
                self.total[label] += own
                if label == WAIT:
                    self._gpu_idle = True
                elif self._gpu_idle:  # attributed when the function returns
                    self.gap[label] += own
                if self._stack:
                    self._stack[-1] += spent
        return inner


def targets() -> list[tuple[Any, str, bool]]:
    """(owner, attribute, is a staticmethod) of every function the timeline wraps."""
    from rollout_spec import drafter, verify
    from rollout_spec.engine import (budget, commit, cuda_graphs, drafter_queue, engine, runner, scheduler,
                                     shadow_acceptance)

    eng = engine.RolloutEngine
    out = [(eng, n, False) for n in ("step", "_decode", "_prefill", "_budgets", "_propose", "_checked",
                                     "_plain_hand_off", "_account_last", "_commit", "_drafting_shadow",
                                     "_ask_budget")]
    out += [(engine, n, False) for n in ("verify", "plan_commit", "stop_mask", "_apply")]
    out += [(commit.RunningBatch, "of", True)]
    out += [(runner.ModelRunner, n, False) for n in ("verify_forward", "_graph_forward", "_logits",
                                                     "keep_accepted_kv", "compact_kv", "prefill")]
    out += [(runner, n, False) for n in ("host_tree_inputs", "to_device")]
    out += [(cuda_graphs.GraphLadder, n, False) for n in ("load", "replay")]
    if verify.use_triton("auto", torch.device("cuda")):  # the fused walk (else torch's, timed as verify)
        from rollout_spec import verify_fused

        out += [(verify_fused, n, False) for n in ("verify_fused", "_unpack", "launch_walk")]
    out += [(verify, "_check_inputs", False)]
    out += [(drafter_queue.DrafterQueue, n, False) for n in ("submit", "drain", "call")]
    out += [(drafter_queue.DrafterFeed, n, False) for n in ("committed", "flush", "ready")]
    out += [(drafter.NgramDrafter, n, False) for n in ("start_batch", "extend_batch", "finish_batch",
                                                       "propose", "propose_ahead")]
    out += [(shadow_acceptance.ShadowAcceptance, n, False) for n in ("propose", "harvest")]
    out += [(scheduler.Scheduler, n, False) for n in ("admit", "release_finished")]
    out += [(budget.DraftBudget, n, False) for n in ("__call__", "observe", "observe_plain", "record_step")]
    out += [(torch.Tensor, "cpu", False), (torch, "matmul", False)]
    return out


@contextmanager
def installed(timeline: Timeline) -> Iterator[None]:
    """The wrappers in place for the duration; the originals restored afterwards."""
    saved = []
    for owner, name, static in targets():
        own = owner.__dict__.get(name)  # None: inherited (Tensor.cpu), restored by deleting
        fn = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}"
        wrapped = timeline.timed(label, fn)
        setattr(owner, name, staticmethod(wrapped) if static else wrapped)
        saved.append((owner, name, own))
    try:
        yield
    finally:
        for owner, name, own in reversed(saved):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def measure(args: argparse.Namespace, engine: Any, calls: list[tuple[list, list]], stop: Any,
            timeline: Timeline, spec: bool) -> tuple[dict, dict[str, float], dict[str, float]]:
    """One engine's calls of a round (prompts, group ids): summary figures, and exclusive ms per
    decode step (total, in GPU gaps)."""
    timeline.clear()
    runs = []
    for group, ids in calls:
        runs.append(eb.run_generate(engine, group, ids, args.temperature, args.max_new_tokens, stop,
                                    args.batch_size))
        if spec:
            engine.end_step()
    figures = eb.summarise(runs)
    steps = max(figures["decodes"], 1)
    per_step = lambda d: {k: 1e3 * v / steps for k, v in d.items()}  # noqa: E731
    return figures, per_step(timeline.total), per_step(timeline.gap)


def print_table(args: argparse.Namespace, plain: tuple, spec: tuple) -> None:
    """Functions by the speculative engine's exclusive time, with both engines' columns."""
    (pf, ptot, pgap), (sf, stot, sgap) = plain, spec
    print(f"\n## Host time per decode step, B={args.batch_size}, T={args.temperature}: plain "
          f"{pf['tps']:.0f} tok/s, {pf['secs'] * 1e3 / max(pf['decodes'], 1):.2f} ms/step; spec "
          f"{sf['tps']:.0f} tok/s (x{sf['tps'] / pf['tps']:.2f}), TPF {sf['tpf']:.2f}, mean W "
          f"{sf['width']:.1f}, {sf['secs'] * 1e3 / max(sf['decodes'], 1):.2f} ms/step")
    print("| function | plain ms | spec ms | plain, GPU idle | spec, GPU idle |\n|---|---|---|---|---|")
    names = sorted(set(ptot) | set(stot), key=lambda n: -stot.get(n, 0.0))
    for n in names:
        if max(ptot.get(n, 0.0), stot.get(n, 0.0)) >= args.min_ms:
            print(f"| {n} | {ptot.get(n, 0.0):.3f} | {stot.get(n, 0.0):.3f} | {pgap.get(n, 0.0):.3f} | "
                  f"{sgap.get(n, 0.0):.3f} |")
    print(f"| all but {WAIT}, GPU idle | | | {sum(pgap.values()):.3f} | {sum(sgap.values()):.3f} |")


def build_parser() -> argparse.ArgumentParser:
    """The options, each range-checked as it is parsed (errors name this script's flags)."""
    ap = DefaultsParser(description=__doc__.split("\n\n")[0])
    add_device_option(ap)
    ap.add_argument("--model", default=eb.DEFAULT_MODEL, help="a checkpoint (not with --random-weights)")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--batch-size", type=int_arg("--batch-size", 1, 4096), default=8)
    ap.add_argument("--temperature", type=temperature_arg("--temperature"), default=0.6)
    ap.add_argument("--rounds", type=int_arg("--rounds", 1, 100), default=2,
                    help="(plain, spec) rounds; the last is shown")
    ap.add_argument("--max-new-tokens", type=int_arg("--max-new-tokens", 1, 1 << 16), default=256)
    ap.add_argument("--max-model-len", type=int_arg("--max-model-len", 2, 1 << 20), default=1024,
                    help="most tokens (prompt + output) of one request")
    ap.add_argument("--draft-tokens", type=int_arg("--draft-tokens", 1, 256), default=32)
    ap.add_argument("--min-ms", type=float_arg("--min-ms", 0.0, 1e6), default=0.005,
                    help="hide functions under this many ms per step")
    ap.add_argument("--fixed-budget", type=int_arg("--fixed-budget", 1, 256), default=None,
                    help="draft nodes per request on every spec step instead of the batch-aware budget: "
                         "what drafting costs and yields where the budget would not draft")
    return ap


def bench_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``engine_bench``'s options for this run (its defaults elsewhere), checked with ``ap`` so that
    an error names this script's flags; ``--fixed-budget`` is refused above ``--draft-tokens``
    (the engine would cut every step's answer to it)."""
    if args.fixed_budget is not None and args.fixed_budget > args.draft_tokens:
        ap.error(f"--fixed-budget {args.fixed_budget} must be at most --draft-tokens {args.draft_tokens}, "
                 f"the engine's most draft nodes per request")
    out = eb.build_parser().parse_args([])
    out.__dict__.update(device=args.device, model=args.model, batch_sizes=[args.batch_size],
                        temperatures=[args.temperature], repeats=args.rounds, max_new_tokens=args.max_new_tokens,
                        max_model_len=args.max_model_len, draft_tokens=args.draft_tokens,
                        random_weights=args.random_weights, overlap_drafter=None)
    eb.check_args(ap, out)
    return out


def main(argv: list[str] | None = None) -> None:
    """Entry point: build both engines, warm up, time ``--rounds`` rounds, print the last."""
    ap = build_parser()
    args = ap.parse_args(argv)
    bench = bench_args(ap, args)
    pool, warm, stop = eb.checked_workload(ap, bench)
    start = time.perf_counter()
    spec_eng, base_eng = eb.build_engines(bench)
    print(f"engines built in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    if args.fixed_budget is not None:
        spec_eng.draft_budget = lambda _num_running: args.fixed_budget
    eb.warm_up((spec_eng, base_eng), warm, args.batch_size, args.temperature, args.max_new_tokens, stop)
    timeline = Timeline()
    with installed(timeline):
        per_call, count = eb.row_shape(args.batch_size, bench.min_samples, bench.queue)
        for r in range(args.rounds):  # both engines on the same new prompts, as engine_bench does
            calls = [pool.take(per_call) for _ in range(count)]
            plain = measure(args, base_eng, calls, stop, timeline, False)
            spec = measure(args, spec_eng, calls, stop, timeline, True)
            print(f"  [round {r + 1}/{args.rounds} done]", file=sys.stderr, flush=True)
    print_table(args, plain, spec)


if __name__ == "__main__":
    main()
