"""Bad input to metrics, sampling and noise functions raises naming the field and its range."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout_spec.config import SamplingParams
from rollout_spec.metrics import SpecStats, plot_dashboard, pooled, stats_from_outputs, wandb_metrics
from rollout_spec.noise import NoiseKeys, quarter_block, race_uniforms, same_device, sample_seed
from rollout_spec.sampling import SamplingTable, row_stats

STATS = dict(step=0, num_requests=2, spec_tokens=10, spec_seconds=1.0, verify_steps=5,
             draft_tokens=8, accepted_tokens=4, verl_accept_rate=0.5, verl_accept_length=1.5,
             draft_budget=4)


@dataclass
class Out:
    token_ids: list
    num_verify_steps: int = 2
    num_draft_tokens: int = 4
    num_accepted_tokens: int = 2


SPEC = [Out([1, 2, 3]), Out([4, 5])]


@pytest.mark.parametrize("change, error, match", [
    ({"spec_tokens": -10}, ValueError, r"spec_tokens must be in \[0"),
    ({"accepted_tokens": 80}, ValueError, r"accepted_tokens must be in \[0, 8\]"),
    ({"same_samples": 10}, ValueError, r"same_samples must be in \[0, 2\]"),
    ({"step": "x"}, TypeError, "step must be an integer"),
    ({"step": 1.5}, TypeError, "step must be an integer"),
    ({"num_requests": True}, TypeError, "num_requests must be an integer"),
    ({"spec_seconds": float("nan")}, ValueError, "spec_seconds must be in"),
    ({"base_tokens": 10, "base_seconds": -1.0}, ValueError, "base_seconds must be in"),
    ({"verl_accept_rate": 1.5}, ValueError, r"verl_accept_rate must be in \[0.0, 1.0\]"),
    ({"mean_reward": float("nan")}, ValueError, "mean_reward must be in"),
    ({"depth_drafted": (5, 3), "depth_accepted": (1, 2, 3)}, ValueError,
     r"depth_accepted must have one count per depth of depth_drafted \(2\), got 3"),
    ({"depth_drafted": (1,), "depth_accepted": (5,)}, ValueError, r"depth_accepted\[0\] must be in \[0, 1\]"),
    ({"depth_drafted": (1,)}, ValueError, "both be given"),
    ({"depth_drafted": 3, "depth_accepted": (1,)}, TypeError, "depth_drafted must be a sequence of counts, got int"),
    ({"depth_drafted": (3,), "depth_accepted": "1"}, TypeError,
     "depth_accepted must be a sequence of counts, got str"),
])
def test_spec_stats_refuses_bad_fields(change, error, match):
    with pytest.raises(error, match=match):
        SpecStats(**{**STATS, **change})


def test_spec_stats_stores_plain_numbers_and_hashable_depths():
    s = SpecStats(**{**STATS, "step": np.int64(3), "spec_seconds": 2, "depth_drafted": [2, 1],
                     "depth_accepted": np.array([1, 0])})
    assert type(s.step) is int and type(s.spec_seconds) is float
    assert s.depth_drafted == (2, 1) and s.depth_accepted == (1, 0)
    hash(s)  # frozen and all fields hashable


@pytest.mark.parametrize("kwargs, error, match", [
    ({"base_outputs": [Out([1, 2, 3])], "base_seconds": 1.0}, ValueError,
     r"base_outputs must have one entry per spec output \(2\), got 1"),
    ({"rewards": [1.0]}, ValueError, r"rewards must have one entry per spec output \(2\), got 1"),
    ({"draft_budget": 4.9}, TypeError, "draft_budget must be an integer"),
    ({"draft_budget": "4"}, TypeError, "draft_budget must be an integer"),
    ({"draft_budget": -3}, ValueError, r"draft_budget must be in \[0"),
    ({"drafter": {"us_per_req": 3.0}}, ValueError, r"drafter has unknown keys \['us_per_req'\]"),
    ({"drafter": [1]}, TypeError, "drafter must be a dict"),
    ({"depths": ([5],)}, ValueError, "depths must be a"),
])
def test_stats_from_outputs_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        stats_from_outputs(0, SPEC, 1.0, **{"draft_budget": 4, **kwargs})


def test_stats_from_outputs_refuses_fractional_output_counters():
    with pytest.raises(TypeError, match=r"spec_outputs\[0\].num_verify_steps must be an integer"):
        stats_from_outputs(0, [Out([1], num_verify_steps=2.7)], 1.0, draft_budget=4)
    s = stats_from_outputs(0, SPEC, 1.0, draft_budget=4, depths=([5], [1]),
                           drafter={"us_per_request": 3.0})
    assert s.depth_drafted == (5,) and s.drafter_us_per_request == 3.0
    hash(s)


BY_DEPTH = SimpleNamespace(token_ids=[1], num_verify_steps=2, num_draft_tokens=4, num_accepted_tokens=2,
                           num_drafted_by_depth=5, num_accepted_by_depth=[1])


@pytest.mark.parametrize("spec, kwargs, match", [
    (5, {}, r"^spec_outputs must be a sequence \(list, tuple\) of RolloutOutput, got int$"),
    ([object()], {}, r"^spec_outputs\[0\] must be a RolloutOutput, got object without token_ids, "
                     r"num_verify_steps, num_draft_tokens, num_accepted_tokens$"),
    ([SPEC[0], {"token_ids": [1]}], {}, r"^spec_outputs\[1\] must be a RolloutOutput, got dict without"),
    ([Out(5)], {}, r"^spec_outputs\[0\]\.token_ids must be a sequence of token ids, got int$"),
    ([BY_DEPTH], {}, r"^spec_outputs\[0\]\.num_drafted_by_depth must be a sequence of counts, got int$"),
    (SPEC, {"base_outputs": 5},
     r"^base_outputs must be a sequence \(list, tuple\) of RolloutOutput, got int$"),
    (SPEC, {"base_outputs": [SPEC[0], object()]},
     r"^base_outputs\[1\] must be a RolloutOutput, got object without token_ids$"),
    (SPEC, {"rewards": 5}, r"^rewards must be a sequence of numbers, got int$"),
    (SPEC, {"rewards": [1.0, None]}, r"^rewards\[1\] must be a number, got NoneType$"),
])
def test_stats_from_outputs_names_an_output_or_reward_of_the_wrong_type(spec, kwargs, match):
    """These raised AttributeErrors or TypeErrors from len() and sum() that named nothing."""
    with pytest.raises(TypeError, match=match):
        stats_from_outputs(0, spec, 1.0, draft_budget=4, **kwargs)


def test_stats_from_outputs_takes_tuples_and_numpy_rewards():
    s = stats_from_outputs(0, tuple(SPEC), 1.0, draft_budget=4, base_outputs=tuple(SPEC),
                           rewards=np.array([1.0, 0.0]))
    assert s.mean_reward == 0.5 and s.same_samples == 2


@pytest.mark.parametrize("history, match", [
    (5, r"^history must be a sequence \(list, tuple\) of SpecStats, got int$"),
    (SpecStats(**STATS), "^history must be a sequence .*, got SpecStats$"),
    # a generator's first sum emptied it: the other figures came out 0, without an error
    ((s for s in [SpecStats(**STATS)]), "^history must be a sequence .*, got generator$"),
    ([SpecStats(**STATS), {"step": 1}], r"^history\[1\] must be SpecStats, got dict$"),
])
def test_pooled_names_a_history_that_is_not_spec_stats(history, match):
    with pytest.raises(TypeError, match=match):
        pooled(history)


@pytest.mark.parametrize("stats", [None, {"step": 0}, [SpecStats(**STATS)]])
def test_wandb_metrics_names_stats_that_are_not_spec_stats(stats):
    with pytest.raises(TypeError, match=f"^stats must be SpecStats, got {type(stats).__name__}$"):
        wandb_metrics(stats)


@pytest.mark.parametrize("first", [
    Out([1], num_draft_tokens=0, num_accepted_tokens=2),  # verl's rate read it as 0
    Out([1], num_draft_tokens=1, num_accepted_tokens=2),  # rate 2.0, averaged to 1.0: in range
    Out([1], num_draft_tokens=1, num_accepted_tokens=3),  # the error named verl_accept_rate
])
def test_stats_from_outputs_checks_each_samples_accepted_against_its_drafted(first):
    """The step's totals (2-3 accepted of 11 drafted) hid one sample's excess."""
    with pytest.raises(ValueError, match=r"spec_outputs\[0\]\.num_accepted_tokens must be in \[0, 1?0?\]"):
        stats_from_outputs(0, [first, Out([2], num_draft_tokens=10, num_accepted_tokens=0)], 1.0,
                           draft_budget=8)


@pytest.mark.parametrize("history, path, error, match", [
    ([SpecStats(**STATS)], "noext", ValueError, "must be a file path ending in .png"),
    ([SpecStats(**STATS)], "dash.jpg", ValueError, "must be a file path ending in .png"),
    ([SpecStats(**STATS)], "dash.txt", ValueError, "must be a file path ending in .png"),
    ((s for s in [SpecStats(**STATS)]), "dash.png", TypeError, "history must be a sequence"),
    ([{"step": 0}], "dash.png", TypeError, r"history\[0\] must be SpecStats, got dict"),
])
def test_plot_dashboard_refuses_bad_history_and_paths(tmp_path, history, path, error, match):
    with pytest.raises(error, match=match):
        plot_dashboard(history, tmp_path / path)
    assert not any(tmp_path.iterdir())  # nothing written


def test_plot_dashboard_writes_png_for_upper_case_suffix(tmp_path):
    path = plot_dashboard([SpecStats(**STATS)], tmp_path / "dash.PNG")
    assert path.exists() and path.read_bytes()[:4] == b"\x89PNG"


def test_sample_seed_takes_numpy_ints_and_refuses_out_of_range():
    assert sample_seed(np.int64(0), np.int32(2), np.uint64(1)) == sample_seed(0, 2, 1)
    with pytest.raises(ValueError, match=r"call_seed must be in \[0, 9223372036854775807\], got -1"):
        sample_seed(-1, 0, 0)
    with pytest.raises(ValueError, match="prompt_index must be in"):
        sample_seed(0, 2**64 - 1, 0)
    with pytest.raises(TypeError, match=r"sample_index must be an integer in \[0, 9223372036854775807\], got float"):
        sample_seed(0, 0, 1.5)


def test_race_uniforms_checks_keys_and_vocab():
    z = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(TypeError, match="seeds must be an integer torch tensor.*float32"):
        race_uniforms(torch.tensor([1.5, 2.9]), z, 5)
    with pytest.raises(TypeError, match="positions must be an integer torch tensor.*ndarray"):
        race_uniforms(z, np.zeros(2, np.int64), 5)
    with pytest.raises(ValueError, match="seeds and positions must be 1-D tensors of one length"):
        race_uniforms(torch.zeros(3, dtype=torch.int64), z, 5)
    with pytest.raises(ValueError, match=r"vocab must be in \[1, 16777215\]"):
        race_uniforms(z, z, 2**40)
    assert torch.equal(race_uniforms(z.int(), z, 5), race_uniforms(z, z, 5))


@pytest.mark.parametrize("vocab, error", [(0, ValueError), (-10, ValueError), (100.5, TypeError),
                                          (True, TypeError)])
def test_quarter_block_refuses_bad_vocab(vocab, error):
    with pytest.raises(error, match="vocab must be"):
        quarter_block(vocab)


def test_sampling_table_checks_sizes():
    sp = SamplingParams(temperature=1.0, top_p=0.9)
    with pytest.raises(ValueError, match=r"num_requests must be in \[0, 2147483647\], got -1"):
        SamplingTable.from_params(sp, -1)
    with pytest.raises(TypeError, match="num_requests must be an integer"):
        SamplingTable.from_params(sp, 2.0)
    table = SamplingTable.from_params(sp, 2)
    for method in (table.truncates, table.cut_candidates):
        with pytest.raises(ValueError, match=r"vocab_size must be in \[1, 16777215\]"):
            method(0)
        with pytest.raises(TypeError, match="vocab_size must be an integer"):
            method(4.0)
    assert table.truncates(10) and table.cut_candidates(10) == 10


@pytest.mark.parametrize("sampling, error, match", [
    ([SamplingParams()] * 3, ValueError, r"sampling must be one SamplingParams or B=2 of them, got 3"),
    ("greedy", TypeError, "sampling must be SamplingParams or a sequence of them, got str"),
    ({"temperature": 0.0}, TypeError, "sampling must be SamplingParams or a sequence of them, got dict"),
])
def test_sampling_table_refuses_what_is_not_one_or_b_params(sampling, error, match):
    """One SamplingParams for the batch or one per request: another count or type is named."""
    with pytest.raises(error, match=match):
        SamplingTable.from_params(sampling, 2)


@pytest.mark.parametrize("rows, match", [
    (np.array([1, 1]), "summing to the logits' 4 rows"),  # length right, sum wrong
    (np.array([2, 1, 1]), r"int64\[B=2\], got int64\[3\]"),
    (np.array([5, -1]), "counts >= 1"),
    (np.array([2.0, 2.0]), r"int64\[B=2\], got float64\[2\]"),
])
@pytest.mark.parametrize("top_p", [1.0, 0.9])  # without truncation the counts went unread
def test_row_stats_checks_rows_per_request(rows, match, top_p):
    table = SamplingTable.from_params(SamplingParams(temperature=1.0, top_p=top_p), 2)
    with pytest.raises(ValueError, match=match):
        row_stats(torch.randn(4, 10), table, rows)


def test_noise_keys_check_says_what_differs():
    keys = NoiseKeys(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    keys.check(2, "cpu")  # a device name is a device
    keys.check(2, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"keys.seeds must be int64\[3\] on cpu, got shape \(2,\)$"):
        keys.check(3, "cpu")
    bad = NoiseKeys(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"keys.positions must be int64\[2\] on cpu, got dtype torch.int32$"):
        bad.check(2, "cpu")
    with pytest.raises(TypeError, match="keys.seeds must be an int64"):
        NoiseKeys([0, 0], keys.positions).check(2, "cpu")


@pytest.mark.parametrize("temp_rows, match", [
    (None, r"temp_rows \(float32\[3\] on cpu\) is required"),
    (torch.tensor([0.5]), r"temp_rows must be float32\[3\] on cpu, got torch.float32\[1\]"),
    (torch.ones(3, 1), r"got torch.float32\[3, 1\]"),
    (torch.ones(3, dtype=torch.float64), r"got torch.float64\[3\]"),
    ([0.5, 1.0, 1.0], "got list"),
])
def test_row_stats_checks_temp_rows_of_differing_requests(temp_rows, match):
    """A float32[1] broadcast the first request's temperature over every row, silently."""
    table = SamplingTable.from_params([SamplingParams(temperature=0.5), SamplingParams()], 2)
    with pytest.raises(TypeError if isinstance(temp_rows, list) else ValueError, match=match):
        row_stats(torch.randn(3, 10), table, np.array([1, 2]), temp_rows)


