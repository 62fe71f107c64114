"""A package's heavy names imported on first use, through a module-level ``__getattr__`` (PEP 562)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_attributes(package: str, sources: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` for ``package``: a name of ``sources`` is imported from the module it
    maps to when first asked for, so importing the package does not load torch, Ray or the engine
    until a caller needs them; any other name is an AttributeError, as for a plain module."""

    def __getattr__(name: str) -> Any:
        if name in sources:
            return getattr(import_module(sources[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
