"""Cost of tree-input building plus verification per step, next to the verify forward it serves.

For every batch size B and draft budget (nodes per request) it times, in one run:
  build   build_tree_inputs with the roots on the device, as the engine passed them until now
          (host index math, one pinned upload, two small kernels); ``build_np``: roots and
          positions as numpy arrays, as the engine's runner holds them (no kernel at all)
  verify  verify(logits, ..., tree=the forward's TreeInputs) for each sampling mode and backend:
          "torch" (the reference: torch row statistics, numpy walk, two round trips) and "auto"
          (on CUDA the fused Triton walk of verify_triton.py), fp32 logits [B + N, 49152] as the
          engine passes them; results read from ``.host``
  forward one forward of a SmolLM2-135M-shaped Llama (random weights, transformers, SDPA, bf16 on
          CUDA / fp32 on CPU) over the B x W tree tokens with a 4-D tree mask and a 512-token KV
          cache per request: an approximation of the engine's verify forward (its own model and
          attention kernel may be faster, which would raise the ratio). The eager forward is
          launch-bound and noisy (20-47 ms across H100 runs), so it reports the FASTEST
          repetition: the ratios are the least favourable ones.
Trees are random with exactly ``budget`` nodes (chains with random branching). Logits are
3 x N(0, 1), so drafts are almost always rejected and the fused walk reads one row per request;
``--deep`` raises every drafted token's logit at its parent row by 25 so the walk follows each
tree to a leaf (the most rows it can read). Times are medians (the forward: the fastest).
``(b+v)/fwd`` is (build_np + verify) over that forward; ``/step`` is the same cost over
``--step-ms`` (default 4.5 ms: the engine's own CUDA-graphed verify step at B=64, W=9, as
bench/engine_bench.py --mode steps measured it on an H100).
``--profile`` prints torch.profiler tables of build and of every verify variant instead, at each
(B, budget) of --batch-sizes x --budgets (default B=64, budget 8 only) with the same --context,
--deep, --modes and --backends, over --reps calls per table (default 10); it runs no forward
and has no ratio, so --step-ms with --profile is an argument error.

    python bench/verify_bench.py --device cuda        # about a minute on one H100
    python bench/verify_bench.py --device cpu         # B in {1, 64}, budgets {4, 8} by default
    python bench/verify_bench.py --device cuda --profile   # where the time goes at B=64, budget 8
    python bench/verify_bench.py --device cuda --profile --batch-sizes 256 --budgets 4,16
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from rollout_spec.cli_args import (DefaultsParser, add_device_option, check_device, check_triton_backend, float_arg,
                                   int_arg, names_arg, numbers_arg)
from rollout_spec.config import SamplingParams
from rollout_spec.tree import DraftBatch, TreeInputs, build_tree_inputs
from rollout_spec.verify import verify

VOCAB = 49152
MODES = {
    "t1.0": SamplingParams(temperature=1.0),
    "greedy": SamplingParams(temperature=0.0),
    "t0.7_k50_p0.9": SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
}


def random_trees(num_req: int, budget: int, rng: np.random.Generator) -> DraftBatch:
    """``budget`` nodes per request; each node extends the previous one with probability 0.6."""
    local = np.arange(budget)
    chain = rng.random((num_req, budget)) < 0.6
    anywhere = (rng.random((num_req, budget)) * (local + 1)).astype(np.int32) - 1
    parents = np.where(chain, local - 1, anywhere).astype(np.int32)
    return DraftBatch(
        offsets=(np.arange(num_req + 1) * budget).astype(np.int32),
        tokens=rng.integers(0, VOCAB, num_req * budget).astype(np.int32),
        parents=parents.reshape(-1),
        probs=np.ones(num_req * budget, np.float32),
    )


def median_ms(fn: Callable[[], object], device: torch.device, reps: int, warmup: int,
              stat: Callable[[list[float]], float] = statistics.median) -> float:
    """Median (or ``stat``) wall time of ``fn`` in milliseconds, the device drained before and
    after."""
    times = []
    for i in range(warmup + reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return stat(times)


def make_model(device: torch.device) -> torch.nn.Module:
    """SmolLM2-135M's shape with random weights (the timing does not depend on the values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, vocab_size=VOCAB,
                      tie_word_embeddings=True, max_position_embeddings=8192)
    cfg._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def forward_ms(model: torch.nn.Module, ti: TreeInputs, context: int, device: torch.device, reps: int,
               warmup: int) -> float:
    """Time one tree forward over ti's [B, W] tokens on top of a ``context``-token KV cache."""
    from transformers import DynamicCache

    cfg, dtype = model.config, model.dtype
    num_req, width = ti.input_ids.shape
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        kv = torch.randn(num_req, cfg.num_key_value_heads, context, head_dim, device=device,
                         dtype=dtype)
        cache.update(kv, kv.clone(), layer)
    seen = torch.ones(num_req, width, context, dtype=torch.bool, device=device)
    mask = torch.cat([seen, ti.tree_mask], dim=2)[:, None]  # [B, 1, W, context + W]

    def step() -> None:
        with torch.inference_mode():
            model(input_ids=ti.input_ids, position_ids=ti.positions,
                  attention_mask=mask, past_key_values=cache, use_cache=True)
        cache.crop(-width)  # drop the tree rows so every repetition sees `context` tokens

    return median_ms(step, device, reps, warmup, stat=min)