@pytest.mark.parametrize("logits, error, got", [
    (torch.randn(10), ValueError, r"shape \[10\]"),
    (torch.randn(1, 2, 10), ValueError, r"shape \[1, 2, 10\]"),
    (np.zeros((1, 10), np.float32), TypeError, "ndarray"),
])
def test_row_stats_needs_2d_logits(logits, error, got):
    table = SamplingTable.from_params(SamplingParams(), 1)
    with pytest.raises(error, match=rf"logits must be a 2-D \[R, V\] tensor, got {got}"):
        row_stats(logits, table, np.array([1]))


@pytest.mark.parametrize("seeds, positions, match", [
    ([-1, 3], [0, 0], r"seeds must hold integers in \[0, 9223372036854775807\], got values from -1 to 3"),
    ([0, 3], [5, -2], r"positions must hold integers in \[0, 9223372036854775807\], got values from -2 to 5"),
])
def test_race_uniforms_refuses_negative_keys(seeds, positions, match):
    """The core reads a key as 64 unsigned bits, so seed -1 raced as seed 2**64 - 1 (no seed
    SamplingParams or sample_seed gives) and position -2 as 2**64 - 2, silently."""
    with pytest.raises(ValueError, match=match):
        race_uniforms(torch.tensor(seeds), torch.tensor(positions), 5)
    assert race_uniforms(torch.tensor([2**63 - 1]), torch.tensor([2**63 - 1]), 5).shape == (1, 5)


