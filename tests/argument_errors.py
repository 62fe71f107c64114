"""Shared checks of the command-line tests: a refused argument is an argparse error (exit status
2, its message on stderr), raised before any work, on a machine with or without a GPU."""
from __future__ import annotations

from typing import Any, Callable

import pytest


def argument_error(main: Callable[[Any], Any], argv: Any, capsys: pytest.CaptureFixture) -> str:
    """Run ``main(argv)``, assert that it exits with status 2, and return what it wrote to stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def hide_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch see no CUDA device, as on a CPU-only machine (both of the ways code asks)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
