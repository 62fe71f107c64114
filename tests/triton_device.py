"""Where the Triton kernel tests run, set up before any of them imports triton.

On a GPU the kernels run compiled; without one, through triton's interpreter on CPU
(TRITON_INTERPRET=1, which triton reads when it is imported, so a test module imports this first).
A module that imports this is skipped where triton is not installed (CI's .venv has none).
"""
from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install triton; CUDA torch wheels ship it)")
