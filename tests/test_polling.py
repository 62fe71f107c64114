"""The shared polling helper: it returns the value it waited for, and a wait that never ends fails
with the message the test gave and the last value it read."""
from __future__ import annotations

import itertools
import time

import pytest

from polling import wait_until


def test_returns_the_first_value_that_ends_the_wait() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter), "the counter did not reach 3", until=lambda n: n >= 3) == 3


def test_a_condition_that_never_holds_fails_with_what_and_the_last_value() -> None:
    reads = itertools.count()
    start = time.monotonic()
    message = r"^the counter did not reach -1 \(waited \d+\.\d\d s; last value read: \d+\)$"
    with pytest.raises(AssertionError, match=message):
        wait_until(lambda: next(reads), "the counter did not reach -1", until=lambda n: n < 0, timeout_s=0.05)
    assert time.monotonic() - start >= 0.05
    assert next(reads) >= 2  # it kept reading until the limit, not once


def test_a_time_limit_already_spent_reads_once() -> None:
    """A caller sharing one deadline between waits may pass what is left of it: nothing."""
    reads = itertools.count()
    with pytest.raises(AssertionError, match="last value read: 0"):
        wait_until(lambda: next(reads), "never true", until=lambda n: n < 0, timeout_s=-1.0)
    assert next(reads) == 1
    assert wait_until(lambda: "ready", "never read", timeout_s=0.0) == "ready"


def test_a_pause_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0, got 0.0"):
        wait_until(lambda: True, "never waited", interval_s=0.0)