def test_noise_keys_check_compares_devices_as_tensors_land():
    """A device named with an index the tensors' device lacks ("cpu:0": tensors on the CPU have
    none) was a mismatch, and so was "cuda" for keys on cuda:0."""
    keys = NoiseKeys(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    keys.check(2, "cpu:0")
    keys.check(2, torch.device("cpu", 0))
    with pytest.raises(ValueError, match=r"keys.seeds must be int64\[2\] on meta, got device cpu$"):
        keys.check(2, "meta")


def test_same_device_resolves_an_index_less_device_to_the_current_one(monkeypatch):
    """"cuda" is the device a tensor made on "cuda" lands on: the current CUDA device."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert same_device("cuda", "cuda:1") and same_device(torch.device("cuda:1"), "cuda")
    assert not same_device("cuda", "cuda:0") and not same_device("cuda:0", "cuda:1")
    assert same_device("cuda", "cuda") and not same_device("cuda", "cpu")
    assert same_device("cpu:0", "cpu") and same_device("mps", "mps:0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_noise_keys_on_cuda_pass_a_check_against_cuda():
    keys = NoiseKeys(*torch.zeros(2, 2, dtype=torch.int64, device="cuda"))
    keys.check(2, "cuda")
    keys.check(2, torch.device("cuda", torch.cuda.current_device()))
    with pytest.raises(ValueError, match=r"keys.seeds must be int64\[2\] on cpu, got device cuda:\d$"):
        keys.check(2, "cpu")
