"""The one place rollout-spec changes SGLang: a general plugin that swaps the NGRAM corpus class.

SGLang runs every ``sglang.srt.plugins`` entry point at the start of each scheduler process
(``load_plugins`` in ``run_scheduler_process``). Ours is declared in pyproject.toml and acts only
when ``ROLLOUT_SPEC_SGLANG`` is set: it registers ``RolloutSpecCorpus`` as a class REPLACE hook on
``NgramCorpus``, which SGLang's HookRegistry also rebinds in the NGRAM worker module that
imported it, and a BEFORE hook on the worker's ``forward_batch_generation`` that hands the corpus
each batch's requests, so their last verify round is indexed when they leave and a request that
finishes at its prefill is indexed at all.
``upstream_problems`` checks SGLang's source for the shape this relies on.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import logging
from pathlib import Path
from typing import Any, Optional

from rollout_spec.integrations.sglang.config import ENV_VAR, spec_from_env

logger = logging.getLogger(__name__)

CORPUS_TARGET = "sglang.srt.speculative.cpp_ngram.ngram_corpus.NgramCorpus"
"""Dotted path of the class replaced (SGLang's NGRAM corpus)."""
WORKER_FILE = "srt/speculative/ngram_worker.py"
"""The NGRAM worker, relative to the sglang package: it must build and call the corpus as we expect."""
FORWARD_TARGET = "sglang.srt.speculative.ngram_worker.NGRAMWorker.forward_batch_generation"
"""Dotted path of the worker method that ``track_batch_requests`` runs before."""
PLUGINS_FILE = "srt/plugins/__init__.py"
HOOKS_FILE = "srt/plugins/hook_registry.py"
SCHEDULER_FILE = "srt/managers/scheduler.py"
REQ_FILE = "srt/managers/schedule_batch.py"
REQ_FIELDS = ("output_ids_through_stop", "origin_input_ids_unpadded", "output_ids", "finished")
"""What ``RolloutSpecCorpus`` reads of an SGLang ``Req``: its output cut at its stop, the prompt
the worker measures ``total_lens`` by, its output so far (empty: a fresh prefill) and whether it
finished (a request tracked at prefill is indexed then)."""


def register() -> bool:
    """SGLang plugin entry point: replace the NGRAM corpus when ``ROLLOUT_SPEC_SGLANG`` is set.

    Also hooks the worker's forward (``track_batch_requests``), which the corpus needs to see
    the tokens a request commits in its last verify round and requests that finish at prefill.
    Returns True when the hooks were registered, False when the variable is unset. A bad variable,
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
    HookRegistry.register(FORWARD_TARGET, track_batch_requests, HookType.BEFORE)
    logger.info("rollout-spec: NGRAM corpus replaced (%s=%s)", ENV_VAR, spec)
    return True


def track_batch_requests(worker: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook on ``NGRAMWorker.forward_batch_generation(batch, ...)``: hand the corpus the
    requests of every batch the worker runs.

    The worker gives the corpus a round's accepted tokens only through the next ``batch_get`` and
    erases a request that left by id alone, so without the request objects a decode request's last
    verify round is lost (``track_requests``); a request that finishes at its prefill never
    reaches the corpus at all (``track_prefill_requests`` for batches that are not decodes).
    Returns None: SGLang's BEFORE hooks leave the arguments as they are then.

    Raises:
        RuntimeError: the worker's corpus is not ours (the REPLACE hook did not apply).
    """
    from rollout_spec.integrations.sglang.corpus import RolloutSpecCorpus

    corpus = worker.ngram_corpus
    if not isinstance(corpus, RolloutSpecCorpus):
        raise RuntimeError(
            f"{ENV_VAR} is set but the NGRAM worker drafts with {type(corpus).__name__}, not "
            f"RolloutSpecCorpus: the REPLACE hook on {CORPUS_TARGET} did not apply (see SGLang's log)"
        )
    if batch.forward_mode.is_decode():
        corpus.track_requests(batch.reqs)
    else:
        corpus.track_prefill_requests(batch.reqs)
    return None


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
    plugin registry offers class REPLACE hooks; schedulers load plugins; and what the forward hook
    relies on (``_forward_hook_problems``).
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
    plugins = _read(root, PLUGINS_FILE)
    if '"sglang.srt.plugins"' not in plugins or "def load_plugins" not in plugins:
        problems.append(f"{PLUGINS_FILE} has no general-plugin group 'sglang.srt.plugins'")
    if "load_plugins()" not in (root / SCHEDULER_FILE).read_text():
        problems.append(f"{SCHEDULER_FILE} no longer calls load_plugins()")
    return problems + _forward_hook_problems(root, worker, calls)


def _forward_hook_problems(root: Path, worker: ast.Module, calls: list[ast.Call]) -> list[str]:
    """What ``track_batch_requests`` and the corpus's final-round read rely on, where it is not.

    The worker class and method of FORWARD_TARGET exist, the method takes ``batch`` first, gates
    drafting on ``forward_mode.is_decode()`` and erases departed requests through the corpus; it
    measures ``total_lens`` with the ``Req`` fields we read at the end; ``Req`` still has those and
    the ones a request tracked at its prefill is read by (REQ_FIELDS); and the registry has BEFORE
    hooks.
    """
    problems = []
    cls, method = FORWARD_TARGET.split(".")[-2:]
    classes = [n for n in worker.body if isinstance(n, ast.ClassDef) and n.name == cls]
    forwards = [f for c in classes for f in c.body if isinstance(f, ast.FunctionDef) and f.name == method]
    if not forwards:
        problems.append(f"{WORKER_FILE} has no {cls}.{method} to hook")
    elif [a.arg for a in forwards[0].args.args[:2]] != ["self", "batch"]:
        problems.append(f"{cls}.{method} in {WORKER_FILE} no longer takes (self, batch, ...)")
    used = {n.attr for n in ast.walk(worker) if isinstance(n, ast.Attribute)}
    for name in ("is_decode", "reqs", "origin_input_ids_unpadded", "output_ids"):
        if name not in used:
            problems.append(f"{WORKER_FILE} no longer reads .{name}, which the forward hook relies on")
    if "erase_match_state" not in _corpus_methods_called(calls):
        problems.append(f"{WORKER_FILE} no longer calls ngram_corpus.erase_match_state")
    req_source = _read(root, REQ_FILE)
    for name in REQ_FIELDS:
        if f"def {name}(" not in req_source and f"self.{name} =" not in req_source:
            problems.append(f"{REQ_FILE} no longer defines Req.{name}")
    if 'BEFORE = "before"' not in _read(root, HOOKS_FILE):
        problems.append(f"{HOOKS_FILE} has no HookType.BEFORE")
    return problems


def _read(root: Path, rel: str) -> str:
    """Text of SGLang source file ``rel`` under ``root``, or "" when it is missing."""
    path = root / rel
    return path.read_text() if path.exists() else ""


def _corpus_methods_called(calls: list[ast.Call]) -> set[str]:
    """Names X in ``self.ngram_corpus.X(...)`` calls."""
    names = set()
    for call in calls:
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr == "ngram_corpus":
            names.add(f.attr)
    return names
