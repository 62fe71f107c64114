"""GraphLadder: bucket choice and padding (eager on CPU; capture and replay on a GPU)."""

from __future__ import annotations

import pytest
import torch

from rollout_spec.engine.cuda_graphs import GraphLadder, InputSpec

SCRATCH_SLOT = 7


def specs() -> list[InputSpec]:
    return [
        InputSpec("input_ids", (1,), torch.int64, width_dims=(1,), pad_value=0),
        InputSpec("slot_ids", (), torch.int64, pad_value=SCRATCH_SLOT),
        InputSpec("tree_mask", (1, 1), torch.bool, width_dims=(1, 2), pad_value=False),
    ]


def step(inputs):
    """A toy step whose output reveals what the padded rows and columns held."""
    ids = inputs["input_ids"].float()
    seen = (inputs["tree_mask"].float() @ ids[..., None])[..., 0]
    return torch.stack([ids, seen, inputs["slot_ids"][:, None].float().expand_as(ids)], dim=-1)


def run_case(device: str, eager: bool) -> None:
    ladder = GraphLadder(step, specs(), batch_sizes=[4, 1, 2], widths=[1, 4], device=device,
                         eager=eager)
    assert ladder.bucket(3, 2) == (4, 4) and ladder.bucket(1, 1) == (1, 1)
    for batch, width in [(3, 2), (4, 4), (1, 1), (2, 3)]:
        ids = torch.arange(1, batch * width + 1, device=device).view(batch, width)
        mask = torch.ones(batch, width, width, dtype=torch.bool, device=device).tril()
        slots = torch.arange(batch, device=device)
        out = ladder.run({"input_ids": ids, "slot_ids": slots, "tree_mask": mask})
        want = step({"input_ids": ids, "slot_ids": slots, "tree_mask": mask})
        torch.testing.assert_close(out[:batch, :width], want)
        bb, bw = ladder.bucket(batch, width)
        assert out.shape[:2] == (bb, bw)
        # padded rows carry the scratch slot and no tokens, whatever an earlier step left there
        assert torch.all(out[batch:, :, 2] == SCRATCH_SLOT)
        assert torch.all(out[batch:, :, 0] == 0) and torch.all(out[:, width:, 0] == 0)


def test_eager_ladder_pads_to_smallest_bucket():
    run_case("cpu", eager=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_ladder_matches_eager():
    run_case("cuda", eager=False)


def test_outside_ladder_and_missing_input_raise():
    ladder = GraphLadder(step, specs(), batch_sizes=[2], widths=[1, 2], device="cpu")
    with pytest.raises(ValueError, match="batch must be in"):
        ladder.bucket(3, 1)
    with pytest.raises(ValueError, match="width in"):
        ladder.bucket(1, 3)
    with pytest.raises(ValueError, match="slot_ids"):
        ladder.run({"input_ids": torch.zeros(1, 1, dtype=torch.int64)})
    with pytest.raises(ValueError, match="batch_sizes"):
        GraphLadder(step, specs(), batch_sizes=[], widths=[1], device="cpu")


def test_ladder_built_in_inference_mode_runs_outside_it():
    """Static buffers are normal tensors, so a ladder made under inference_mode can be fed later."""
    with torch.inference_mode():
        ladder = GraphLadder(step, specs(), batch_sizes=[2], widths=[2], device="cpu")
    ids = torch.ones(1, 2, dtype=torch.int64)
    out = ladder.run({"input_ids": ids, "slot_ids": torch.zeros(1, dtype=torch.int64),
                      "tree_mask": torch.ones(1, 2, 2, dtype=torch.bool)})
    assert out.shape[:2] == (2, 2) and torch.all(out[0, :, 0] == 1)
