"""Files written whole or not at all."""
from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replaced_on_success(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` for the block to write; renamed onto ``path`` when the
    block succeeds, removed when it fails or is interrupted. A checkpoint or cache stopped
    mid-write thus leaves the file that was there before (or none), never half of a new one.

    Each call gets its own temporary, so two writers of one path (two threads of a process too)
    never write into each other's; the last rename wins whole. A path that names a directory
    (ending in a separator, ``.`` or ``..``) is refused (IsADirectoryError) and an empty one
    (FileNotFoundError), as opening them would be, before the block runs.
    """
    text = os.fspath(path)
    if not text:
        raise FileNotFoundError(errno.ENOENT, "an empty path names no file", text)
    if os.path.basename(text) in ("", ".", ".."):  # splits at altsep too, where there is one
        raise IsADirectoryError(errno.EISDIR, "names a directory, not a file", text)
    path = Path(text)
    # 200 bytes of the name at most, so that the temporary's stays within 255
    stem = os.fsencode(path.name)[:200].decode("utf-8", "ignore")
    tmp = path.with_name(f"{stem}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):  # never hide the block's own error behind this one
            tmp.unlink(missing_ok=True)
