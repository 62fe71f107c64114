"""Sampling noise keyed by (request seed, position, token), the same on every step and batch.

Verification samples each row's token by a Gumbel race (verify.py). Its uniforms come from
Philox-4x32-10 with the request's seed as the key and the row's position (and the token's
column) as the counter, not from a stream that advances with every call. A request at a given
position therefore draws the same noise whether the row is a plain decode step's root, a draft
node several levels deep, or a prefill's last token, and whatever else shares the batch: from
the same logits, speculative and plain decoding emit the same tokens (RL runs reproduce with the
drafter on or off, and engines can be compared on identical samples).

Column layout (shared with verify_triton's kernel, which draws the same bits on the GPU): a row
is read in super-blocks of 4Q columns (Q = ``quarter_block(V)``); column ``s + w * Q + i`` of the
super-block at ``s`` takes word w of Philox's output for counter ``(s / 4 + i, pos_lo, pos_hi,
NOISE_TAG)`` under key ``(seed_lo, seed_hi)``. The word's 31 bits x (as triton's
``uint_to_uniform_float`` folds it) give the uniform (x + 1/2) 2^-31, in (0, 1) and fine near 0,
and the race's exponential is -log1p(-u) (docs/verification.md, "The noise's range").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rollout_spec.config import check_int
from rollout_spec.token_ids import int_array

# torch is imported inside the functions that make or read tensors: the drafter uses the
# layout (quarter_block) and must not load torch (DESIGN.md).
if TYPE_CHECKING:
    import torch

NOISE_TAG = 0x5EED0C0F  # counter word 3: sets these draws apart from other uses of Philox
MAX_VERIFY_VOCAB = 2**24 - 1
"""Largest vocabulary a verify step races over (verify.py: token ids exact in float32)."""
MAX_SEED = 2**63 - 1
"""Largest seed, prompt or sample index (``SamplingParams.seed``; int64 on the device)."""
MAX_POSITION = 2**63 - 1
"""Largest noise position (int64; the core reads it as Philox counter words 1 and 2)."""


def quarter_block(vocab: int) -> int:
    """Q of the column layout: the smallest power of two >= V / 4, within [16, 1024];
    ``vocab`` in [1, 2**31 - 1] (int32 token ids, as the drafter stores them)."""
    vocab = check_int("vocab", vocab, 1, 2**31 - 1)
    need = max(1, -(-vocab // 4))
    return max(16, min(1024, 1 << (need - 1).bit_length()))


@dataclass(frozen=True)
class NoiseKeys:
    """What keys each request's noise in one ``verify`` call: its seed and the position of its
    root row (a node at depth d uses position + d), int64[B] tensors on the logits' device."""

    seeds: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def fresh(generator: torch.Generator | None, num_requests: int,
              device: torch.device) -> "NoiseKeys":
        """Independent keys for one call that has none of its own: seeds drawn from
        ``generator`` (seeded calls reproduce), positions 0."""
        import torch

        num_requests = check_int("num_requests", num_requests, 0, 2**31 - 1)
        gen_device = generator.device if generator is not None else torch.device("cpu")
        seeds = torch.randint(0, 2**62, (num_requests,), generator=generator, device=gen_device)
        return NoiseKeys(seeds.to(device), torch.zeros(num_requests, dtype=torch.int64, device=device))

    def check(self, num_requests: int, device: torch.device | str) -> None:
        """Raise naming the field and what differs (dtype, shape, device) unless both are
        int64[num_requests] tensors on ``device`` (a torch.device or its name; "cuda" is the
        current CUDA device, as for a tensor made there: ``same_device``)."""
        import torch

        num_requests = check_int("num_requests", num_requests, 0)
        device = torch.device(device)
        for name in ("seeds", "positions"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"keys.{name} must be an int64[{num_requests}] tensor on {device}, "
                                f"got {type(t).__name__}")
            differs = {"dtype": (t.dtype, t.dtype != torch.int64),
                       "shape": (tuple(t.shape), t.shape != (num_requests,)),
                       "device": (t.device, not same_device(t.device, device))}
            got = ", ".join(f"{what} {have}" for what, (have, bad) in differs.items() if bad)
            if got:
                raise ValueError(f"keys.{name} must be int64[{num_requests}] on {device}, got {got}")


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` (torch devices or their names) are one device, as tensors made on
    them would be: torch.device("cuda") != torch.device("cuda:0"), yet a tensor made on "cuda"
    lands on the current CUDA device, and "cpu:0" is the CPU."""
    import torch

    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a == b or a.type == "cpu" or _placed_index(a) == _placed_index(b)


def _placed_index(device: torch.device) -> int:
    """The index of the device a tensor made on ``device`` lands on: its own, else the current
    device of its type (MPS has one device, index 0, and no ``current_device``)."""
    import torch

    if device.index is not None:
        return device.index
    if device.type == "mps":
        return 0
    return torch.get_device_module(device.type).current_device()


def sample_seed(call_seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of prompt ``prompt_index`` in a call seeded
    ``call_seed``: splitmix64's finaliser over the three, in [0, 2**63). Each argument is an
    integer (numpy integers included) in [0, MAX_SEED]; anything else raises naming it."""
    call_seed = check_int("call_seed", call_seed, 0, MAX_SEED)
    prompt_index = check_int("prompt_index", prompt_index, 0, MAX_SEED)
    sample_index = check_int("sample_index", sample_index, 0, MAX_SEED)
    z = (call_seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9
         + sample_index * 0x94D049BB133111EB + 0x632BE59BD9B4E019) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 1


def race_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32[A, V] on the keys' device: the uniforms, in (0, 1), of rows keyed (seeds[a], positions[a]),
    every column (computed by the native core on the host). ``seeds`` and ``positions`` are 1-D
    integer tensors of one length, seeds in [0, MAX_SEED] and positions in [0, MAX_POSITION],
    ``vocab`` in [1, MAX_VERIFY_VOCAB]; anything else raises naming the argument."""
    import torch

    from rollout_spec import _core

    vocab = check_int("vocab", vocab, 1, MAX_VERIFY_VOCAB)
    int_dtypes = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    for name, t in (("seeds", seeds), ("positions", positions)):
        if not isinstance(t, torch.Tensor) or t.dtype not in int_dtypes:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be an integer torch tensor (int8 to int64, uint8), got {got}")
    if seeds.ndim != 1 or positions.shape != seeds.shape:
        raise ValueError(f"seeds and positions must be 1-D tensors of one length, got shapes "
                         f"{list(seeds.shape)} and {list(positions.shape)}")

    # The core reads each key as 64 unsigned bits: a negative one would alias a large seed or
    # position, so both are checked here, on the host copies it reads.
    host_seeds, host_positions = (np.ascontiguousarray(t.cpu().numpy(), np.int64)
                                  for t in (seeds, positions))
    int_array("seeds", host_seeds, 0, MAX_SEED)
    int_array("positions", host_positions, 0, MAX_POSITION)
    u = _core.race_uniforms(host_seeds, host_positions, vocab, quarter_block(vocab), NOISE_TAG)
    return torch.from_numpy(u).to(seeds.device)
