"""GraphLadder: bucket choice and padding (eager on CPU; capture and replay on a GPU)."""

from __future__ import annotations

import numpy as np
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
    # full-width steps after wider batches refill only the rows an earlier step wrote
    for batch, width in [(3, 2), (4, 4), (1, 1), (2, 3), (4, 4), (2, 4), (3, 4), (1, 4), (4, 4)]:
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


def load_case(device: str, eager: bool) -> None:
    """``load`` (host arrays, one copy, pads written by the host) + ``replay`` gives what
    ``run`` gives, whatever larger step used the bucket before."""
    ladder = GraphLadder(step, specs(), batch_sizes=[4, 1, 2], widths=[1, 4], device=device,
                         eager=eager)
    assert len(ladder.graphs) == (0 if eager else 6)
    for batch, width in [(3, 2), (4, 4), (2, 3), (1, 1), (3, 4)]:
        ids = np.arange(1, batch * width + 1, dtype=np.int64).reshape(batch, width)
        mask = np.tril(np.ones((batch, width, width), bool))
        slots = np.arange(batch, dtype=np.int64)
        key = ladder.bucket(batch, width)
        ladder.load(key, {"input_ids": ids, "slot_ids": slots, "tree_mask": mask})
        out = ladder.replay(key)
        want = step({"input_ids": torch.from_numpy(ids), "slot_ids": torch.from_numpy(slots),
                     "tree_mask": torch.from_numpy(mask)})
        torch.testing.assert_close(out[:batch, :width].cpu(), want)
        assert torch.all(out[batch:, :, 2] == SCRATCH_SLOT)
        assert torch.all(out[batch:, :, 0] == 0) and torch.all(out[:, width:, 0] == 0)
    with pytest.raises(ValueError, match="does not fit"):
        ladder.load((2, 4), {"input_ids": np.zeros((3, 1), np.int64)})
    with pytest.raises(ValueError, match="slot_ids"):
        ladder.load((2, 4), {"input_ids": np.zeros((1, 1), np.int64)})


