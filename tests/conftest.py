"""Set up before pytest imports any test module.

Without a GPU, Triton kernels run through triton's interpreter on CPU. Triton reads
TRITON_INTERPRET when it is first imported, and any module may import it first (the engine's
attention imports it where it is installed), so it is set here rather than in the kernel tests.
Nothing else changes: every "auto" backend picks torch on CPU, interpreter or not. The GPU is
looked for by its device nodes, not through torch: the sanitizer runs of the drafter's tests
(scripts/sanitize.sh) never load torch.
"""
from __future__ import annotations

import os
from pathlib import Path

GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")  # NVIDIA, AMD (ROCm), WSL


def has_gpu_device() -> bool:
    """Whether this machine exposes a GPU to the process (what CUDA or ROCm torch would open)."""
    return any(Path(node).exists() for node in GPU_DEVICE_NODES)


if not has_gpu_device():
    os.environ.setdefault("TRITON_INTERPRET", "1")
