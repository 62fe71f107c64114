"""Up-front checks of the engine's options and of ``generate``'s inputs.

Each check runs before the work it guards (a weight load, a prefill) and raises naming the field
and its allowed range; nothing is coerced (a float, a bool or a string where an int belongs
raises). ``checked_budget`` checks a budget's answer at every decode step, so its common case
(one Python int) is a single type test.
"""
from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from numbers import Integral
from typing import Any, Optional, Union

import numpy as np
import torch

from rollout_spec.config import SpecConfig, check_int, check_token_ids
from rollout_spec.groups import GROUP_ID_MAX
from rollout_spec.verify import use_triton

DRAFTER_METHODS = ("start_batch", "extend_batch", "propose", "finish_batch", "end_step")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def pick_device(device: str | torch.device) -> torch.device:
    """``"auto"`` means CUDA when available, else CPU; a device torch cannot name, or a CUDA or
    MPS device this machine lacks, raises ValueError naming ``device``."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}") from err
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: torch sees {torch.cuda.device_count()} CUDA devices "
                         "here (use 'cpu')")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: MPS is not available here (use 'cpu')")
    return dev


def check_options(
    device: torch.device, spec: Any, *, num_slots: Any, max_model_len: Any, max_prefill_tokens: Any,
    draft_budget: Any, max_draft_tokens: Any, cuda_graphs: Any, batch_aware_budget: Any,
    overlap_drafter: Any, verify_backend: Any, worker_min_batch: Any, **_need_the_model: Any,
) -> dict[str, int]:
    """Check ``RolloutEngine``'s options that need no model (``from_pretrained`` runs this before
    loading weights; max_model_len's upper bound and eos_token_ids are checked against the
    model later). Returns the integer options as plain ints, by name.

    Raises:
        TypeError: a wrong type (also a bool or float for an int, a non-callable draft_budget,
            a spec that is no SpecConfig, None or drafter).
        ValueError: a number out of range, an unknown verify_backend, or "triton" off CUDA
            without TRITON_INTERPRET=1.
        ImportError: verify_backend="triton" without the triton package.
    """
    sizes = {name: check_int(name, value, lo, hi) for name, value, lo, hi in (
        ("num_slots", num_slots, 1, 1 << 20), ("max_prefill_tokens", max_prefill_tokens, 1, 1 << 30),
        ("max_draft_tokens", max_draft_tokens, 0, 1024), ("worker_min_batch", worker_min_batch, 1, 1 << 20))}
    if max_model_len is not None:
        check_int("max_model_len", max_model_len, 2)
    for name, value, optional in (("cuda_graphs", cuda_graphs, False),
                                  ("batch_aware_budget", batch_aware_budget, True),
                                  ("overlap_drafter", overlap_drafter, True)):
        if not isinstance(value, bool) and not (optional and value is None):
            raise TypeError(f"{name} must be True or False{' or None' if optional else ''}, got {value!r}")
    if draft_budget is not None and not callable(draft_budget):
        raise TypeError("draft_budget must be None or a callable (num_running) -> int or one int per "
                        f"request, got {type(draft_budget).__name__} {draft_budget!r}")
    if verify_backend not in ("auto", "torch", "triton"):
        raise ValueError(f"verify_backend must be 'auto', 'torch' or 'triton', got {verify_backend!r}")
    try:  # here rather than at the first verification, after a prefill
        use_triton(verify_backend, device)
    except (ImportError, ValueError) as err:  # "backend='triton' needs ..."
        raise type(err)(f"verify_{err}") from None
    if spec is not None and not isinstance(spec, SpecConfig):
        missing = [m for m in DRAFTER_METHODS if not callable(getattr(spec, m, None))]
        if missing:
            raise TypeError(f"spec must be a SpecConfig, None or a drafter; {type(spec).__name__} lacks {missing}")
    return sizes


def check_dtype(dtype: Any) -> None:
    """``from_pretrained``'s dtype: None or one of ``DTYPES``."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in DTYPES):
        raise TypeError(f"dtype must be None or one of {', '.join(map(str, DTYPES))}, got {dtype!r}")


def vocab_ids(name: str, ids: Any, vocab_size: int) -> tuple[int, ...]:
    """``ids`` (a sequence of token ids) as a tuple of ints in ``[0, vocab_size)``."""
    try:
        return check_token_ids(name, ids, vocab_size - 1)
    except ValueError as err:
        raise ValueError(f"{err} (token ids lie in [0, {vocab_size}), the model's vocabulary)") from None


def check_group_ids(group_ids: Any) -> Optional[list[Optional[int]]]:
    """``generate``'s group_ids: each entry None or an int in ``[0, GROUP_ID_MAX]``, named by its
    index in the caller's list (the length is checked against the prompts by the session)."""
    if group_ids is None:
        return None
    if isinstance(group_ids, (str, bytes)) or not isinstance(group_ids, Iterable):
        raise TypeError(f"group_ids must be None or a sequence, got {type(group_ids).__name__}")
    if isinstance(group_ids, (AbstractSet, Mapping)):  # entry i must be prompt i's
        raise TypeError(f"group_ids must be None or a sequence in the prompts' order, got "
                        f"{type(group_ids).__name__}, which has no order")
    return [None if g is None else check_int(f"group_ids[{i}]", g, 0, GROUP_ID_MAX)
            for i, g in enumerate(group_ids)]


def checked_budget(answer: Any, num_running: int, max_draft_tokens: int) -> Union[int, np.ndarray]:
    """A ``DraftBudget``'s answer for ``num_running`` requests: one int for all (at most
    ``max_draft_tokens``, the cap every request gets anyway) or an int64 array of one per request.
    Below zero means no drafts, as zero does."""
    if type(answer) is int or (isinstance(answer, Integral) and not isinstance(answer, bool)):
        return min(int(answer), max_draft_tokens)
    sizes = None
    if isinstance(answer, (list, tuple, np.ndarray)):
        sizes = np.asarray(answer)
    if sizes is None or sizes.shape != (num_running,) or sizes.dtype.kind not in "iu":
        raise ValueError(f"draft_budget returned {reprlib.repr(answer)} for {num_running} running "
                         f"requests; it must return one int, or a sequence of {num_running} ints")
    return sizes.astype(np.int64, copy=False)
