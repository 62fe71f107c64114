"""SpecConfig and SamplingParams reject bad input with errors that name the field."""
import json
import re
from dataclasses import asdict

import numpy as np
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
        ({"min_token_prob": 10**400}, r"min_token_prob must be in \[0.0, 1.0\], got an integer beyond"),
        ({"group_weight": -10**400}, r"group_weight must be in \[0.0, 1000000.0\], got an integer beyond"),
        ({"external_corpora": None}, "external_corpora must be a list or tuple of file paths"),
        ({"external_corpora": {"a.npy": 1}}, "external_corpora must be a list or tuple of file paths"),
    ],
)
def test_spec_config_errors_name_the_field(kwargs, field):
    """Wrong types and values alike; an int too large for a float is out of range, not an
    OverflowError."""
    with pytest.raises((ValueError, TypeError), match=field):
        SpecConfig(**kwargs)


@pytest.mark.parametrize("value, error, message", [
    (5, TypeError, r"shared_index must be None or a name \(str\) of 1 to 128 characters, got int 5"),
    (b"rl", TypeError, "got bytes"),
    ("", ValueError, "got 0 characters"),
    ("x" * 129, ValueError, "got 129 characters"),
])
def test_spec_config_shared_index_errors(value, error, message):
    """A wrong type is a TypeError, a wrong length a ValueError, both naming the field."""
    with pytest.raises(error, match=message):
        SpecConfig(shared_index=value)
    assert SpecConfig(shared_index="x" * 128).shared_index == "x" * 128


@pytest.mark.parametrize("field", ["tree", "adaptive_budget"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_spec_config_bool_fields_refuse_other_types(field, value):
    """``tree`` and ``adaptive_budget`` take only True/False: a truthy 1 or "yes" is refused by
    name rather than read as True."""
    with pytest.raises(TypeError, match=rf"^{field} must be a bool, got {re.escape(repr(value))}$"):
        SpecConfig(**{field: value})


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n must"),
        ({"temperature": -1.0}, r"temperature must be 0 \(greedy\) or in \[0.01, 100.0\], got -1.0"),
        ({"temperature": float("nan")}, r"temperature must be 0 \(greedy\) or in \[0.01, 100.0\], got nan"),
        ({"temperature": "1"}, r"temperature must be a number, 0 \(greedy\) or in \[0.01, 100.0\], got str"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop_token_ids": [1, -2]}, r"stop_token_ids\[1\]"),
        ({"seed": "x"}, "seed"),
        ({"temperature": 10**400}, r"temperature must be 0 \(greedy\) or in \[0.01, 100.0\], got an integer beyond"),
        ({"temperature": 1e-30}, r"temperature must be 0 \(greedy\) or in \[0.01, 100.0\], got 1e-30"),
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


def test_numpy_numbers_are_stored_as_python_numbers():
    """A config built from numpy scalars must still travel as JSON (the adapters' env/config)."""
    spec = SpecConfig(num_draft_tokens=np.int64(8), group_weight=np.float32(0.5))
    sp = SamplingParams(n=np.int32(4), temperature=np.float64(0.6), top_k=np.int16(20), seed=np.uint8(3))
    assert type(spec.num_draft_tokens) is int and type(spec.group_weight) is float
    assert type(sp.n) is int and type(sp.temperature) is float and type(sp.top_k) is int and type(sp.seed) is int
    assert json.loads(json.dumps(asdict(spec)))["num_draft_tokens"] == 8
    assert json.loads(json.dumps(asdict(sp)))["n"] == 4


@pytest.mark.parametrize("stop_ids, shown", [
    (bytearray(b"\x02"), "bytearray"),  # its bytes would read as token ids
    (memoryview(b"\x02\x03"), "memoryview"),
    ({2: "eos"}, "dict"),  # its keys would
    (np.array(2), "ndarray"),  # a 0-d array is iterable by type only
])
def test_stop_token_ids_refuse_bytes_mappings_and_0d_arrays(stop_ids, shown):
    with pytest.raises(TypeError, match=rf"stop_token_ids must be a sequence of token ids in "
                                        rf"\[0, 2147483647\], got {shown}"):
        SamplingParams(stop_token_ids=stop_ids)


def test_stop_token_ids_take_any_iterable_of_ints():
    assert SamplingParams(stop_token_ids=np.array([2, 3])).stop_token_ids == (2, 3)
    assert SamplingParams(stop_token_ids=range(2, 4)).stop_token_ids == (2, 3)


@pytest.mark.parametrize("value", [None, 1, True, b"yes"])
def test_parse_bool_refuses_non_text_naming_the_setting(value):
    from rollout_spec.config import parse_bool

    with pytest.raises(TypeError, match=r"FLAG must be a str \(1/0, true/false, yes/no, on/off\)"):
        parse_bool("FLAG", value)