BACKENDS = ("torch", "auto", "triton")
MAX_POSITIONS = 8192  # the model's max_position_embeddings: context + W must fit
# (batch sizes, budgets, reps) where the flags are not given: --profile, else by device
DEFAULTS = {"profile": ([64], [8], 10), "cuda": ([1, 64, 256], [4, 8, 16], 20), "cpu": ([1, 64], [4, 8], 3)}
STEP_MS = 4.5  # --step-ms where not given: engine_bench.py --mode steps' verify step, B=64, W=9, H100


def build_parser() -> argparse.ArgumentParser:
    """Every option, each typed and range-checked as it is parsed."""
    ap = DefaultsParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_device_option(ap)
    ap.add_argument("--batch-sizes", type=numbers_arg("--batch-sizes", int, 1, 1024), default=None,
                    help="(default: 1,64,256 on CUDA, 1,64 elsewhere, 64 with --profile)")
    ap.add_argument("--budgets", type=numbers_arg("--budgets", int, 1, 256), default=None,
                    help="(default: 4,8,16 on CUDA, 4,8 elsewhere, 8 with --profile)")
    ap.add_argument("--modes", type=names_arg("--modes", tuple(MODES)), default=",".join(MODES),
                    help=f"subset of {','.join(MODES)}")
    ap.add_argument("--backends", type=names_arg("--backends", BACKENDS), default=None,
                    help="subset of torch,auto,triton (default: torch,auto on CUDA, torch elsewhere)")
    ap.add_argument("--context", type=int_arg("--context", 1, MAX_POSITIONS - 2), default=512,
                    help=f"cached tokens per request before the tree (context + budget + 1 <= {MAX_POSITIONS})")
    ap.add_argument("--reps", type=int_arg("--reps", 1, 100000), default=None,
                    help="timed repetitions; with --profile, profiled calls per table\n"
                         "(default: 20 on CUDA, 3 elsewhere, 10 with --profile)")
    ap.add_argument("--no-forward", action="store_true", help="skip the model forward")
    ap.add_argument("--deep", action="store_true",
                    help="logits that accept the drafts: the walk reads whole paths")
    ap.add_argument("--step-ms", type=float_arg("--step-ms", 0.0, 1e6, lo_open=True), default=None,
                    help=f"engine verify step to compare with (default: {STEP_MS}; not with --profile)")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler tables of build and verify instead, at each\n"
                         "--batch-sizes x --budgets point (default: B=64, budget 8 only)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options with the device's defaults filled in; what cannot run here is refused now."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.profile and args.step_ms is not None:
        ap.error(f"--step-ms {args.step_ms:g}: --profile prints profiler tables, with no /step ratio "
                 "(leave out --step-ms or --profile)")
    args.device = check_device(ap, args.device)
    gpu = args.device.startswith("cuda")
    if "triton" in (args.backends or ()):
        check_triton_backend(ap, "--backends", args.device)
    batch_sizes, budgets, reps = DEFAULTS["profile" if args.profile else "cuda" if gpu else "cpu"]
    args.batch_sizes = args.batch_sizes or batch_sizes
    args.budgets = args.budgets or budgets
    args.backends = args.backends or (["torch", "auto"] if gpu else ["torch"])
    args.reps = args.reps or reps
    args.step_ms = STEP_MS if args.step_ms is None else args.step_ms
    if args.context + max(args.budgets) + 1 > MAX_POSITIONS:
        ap.error(f"--context {args.context} + the largest --budgets value {max(args.budgets)} + 1 exceeds the "
                 f"model's {MAX_POSITIONS} positions")
    return args


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the grid, print one table (with --profile: profiler tables per point)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    warmup = 3 if gpu else 1
    variants = [(m, b) for m in args.modes for b in args.backends]
    if args.profile:
        for num_req in args.batch_sizes:
            for budget in args.budgets:
                profile(num_req, budget, variants, args.context, device, args.reps, args.deep)
        return
    model = None if args.no_forward else make_model(device)
    print_header(device, args.step_ms)
    for num_req in args.batch_sizes:
        for budget in args.budgets:
            for row in bench_point(num_req, budget, variants, model, args.context, device, args.reps,
                                   warmup, args.deep):
                print_row(row, args.step_ms)


