"""Files written whole or not at all."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replaced_on_success(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` for the block to write; renamed onto ``path`` when the
    block succeeds, removed when it fails or is interrupted. A checkpoint or cache stopped
    mid-write thus leaves the file that was there before (or none), never half of a new one."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
