"""Model runner: turns scheduled sequences into padded tensors, runs the forward, keeps the KV.

Two kinds of forward share one model: prefill (causal attention over the padded prompts,
``ctx_len = 0``) and verify (each request's root plus its draft nodes under the tree mask).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from rollout_spec.engine.cuda_graphs import (GraphLadder, check_ladder, prefill_input_specs,
                                             prefill_ladder, verify_input_specs)
from rollout_spec.engine.kv_cache import KVCache
from rollout_spec.engine.model import StepContext, Transformer
from rollout_spec.engine.sequence import Sequence
from rollout_spec.noise import NoiseKeys
from rollout_spec.tree import DraftBatch, TreeInputs, build_tree_inputs, host_tree_inputs, to_device


def lm_head_rows(rows: int) -> int:
    """``rows`` rounded up to the next of 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... (four sizes
    an octave): at most 25% padding, and a few dozen LM-head shapes up to tens of thousands of rows."""
    if rows <= 8:
        return 8
    step = 1 << (rows.bit_length() - 3)  # a quarter of the octave [2^(e-1), 2^e) that holds rows
    return -(-rows // step) * step


class ModelRunner:
    """Owns the model and its static KV cache on one device."""

    def __init__(self, model: Transformer, num_slots: int, cache_len: int) -> None:
        self.model = model
        c = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # One extra slot that no request owns: padded rows of a captured graph may write there.
        self.scratch_slot = num_slots
        self.cache = KVCache(
            c.num_layers, num_slots + 1, c.num_kv_heads, cache_len, c.head_dim, p.dtype, p.device
        )
        self.prefill_tokens = 0  # prompt tokens run through prefill (padding excluded), for stats/tests
        self.graphs: Optional[GraphLadder] = None  # captured verify/decode steps (CUDA only)
        self.prefill_graphs: Optional[GraphLadder] = None  # captured prefill buckets (CUDA only)
        self._ones: Optional[Tensor] = None
        self._step_rows: Optional[tuple[Tensor, Tensor]] = None  # last verify's (slot, ctx_len) on the device
        # The noise seed of the sequence in each slot (written at its prefill), for noise_keys.
        self.slot_seeds = torch.zeros(num_slots + 1, dtype=torch.int64, device=self.device)
        self._logit_buf: Optional[Tensor] = None  # [rows, V] in the model's dtype, grown on demand

    def capture_graphs(self, batch_sizes: list[int], widths: list[int],
                       prefill: Optional[tuple[list[int], list[int]]] = None) -> None:
        """Capture the decode/verify forward for every (B, W) bucket; steps outside run eagerly.

        ``prefill`` (prompts per prefill, padded lengths) sets the prefill's ladder (default:
        ``prefill_ladder`` for this cache), captured too. An eager prefill of 16 prompts cost
        ~40 ms of host time on the H100 for ~7 ms of GPU work. Before anything is captured, a
        width or padded length past the cache raises ValueError (capture writes every bucket),
        and so does an empty ladder or a size below 1; a size that is no integer (2.5, True)
        raises TypeError (``cuda_graphs.check_ladder``).
        """
        groups, lengths = prefill or prefill_ladder(self.scratch_slot, self.cache.max_len)
        groups, lengths = check_ladder("prefill groups", groups), check_ladder("prefill lengths", lengths)
        self._check_room("prefill lengths", np.zeros(1, np.int64), lengths[-1])
        with torch.inference_mode():
            self.graphs = self.verify_ladder(batch_sizes, widths)
            self.prefill_graphs = GraphLadder(self._prefill_step, prefill_input_specs(self.scratch_slot),
                                              groups, lengths, self.device)

    def verify_ladder(self, batch_sizes: list[int], widths: list[int], eager: bool = False) -> GraphLadder:
        """The decode/verify step over (B, W) buckets: captured (``capture_graphs``), or with
        ``eager`` run as is on the same padded inputs (to time steps where nothing is captured)."""
        batch_sizes, widths = check_ladder("batch_sizes", batch_sizes), check_ladder("widths", widths)
        # Capture runs every bucket on pad inputs (ctx_len 0): a wider bucket writes past the cache.
        self._check_room("widths", np.zeros(1, np.int64), widths[-1])
        return GraphLadder(self._graph_step, verify_input_specs(self.scratch_slot), batch_sizes, widths,
                           self.device, eager=eager)

    def _graph_step(self, inp: dict[str, Tensor]) -> Tensor:
        ctx = StepContext(self.cache, inp["slot_ids"], inp["ctx_lens"], inp["tree_mask"])
        return self.model.hidden(inp["input_ids"], inp["positions"], ctx)

    def _prefill_step(self, inp: dict[str, Tensor]) -> Tensor:
        """The prefill forward on padded prompts; hidden state of each prompt's last token."""
        ids = inp["input_ids"]
        ctx = StepContext(self.cache, inp["slot_ids"], inp["ctx_lens"], None, kv_limit=ids.shape[1])
        hidden = self.model.hidden(ids, inp["positions"], ctx)
        return hidden[torch.arange(ids.shape[0], device=ids.device), inp["last"]]

    def _check_room(self, field: str, ctx_lens: np.ndarray, width: int) -> None:
        """Raise unless ``width`` new positions after every ``ctx_lens`` fit the cache.

        A step writes its (padded) columns at ``ctx_len .. ctx_len + width - 1`` of each slot; past
        ``cache_len`` that is an index error on CPU and a device-side assert (a dead CUDA context)
        on a GPU. The host arrays are at hand, so the check costs no sync.
        """
        need = int(ctx_lens.max(initial=0)) + width
        if need > self.cache.max_len:
            raise ValueError(f"{field}: the step would write cache position {need - 1} (max ctx_len + "
                             f"width - 1), past cache_len={self.cache.max_len}")

    def _long(self, values: list[int] | np.ndarray) -> Tensor:
        """int64 values on the device; from pinned memory without a host sync on CUDA (a
        pageable copy would wait for the GPU to drain, e.g. for the KV moves after a verify).
        Read-only views (a one-prompt prefill's broadcast positions) are copied: torch warns on them."""
        host = torch.from_numpy(np.require(values, np.int64, ["C", "W"]))
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def prefill(self, groups: list[list[Sequence]]) -> Tensor:
        """Run each group's prompt once into its first slot, copy it to the others, and note
        every sequence's noise seed in its slot (``noise_keys``).

        Returns logits ``[G, V]`` of each prompt's last token (model dtype, see ``_logits``).
        """
        lens = [len(g[0].prompt) for g in groups]
        G, T = len(groups), max(lens)
        ids = np.zeros((G, T), np.int64)
        for i, g in enumerate(groups):
            ids[i, : lens[i]] = g[0].prompt
        # No tree mask: causal attention over the prompts' own K/V (padding columns sit at the
        # end, and their K/V, written past each prompt, is overwritten before anyone reads it).
        host = {"input_ids": ids, "positions": np.broadcast_to(np.arange(T), (G, T)),
                "slot_ids": np.array([g[0].slot for g in groups], np.int64),
                "ctx_lens": np.zeros(G, np.int64), "last": np.array(lens, np.int64) - 1}
        self._check_room("prompt lengths", host["ctx_lens"], T)  # buckets fit: capture_graphs
        graphs = self.prefill_graphs
        if graphs is not None and graphs.fits(G, T):
            key = graphs.bucket(G, T)
            graphs.load(key, host)
            last = graphs.replay(key)  # the bucket's padding rows: see _logits
        else:
            last = self._prefill_step({name: self._long(a) for name, a in host.items()})
        for g, n in zip(groups, lens):
            self.cache.copy_prefix(g[0].slot, self._long([s.slot for s in g[1:]]), n)
        slots, seeds = self._long([[s.slot, s.seed] for g in groups for s in g]).T
        self.slot_seeds[slots] = seeds
        self.prefill_tokens += sum(lens)
        return self._logits(last, keep=G)

    def _upload_step(self, slots: np.ndarray, ctx_lens: np.ndarray, roots: np.ndarray) -> Tensor:
        """int64 ``[3, B]`` (slot, ctx_len, root) on the device in one copy."""
        return self._long(np.stack([slots, ctx_lens, roots]))

    @torch.inference_mode()
    def verify_forward(self, slots: np.ndarray, ctx_lens: np.ndarray, roots: np.ndarray,
                       batch: DraftBatch) -> tuple[Tensor, Optional[TreeInputs]]:
        """One forward over every request's root and draft nodes; logits ``[B + N, V]``.

        ``slots``, ``ctx_lens``, ``roots`` are int64[B] host arrays. Rows follow verify's order
        (request b's root, then its nodes in slice order); the tree inputs are returned too so
        verification does not rebuild them (None for a step without drafts: one row each).
        """
        num, width = len(slots), 1 + int(batch.sizes().max(initial=0))
        if self.graphs is not None and self.graphs.fits(num, width):
            key = self.graphs.bucket(num, width)
            self._check_room("ctx_lens", ctx_lens, key[1])  # the bucket's padding columns write too
            return self._graph_forward(key, slots, ctx_lens, roots, batch)
        self._check_room("ctx_lens", ctx_lens, width)
        slot_t, ctx_t, root_t = self._upload_step(slots, ctx_lens, roots).unbind(0)
        self._step_rows = (slot_t, ctx_t)
        if batch.num_nodes == 0:  # plain decode: the tree is each root alone
            ti, ids, pos, mask = None, root_t[:, None], ctx_t[:, None], self._decode_mask(num)
        else:
            ti = build_tree_inputs(batch, roots, ctx_lens, self.device)  # host-built
            ids, pos, mask, width = ti.input_ids, ti.positions, ti.tree_mask, ti.width
        ctx = StepContext(self.cache, slot_t, ctx_t, mask, kv_limit=int(ctx_lens.max()) + width)
        hidden = self.model.hidden(ids, pos, ctx)
        rows = hidden[:, 0] if ti is None else hidden.reshape(-1, hidden.shape[-1])[ti.flat_index]
        return self._logits(rows), ti

    def _graph_forward(self, key: tuple[int, int], slots: np.ndarray, ctx_lens: np.ndarray,
                       roots: np.ndarray, batch: DraftBatch) -> tuple[Tensor, Optional[TreeInputs]]:
        """``verify_forward`` on the captured bucket ``key``: the step's inputs, built on the
        host at the bucket's width, reach the graph's buffers in one copy; the tree fields
        verification needs besides (parents, rows) travel in a second."""
        num, graphs = len(slots), self.graphs
        assert graphs is not None
        tree = None
        if key[1] == 1:  # plain decode: each root alone
            host = {"input_ids": roots[:, None], "positions": ctx_lens[:, None],
                    "tree_mask": np.ones((num, 1, 1), bool)}
        else:
            tree = host_tree_inputs(batch, roots, ctx_lens, key[1])
            host = {name: tree.pop(name) for name in ("input_ids", "positions", "tree_mask")}
        static = graphs.load(key, {**host, "slot_ids": slots, "ctx_lens": ctx_lens})
        padded = graphs.replay(key)
        hidden = padded[:num]
        self._step_rows = (static["slot_ids"][:num], static["ctx_lens"][:num])
        if tree is None:  # the bucket's padding rows: see _logits
            return self._logits(padded[:, 0], keep=num), None
        rows = len(tree["flat_index"])
        # Gather a padded number of rows (the extra ones repeat cell 0; see _logits).
        tree["flat_index"] = np.pad(tree["flat_index"], (0, lm_head_rows(rows) - rows))
        names = list(tree)
        fields = dict(zip(names, to_device([tree[n] for n in names], self.device)))
        gather = fields.pop("flat_index")
        ti = TreeInputs(input_ids=static["input_ids"][:num], positions=static["positions"][:num],
                        tree_mask=static["tree_mask"][:num], flat_index=gather[:rows], **fields,
                        source=batch)
        return self._logits(hidden.reshape(-1, hidden.shape[-1])[gather], keep=rows), ti

    def _logits(self, rows: Tensor, keep: Optional[int] = None) -> Tensor:
        """``rows @ lm_head.T`` in the model's dtype, written into a buffer kept across steps;
        with ``keep``, the logits of the first ``keep`` rows only: the LM head then runs on
        ``lm_head_rows(keep)`` of ``rows`` (fewer if ``rows`` has fewer), the rest padding.

        The graphed paths pass their padded rows so that the LM head meets a few shapes only: cuBLAS chooses an algorithm for every new row count, ~0.6 ms of host time
        each on the H100, and a drafting step's rows (B + N) were new every few steps, a plain
        step's (B) whenever a sample ended. Drafting steps verify a different number of rows
        each time; a fresh ``[rows, V]`` allocation per step cost 0.1-0.7 ms of host time on the
        H100, the GPU idle meanwhile. No float32 copy: verification reads any float dtype in
        float32 (exactly, for bf16), and a copy of ``[B + N, V]`` rows cost a kernel per step.
        The result is overwritten by the next step.
        """
        if keep is not None:
            rows = rows[: min(lm_head_rows(keep), rows.shape[0])]
        num, weight = rows.shape[0], self.model.lm_head.weight
        if self._logit_buf is None or self._logit_buf.shape[0] < num:
            size = max(num, 2 * self._logit_buf.shape[0] if self._logit_buf is not None else 64)
            self._logit_buf = None  # free the old buffer before allocating the larger one
            self._logit_buf = torch.empty(size, weight.shape[0], dtype=weight.dtype, device=self.device)
        out = self._logit_buf[:num]
        torch.matmul(rows, weight.t(), out=out)
        return out if keep is None else out[:keep]

    def _decode_mask(self, num: int) -> Tensor:
        """A ``[num, 1, 1]`` all-true tree mask, allocated once per size bound."""
        if self._ones is None or self._ones.shape[0] < num:
            size = max(num, self.cache.num_slots)
            self._ones = torch.ones(size, 1, 1, dtype=torch.bool, device=self.device)
        return self._ones[:num]

    def keep_accepted_kv(self, slots: np.ndarray, ctx_lens: np.ndarray, accepted_offsets: np.ndarray,
                         accepted_nodes: np.ndarray) -> None:
        """Move accepted nodes' KV from their tree columns onto their path positions.

        Node j was written at ``ctx_len + 1 + j``; the d-th accepted node (1-based) belongs at
        ``ctx_len + d``. ``ctx_lens`` are the lengths before this step's tokens are committed.
        This is the host path (moves built in numpy from verification's host arrays);
        ``compact_kv`` does the same from the fused walk's device rows.
        """
        counts = np.diff(accepted_offsets)
        if counts.sum() == 0:
            return
        base = np.repeat(ctx_lens, counts)
        depth = np.arange(len(accepted_nodes)) - np.repeat(accepted_offsets[:-1], counts) + 1
        src = base + 1 + accepted_nodes
        dst = base + depth
        moved = src != dst  # a chain accepted from its first node is already in place
        if moved.any():
            index = self._long(np.stack([np.repeat(slots, counts)[moved], src[moved], dst[moved]]))
            self.cache.move(index[0], index[1], index[2])

    def noise_keys(self) -> NoiseKeys:
        """The noise keys of the last ``verify_forward``'s requests: their slots' seeds, and
        their roots' positions (the context lengths), already on the device."""
        slot_t, ctx_t = self._last_step_rows("noise_keys")
        return NoiseKeys(self.slot_seeds[slot_t], ctx_t)

    def compact_kv(self, walk: Tensor) -> None:
        """``keep_accepted_kv`` on the device: one kernel reads the moves from the fused
        verification's walk rows of the last ``verify_forward`` (``kv_compact``), queued
        behind the walk without waiting for it."""
        step_rows = self._last_step_rows("compact_kv")
        from rollout_spec.engine.kv_compact import compact_accepted_kv

        compact_accepted_kv(self.cache.kv, walk, *step_rows)

    def _last_step_rows(self, caller: str) -> tuple[Tensor, Tensor]:
        """The last ``verify_forward``'s (slot, ctx_len) rows on the device; a RuntimeError
        naming ``caller`` before any (a check that ``python -O`` keeps, unlike an assert)."""
        if self._step_rows is None:
            raise RuntimeError(f"{caller} called before any verify_forward: there is no step to read")
        return self._step_rows
