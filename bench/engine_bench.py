"""Engine speed: decode/verify step costs, and tokens/s with and without speculation.

Two modes, both printing tables whose ratios are measured in the same run:

* ``--mode steps`` needs no model file: a SmolLM2-135M-shaped model with random weights. It times
  one decode/verify step T(B, W) for eager torch attention, CUDA-graphed torch attention and
  CUDA-graphed Triton attention, prints the verify tax T(B, W) / T(B, 1), the attention kernels
  alone, a graph-replayed no-spec sampling loop against transformers' ``generate`` at the largest
  B, and the speedup bound TPF / tax for the TPF figures of the recorded traces.
* ``--mode engine`` runs ``RolloutEngine`` on the GRPO-style workload (reasoning-gym gsm_symbolic
  prompts through the chat template, temperature 0.6 and 1.0) with and without the drafter and
  prints tokens/s, TPF, speedup, verify tax and the bound TPF / tax next to the speedup. GRPO's
  n=8 holds at every B: a call is max(1, Q * B // 8) prompts of 8 samples (Q = ``--queue``,
  default 4) with at most B decoded at once (``max_running=B``), so the others wait for a slot
  and at B=1 a prompt's samples run one after another; ``--queue 1`` is one synchronous batch
  that drains from its first finished sample on (docs/gpu.md, session 69). ``--history``
  says what the drafter has seen of a timed prompt: ``cold`` (default) nothing, ``warm`` one
  earlier RL step on it. Each row is ``--repeats`` rounds of (plain call, spec call) on the
  same new prompts, interleaved so that drift hits both; its figures are over all rounds and
  it shows the spread of the per-round speedups and the seconds it took. Then come where a
  decode step's time went per row, the batch-aware budget's decisions per row (on CUDA), each
  round's speedup and decisions, and what the budget learned.

Examples::

    python bench/engine_bench.py --mode steps --device cuda
    python bench/engine_bench.py --mode engine --device cuda --reference
    python bench/engine_bench.py --mode engine --device cuda --history warm --repeats 5
    python bench/engine_bench.py --mode engine --device cpu --quick --random-weights
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from typing import Callable

import numpy as np
import torch

from rollout_spec.cli_args import (DefaultsParser, add_device_option, check_device, check_triton_backend, int_arg,
                                   numbers_arg, temperatures_arg)
from rollout_spec.config import DEFAULT_MODEL
from rollout_spec.engine import triton_attention
from rollout_spec.engine.cuda_graphs import GraphLadder, verify_input_specs
from rollout_spec.engine.kv_cache import KVCache
from rollout_spec.engine.model import ModelConfig, StepContext, Transformer

# DEFAULT_MODEL's shapes: what --random-weights builds
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
                    max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
TRACE_TPF = {"T=0.6 (trace, step 2)": 2.42, "T=1.0 (trace, step 1)": 1.30}  # shared/traces README


def random_model(device: torch.device, dtype: torch.dtype) -> tuple[Transformer, object]:
    """SmolLM2-135M's shapes with random weights: timing needs no checkpoint."""
    from transformers import LlamaConfig

    hf = LlamaConfig(**SMOLLM2_135M)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_hf(hf))
    model.tie_weights()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model.to(device=device, dtype=dtype).eval(), hf


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Mean seconds of ``fn()`` over ``iters`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


class StepBench:
    """One model, one static KV cache, and step inputs at a fixed context length."""

    def __init__(self, model: Transformer, max_batch: int, ctx: int, cache_len: int) -> None:
        c = model.config
        p = next(model.parameters())
        self.model, self.device, self.ctx = model, p.device, ctx
        self.scratch = max_batch  # padded rows of a graph write this slot only
        self.cache = KVCache(c.num_layers, max_batch + 1, c.num_kv_heads, cache_len, c.head_dim,
                             p.dtype, p.device)

    def inputs(self, batch: int, width: int) -> dict[str, torch.Tensor]:
        """A verify step: each row a chain of ``width`` nodes after ``ctx`` cached tokens."""
        dev = self.device
        pos = self.ctx + torch.arange(width, device=dev).expand(batch, width)
        return {"input_ids": torch.randint(0, 1000, (batch, width), device=dev),
                "positions": pos.contiguous(),
                "slot_ids": torch.arange(batch, device=dev),
                "ctx_lens": torch.full((batch,), self.ctx, device=dev),
                "tree_mask": torch.ones(batch, width, width, dtype=torch.bool, device=dev).tril()}

    def step(self, inp: dict[str, torch.Tensor], kv_limit: int | None = None) -> torch.Tensor:
        """One forward: logits of every new row (what verification reads)."""
        ctx = StepContext(self.cache, inp["slot_ids"], inp["ctx_lens"], inp["tree_mask"], kv_limit)
        return self.model.logits(self.model.hidden(inp["input_ids"], inp["positions"], ctx))

    def ladder(self, backend: str, batches: list[int], widths: list[int]) -> GraphLadder:
        """Capture every (B, W) with the given attention backend."""
        triton_attention.set_backend(backend)
        with torch.inference_mode():
            return GraphLadder(self.step, verify_input_specs(self.scratch), batches, widths, self.device)


def step_grid(bench: StepBench, batches: list[int], widths: list[int], iters: int) -> dict:
    """T(B, W) in seconds for eager torch, graphed torch and graphed triton attention."""
    out: dict[str, dict[tuple[int, int], float]] = {"eager-torch": {}}
    triton_attention.set_backend("torch")
    with torch.inference_mode():
        for b in batches:
            for w in widths:
                inp = bench.inputs(b, w)
                out["eager-torch"][(b, w)] = time_call(lambda: bench.step(inp, bench.ctx + w),
                                                       bench.device, max(3, iters // 4))
    backends = ["torch", "triton"] if triton_attention.is_available() else ["torch"]
    for backend in backends if bench.device.type == "cuda" else []:
        ladder = bench.ladder(backend, batches, widths)
        res = out[f"graph-{backend}"] = {}
        for b in batches:  # replays run outside inference mode too: the ladder's buffers allow it
            for w in widths:
                inp = bench.inputs(b, w)
                res[(b, w)] = time_call(lambda: ladder.run(inp), bench.device, iters)
        del ladder
        torch.cuda.empty_cache()
    triton_attention.set_backend("auto")
    return out


def print_step_table(grid: dict, batches: list[int], widths: list[int]) -> None:
    """Step times (ms), verify tax per backend, and the bound TPF / tax for the trace TPFs."""
    names = list(grid)
    best = names[-1]
    print(f"\n## Step time T(B, W) in ms (random SmolLM2-135M weights); tax = T(B,W)/T(B,1) [{best}]")
    head = "| B | W | " + " | ".join(names) + " | tax | " + " | ".join(f"bound {k}" for k in TRACE_TPF)
    print(head + " |\n|" + "---|" * head.count("|"))
    for b in batches:
        for w in widths:
            tax = grid[best][(b, w)] / grid[best][(b, 1)]
            times = " | ".join(f"{grid[n][(b, w)] * 1e3:.3f}" for n in names)
            # the trace TPFs were measured with a budget of 8 nodes, i.e. W = 9
            bounds = " | ".join(f"{tpf / tax:.2f}" if w == 9 else "-" for tpf in TRACE_TPF.values())
            print(f"| {b} | {w} | {times} | {tax:.2f} | {bounds} |")


def attention_table(bench: StepBench, batches: list[int], widths: list[int], iters: int) -> None:
    """One layer's attention alone: torch reference (reading only ctx+W) vs the Triton kernel."""
    if bench.device.type != "cuda" or not triton_attention.is_available():
        print("attention kernel table skipped: needs CUDA and triton", file=sys.stderr)
        return
    from rollout_spec.engine.attention import tree_attention

    c = bench.model.config
    k, v = bench.cache.k[0], bench.cache.v[0]
    print(f"\n## One layer's attention at ctx={bench.ctx}, us (Hq={c.num_heads}, Hkv={c.num_kv_heads})")
    print("| B | W | torch | triton | torch/triton | max abs err |\n|---|---|---|---|---|---|")
    for b in batches:
        for w in widths:
            inp = bench.inputs(b, w)
            q = torch.randn(b, c.num_heads, w, c.head_dim, device=bench.device, dtype=k.dtype)
            args = (q, k, v, inp["slot_ids"], inp["ctx_lens"], inp["tree_mask"], c.head_dim ** -0.5)
            triton_attention.set_backend("torch")
            ref = tree_attention(*args, kv_limit=bench.ctx + w)
            t_torch = time_call(lambda: tree_attention(*args, kv_limit=bench.ctx + w), bench.device, iters)
            got = triton_attention.tree_attention_triton(*args)
            t_tri = time_call(lambda: triton_attention.tree_attention_triton(*args), bench.device, iters)
            err = (got.float() - ref.float()).abs().max().item()
            print(f"| {b} | {w} | {t_torch * 1e6:.1f} | {t_tri * 1e6:.1f} | {t_torch / t_tri:.2f} | {err:.3g} |")
    triton_attention.set_backend("auto")


def graph_decode_tokens_per_s(bench: StepBench, batch: int, prompt_len: int, new_tokens: int) -> float:
    """No-spec sampling loop on the graph ladder: prefill, then ``new_tokens`` replayed decodes.

    A stand-in for the engine's no-spec path in ``--mode steps`` (no scheduler, no stop tokens).
    """
    dev, model = bench.device, bench.model
    ladder = bench.ladder("auto", [batch], [1])
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.inference_mode():
        sync(dev)
        t0 = time.perf_counter()
        ids = torch.randint(0, 1000, (batch, prompt_len), device=dev)
        ctx = StepContext(bench.cache, torch.arange(batch, device=dev),
                          torch.zeros(batch, dtype=torch.long, device=dev), None, prompt_len)
        pos = torch.arange(prompt_len, device=dev).expand(batch, -1)
        last = model.logits(model.hidden(ids, pos, ctx)[:, -1:])
        ctx_lens = torch.full((batch,), prompt_len, device=dev)
        mask = torch.ones(batch, 1, 1, dtype=torch.bool, device=dev)
        for _ in range(new_tokens):
            tok = torch.multinomial(torch.softmax(last[:, -1], -1), 1, generator=gen)
            last = ladder.run({"input_ids": tok, "positions": ctx_lens[:, None], "tree_mask": mask,
                               "slot_ids": torch.arange(batch, device=dev), "ctx_lens": ctx_lens})
            ctx_lens = ctx_lens + 1
        sync(dev)
    return batch * new_tokens / (time.perf_counter() - t0)


def hf_generate_tokens_per_s(hf_config: object, device: torch.device, dtype: torch.dtype,
                             batch: int, prompt_len: int, new_tokens: int) -> float:
    """transformers' ``generate`` (sampling, forced length) on the same random-weight shapes."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config).to(device=device, dtype=dtype).eval()
    ids = torch.randint(3, 1000, (batch, prompt_len), device=device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0,
              top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids[:, :8], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        sync(device)
    return batch * new_tokens / (time.perf_counter() - t0)


N_SAMPLES = 8  # GRPO's n: samples per prompt whatever the batch size
RANDOM_PROMPT_LEN = 128  # ids per prompt of the --random-weights workload
WARM_GROUP_BASE = 1 << 30  # group ids of the warm-up prompts, far from every timed prompt's
HISTORY = {"cold": "every timed prompt is new to the spec engine",
           "warm": "an untimed spec call + end_step on the same prompts before each timed one"}
Prompts = list[list[int]]


def generate_call(engine: object, prompts: Prompts, groups: list[int], temperature: float,
                  max_new: int, stop: tuple[int, ...] | None, max_running: int) -> list:
    """``engine.generate`` on the bench's workload: n=8 samples per prompt, ``max_running`` at once.

    GRPO's n is 8 at every batch size, so at B=1 a prompt's 8 samples run one after another.
    """
    from rollout_spec.config import SamplingParams

    params = SamplingParams(n=N_SAMPLES, temperature=temperature, max_new_tokens=max_new, seed=0,
                            stop_token_ids=stop)
    return engine.generate(prompts, params, group_ids=groups, max_running=max_running)


def run_generate(engine: object, prompts: Prompts, groups: list[int], temperature: float,
                 max_new: int, stop: tuple[int, ...] | None, max_running: int) -> dict:
    """One timed ``generate_call``: seconds, samples, tokens, forwards, drafted nodes, phase seconds."""
    before = dict(engine.phase_seconds)
    wait0 = engine._queue.wait_seconds
    sync(engine.device)
    t0 = time.perf_counter()
    outs = generate_call(engine, prompts, groups, temperature, max_new, stop, max_running)
    sync(engine.device)
    secs = time.perf_counter() - t0
    return {"secs": secs, "samples": len(outs), "tokens": sum(len(o.token_ids) for o in outs),
            "steps": sum(o.num_verify_steps for o in outs),
            "drafts": sum(o.num_draft_tokens for o in outs),
            "phases": {k: engine.phase_seconds[k] - before[k] for k in before},
            "wait": engine._queue.wait_seconds - wait0}


def summarise(runs: list[dict]) -> dict:
    """Figures of one or more timed ``generate`` calls taken together (sums, then ratios)."""
    total = {k: sum(r[k] for r in runs) for k in ("secs", "samples", "tokens", "steps", "drafts", "wait")}
    phases = {k: sum(r["phases"][k] for r in runs) for k in runs[0]["phases"]}
    decodes = max(phases.pop("steps"), 1)
    prefill = phases.pop("prefill")
    outside = total["secs"] - prefill - sum(phases.values())  # set-up, drafter settle, syncs
    steps = max(total["steps"], 1)
    return {"runs": runs, "prefill_ms": 1e3 * prefill, "outside_ms": 1e3 * outside,
            "secs": total["secs"], "samples": total["samples"], "tokens": total["tokens"],
            "tps": total["tokens"] / total["secs"], "tpf": total["tokens"] / steps,
            "width": 1 + total["drafts"] / steps,
            "ms": {k: 1e3 * v / decodes for k, v in phases.items()}, "decodes": decodes,
            "wait_ms": 1e3 * total["wait"] / decodes}


def row_shape(batch: int, min_samples: int, queue: int = 1) -> tuple[int, int]:
    """(prompts per call, calls per round) of the row at ``batch`` samples decoded at once.

    A call holds max(1, queue * B // 8) prompts of 8 samples, i.e. about ``queue`` times as many
    samples as run at once: the others wait for a slot, as in an RL step's rollout, so the
    batch stays full until the tail instead of draining from the first finished sample on. A
    round makes as many calls (each on other prompts) as it takes to reach ``min_samples``
    samples, so at small B one prompt's length and luck do not decide the round.
    """
    per_call = max(1, queue * batch // N_SAMPLES)
    return per_call, max(1, -(-min_samples // (N_SAMPLES * per_call)))


def prompts_needed(args: argparse.Namespace) -> int:
    """Timed prompts of the whole run: every call of every round and row, and each profiled call,
    gets new ones."""
    per_temp = 0
    for b in args.batch_sizes:
        per_call, calls = row_shape(b, args.min_samples, args.queue)
        per_temp += args.repeats * calls * per_call
    return len(args.temperatures) * per_temp + sum(row_shape(b, 1)[0] for b in args.profile)


class PromptPool:
    """The timed prompts, each handed out once, with its pool index as its group id.

    Handing each out once is what ``--history cold`` rests on: no timed prompt reached the
    speculative engine before its own call (the warm-up prompts are a separate list).
    """

    def __init__(self, prompts: Prompts) -> None:
        self.prompts, self.used = prompts, 0

    def take(self, count: int) -> tuple[Prompts, list[int]]:
        """The next ``count`` unused prompts and their group ids."""
        if self.used + count > len(self.prompts):
            raise RuntimeError(f"prompt pool exhausted: {count} wanted, {len(self.prompts) - self.used} left")
        ids = list(range(self.used, self.used + count))
        self.used += count
        return [self.prompts[i] for i in ids], ids


def gsm_prompts(tokenizer: object, count: int) -> Prompts:
    """``count`` distinct gsm_symbolic chat prompts (reasoning-gym, seed 0)."""
    from rollout_spec.workloads import Workload

    drawn = Workload("gsm_symbolic", tokenizer, num_prompts=count + count // 8 + 8, seed=0).prompts
    unique = list(dict.fromkeys(tuple(p.prompt_ids) for p in drawn))  # a repeat would be seen twice
    if len(unique) < count:
        raise RuntimeError(f"gsm_symbolic gave {len(unique)} distinct prompts, {count} needed")
    return [list(p) for p in unique[:count]]


def load_tokenizer(ap: argparse.ArgumentParser, model: str) -> object:
    """The checkpoint's tokenizer alone, as ``RolloutEngine.from_pretrained`` will load it: the
    prompts are drawn and checked before any engine (weights, CUDA graphs) is built."""
    from rollout_spec.engine import weights

    try:
        model_dir = weights.resolve_model_dir(model)
    except (ValueError, ModuleNotFoundError) as err:
        ap.error(f"--model {model}: {err}")
    tokenizer = weights.load_tokenizer(model_dir)
    if tokenizer is None:
        ap.error(f"--model {model}: {model_dir} has no tokenizer ({' or '.join(weights.TOKENIZER_FILES)}), "
                 f"which the gsm_symbolic prompts need (or use --random-weights)")
    return tokenizer


def draw_prompts(args: argparse.Namespace, tokenizer: object) -> tuple[PromptPool, Prompts, tuple | None]:
    """The timed pool, the warm-up prompts and the stop tokens of the workload.

    ``--random-weights``: random prompts of ``RANDOM_PROMPT_LEN`` ids of SmolLM2's vocabulary (below
    20000), no stop tokens (every sample runs to max_new_tokens); otherwise gsm_symbolic chat
    prompts through ``tokenizer``. The warm-up prompts are not in the timed pool, so warming up
    never shows the drafter a timed one.
    """
    timed, warm = prompts_needed(args), max(1, max(args.batch_sizes) // N_SAMPLES)
    if args.random_weights:
        gen = torch.Generator().manual_seed(0)
        hi = min(20000, SMOLLM2_135M["vocab_size"])
        prompts = torch.randint(3, hi, (timed + warm, RANDOM_PROMPT_LEN), generator=gen).tolist()
        return PromptPool(prompts[:timed]), prompts[timed:], ()
    prompts = gsm_prompts(tokenizer, timed + warm)
    return PromptPool(prompts[:timed]), prompts[timed:], None


def checked_workload(ap: argparse.ArgumentParser,
                     args: argparse.Namespace) -> tuple[PromptPool, Prompts, tuple | None]:
    """``draw_prompts`` with the checkpoint's tokenizer loaded alone, then ``check_prompts``: a
    workload that does not fit ``--max-model-len`` is refused before any engine is built."""
    tokenizer = None if args.random_weights else load_tokenizer(ap, args.model)
    pool, warm, stop = draw_prompts(args, tokenizer)
    check_prompts(ap, args, pool, warm)
    return pool, warm, stop


def build_engines(args: argparse.Namespace) -> tuple[object, object]:
    """Speculative and plain engines sharing one model: SmolLM2-135M shapes with random weights
    (``--random-weights``) or the named checkpoint (the slow part: weights, graphs, budget timing)."""
    from rollout_spec.config import SpecConfig
    from rollout_spec.engine.engine import RolloutEngine

    max_b, dev = max(args.batch_sizes), torch.device(args.device)
    kw = dict(num_slots=max_b, max_model_len=args.max_model_len, max_draft_tokens=args.draft_tokens,
              verify_backend=args.verify_backend, overlap_drafter=args.overlap_drafter)
    spec = SpecConfig(num_draft_tokens=args.draft_tokens)
    if args.random_weights:
        model, _ = random_model(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
        spec_eng = RolloutEngine(model, None, spec, **kw)
    else:
        spec_eng = RolloutEngine.from_pretrained(args.model, device=dev, spec=spec, **kw)
    base_eng = RolloutEngine(spec_eng.model, spec_eng.tokenizer, None,
                             eos_token_ids=spec_eng.eos_token_ids, **kw)
    return spec_eng, base_eng


def warm_up(engines: tuple, prompts: Prompts, batch: int, temperature: float, max_new: int,
            stop: tuple | None) -> None:
    """A short untimed call per engine at this batch size and temperature.

    Triton kernels compile on the first call with new shape classes (seconds each); without
    this, whichever engine meets a shape first pays for the compile inside its timed run.
    Group ids far from the timed ones keep the warm-up out of the timed prompts' group scope.
    """
    group = prompts[: max(1, batch // N_SAMPLES)]
    ids = [WARM_GROUP_BASE + i for i in range(len(group))]
    for eng in engines:
        generate_call(eng, group, ids, temperature, min(16, max_new), stop, batch)


def measure_round(args: argparse.Namespace, engines: tuple, pool: PromptPool, stop: tuple | None,
                  temperature: float, batch: int) -> tuple[list[dict], list[dict]]:
    """One round of a row: per call, the plain engine then the speculative one on new prompts.

    Every timed spec call is an RL step (``end_step`` after it). ``--history warm`` puts an
    untimed spec call on the same prompts and group ids, and its ``end_step``, before it, so the
    timed call is those prompts' second RL step; ``cold`` leaves it their first.
    """
    spec_eng, base_eng = engines
    per_call, calls = row_shape(batch, args.min_samples, args.queue)
    bases, specs = [], []
    for _ in range(calls):
        group, ids = pool.take(per_call)
        call = (group, ids, temperature, args.max_new_tokens, stop, batch)
        bases.append(run_generate(base_eng, *call))
        if args.history == "warm":
            generate_call(spec_eng, *call)
            spec_eng.end_step()
        specs.append(run_generate(spec_eng, *call))
        spec_eng.end_step()
    return bases, specs


def measure_row(args: argparse.Namespace, engines: tuple, pool: PromptPool, warm: Prompts,
                stop: tuple | None, temperature: float, batch: int) -> dict:
    """A row: warm-up, then ``--repeats`` rounds; figures over all rounds, the budget's decisions
    in the row (warm-up included) and per round its speedup and decisions (all empty without a
    batch-aware budget)."""
    t0 = time.perf_counter()
    decisions = getattr(engines[0].draft_budget, "decisions", Counter())
    start = Counter(decisions)
    warm_up(engines, warm, batch, temperature, args.max_new_tokens, stop)
    rounds, round_decisions = [], []
    for _ in range(args.repeats):
        before = Counter(decisions)
        rounds.append(measure_round(args, engines, pool, stop, temperature, batch))
        round_decisions.append(Counter(decisions) - before)
    per_round = [summarise(s)["tps"] / summarise(b)["tps"] for b, s in rounds]
    return {"base": summarise([r for b, _ in rounds for r in b]),
            "spec": summarise([r for _, s in rounds for r in s]),
            "decisions": Counter(decisions) - start, "speedups": per_round,
            "round_decisions": round_decisions, "secs": time.perf_counter() - t0}


def print_engine_header(args: argparse.Namespace) -> None:
    """The engine table's title (workload, history mode, rounds) and column names."""
    src = "random weights, random prompts" if args.random_weights else "gsm_symbolic chat prompts"
    print(f"\n## Engine tokens/s, speculation on vs off ({src}; n={N_SAMPLES} samples per prompt at "
          f"every B, max(1, {args.queue}B/8) prompts per call, max_running=B; history={args.history}: "
          f"{HISTORY[args.history]}; {args.repeats} rounds of (plain call, spec call) per row, "
          f">= {args.min_samples} samples per round; same prompts and seeds)")
    print("| T | B | no-spec tok/s | spec tok/s | TPF | mean W | tax | bound TPF/tax | speedup "
          "| speedup/bound | round speedups min-max | samples | row s |\n" + "|---" * 13 + "|")


def engine_rows(args: argparse.Namespace) -> None:
    """Speculation on vs off, same engine weights, prompts and seeds; one row per (T, B)."""
    pool, warm, stop = checked_workload(build_parser(), args)
    t0 = time.perf_counter()
    spec_eng, base_eng = build_engines(args)
    print(f"engines built in {time.perf_counter() - t0:.1f}s (graph capture and budget timing included)",
          file=sys.stderr)
    budget = spec_eng.draft_budget
    if hasattr(budget, "cost"):  # the engine's own batch-aware budget: show what it measured
        top = args.draft_tokens + 1
        print(f"budget: B -> (tax at W=9, at W={top}, draft nodes picked at the prior acceptance) "
              + ", ".join(f"{b}: ({budget.cost.verify_tax(b, 9):.2f}, {budget.cost.verify_tax(b, top):.2f}, "
                          f"{budget.best(b)})" for b in args.batch_sizes))
    bench = StepBench(spec_eng.model, max(args.batch_sizes), args.ctx, args.ctx + args.draft_tokens + 16)
    grid = step_grid(bench, args.batch_sizes, tax_widths(args.draft_tokens), iters=10)
    cost = grid[list(grid)[-1]]
    del bench
    print_engine_header(args)
    phase_rows, decision_rows, round_rows = [], [], []
    counts_decisions = hasattr(spec_eng.draft_budget, "decisions")  # the batch-aware budget does
    for temp in args.temperatures:
        for b in args.batch_sizes:
            row = measure_row(args, (spec_eng, base_eng), pool, warm, stop, temp, b)
            if counts_decisions:
                decision_rows.append((temp, b, row["decisions"]))
            base, spec = row["base"], row["spec"]
            tax = interp_tax(cost, b, spec["width"])
            bound, speedup = spec["tpf"] / tax, spec["tps"] / base["tps"]
            print(f"| {temp} | {b} | {base['tps']:.0f} | {spec['tps']:.0f} | {spec['tpf']:.2f} | "
                  f"{spec['width']:.2f} | {tax:.2f} | {bound:.2f} | {speedup:.2f} | {speedup / bound:.2f} | "
                  f"{min(row['speedups']):.2f}-{max(row['speedups']):.2f} | {base['samples']} | "
                  f"{row['secs']:.1f} |", flush=True)
            phase_rows.append((temp, b, base, spec, cost[(b, 1)]))
            round_rows.append((temp, b, row["speedups"], row["round_decisions"]))
    print_phase_table(phase_rows)
    print_decision_table(decision_rows)
    print_round_table(round_rows)
    print_budget_state(spec_eng.draft_budget, args.batch_sizes, spec_eng.shadow_rounds)
    for b in args.profile:
        profile_generate(args, spec_eng, pool, stop, b)
    if args.reference:
        b, dev = max(args.batch_sizes), torch.device(args.device)
        theirs = hf_generate_tokens_per_s(spec_eng.model.config.hf_config, dev, spec_eng.runner.dtype,
                                          b, 128, args.max_new_tokens)
        print(f"\ntransformers generate, B={b}, prompt 128, {args.max_new_tokens} new: {theirs:.0f} tok/s")
    print(f"whole engine run: {time.perf_counter() - t0:.0f}s", file=sys.stderr)


def print_phase_table(rows: list) -> None:
    """Where a decode step's wall time goes (ms per step), plain engine vs speculative engine.

    propose = budget + drafter proposal (including waiting for the drafter's queued bookkeeping,
    shown separately as wait); forward+verify = tree inputs, graphed forward, LM head and
    verification (it ends on the host sync); commit = KV moves, token appends, queueing the
    drafter's extend. GPU(B,1) is the grid's decode step, for scale. The last columns are whole
    ``generate`` figures (ms in all, not per step): prefill steps, and everything outside the
    steps (setting the call up, handing the drafter its last tokens, ...).
    """
    print("\n## Decode step by phase, ms per step (plain engine / speculative engine)")
    print("| T | B | GPU(B,1) | plain: fwd+verify | commit | total | spec: propose | wait | fwd+verify "
          "| commit | total | steps plain/spec | prefill ms plain/spec | outside ms plain/spec |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for temp, b, base, spec, gpu in rows:
        pm, sm = base["ms"], spec["ms"]
        print(f"| {temp} | {b} | {gpu * 1e3:.2f} | {pm['forward_verify']:.2f} | {pm['commit']:.2f} | "
              f"{sum(pm.values()):.2f} | {sm['propose']:.2f} | {spec['wait_ms']:.2f} | "
              f"{sm['forward_verify']:.2f} | {sm['commit']:.2f} | {sum(sm.values()):.2f} | "
              f"{base['decodes']:.0f}/{spec['decodes']:.0f} | {base['prefill_ms']:.0f}/{spec['prefill_ms']:.0f} | "
              f"{base['outside_ms']:.0f}/{spec['outside_ms']:.0f} |")


DECISIONS = ("drafted", "vetoed", "model", "probe", "plain for the guard")  # DraftBudget.decisions' keys


def print_decision_table(rows: list[tuple[float, int, Counter]]) -> None:
    """The batch-aware budget's decode-step decisions by reason, per row (its warm-up included):
    where the steps of a row that did not draft came from (the model's pick of 0, a veto of the
    throughput guard, a plain step the guard asked for) and how many were probes."""
    if not rows:
        return
    print("\n## Budget decisions per row (one per budget call of the row's spec calls, warm-up included)")
    print("| T | B | " + " | ".join(DECISIONS) + " |\n" + "|---" * (2 + len(DECISIONS)) + "|")
    for temp, b, counts in rows:
        print(f"| {temp} | {b} | " + " | ".join(str(counts[k]) for k in DECISIONS) + " |")


def print_round_table(rows: list[tuple[float, int, list[float], list[Counter]]]) -> None:
    """Each round's speedup with the budget's decisions in it (warm-up excluded): whether a
    row's spread comes from its first rounds, while the budget learns, or from noise."""
    print("\n## Rounds: speedup and budget decisions per round")
    print("| T | B | round | speedup | " + " | ".join(DECISIONS) + " |\n" + "|---" * (4 + len(DECISIONS)) + "|")
    for temp, b, speedups, counts in rows:
        for i, (x, c) in enumerate(zip(speedups, counts)):
            print(f"| {temp} | {b} | {i + 1} | {x:.2f} | " + " | ".join(str(c[k]) for k in DECISIONS) + " |")


def print_budget_state(budget: object, batches: list[int], shadow_rounds: int) -> None:
    """What the engine's budget learned: tokens per request per step by draft size, residual step
    time per path, picks."""
    host = getattr(budget, "host", None)
    if host is None:
        return
    gains = ", ".join(f"{k}: {budget.tracker.expected_tokens(k):.2f}" for k in budget.candidates[1:])
    print(f"\n## Budget state after the runs: E(k) by draft size [{gains}], drafter fill "
          f"{budget.fill:.2f}, steps observed plain/spec {host.counts()}, shadow rounds on plain "
          f"steps {shadow_rounds}\ndecisions: {dict(budget.decisions.most_common())}, of them "
          f"priced by the call's end (nothing waiting): {budget.drained_asks}")
    print("| B | GPU k=0 ms | residual plain ms | residual spec ms (k=4) | pick now | guard us/token "
          "plain / drafting |\n|---|---|---|---|---|---|")
    guard = getattr(budget, "guard", None)
    for b in batches:
        measured = [guard.seconds_per_token(d, b) if guard is not None else None for d in (False, True)]
        shown = " / ".join("-" if m is None else f"{m * 1e6:.1f}" for m in measured)
        print(f"| {b} | {budget.cost.step_time(b, 1) * 1e3:.2f} | {host.residual(False, b, 0) * 1e3:.2f} | "
              f"{host.residual(True, b, budget.fill * b * 4) * 1e3:.2f} | {budget.best(b)} | {shown} |")


def profile_generate(args: argparse.Namespace, engine: object, pool: PromptPool,
                     stop: tuple | None, batch: int) -> None:
    """cProfile one speculative call at ``batch`` samples at once (new prompts): the host's hot
    functions."""
    import cProfile
    import pstats

    group, ids = pool.take(row_shape(batch, 1)[0])
    prof = cProfile.Profile()
    prof.enable()
    run_generate(engine, group, ids, args.temperatures[0], args.max_new_tokens, stop, batch)
    prof.disable()
    print(f"\n## cProfile of one speculative generate, B={batch}, T={args.temperatures[0]} (tottime)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def tax_widths(max_draft: int) -> list[int]:
    """Step widths timed for the verify tax: decode, then 1 + every power-of-two draft size up
    to ``max_draft`` and ``max_draft`` itself (the budget's candidates)."""
    sizes = {1 << i for i in range(11) if (1 << i) <= max_draft} | {max_draft}
    return [1] + sorted(k + 1 for k in sizes if k > 0)


def interp_tax(cost: dict[tuple[int, int], float], batch: int, width: float) -> float:
    """Verify tax at a (possibly fractional) mean width, interpolated on the measured grid."""
    widths = sorted({w for (b, w) in cost if b == batch})
    times = [cost[(batch, w)] for w in widths]
    return float(np.interp(width, widths, times) / cost[(batch, 1)])


STEP_WIDTHS = (1, 2, 3, 5, 9)  # steps mode's widths W of T(B, W)
STEPS_PROMPT_LEN = 128  # steps mode's decode loops: random prompts of this length


def steps_mode(args: argparse.Namespace) -> None:
    """Random-weight step timings, attention kernels, and the no-spec loop vs transformers."""
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, hf = random_model(dev, dtype)
    widths, prompt = list(STEP_WIDTHS), STEPS_PROMPT_LEN
    cache_len = max(args.ctx + max(widths), prompt + args.max_new_tokens) + 16
    bench = StepBench(model, max(args.batch_sizes), args.ctx, cache_len)
    grid = step_grid(bench, args.batch_sizes, widths, iters=5 if args.quick else 20)
    print_step_table(grid, args.batch_sizes, widths)
    attention_table(bench, args.batch_sizes, widths, iters=5 if args.quick else 50)
    b = max(args.batch_sizes)
    ours = graph_decode_tokens_per_s(bench, b, prompt, args.max_new_tokens)
    del bench
    theirs = hf_generate_tokens_per_s(hf, dev, dtype, b, prompt, args.max_new_tokens)
    print(f"\n## No-spec sampling at B={b}, prompt {prompt}, {args.max_new_tokens} new tokens")
    print(f"| graph decode loop tok/s | transformers generate tok/s | ratio |\n|---|---|---|\n"
          f"| {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f} |")


def build_parser() -> argparse.ArgumentParser:
    """Every option; numbers are range-checked as they are parsed."""
    ap = DefaultsParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("steps", "engine"), default="engine")
    add_device_option(ap)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a checkpoint (not with --random-weights)")
    ap.add_argument("--batch-sizes", type=numbers_arg("--batch-sizes", int, 1, 4096),
                    default="1,8,32,64,128,256",
                    help="samples decoded at once (engine mode: max_running; n=8 samples per prompt)")
    ap.add_argument("--max-new-tokens", type=int_arg("--max-new-tokens", 1, 1 << 16), default=256)
    ap.add_argument("--max-model-len", type=int_arg("--max-model-len", 2, 1 << 20), default=None,
                    help="engine mode: most tokens (prompt + output) of one request (default: 1024; steps "
                         "mode sizes its cache to --ctx and --max-new-tokens)")
    ap.add_argument("--ctx", type=int_arg("--ctx", 1, 1 << 20), default=384,
                    help="cached context of the timed steps")
    ap.add_argument("--temperatures", type=temperatures_arg("--temperatures"), default="0.6,1.0",
                    help="comma-separated; each 0 (greedy) or in [0.01, 100]")
    ap.add_argument("--history", choices=tuple(HISTORY), default="cold",
                    help="engine mode: " + "; ".join(f"{k} = {v}" for k, v in HISTORY.items()))
    ap.add_argument("--repeats", type=int_arg("--repeats", 1, 1000), default=3,
                    help="engine mode: rounds of (plain call, spec call) per row, interleaved")
    ap.add_argument("--queue", type=int_arg("--queue", 1, 64), default=4,
                    help="engine mode: samples per call as a multiple of B (the rest wait for a slot)")
    ap.add_argument("--min-samples", type=int_arg("--min-samples", 1, 1 << 20), default=16,
                    help="engine mode: a round makes calls on other prompts until it has this many samples")
    ap.add_argument("--random-weights", action="store_true",
                    help="engine mode without a checkpoint: SmolLM2-135M shapes, random prompts")
    ap.add_argument("--reference", action="store_true",
                    help="engine mode: also time transformers' generate at the largest B")
    ap.add_argument("--draft-tokens", type=int_arg("--draft-tokens", 1, 256), default=32,
                    help="engine mode: most draft nodes per request (SpecConfig.num_draft_tokens); "
                         "the batch-aware budget picks a power of two below it, or it, at each step")
    ap.add_argument("--verify-backend", default="auto", choices=("auto", "torch", "triton"))
    ap.add_argument("--overlap-drafter", choices=("auto", "on", "off"), default="auto",
                    help="engine mode: the drafter on a worker thread (auto: on for CUDA)")
    ap.add_argument("--profile", type=numbers_arg("--profile", int, 1, 4096), default=[],
                    help="engine mode: cProfile one spec generate at these B (at most the largest "
                         "--batch-sizes value: the engines have that many slots)")
    ap.add_argument("--quick", action="store_true",
                    help="defaults for a CPU smoke run: B in {1, 8}, 8 new tokens, ctx 64, 2 rounds, "
                         ">= 8 samples per round (flags given explicitly still win)")
    return ap


def check_length(ap: argparse.ArgumentParser, prompt_len: int, max_new: int, max_model_len: int,
                 what: str = "prompt length") -> None:
    """Refuse a prompt plus ``--max-new-tokens`` longer than ``--max-model-len``: the engine would
    cut every sample short (or make none) instead of generating the tokens asked for."""
    if prompt_len + max_new > max_model_len:
        ap.error(f"--max-new-tokens {max_new}: {what} {prompt_len} + {max_new} new tokens exceeds "
                 f"--max-model-len {max_model_len} (raise it to at least {prompt_len + max_new})")


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What parsing alone cannot see, refused before any model is built: the device, the Triton
    backend (installed, and on CUDA), --profile and --max-model-len outside engine mode, --profile
    against the engines' slots, --model with --random-weights or in steps mode (neither loads a
    checkpoint), the random-weight prompts' length and the random model's positions
    (``check_random_positions``; the checkpoint's prompts are checked once drawn with its tokenizer
    alone, ``checked_workload``). An unset --max-model-len becomes 1024."""
    if args.random_weights and args.model != DEFAULT_MODEL:
        ap.error(f"--model {args.model}: --random-weights builds {DEFAULT_MODEL}'s shapes and loads no "
                 f"checkpoint; give one of the two")
    if args.mode == "steps" and args.model != DEFAULT_MODEL:
        ap.error(f"--model {args.model}: --mode steps times {DEFAULT_MODEL}'s shapes with random weights "
                 f"and loads no checkpoint (leave out --model)")
    args.device = check_device(ap, args.device)
    if args.verify_backend == "triton":
        check_triton_backend(ap, "--verify-backend", args.device)
    if args.profile and args.mode != "engine":
        ap.error("--profile is an engine-mode option (add --mode engine)")
    if args.max_model_len is not None and args.mode != "engine":
        ap.error("--max-model-len is an engine-mode option (add --mode engine): steps mode sizes its "
                 "cache to --ctx and --max-new-tokens")
    if args.max_model_len is None:
        args.max_model_len = 1024
    too_big = [b for b in args.profile if b > max(args.batch_sizes)]
    if too_big:
        ap.error(f"every --profile value must be in [1, {max(args.batch_sizes)}] (the largest --batch-sizes "
                 f"value: the engines' slots), got {too_big[0]}")
    if args.mode == "engine" and args.random_weights:
        limit = SMOLLM2_135M["max_position_embeddings"]
        if args.max_model_len > limit:
            ap.error(f"--max-model-len must be in [2, {limit}] with --random-weights, got {args.max_model_len}")
        check_length(ap, RANDOM_PROMPT_LEN, args.max_new_tokens, args.max_model_len)
    check_random_positions(ap, args)


def check_random_positions(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse steps the random-weight model (steps mode; engine mode with --random-weights) would
    run past SmolLM2-135M's positions: the step grid's --ctx cached tokens and its widest step
    (steps mode's widest W, else --draft-tokens + 1), and steps mode's decode loops of
    --max-new-tokens after a prompt. The model would run there without a word, on a KV cache
    sized for them (at --ctx 1048576, 24 GB a row in bfloat16)."""
    if args.mode == "engine" and not args.random_weights:
        return  # a checkpoint's positions are its own
    limit = SMOLLM2_135M["max_position_embeddings"]
    widest = max(STEP_WIDTHS) if args.mode == "steps" else args.draft_tokens + 1
    if args.ctx + widest > limit:
        ap.error(f"--ctx {args.ctx}: the step grid's {args.ctx} cached + {widest} new tokens exceed the random "
                 f"model's {limit} positions (--ctx must be at most {limit - widest})")
    if args.mode == "steps" and STEPS_PROMPT_LEN + args.max_new_tokens > limit:
        ap.error(f"--max-new-tokens {args.max_new_tokens}: the decode loops' prompt {STEPS_PROMPT_LEN} + "
                 f"{args.max_new_tokens} new tokens exceed the random model's {limit} positions "
                 f"(--max-new-tokens must be at most {limit - STEPS_PROMPT_LEN} in steps mode)")


def check_prompts(ap: argparse.ArgumentParser, args: argparse.Namespace, pool: "PromptPool",
                  warm: Prompts) -> None:
    """Refuse a workload whose longest prompt plus ``--max-new-tokens`` exceeds ``--max-model-len``
    (before any timed call)."""
    longest = max(len(p) for p in pool.prompts + warm)
    check_length(ap, longest, args.max_new_tokens, args.max_model_len, "longest prompt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; a bad value exits with a message naming its flag and range."""
    ap = build_parser()
    if ap.parse_known_args(argv)[0].quick:
        ap.set_defaults(batch_sizes="1,8", max_new_tokens=8, ctx=64, repeats=2, min_samples=8, queue=1)
    args = ap.parse_args(argv)
    check_args(ap, args)
    args.overlap_drafter = {"auto": None, "on": True, "off": False}[args.overlap_drafter]
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    print(f"device={args.device} torch={torch.__version__} triton={triton_attention.is_available()} "
          f"verify_backend={args.verify_backend} overlap_drafter={args.overlap_drafter}"
          + (f" gpu={torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""))
    (steps_mode if args.mode == "steps" else engine_rows)(args)


if __name__ == "__main__":
    main()
