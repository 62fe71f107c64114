"""Reward for the OpenRLHF example, loaded by OpenRLHF from ``--reward.remote_url <this file>``.

OpenRLHF calls ``reward_func(queries, prompts, labels)`` (queries are prompt + response text) and
reads ``rewards`` (the training signal) and ``scores`` (logged) from the returned dict.
"""
from __future__ import annotations

import re

import torch

_ANSWER = re.compile(r"Answer:\s*(-?[\d,]*\.?\d+)")


def extract_answer(text: str) -> str | None:
    """The number after the last 'Answer:' in ``text``, commas removed; None when absent."""
    found = _ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


def _same_number(got: str | None, label: str) -> bool:
    if got is None:
        return False
    try:
        return abs(float(got) - float(label)) < 1e-6
    except ValueError:
        return got.strip() == label.strip()


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """1.0 when the response's final answer equals the label, else 0.0."""
    rewards = torch.tensor(
        [float(_same_number(extract_answer(q[len(p):] if q.startswith(p) else q), str(lab)))
         for q, p, lab in zip(queries, prompts, labels)]
    )
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
