"""The one-pass Triton row-statistics kernel against torch, and verify() through it.

Runs on a GPU when one is present, otherwise on CPU through triton's interpreter
(TRITON_INTERPRET=1, set here before triton is imported). Skips when triton is not installed
(CI's .venv has no triton).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed")

from rollout_spec.config import SamplingParams  # noqa: E402
from rollout_spec.tree import DraftBatch  # noqa: E402
from rollout_spec.verify import verify  # noqa: E402
from rollout_spec.verify_triton import row_lse_argmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("vocab, block", [(7, 4096), (1000, 256), (3000, 1024)])
@pytest.mark.parametrize("temp", [1.0, 0.7, "per_row"])
def test_lse_and_argmax_match_torch(vocab, block, temp):
    gen = torch.Generator().manual_seed(vocab)
    x = 3 * torch.randn(5, vocab, generator=gen)
    x[1] = -float("inf")  # a masked row with a single finite entry
    x[1, vocab // 2] = 2.0
    x[2, 3] = x[2].max() + 1  # a tie: the first index wins, as in torch
    x[2, vocab - 1] = x[2, 3]
    x = x.to(DEVICE)
    t = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.3], device=DEVICE) if temp == "per_row" else temp
    lse, am = row_lse_argmax(x, t, block=block)
    ref = torch.logsumexp(x / (t[:, None] if temp == "per_row" else t), dim=-1)
    torch.testing.assert_close(lse, ref, atol=1e-5, rtol=1e-6)
    assert torch.equal(am, x.argmax(dim=-1))


def test_bfloat16_logits_are_read_in_float32():
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    lse, am = row_lse_argmax(x.to(DEVICE), 1.0, block=128)
    torch.testing.assert_close(lse, torch.logsumexp(x.float().to(DEVICE), -1), atol=1e-5, rtol=1e-6)
    assert torch.equal(am, x.to(DEVICE).argmax(-1))


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.8),
                                      [SamplingParams(temperature=0.0), SamplingParams(temperature=1.2)]])
def test_verify_agrees_across_backends(sampling):
    batch = DraftBatch.from_lists([[(1, -1), (2, 0), (3, 0)], [(4, -1), (5, 0)]])
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    logits[0, 1] += 6  # make some drafts acceptable
    logits[1, 2] += 6
    out = [verify(logits, batch, sampling,
                  torch.Generator(device=DEVICE).manual_seed(0), backend=b).host
           for b in ("torch", "triton")]
    np.testing.assert_array_equal(out[0].emitted_tokens, out[1].emitted_tokens)
    np.testing.assert_allclose(out[0].emitted_logprobs, out[1].emitted_logprobs, atol=1e-5)
