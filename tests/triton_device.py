"""Where the Triton kernel tests run: through triton's interpreter on CPU where TRITON_INTERPRET=1
(conftest.py sets it on a machine without a GPU, before anything imports triton), else compiled
on the GPU. A module that imports this is skipped where triton is not installed.
"""
from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("compiled Triton kernels need a CUDA GPU (TRITON_INTERPRET=1 runs them on CPU)",
                allow_module_level=True)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytest.importorskip("triton", reason="triton is not installed (pip install triton; CUDA torch wheels ship it)")