def test_eager_ladder_loads_host_arrays_in_one_copy():
    load_case("cpu", eager=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_ladder_loads_host_arrays():
    load_case("cuda", eager=False)


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
    with pytest.raises(ValueError, match="slot_ids.* 1 rows, the others 2"):
        ladder.run({"input_ids": torch.zeros(2, 1, dtype=torch.int64),
                    "slot_ids": torch.zeros(1, dtype=torch.int64),
                    "tree_mask": torch.ones(2, 1, 1, dtype=torch.bool)})
    with pytest.raises(ValueError, match="batch_sizes"):
        GraphLadder(step, specs(), batch_sizes=[], widths=[1], device="cpu")


@pytest.mark.parametrize("field, sizes, error, match", [
    ("batch_sizes", [1, 2.5], TypeError,
     r"batch_sizes\[1\] must be an integer in \[1, inf\], got float 2\.5"),
    ("widths", [True], TypeError, r"widths\[0\] must be an integer in \[1, inf\], got bool True"),
    ("widths", [0, 2], ValueError, r"widths\[0\] must be in \[1, inf\], got 0"),
    ("batch_sizes", [], ValueError, r"batch_sizes must be a non-empty list of positive ints, got \[\]"),
])
def test_ladder_sizes_that_are_no_positive_integers_are_refused(field, sizes, error, match):
    """A float size was truncated (2.5 captured as 2) and a bool read as 1; now each size is
    checked as ``config.check_int`` checks ints, naming the field, the index and the range."""
    sizes_of = {"batch_sizes": [1], "widths": [1], field: sizes}
    with pytest.raises(error, match=match):
        GraphLadder(step, specs(), device="cpu", **sizes_of)


def test_ladder_takes_numpy_integers_as_plain_ints():
    ladder = GraphLadder(step, specs(), batch_sizes=np.array([2, 1]), widths=[np.int64(1)], device="cpu")
    assert ladder.batch_sizes == (1, 2) and all(type(b) is int for b in ladder.batch_sizes)


def test_ladder_built_in_inference_mode_runs_outside_it():
    """Static buffers are normal tensors, so a ladder made under inference_mode can be fed later."""
    with torch.inference_mode():
        ladder = GraphLadder(step, specs(), batch_sizes=[2], widths=[2], device="cpu")
    ids = torch.ones(1, 2, dtype=torch.int64)
    out = ladder.run({"input_ids": ids, "slot_ids": torch.zeros(1, dtype=torch.int64),
                      "tree_mask": torch.ones(1, 2, 2, dtype=torch.bool)})
    assert out.shape[:2] == (2, 2) and torch.all(out[0, :, 0] == 1)


class EchoDrafter:
    """Drafts the request's last ``budget`` tokens as a chain: some accepted, many rejected."""

    def __init__(self) -> None:
        self.ctx: dict[int, list[int]] = {}

    def start_batch(self, req_ids, prompts, group_ids) -> None:
        for r, p in zip(req_ids, prompts):
            self.ctx[r] = list(p)

    def extend_batch(self, req_ids, token_lists) -> None:
        for r, toks in zip(req_ids, token_lists):
            self.ctx[r].extend(int(t) for t in toks)

    def finish_batch(self, req_ids) -> None:
        for r in req_ids:
            self.ctx.pop(r, None)

    def end_step(self) -> None:
        pass

    def propose(self, req_ids, budgets):
        from rollout_spec.tree import DraftBatch

        chains = [self.ctx[r][-int(b):] if b else [] for r, b in zip(req_ids, budgets)]
        return DraftBatch.from_lists([[(t, i - 1) for i, t in enumerate(c)] for c in chains])


def test_engine_with_ladder_matches_engine_without(monkeypatch):
    """The runner's bucketed path (rows and columns padded) gives the same greedy tokens.

    On CPU the ladder runs eagerly, which exercises exactly the padding a GPU replay sees.
    """
    transformers = pytest.importorskip("transformers")
    from rollout_spec.config import SamplingParams
    from rollout_spec.engine.engine import RolloutEngine
    from rollout_spec.engine.weights import build_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, initializer_range=0.3)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    state = {k.removeprefix("model."): v for k, v in ref.state_dict().items()}
    model = build_model(cfg, state, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (int(n),), generator=gen).tolist() for n in (3, 9, 17, 30, 5, 12)]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=20, stop_token_ids=())
    outs = []
    replays, head_rows = [], []  # (rows, kept) of the LM head's calls on the ladder
    for ladder in (None, ([1, 2, 4, 8], [1, 2, 3, 5])):  # B=6 pads to 8; W=4 pads to 5
        eng = RolloutEngine(model, None, EchoDrafter(), num_slots=8, max_model_len=128,
                            draft_budget=lambda n: 3 if n > 4 else 6)  # W=7: outside, eager
        if ladder:
            eng.runner.capture_graphs(*ladder)
            assert eng.runner.graphs.eager
            for graphs, tag in ((eng.runner.graphs, "step"), (eng.runner.prefill_graphs, "prefill")):
                def spy(key, _replay=graphs.replay, _tag=tag):
                    replays.append((_tag, key))
                    return _replay(key)
                graphs.replay = spy

            kept = []  # the logits each LM-head call returns

            def head(rows, keep=None, _logits=eng.runner._logits):
                kept.append(rows.shape[0] if keep is None else keep)
                return _logits(rows, keep)

            def matmul(a, b, *, out=None, _matmul=torch.matmul):  # the LM head's, into its buffer
                if out is not None:
                    head_rows.append((a.shape[0], kept[-1]))
                return _matmul(a, b, out=out)
            eng.runner._logits = head
            monkeypatch.setattr(torch, "matmul", matmul)
        outs.append(eng.generate(prompts, params))
    # drafting and plain steps, padded in both dims; the 6 prompts of up to 30 tokens in one
    # prefill padded to 8 prompts of 128 tokens
    assert {("step", (8, 5)), ("step", (8, 1)), ("prefill", (8, 128))} <= set(replays)
    # The LM head runs on the bucket's padded rows (plain steps, prefill) or a padded gather
    # (drafting steps): row counts from the ladder's sizes and lm_head_rows only.
    from rollout_spec.engine.runner import lm_head_rows

    shapes = {1, 2, 4} | {lm_head_rows(k) for k in range(1, 8 * 5 + 1)}
    assert all(kept <= rows and rows in shapes for rows, kept in head_rows)
    assert {(8, 6)} <= set(head_rows) and any(rows > kept > 8 for rows, kept in head_rows)
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids and a.num_verify_steps == b.num_verify_steps
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def test_lm_head_rows_pad_to_few_shapes():
    """The graphed path's LM head sees at most 25% padding and four row counts an octave."""
    from rollout_spec.engine.runner import lm_head_rows

    got = [lm_head_rows(r) for r in range(1, 10001)]
    assert all(r <= g <= max(8, 1.25 * r) for r, g in zip(range(1, 10001), got))
    assert got == sorted(got) and len(set(got)) == 42
    assert [lm_head_rows(r) for r in (8, 9, 11, 16, 17, 257)] == [8, 10, 12, 16, 20, 320]
