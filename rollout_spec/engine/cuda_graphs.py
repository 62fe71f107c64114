"""CUDA graphs for the decode and verify steps: a ladder of (batch, width) buckets.

A step of the engine is a fixed-shape forward over a padded (B, W) batch. Launching its few
hundred small kernels one by one costs more than the arithmetic at small batch sizes, so each
bucket of the ladder is captured once and replayed. All buckets share one memory pool (captured
largest first, so the smaller ones fit inside what the largest reserved). A step of size (b, w)
replays the smallest bucket with B >= b and W >= w; its inputs are copied into the bucket's
static buffers and the padding is filled with each input's pad value. A bucket's static inputs
are views of one device buffer, so ``load`` can write a step's host arrays, padding included,
with a single host-to-device copy (the per-input copies and fills of ``run`` cost the engine
0.1-0.2 ms of host time per step on the H100). The prefill has a ladder of its own over (prompts,
padded prompt length).
"""

from __future__ import annotations

import bisect
import gc
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from rollout_spec.config import check_int
from rollout_spec.tree import byte_spans

StepFn = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class InputSpec:
    """How one step input is laid out: dim 0 is the batch; ``width_dims`` are sized by W.

    ``trailing`` is the shape after the batch dim with every width dim given as 1 (it is
    replaced by the bucket's W). ``pad_value`` fills padded rows and columns: e.g. a scratch KV
    slot for slot ids, so padded rows never write into a live request's cache.
    """

    name: str
    trailing: tuple[int, ...]
    dtype: torch.dtype
    width_dims: tuple[int, ...] = ()
    pad_value: float | int | bool = 0

    def shape(self, batch: int, width: int) -> tuple[int, ...]:
        """Full shape of this input for a bucket."""
        dims = list(self.trailing)
        for d in self.width_dims:
            dims[d - 1] = width
        return (batch, *dims)


def verify_input_specs(scratch_slot: int) -> list[InputSpec]:
    """The engine's step inputs: ids/positions [B, W], slot ids and context lengths [B], tree mask.

    Padded rows write their K/V into ``scratch_slot`` (owned by no request) and see nothing.
    """
    return [InputSpec("input_ids", (1,), torch.int64, (1,)),
            InputSpec("positions", (1,), torch.int64, (1,)),
            InputSpec("slot_ids", (), torch.int64, (), scratch_slot),
            InputSpec("ctx_lens", (), torch.int64),
            InputSpec("tree_mask", (1, 1), torch.bool, (1, 2), False)]


def prefill_input_specs(scratch_slot: int) -> list[InputSpec]:
    """The prefill's inputs: ids/positions [G, T], slot ids, zero context lengths and the index of
    each prompt's last token [G]. Padded prompts write their K/V into ``scratch_slot``."""
    return [InputSpec("input_ids", (1,), torch.int64, (1,)),
            InputSpec("positions", (1,), torch.int64, (1,)),
            InputSpec("slot_ids", (), torch.int64, (), scratch_slot),
            InputSpec("ctx_lens", (), torch.int64),
            InputSpec("last", (), torch.int64)]


def prefill_ladder(max_groups: int, max_len: int) -> tuple[list[int], list[int]]:
    """Prefill buckets: prompts per prefill in powers of two up to 32, lengths 128, 256, 512
    (the last one cut to the cache length when that is shorter; prompts per prefill capped by
    the engine's slots). Longer or larger prefills run eagerly:
    they are rare, and their GPU time dwarfs the launch overhead a graph saves.

    Lengths are coarse because every bucket is captured at engine start (~0.1 s each on the H100)
    and a prefill of a few prompts is launch-bound: padding 4 prompts from 257 to 512 tokens
    costs little GPU time. (Captured lazily instead, on first use, the captures landed inside
    timed rollouts and were most of the prefill time of short ones.)"""
    groups = [g for g in (1, 2, 4, 8, 16, 32) if g <= max_groups] or [1]
    lengths = [t for t in (128, 256) if t < max_len] + [min(max_len, 512)]
    return groups, lengths


def default_ladder(max_batch: int, max_width: int) -> tuple[list[int], list[int]]:
    """Bucket sizes: dense where padding would cost most (small B, small W), coarse above."""
    batches = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256) if b < max_batch]
    widths = [w for w in (1, 2, 3, 4, 5, 7, 9, 13, 17) if w < max_width]
    return batches + [max_batch], widths + [max_width]


