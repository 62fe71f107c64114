"""Group-sticky engine choice for OpenRLHF's rollout dispatch.

OpenRLHF (0.11) sends all n samples of a prompt to one vLLM engine, chosen by least pending load,
so a prompt lands on a different engine at each step and its history is elsewhere.
:func:`route_dispatch_by_group` (installed by ``--rollout_spec`` on the trainer's
``SamplesGenerator``) places prompts with :func:`assign_prompts_to_engines` instead: the same
prompt goes to the same engine every step unless that engine is over its bounded share
(``GroupRouter``), and loads stay within ``load_factor`` of even.

Engine ``i`` of ``self.vllm_engines`` is replica ``i``, so an engine's
``SharedIndexConfig.replica_id`` is its index in that list.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from rollout_spec.config import check_int
from rollout_spec.distributed import GroupRouter, group_keys

Prompt = Union[str, Sequence[int]]


def assign_prompts_to_engines(
    prompts: Sequence[Prompt],
    num_engines: int,
    n_samples_per_prompt: int = 1,
    pending: Optional[Sequence[int]] = None,
    tokenize: Optional[Callable[[str], Sequence[int]]] = None,
    router: Optional[GroupRouter] = None,
) -> list[int]:
    """The engine index for each prompt (all its samples go there), sticky by prompt.

    Args:
        prompts: prompt texts or token id lists, one per prompt (before the n-fold expansion).
        num_engines: ``len(self.vllm_engines)``.
        n_samples_per_prompt: requests each prompt brings (its weight in the balance).
        pending: requests already running per engine (``get_num_unfinished_requests``).
        tokenize: maps a text prompt to the token ids the engine will see (after OpenRLHF's
            truncation: :func:`engine_prompt_ids`); with it the routing key
            equals the group id the engine-side drafter uses (the prompt-token hash), so the
            shared index sends a group's history to the engine that serves it. Without it text
            prompts are keyed by their text: routing stays sticky, index placement may differ.
        router: reuse one router across steps (default: a new one with default bounds).
    """
    check_int("num_engines", num_engines, 1, 1 << 16)
    check_int("n_samples_per_prompt", n_samples_per_prompt, 1, 1 << 16)
    router = router or GroupRouter(num_engines)
    if router.num_replicas != num_engines:
        raise ValueError(f"router has {router.num_replicas} replicas, num_engines is {num_engines}")
    keys = group_keys(tokenize(p) if tokenize is not None and isinstance(p, str) else p for p in prompts)
    placed = router.assign(keys, weights=[n_samples_per_prompt] * len(keys), base_load=pending)
    return placed.tolist()


def engine_prompt_ids(ids: Sequence[int], max_len: int, max_new_tokens: Optional[int]) -> Sequence[int]:
    """The prompt tokens OpenRLHF's rollout executor hands vLLM for a prompt tokenized as ``ids``.

    OpenRLHF (0.11, ``SingleTurnAgentExecutor.execute``; the multi-turn executor cuts its first
    observation the same way) keeps the last ``max_len - max_tokens`` tokens of a longer prompt,
    where ``max_tokens`` is ``max_new_tokens`` or, when that is None, ``max(1, max_len - len(ids))``.
    The engine's drafter groups requests by these tokens, so the routing key must be their hash too.
    """
    max_tokens = max_new_tokens if max_new_tokens is not None else max(1, max_len - len(ids))
    keep = max_len - max_tokens
    return ids[-keep:] if len(ids) > keep else ids  # OpenRLHF's own slice, for any keep


def route_dispatch_by_group(generator: Any, router: Optional[GroupRouter] = None) -> None:
    """Make ``generator._dispatch_prompts_to_vllm`` (OpenRLHF's ``SamplesGenerator``) sticky by prompt.

    OpenRLHF's own method still builds the sampling parameters and submits the requests: it is
    called once per chosen engine with that engine's prompts and ``vllm_engines`` narrowed to it,
    so its least-pending choice has only that engine to pick. Refs come back in prompt order.
    Prompts are keyed by the token ids the engine hands vLLM (:func:`engine_prompt_ids`: tokenized
    with ``add_special_tokens=False``, then cut to the call's ``max_len`` budget), which is the
    group id the engine's drafter uses. Not for a prompt with images: vLLM expands each image
    placeholder into the image's tokens, so its drafter group differs from the key (it still
    routes sticky; the shared index may place its history on another engine).
    """
    import ray

    dispatch = type(generator)._dispatch_prompts_to_vllm  # OpenRLHF's, unbound
    engines = list(generator.vllm_engines)
    router = router or GroupRouter(len(engines))
    tokenizer = generator.tokenizer
    batched = hasattr(tokenizer, "image_processor")  # a VLM's AutoProcessor: input_ids is [ids]

    def sticky_dispatch(prompts: list, labels: list, *, images: Optional[list] = None, **generate_kwargs: Any) -> list:
        n = generate_kwargs.get("n_samples_per_prompt", generator.args.rollout.n_samples_per_prompt)
        max_len = generate_kwargs.get("max_len", 2048)  # OpenRLHF's defaults, as its dispatch reads them
        max_new_tokens = generate_kwargs.get("max_new_tokens")

        def tokenize(text: str) -> Sequence[int]:
            ids = tokenizer(text=text, add_special_tokens=False)["input_ids"]
            return engine_prompt_ids(ids[0] if batched else ids, max_len, max_new_tokens)

        pending = ray.get([e.get_num_unfinished_requests.remote() for e in engines])
        placed = assign_prompts_to_engines(prompts, len(engines), n, pending, tokenize, router)
        images = [None] * len(prompts) if images is None else images
        refs: list = [None] * len(prompts)
        for engine in sorted(set(placed)):
            rows = [i for i, e in enumerate(placed) if e == engine]
            generator.vllm_engines = [engines[engine]]
            try:
                got = dispatch(generator, [prompts[i] for i in rows], [labels[i] for i in rows],
                               images=[images[i] for i in rows], **generate_kwargs)
            finally:
                generator.vllm_engines = engines
            for i, ref in zip(rows, got):
                refs[i] = ref
        return refs

    generator._dispatch_prompts_to_vllm = sticky_dispatch
