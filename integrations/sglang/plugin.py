"""The one place rollout-spec changes SGLang: a general plugin that swaps the NGRAM corpus class.

SGLang runs every ``sglang.srt.plugins`` entry point at the start of each scheduler process
(``load_plugins`` in ``run_scheduler_process``). Ours is declared in pyproject.toml and acts only
when ``ROLLOUT_SPEC_SGLANG`` is set: it registers ``RolloutSpecCorpus`` as a class REPLACE hook on
``NgramCorpus``, which SGLang's HookRegistry also rebinds in the NGRAM worker module that
imported it. ``upstream_problems`` checks SGLang's source for the shape this relies on.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import logging
from pathlib import Path
from typing import Optional

from rollout_spec.integrations.sglang.config import ENV_VAR, spec_from_env

logger = logging.getLogger(__name__)

CORPUS_TARGET = "sglang.srt.speculative.cpp_ngram.ngram_corpus.NgramCorpus"
"""Dotted path of the class replaced (SGLang's NGRAM corpus)."""
WORKER_FILE = "srt/speculative/ngram_worker.py"
"""The NGRAM worker, relative to the sglang package: it must build and call the corpus as we expect."""
PLUGINS_FILE = "srt/plugins/__init__.py"
SCHEDULER_FILE = "srt/managers/scheduler.py"


def register() -> bool:
    """SGLang plugin entry point: replace the NGRAM corpus when ``ROLLOUT_SPEC_SGLANG`` is set.

    Returns True when the hook was registered, False when the variable is unset. A bad variable,
    or a corpus or hook registry that does not import, raises SystemExit naming the problem:
    SGLang's loader catches a plugin's exceptions (``Exception``) and would go on drafting with
    its own NGRAM corpus, silently not what the variable asked for; SystemExit stops the
    scheduler at start-up instead.
    """
    try:
        spec = spec_from_env()
        if spec is None:
            return False
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        from rollout_spec.integrations.sglang.corpus import RolloutSpecCorpus
    except Exception as exc:
        raise SystemExit(f"rollout-spec SGLang plugin ({ENV_VAR} is set): {type(exc).__name__}: {exc}") from exc

    HookRegistry.register(CORPUS_TARGET, RolloutSpecCorpus, HookType.REPLACE)
    logger.info("rollout-spec: NGRAM corpus replaced (%s=%s)", ENV_VAR, spec)
    return True


def sglang_source_dir() -> Optional[Path]:
    """Directory of the installed ``sglang`` package, found without importing it (None if absent)."""
    found = importlib.util.find_spec("sglang")
    if found is None or not found.submodule_search_locations:
        return None
    return Path(list(found.submodule_search_locations)[0])


def upstream_problems(root: Path) -> list[str]:
    """Ways the installed SGLang differs from what the adapter and plugin rely on (empty: none).

    Checked in SGLang's source: the NGRAM worker imports ``NgramCorpus`` from CORPUS_TARGET's
    module, builds it with keywords our constructor accepts and calls only methods we define; the
    plugin registry offers class REPLACE hooks; schedulers load plugins.
    """
    from rollout_spec.integrations.sglang.corpus import RolloutSpecCorpus

    problems: list[str] = []
    worker = ast.parse((root / WORKER_FILE).read_text())
    module, _, cls = CORPUS_TARGET.rpartition(".")
    imported = any(
        isinstance(n, ast.ImportFrom) and n.module == module and any(a.name == cls for a in n.names)
        for n in ast.walk(worker)
    )
    if not imported:
        problems.append(f"{WORKER_FILE} no longer imports {cls} from {module}")
    accepted = set(inspect.signature(RolloutSpecCorpus).parameters)
    calls = [n for n in ast.walk(worker) if isinstance(n, ast.Call)]
    built = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == cls]
    if not built:
        problems.append(f"{WORKER_FILE} no longer constructs {cls}(...)")
    for call in built:
        extra = {k.arg for k in call.keywords} - accepted
        if extra or call.args:
            problems.append(f"{cls}(...) in {WORKER_FILE} passes arguments we do not accept: {sorted(extra) or 'positional'}")
    for method in sorted(_corpus_methods_called(calls)):
        if not hasattr(RolloutSpecCorpus, method):
            problems.append(f"{WORKER_FILE} calls ngram_corpus.{method}, which RolloutSpecCorpus lacks")
    plugins = (root / PLUGINS_FILE).read_text() if (root / PLUGINS_FILE).exists() else ""
    if '"sglang.srt.plugins"' not in plugins or "def load_plugins" not in plugins:
        problems.append(f"{PLUGINS_FILE} has no general-plugin group 'sglang.srt.plugins'")
    if "load_plugins()" not in (root / SCHEDULER_FILE).read_text():
        problems.append(f"{SCHEDULER_FILE} no longer calls load_plugins()")
    return problems


def _corpus_methods_called(calls: list[ast.Call]) -> set[str]:
    """Names X in ``self.ngram_corpus.X(...)`` calls."""
    names = set()
    for call in calls:
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr == "ngram_corpus":
            names.add(f.attr)
    return names
