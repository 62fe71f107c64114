"""A drafter that also feeds the shared index: every adapter switches it on the same way.

:class:`SharingDrafter` wraps a drafter (``NgramDrafter``) and is called exactly like it. It
keeps the tokens each grouped request commits, records the response when the request finishes,
and publishes at ``end_step`` (the RL step boundary) before the drafter ages its history. The
client's background thread ingests the other replicas' publications into the wrapped drafter.
:func:`share_drafter` applies it when ``SpecConfig.shared_index`` names a coordinator group; the
SGLang corpus, the vLLM proposer and the embedded engine call it where they build their drafter.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Optional

from rollout_spec.config import SpecConfig
from rollout_spec.distributed.coordinator import default_num_shards
from rollout_spec.distributed.placement import (
    ENV_NUM_REPLICAS,
    ENV_REPLICA_ID,
    NAMESPACE,
    ReplicaPlacement,
    placement_from_env,
)
from rollout_spec.distributed.shared_index import SharedIndexClient, SharedIndexConfig
from rollout_spec.drafter import background_kwargs

logger = logging.getLogger(__name__)


class SharingDrafter:
    """``drafter`` plus a :class:`SharedIndexClient`: same calls, and finished grouped samples are
    published at every ``end_step``. Everything not defined here goes to the wrapped drafter."""

    def __init__(self, drafter: Any, index: SharedIndexClient) -> None:
        self.drafter = drafter
        self.index = index
        self._live: dict[int, tuple[int, list[int]]] = {}  # req id -> (group, committed tokens)
        self._next_step = 0

    def start(self, req_id: int, prompt_ids: Any, group_id: Optional[int] = None) -> None:
        """Start one request (see ``NgramDrafter.start``)."""
        self.start_batch([req_id], [prompt_ids], [group_id])

    def start_batch(self, req_ids: Sequence[int], prompts: Sequence[Any],
                    group_ids: Optional[Sequence[Optional[int]]] = None) -> None:
        """Start requests; grouped ones are followed until they finish (groupless are not shared)."""
        self.drafter.start_batch(req_ids, prompts, group_ids)
        for rid, gid in zip(req_ids, () if group_ids is None else group_ids):
            if gid is not None:
                self._live[int(rid)] = (int(gid), [])

    def extend(self, req_id: int, token_ids: Any) -> None:
        """Commit tokens to one request."""
        self.extend_batch([req_id], [token_ids])

    def extend_batch(self, req_ids: Sequence[int], token_lists: Sequence[Any], *,
                     background: bool = False) -> None:
        """Commit tokens; kept for grouped requests until they finish. ``background`` (see
        ``NgramDrafter.extend_batch``) is passed on only to a drafter that indexes in the
        background; another one extends at once, with the same result."""
        self.drafter.extend_batch(req_ids, token_lists, **background_kwargs(self.drafter, background))
        for rid, tokens in zip(req_ids, token_lists):
            live = self._live.get(int(rid))
            if live is not None:
                live[1].extend(tokens)

    def finish(self, req_id: int) -> None:
        """Finish one request."""
        self.finish_batch([req_id])

    def finish_batch(self, req_ids: Sequence[int]) -> None:
        """Finish requests; their responses are recorded for the next publication."""
        self.drafter.finish_batch(req_ids)
        for rid in req_ids:
            live = self._live.pop(int(rid), None)
            if live is not None and live[1]:
                self.index.record(live[0], live[1])

    def end_step(self) -> None:
        """RL step boundary: publish this step's responses, then age the drafter's history.

        Steps are numbered like the other replicas', so the coordinators retain and evict them
        together: at least the newest step published so far (others may have ended this step
        first), and at a replica's first boundary the step after the newest one published when it
        joined, since a replica (re)started mid-job generates for that step. (Were it to join just
        after a peer ended the step it is in, it labels its step one too new: kept a step longer,
        never evicted early.) A first boundary reached before the index's first pull returned
        takes that pull itself, so the step is numbered from what the job had published.

        The drafter ages even when sharing fails; then the index's error is raised. A step whose
        publish failed still counts, so the next boundary is numbered after it: a replica whose
        puller was restarted does not label its steps behind its peers', which would evict them
        early. Its responses are kept by the index and sent under its number after the restart
        (see ``SharedIndexClient.publish``).
        """
        try:
            if self._next_step == 0:
                self.index.join()
                first = self.index.step_at_join + 1
            else:
                first = self._next_step
            step = max(first, self.index.latest_step)
            self._next_step = step + 1
            self.index.publish(step)
        finally:
            self.drafter.end_step()

    def stats(self) -> dict[str, Any]:
        """The drafter's statistics plus the shared index's counters under ``shared_index/``; it
        answers while the index's puller is stopped (``shared_index/puller_failed`` is then 1.0)."""
        out = dict(self.drafter.stats())
        out.update({f"shared_index/{k}": v for k, v in self.index.stats().items()})
        return out

    def close(self) -> None:
        """Stop the index's background thread (re-raising an error it hit)."""
        self.index.close()

    def __getattr__(self, name: str) -> Any:
        if name in ("drafter", "index"):  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.drafter, name)


