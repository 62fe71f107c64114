"""Checks the engine's kernels make of their tensor arguments before launching: index tensors
hold integers, and every input lives on one device. Host-side reads of dtype and device only,
so they cost no GPU sync."""
from __future__ import annotations

from collections.abc import Iterable

import torch


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds integers (not floating point, complex or bool): what slot ids and
    context lengths must be."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_same_device(reference: tuple[str, torch.Tensor], others: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise ValueError naming the first of the ``(name, tensor)`` pairs ``others`` that is not on
    the device of ``reference`` (a ``(name, tensor)`` pair too)."""
    ref_name, ref = reference
    for name, t in others:
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device}, {ref_name} on {ref.device}: every input must share a device")
