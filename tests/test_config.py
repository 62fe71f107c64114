"""SpecConfig and SamplingParams reject bad input with errors that name the field."""
import pytest

from rollout_spec.config import SamplingParams, SpecConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_draft_tokens": -1}, "num_draft_tokens"),
        ({"max_depth": 0}, "max_depth"),
        ({"min_token_prob": 1.5}, "min_token_prob"),
        ({"min_match_len": 40, "max_match_len": 32}, "min_match_len"),
        ({"capacity_tokens": 10}, "capacity_tokens"),
        ({"group_weight": -0.1}, "group_weight"),
        ({"history_steps": 2.5}, "history_steps"),
    ],
)
def test_spec_config_errors_name_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        SpecConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n must"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop_token_ids": [1, -2]}, r"stop_token_ids\[1\]"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        SamplingParams(**kwargs)


def test_configs_are_frozen_and_normalised():
    sp = SamplingParams(stop_token_ids=[2, 3], temperature=0)
    assert sp.stop_token_ids == (2, 3) and sp.greedy
    with pytest.raises(AttributeError):
        sp.n = 3  # type: ignore[misc]
    assert SpecConfig(external_corpora=["a.npy"]).external_corpora == ("a.npy",)