def share_drafter(
    drafter: Any, spec: SpecConfig, placement: Optional[ReplicaPlacement], **client_options: Any
) -> Any:
    """``drafter`` itself when ``spec.shared_index`` is None, else a :class:`SharingDrafter` over it.

    ``placement`` comes from the framework hook; None falls back to the ``ROLLOUT_SPEC_REPLICA_ID``
    / ``ROLLOUT_SPEC_NUM_REPLICAS`` variables. Ray is joined (``address="auto"``) when this process
    is not connected yet. ``client_options`` go to :class:`SharedIndexConfig`; its ``retain_steps``
    is read from the coordinators, whatever the driver gave ``ensure_coordinators``.

    Raises:
        TypeError: ``spec`` is not a SpecConfig, or ``placement`` neither a ReplicaPlacement nor None.
        ValueError: a shared index is asked for but no placement is known, or a ``retain_steps``
            client option is not the coordinators' value.
        LookupError: the coordinators were not created (``create_coordinators`` in the driver).
    """
    _check_spec(spec)
    if placement is not None and not isinstance(placement, ReplicaPlacement):
        raise TypeError(f"placement must be a ReplicaPlacement or None, got {type(placement).__name__} "
                        f"{placement!r} (from a dict: ReplicaPlacement.from_dict)")
    if spec.shared_index is None:
        return drafter
    placement = placement or placement_from_env()
    if placement is None:
        raise ValueError(
            f"SpecConfig.shared_index={spec.shared_index!r} needs this replica's rank and the replica "
            f"count: run it through a rollout-spec framework hook or set {ENV_REPLICA_ID} and {ENV_NUM_REPLICAS}"
        )
    _join_ray()
    options = {"namespace": NAMESPACE, "num_shards": default_num_shards(placement.num_replicas),
               **client_options}
    config = SharedIndexConfig(replica_id=placement.replica_id, num_replicas=placement.num_replicas,
                               name=spec.shared_index, **options)
    logger.info("rollout-spec: replica %d/%d shares its index through %r", placement.replica_id,
                placement.num_replicas, spec.shared_index)
    return SharingDrafter(drafter, SharedIndexClient(drafter, config))


def ensure_coordinators(spec: SpecConfig, num_replicas: int, retain_steps: Optional[int] = None) -> list[Any]:
    """Create (or get) the coordinators ``spec.shared_index`` names, sized for ``num_replicas``;
    the framework hooks call it in the driver. ``retain_steps`` None: ``max(1, spec.history_steps)``.
    Returns [] when no shared index is configured. ``num_replicas`` (in [1, 65536]) is checked
    either way, and ``spec`` must be a SpecConfig (TypeError, ValueError)."""
    _check_spec(spec)
    num_shards = default_num_shards(num_replicas)
    if spec.shared_index is None:
        return []
    from rollout_spec.distributed.coordinator import create_coordinators

    _join_ray()
    retain = retain_steps if retain_steps is not None else max(1, spec.history_steps)
    return create_coordinators(spec.shared_index, num_shards, retain, namespace=NAMESPACE)


def _check_spec(spec: object) -> None:
    """Refuse a ``spec`` that is not a SpecConfig (it would fail later as an AttributeError)."""
    if not isinstance(spec, SpecConfig):
        raise TypeError(f"spec must be a SpecConfig, got {type(spec).__name__}")


def _join_ray() -> None:
    """Connect this process to the running Ray cluster if it is not connected (engine subprocesses)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False, namespace=NAMESPACE)