def bench_point(num_req: int, budget: int, variants: list[tuple[str, str]], model: torch.nn.Module | None,
                context: int, device: torch.device, reps: int, warmup: int,
                deep: bool = False) -> list[dict[str, object]]:
    """Time build, verify per (mode, backend) and the forward for one (B, budget)."""
    rng = np.random.default_rng(num_req * 100 + budget)
    batch = random_trees(num_req, budget, rng)
    roots = torch.randint(0, VOCAB, (num_req,), device=device)
    root_pos = torch.full((num_req,), context, dtype=torch.int64, device=device)
    ti = build_tree_inputs(batch, roots, root_pos, device)
    build = median_ms(lambda: build_tree_inputs(batch, roots, root_pos, device), device, reps,
                      warmup)
    roots_np, pos_np = roots.cpu().numpy(), root_pos.cpu().numpy()
    build_np = median_ms(lambda: build_tree_inputs(batch, roots_np, pos_np, device), device,
                         reps, warmup)
    logits = step_logits(batch, device, deep)
    gen = torch.Generator(device=device).manual_seed(0)
    fwd = float("nan") if model is None else forward_ms(
        model, ti, context, device, max(1, reps // 2) if device.type == "cuda" else 1, warmup)
    out = []
    for mode, backend in variants:
        sp = MODES[mode]
        ver = median_ms(lambda: verify(logits, batch, sp, gen, tree=ti, backend=backend).host,
                        device, reps, warmup)
        out.append(dict(B=num_req, budget=budget, W=ti.width, mode=mode, backend=backend,
                        build=build, build_np=build_np, verify=ver, forward=fwd))
    return out


def step_logits(batch: DraftBatch, device: torch.device, deep: bool) -> torch.Tensor:
    """fp32 [B + N, V] logits, 3 x N(0, 1); ``deep``: each drafted token 25 higher at its
    parent's row, so verification accepts (nearly) every draft."""
    logits = 3 * torch.randn(batch.num_requests + batch.num_nodes, VOCAB, device=device)
    if deep:
        sizes = batch.sizes()
        root_row = np.repeat(batch.offsets[:-1] + np.arange(batch.num_requests), sizes)
        parent_row = torch.from_numpy(root_row + 1 + batch.parents).to(device)
        logits[parent_row, torch.from_numpy(batch.tokens).to(device).long()] += 25.0
    return logits


def print_header(device: torch.device, step_ms: float) -> None:
    """Device line and column titles (rows follow as they are measured)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    head = f"{'B':>4} {'budget':>6} {'W':>3} {'mode':>14} {'backend':>8} {'build ms':>9} " \
           f"{'build_np':>8} {'verify ms':>10} {'forward ms':>11} {'(b+v)/fwd':>10} " \
           f"{'/' + format(step_ms, 'g') + 'ms':>8}"
    print(head)
    print("-" * len(head), flush=True)


def print_row(r: dict, step_ms: float) -> None:
    """One (B, budget, mode, backend) line; ratios of build (numpy roots) + verify. Without a
    forward (``--no-forward``) its two cells read ``-``, not nan."""
    cost = r["build_np"] + r["verify"]
    timed = not math.isnan(r["forward"])
    forward = f"{r['forward']:>11.2f}" if timed else f"{'-':>11}"
    per_forward = f"{cost / r['forward'] * 100:>9.1f}%" if timed else f"{'-':>10}"
    print(f"{r['B']:>4} {r['budget']:>6} {r['W']:>3} {r['mode']:>14} {r['backend']:>8} "
          f"{r['build']:>9.3f} {r['build_np']:>8.3f} {r['verify']:>10.3f} "
          f"{forward} {per_forward} {cost / step_ms * 100:>7.1f}%", flush=True)


def profile(num_req: int, budget: int, variants: list[tuple[str, str]], context: int,
            device: torch.device, calls: int, deep: bool) -> None:
    """torch.profiler tables (``calls`` calls each) of build and of every verify variant at one
    (B, budget), inputs made as ``bench_point`` makes them: kernel launches, copies and
    synchronisations by name."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    batch = random_trees(num_req, budget, np.random.default_rng(num_req * 100 + budget))
    roots = torch.randint(0, VOCAB, (num_req,), device=device)
    pos = torch.full((num_req,), context, dtype=torch.int64, device=device)
    ti = build_tree_inputs(batch, roots, pos, device)
    logits = step_logits(batch, device, deep)
    gen = torch.Generator(device=device).manual_seed(0)
    roots_np, pos_np = roots.cpu().numpy(), pos.cpu().numpy()
    jobs = [("build", lambda: build_tree_inputs(batch, roots, pos, device)),
            ("build numpy roots", lambda: build_tree_inputs(batch, roots_np, pos_np, device))] + [
        (f"verify {m} {b}", lambda m=m, b=b: verify(logits, batch, MODES[m], gen, tree=ti,
                                                    backend=b).host) for m, b in variants]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, fn in jobs:
        for _ in range(3):
            fn()  # compile and warm up outside the trace
        with torch_profile(activities=acts) as prof:
            for _ in range(calls):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        print(f"== B={num_req}, budget {budget}: {name} ({calls} calls)")
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=48))


if __name__ == "__main__":
    main()