def check_ladder(field: str, values: Sequence[int]) -> tuple[int, ...]:
    """``values`` sorted without repeats, each checked by ``config.check_int`` as ``field[i]``:
    a float such as 2.5 or a bool is a TypeError, not a size truncated or read as 1.

    Raises:
        ValueError: no values, or a value below 1.
        TypeError: a value that is no integer (a bool included).
    """
    values = list(values)
    if not values:
        raise ValueError(f"{field} must be a non-empty list of positive ints, got []")
    return tuple(sorted({check_int(f"{field}[{i}]", v, 1) for i, v in enumerate(values)}))


class GraphLadder:
    """Captured (or eager) step functions for every (batch, width) bucket of a ladder.

    ``step_fn(inputs)`` must be shape-static given its inputs' shapes, allocate nothing that
    outlives the call except its output, and not sync the host. With ``eager=True`` (or on a
    non-CUDA device) nothing is captured: ``run`` pads to the same bucket and calls step_fn,
    which keeps the padding logic identical on CPU and in tests.
    """

    def __init__(self, step_fn: StepFn, specs: Sequence[InputSpec], batch_sizes: Sequence[int],
                 widths: Sequence[int], device: torch.device | str, eager: bool = False) -> None:
        self.step_fn = step_fn
        self.specs = tuple(specs)
        self.batch_sizes = check_ladder("batch_sizes", batch_sizes)
        self.widths = check_ladder("widths", widths)
        self.device = torch.device(device)
        self.eager = eager or self.device.type != "cuda"
        self.static: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # Leading rows of each bucket's inputs that may hold a step's data rather than pad values:
        # only those beyond the next step's rows need refilling (none while B stays put).
        self._dirty: dict[tuple[int, int], int] = {}
        self._arena: dict[tuple[int, int], torch.Tensor] = {}  # uint8 buffer under the static views
        self._staging: dict[tuple[int, int], tuple[torch.Tensor, dict[str, np.ndarray], object]] = {}
        with torch.inference_mode(False):  # normal tensors: callers may fill them in either mode
            for b in self.batch_sizes:
                for w in self.widths:
                    self._arena[(b, w)], self.static[(b, w)] = self._allocate(b, w, self.device)
        if not self.eager:
            self._capture_all()

    def _allocate(self, batch: int, width: int, device: torch.device | str,
                  pin: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One uint8 buffer holding every input of a bucket (16-byte aligned, pad-filled) and
        the typed views of it, by input name."""
        shapes = [s.shape(batch, width) for s in self.specs]
        sizes = [int(np.prod(sh)) * torch.empty(0, dtype=s.dtype).element_size()
                 for s, sh in zip(self.specs, shapes)]
        spans, total = byte_spans(sizes)
        buf = torch.empty(total, dtype=torch.uint8, device=device, pin_memory=pin)
        views = {}
        for s, sh, (start, size) in zip(self.specs, shapes, spans):
            views[s.name] = buf[start : start + size].view(s.dtype).view(sh)
            views[s.name].fill_(s.pad_value)
        return buf, views

    def bucket(self, batch: int, width: int) -> tuple[int, int]:
        """The smallest captured (B, W) that holds a step of ``batch`` rows and ``width`` columns."""
        i = bisect.bisect_left(self.batch_sizes, batch)
        j = bisect.bisect_left(self.widths, width)
        if batch < 1 or width < 1 or i == len(self.batch_sizes) or j == len(self.widths):
            raise ValueError(f"step (batch={batch}, width={width}) is outside the ladder: batch must "
                             f"be in [1, {self.batch_sizes[-1]}], width in [1, {self.widths[-1]}]")
        return self.batch_sizes[i], self.widths[j]

    def fits(self, batch: int, width: int) -> bool:
        """Whether some bucket holds a step of this size."""
        return 1 <= batch <= self.batch_sizes[-1] and 1 <= width <= self.widths[-1]

    def _capture_all(self) -> None:
        # A garbage collection inside a capture may free an older ladder, whose CUDAGraph
        # destructor calls cudaGraphExecDestroy: illegal while capturing, it invalidates the
        # capture. So collect now and keep the collector off until every bucket is captured.
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_buckets()
        finally:
            if was_enabled:
                gc.enable()

    def _capture_buckets(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for key in sorted(self.static, reverse=True):  # largest first: it sizes the shared pool
            inputs = self.static[key]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up (lazy inits, autotune) outside the capture
                self.step_fn(inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self.step_fn(inputs)
            self.graphs[key] = graph
        torch.cuda.synchronize()

    def _fill(self, key: tuple[int, int], inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy the inputs into the bucket's static tensors; padding must hold pad values, not
        an earlier step's data: rows past this step's that an earlier step wrote are refilled,
        and a tensor narrower than the bucket in some other dim is refilled whole."""
        static, rows = self.static[key], None
        dirty = self._dirty.get(key, key[0])
        for spec in self.specs:
            if spec.name not in inputs:
                raise ValueError(f"step input {spec.name!r} is missing")
            src, dst = inputs[spec.name], static[spec.name]
            if src.dim() != dst.dim():
                raise ValueError(f"step input {spec.name!r} must have {dst.dim()} dims, got {src.dim()}")
            rows = src.shape[0] if rows is None else rows
            if src.shape[0] != rows:
                raise ValueError(f"step input {spec.name!r} has {src.shape[0]} rows, the others {rows}")
            if tuple(src.shape[1:]) != tuple(dst.shape[1:]):
                dst.fill_(spec.pad_value)
            elif dirty > rows:
                dst[rows:dirty].fill_(spec.pad_value)
            dst[tuple(slice(0, n) for n in src.shape)].copy_(src, non_blocking=True)
        self._dirty[key] = rows
        return static

    def load(self, key: tuple[int, int], host: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Write one step's host arrays into bucket ``key``'s static inputs with one copy.

        Each array holds the step's leading rows (and columns) of its input; the rest of the
        bucket gets the pad values. The arrays are packed into a pinned staging buffer of the
        bucket (reused once the previous copy from it has finished) and copied without a host
        sync. Returns the static views (valid until the bucket is written again).
        """
        if key not in self.static:
            raise ValueError(f"{key} is not a bucket of this ladder")
        pin = self.device.type == "cuda"
        if key not in self._staging:
            buf, views = self._allocate(*key, "cpu", pin=pin)
            self._staging[key] = (buf, {n: v.numpy() for n, v in views.items()},
                                  torch.cuda.Event() if pin else None)
        buf, views, done = self._staging[key]
        if done is not None:
            done.synchronize()  # the last copy from this buffer (long finished in the engine)
        rows = None
        for spec in self.specs:
            if spec.name not in host:
                raise ValueError(f"step input {spec.name!r} is missing")
            src, dst = host[spec.name], views[spec.name]
            if src.ndim != dst.ndim or any(n > m for n, m in zip(src.shape, dst.shape)):
                raise ValueError(f"step input {spec.name!r} of shape {src.shape} does not fit "
                                 f"the bucket's {dst.shape}")
            rows = src.shape[0] if rows is None else rows
            if src.shape[0] != rows:
                raise ValueError(f"step input {spec.name!r} has {src.shape[0]} rows, the others {rows}")
            if src.shape != dst.shape:
                dst.fill(spec.pad_value)
            dst[tuple(slice(0, n) for n in src.shape)] = src
        self._arena[key].copy_(buf, non_blocking=pin)
        if done is not None:
            done.record()
        self._dirty[key] = rows
        return self.static[key]

    def replay(self, key: tuple[int, int]) -> torch.Tensor:
        """Run bucket ``key`` on what its static inputs hold; its padded output (see ``run``)."""
        if self.eager:
            return self.step_fn(self.static[key])
        self.graphs[key].replay()
        return self.outputs[key]

    def run(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run one step: pad into the bucket, replay (or call eagerly), return the padded output.

        The output is the bucket's static tensor (a view into the shared pool): read or copy it
        before the next ``run``. Its first two dims are the bucket's (B, W); slice what you need.
        """
        first = self.specs[0]
        ref = inputs[first.name]
        batch = ref.shape[0]
        width = ref.shape[first.width_dims[0]] if first.width_dims else 1
        key = self.bucket(batch, width)
        self._fill(key, inputs)
        return self.replay(key)


def dummy_step_inputs(batch: int, width: int, scratch_slot: int, ctx_len: int,
                      device: torch.device) -> dict[str, torch.Tensor]:
    """Verify-shaped inputs whose every row writes only the scratch slot (safe to time anytime)."""
    return {"input_ids": torch.zeros(batch, width, dtype=torch.int64, device=device),
            "positions": (ctx_len + torch.arange(width, device=device)).expand(batch, width).contiguous(),
            "slot_ids": torch.full((batch,), scratch_slot, dtype=torch.int64, device=device),
            "ctx_lens": torch.full((batch,), ctx_len, dtype=torch.int64, device=device),
            "tree_mask": torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(
                batch, width, width).contiguous()}


def ladder_step_timer(ladder: GraphLadder, scratch_slot: int, ctx_len: int) -> Callable[[int, int], None]:
    """``step(B, W)`` running one replay of the ladder on scratch-slot inputs, for cost models."""
    cache: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def step(batch: int, width: int) -> None:
        """One replay at (batch, width); inputs are built once per shape."""
        key = (batch, width)
        if key not in cache:
            cache[key] = dummy_step_inputs(batch, width, scratch_slot, ctx_len, ladder.device)
        with torch.inference_mode():
            ladder.run(cache[key])

    return step
