"""The one way tests wait for something another thread, process or actor does: read a value until
it is what the test waits for, or fail after a time limit, naming what did not happen and the
last value read (so a timeout says how far things got, not only that they did not finish)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(read: Callable[[], T], what: str, *, until: Callable[[T], Any] = bool,
               timeout_s: float = 10.0, interval_s: float = 0.01) -> T:
    """Call ``read()`` every ``interval_s`` until ``until(value)`` holds, and return that value.

    Args:
        read: what to observe; called at least once, and again until the time limit passed.
        what: the failure, as the test should report it ("the puller did not stop").
        until: when the wait is over; by default when the value read is truthy.
        timeout_s: how long to wait, in seconds; at most 0 reads once (the time was spent).
        interval_s: the pause between reads, in seconds (> 0).

    Raises:
        AssertionError: ``until`` did not hold within ``timeout_s``; the message is ``what``,
            the seconds waited and the last value read. A failed check, as ``assert`` raises it:
            it also crosses a Ray actor call (``pytest.fail``'s exception is no ``Exception``).
        ValueError: ``interval_s`` is not > 0.
    """
    if not interval_s > 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
    start = time.monotonic()
    while True:
        value = read()
        if until(value):
            return value
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise AssertionError(f"{what} (waited {waited:.2f} s; last value read: {value!r})")
        time.sleep(interval_s)
