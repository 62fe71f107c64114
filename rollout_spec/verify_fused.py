"""The GPU path of ``verify``: the tree walk runs in verify_triton's kernel, the host only packs
inputs and unpacks one small result.

Per step: no upload when the engine passes the TreeInputs of this batch and all requests share
their sampling parameters (one small upload otherwise), one threshold kernel when top-k/top-p
truncate (plus ``torch.topk`` for top-p without top-k), one walk kernel, one device-to-host
copy. The law, the keyed noise and the reported log-probabilities are those of the torch reference
in verify.py (tests compare the two decision for decision).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from rollout_spec.noise import NoiseKeys
from rollout_spec.sampling import SamplingTable, effective_temperature, row_stats
from rollout_spec.tree import DraftBatch, TreeInputs, index_arrays, to_device
from rollout_spec.verify import HostVerifyResult
from rollout_spec.verify_triton import (
    MAX_CANDIDATES,
    OUT_FIELDS,
    can_select,
    launch_thresholds,
    launch_walk,
)


def verify_fused(logits: torch.Tensor, batch: DraftBatch, table: SamplingTable,
                 keys: NoiseKeys, tree: TreeInputs | None, noise: torch.Tensor | None = None,
                 on_walk: Callable[[torch.Tensor], None] | None = None
                 ) -> tuple[HostVerifyResult, torch.Tensor]:
    """Verify validated inputs with the walk kernel; results on the host, and the walk's rows
    on the device (int32 ``[B, 1 + 3W]``, see ``launch_walk``) for device-side consumers such
    as the engine's KV compaction. ``on_walk(rows)`` runs once the rows' final values are
    queued: before the readback, unless candidate thresholds may need the exact redo.

    ``noise`` (tests only) replaces the keyed draws, see ``launch_walk``.
    """
    dev, num_req, vocab = logits.device, batch.num_requests, logits.shape[1]
    own_tree = tree is not None and tree.source is batch  # the forward's arrays: no upload
    width = tree.width if own_tree else 1 + int(batch.sizes().max(initial=0))
    truncating = table.truncates(vocab)
    plain = not own_tree and batch.num_nodes == 0  # plain sampling: constant index arrays
    host = [] if own_tree or plain else list(index_arrays(batch, width))
    if not table.uniform:  # per-request parameters travel with the index arrays
        host += [table.temperature] + ([table.top_k, table.top_p] if truncating else [])
    uploaded = to_device(host, dev) if host else []
    if own_tree:
        cells, params = [tree.input_ids, tree.parent_col, tree.row_index], uploaded
    elif plain:
        cells, params = _plain_cells(num_req, dev), uploaded
    else:
        cells, params = uploaded[:3], uploaded[3:]
    temp: float | torch.Tensor = params[0] if params else float(table.temperature[0])
    rows, walk_size = num_req + batch.num_nodes, num_req * (1 + OUT_FIELDS.value * width)
    flags_at = walk_size + (-walk_size % 4)  # 16-byte aligned flags: one kernel variant
    out = torch.empty(flags_at + (rows if truncating else 0), dtype=torch.int32, device=dev)
    thr, checked = None, False
    if truncating:
        thr = _candidate_thresholds(logits, table, cells, params, out[flags_at:])
        checked = thr is not None
        if thr is None:
            thr = _exact_thresholds(logits, table, batch)
    walk = out[:walk_size].view(num_req, -1)
    launch_walk(logits, *cells, temp, thr, keys, walk, table.any_sampling, noise)
    if on_walk is not None and not checked:  # final now: its consumer queues behind the walk
        on_walk(walk)
    got = out.cpu().numpy()
    if checked and got[flags_at:].any():  # rare: some cut lies past its candidates
        thr = _exact_thresholds(logits, table, batch)
        launch_walk(logits, *cells, temp, thr, keys, walk, table.any_sampling, noise)
        got = out.cpu().numpy()
    if on_walk is not None and checked:
        on_walk(walk)
    return _unpack(got[:walk_size].reshape(num_req, -1), width), walk


_PLAIN_CELLS: dict[torch.device, list[torch.Tensor]] = {}
PLAIN_CELLS_MIN = 256  # requests the first upload of plain index arrays covers


def _plain_cells(num_req: int, device: torch.device) -> list[torch.Tensor]:
    """tokens, parent_col, row_index ([B, 1] each) of B roots without drafts, as device views
    of arrays uploaded once per device (grown when a larger B comes): plain decoding steps
    then upload nothing. The walk only reads them."""
    have = _PLAIN_CELLS.get(device)
    if have is None or have[0].shape[0] < num_req:
        size = max(num_req, 2 * have[0].shape[0] if have is not None else PLAIN_CELLS_MIN)
        host = [np.zeros((size, 1), np.int64), np.full((size, 1), -1, np.int64),
                np.arange(size, dtype=np.int64)[:, None]]
        have = _PLAIN_CELLS[device] = to_device(host, device)
    return [a[:num_req] for a in have]


def _candidate_thresholds(logits: torch.Tensor, table: SamplingTable, cells: list[torch.Tensor],
                          params: list[torch.Tensor], flags: torch.Tensor) -> torch.Tensor | None:
    """float32[R] thresholds from each row's largest logits (selected by the threshold kernel
    itself or, for many candidates, by torch.topk); ``flags`` marks rows the candidates cannot
    decide. None when too many candidates are
    needed (a top-k beyond MAX_CANDIDATES)."""
    vocab = logits.shape[1]
    ncand = table.cut_candidates(vocab)
    if ncand > MAX_CANDIDATES:
        return None
    # The threshold kernel selects a few candidates itself; many (top-p without top-k): topk.
    candidates = None if can_select(vocab, ncand) else torch.topk(logits, ncand, dim=-1).values
    thr = torch.empty(flags.shape[0], dtype=torch.float32, device=logits.device)
    per_request = tuple(params) if params else (table.temperature[0], table.top_k[0],
                                                table.top_p[0])
    launch_thresholds(logits, ncand, cells[1], cells[2], per_request, thr, flags, candidates)
    return thr


def _exact_thresholds(logits: torch.Tensor, table: SamplingTable, batch: DraftBatch
                      ) -> torch.Tensor:
    """float32[R] thresholds by the torch reference (sorts whole rows where it must)."""
    rows_per_req = batch.sizes() + 1
    temp_rows = None
    if not table.uniform:
        temps = np.repeat(effective_temperature(table), rows_per_req)
        temp_rows = torch.from_numpy(temps).to(logits.device)
    return row_stats(logits, table, rows_per_req, temp_rows).thr


def _unpack(got: np.ndarray, width: int) -> HostVerifyResult:
    """CSR results from the kernel's padded rows [n, columns[W], tokens[W], logprobs[W]]."""
    num_req = got.shape[0]
    num_acc = got[:, 0].astype(np.int64)
    cols = np.arange(width)
    acc_mask = cols < num_acc[:, None]
    em_mask = cols <= num_acc[:, None]
    tokens = got[:, 1 + width : 1 + 2 * width]
    acc_off = np.zeros(num_req + 1, np.int64)
    np.cumsum(num_acc, out=acc_off[1:])
    return HostVerifyResult(
        accepted_offsets=acc_off,
        accepted_nodes=got[:, 1 : 1 + width][acc_mask].astype(np.int64) - 1,
        bonus=tokens[np.arange(num_req), num_acc].astype(np.int64),
        emitted_offsets=acc_off + np.arange(num_req + 1, dtype=np.int64),
        emitted_tokens=tokens[em_mask].astype(np.int64),
        emitted_logprobs=got[:, 1 + 2 * width :].view(np.float32)[em_mask],
        num_accepted=num_acc,
    )
