"""The OpenRLHF hook without OpenRLHF, Ray or vLLM installed: flag parsing, the engine and
trainer mixins over stand-in base classes, and the log dict. The same pieces are run against the
real packages in tests/test_integration_openrlhf_real.py when they are importable."""
from __future__ import annotations

import asyncio
import sys
import types
from types import SimpleNamespace

import pytest

import rollout_spec.integrations.openrlhf.engines as engines
from rollout_spec.config import SpecConfig
from rollout_spec.integrations.openrlhf.engines import (
    SpecEngineMixin,
    SpecTrainerMixin,
    _InjectKwargs,
    merge_step_results,
)
from rollout_spec.integrations.openrlhf.options import spec_from_args, split_argv
from rollout_spec.integrations.openrlhf.train_ppo_ray import main
from rollout_spec.integrations.vllm import SpecDecodeCounters


def test_flags_become_a_spec_config_and_the_rest_goes_to_openrlhf():
    ns, rest = split_argv([
        "--vllm.num_engines", "2", "--rollout_spec", "--rollout_spec.num_draft_tokens", "6",
        "--rollout_spec.group_weight", "2.5", "--rollout_spec.num_speculative_tokens", "4",
        "--rollout_spec.external_corpora", "a.npy", "b.npy", "--actor.model_name_or_path", "m",
    ])
    assert rest == ["--vllm.num_engines", "2", "--actor.model_name_or_path", "m"]
    spec, k = spec_from_args(ns)
    assert k == 4
    assert spec == SpecConfig(num_draft_tokens=6, group_weight=2.5, tree=False,
                              external_corpora=("a.npy", "b.npy"))
    spec, _ = spec_from_args(split_argv(["--rollout_spec", "--rollout_spec.tree", "true"])[0])
    assert spec.tree is True
    assert spec_from_args(split_argv(["--vllm.num_engines", "2"])[0]) is None


def test_launcher_refuses_bad_options_before_touching_openrlhf():
    with pytest.raises(SystemExit, match="rollout_spec.max_depth was given without --rollout_spec"):
        main(["--rollout_spec.max_depth", "3"])
    with pytest.raises(SystemExit, match=r"^rollout-spec: --rollout_spec\.max_depth must be in \[1, 1024\], got 0$"):
        main(["--rollout_spec", "--rollout_spec.max_depth", "0"])
    with pytest.raises(SystemExit, match=r"^rollout-spec: --rollout_spec\.num_speculative_tokens must be in"):
        main(["--rollout_spec", "--rollout_spec.num_speculative_tokens", "0"])
    with pytest.raises(SystemExit, match=r"num_speculative_tokens must be in \[1, 1024\], got 0"):
        main(["--rollout_spec", "--rollout_spec.num_speculative_tokens", "0"])
    with pytest.raises(SystemExit, match=r"num_draft_tokens is 0 \(speculation off\): drop --rollout_spec"):
        main(["--rollout_spec", "--rollout_spec.num_draft_tokens", "0"])
    for flag in ("--train.async_enable", "--train.async_e", "--train.async_ena"):  # argparse's prefixes too
        with pytest.raises(SystemExit, match="does not support --train.async_enable"):
            main(["--rollout_spec", flag])
    with pytest.raises(SystemExit):  # argparse: not a bool
        split_argv(["--rollout_spec", "--rollout_spec.tree", "maybe"])


def test_a_misspelt_option_is_refused_with_the_nearest_flag():
    """A misspelt ``--rollout_spec.*`` option was passed on to OpenRLHF's parser, which knows
    nothing of our fields; it stops the launch here, naming the nearest field's flag."""
    with pytest.raises(SystemExit, match=r"unknown option --rollout_spec\.num_draft_token "
                                         r"\(did you mean --rollout_spec\.num_draft_tokens\?\)"):
        main(["--rollout_spec", "--rollout_spec.num_draft_token", "8"])
    with pytest.raises(SystemExit, match=r"unknown option --rollout_spec\.zzz \(the options are"):
        split_argv(["--rollout_spec.zzz=3", "--actor.model_name_or_path", "m"])
    assert split_argv(["--rollout_spec", "--actor.x", "3"])[1] == ["--actor.x", "3"]


def test_launcher_without_openrlhf_names_the_missing_package(monkeypatch):
    """Without OpenRLHF installed the launcher (even its --help) ended in an ImportError
    traceback from runpy; it now exits with a message naming the package and its install."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "openrlhf" else find_spec(name, *a))
    for argv in (["--help"], ["--rollout_spec", "--rollout_spec.num_draft_tokens", "8"]):
        with pytest.raises(SystemExit, match=r"openrlhf is not installed \(pip install 'rollout-spec\[openrlhf\]'\)"):
            main(argv)


class FakeLLM:
    async def collective_rpc(self, method):
        assert method == "rollout_spec_end_step"
        return [{"chain_tokens_proposed": 5, "drafter/tokens": 7}, {"chain_tokens_proposed": 5}]


class FakeRolloutActor:
    """OpenRLHF's RolloutRayActor shape: async __init__ that hands kwargs to vLLM."""

    async def __init__(self, *args, **kwargs):
        self.engine_args = kwargs
        self.llm = FakeLLM()


def test_engine_mixin_passes_engine_args_and_reports_step_counters(monkeypatch):
    readings = iter([SpecDecodeCounters(1, 4, 2), SpecDecodeCounters(5, 20, 12)])
    monkeypatch.setattr(engines, "_counters_now", lambda: next(readings))
    cls = type("Spec", (SpecEngineMixin, FakeRolloutActor), {})
    actor = cls.__new__(cls)
    extra = {"speculative_config": {"method": "custom_class"}, "disable_log_stats": False}
    asyncio.run(actor.__init__(model="m", rollout_spec_engine_kwargs=extra))
    assert actor.engine_args == {"model": "m", **extra}
    step, workers = asyncio.run(actor.rollout_spec_end_step())
    assert step == SpecDecodeCounters(4, 16, 10) and workers[0]["chain_tokens_proposed"] == 5
    clash = cls.__new__(cls)
    with pytest.raises(ValueError, match=r"already sets \['speculative_config'\]"):
        asyncio.run(clash.__init__(speculative_config={}, rollout_spec_engine_kwargs=extra))


def test_trainer_mixin_adds_acceptance_after_openrlhfs_step(monkeypatch):
    class Trainer:
        vllm_engines = ["engine0"]

        def train_step(self, rollout_samples, global_step):
            return {"policy_loss": 0.1}, global_step + 1

    seen = []
    monkeypatch.setattr(engines, "end_step_and_collect",
                        lambda e: seen.append(list(e)) or {"rollout/spec_accept_rate": 0.5})
    trainer = type("Spec", (SpecTrainerMixin, Trainer), {})()
    status, step = trainer.train_step([], 3)
    assert step == 4 and seen == [["engine0"]]
    assert status == {"policy_loss": 0.1, "rollout/spec_accept_rate": 0.5}


def test_merge_sums_engines_and_counts_each_engines_drafter_once():
    logs = merge_step_results([
        (SpecDecodeCounters(4, 16, 8), [{"chain_tokens_proposed": 16, "drafter/x": 1}, {"chain_tokens_proposed": 16}]),
        (SpecDecodeCounters(6, 24, 4), [{"chain_tokens_proposed": 24, "active": True}]),
    ])
    assert logs["rollout/spec_accept_rate"] == pytest.approx(12 / 40)
    assert logs["rollout/spec_accept_length"] == pytest.approx(1 + 12 / 10)
    assert logs["rollout/spec_chain_tokens_proposed"] == 40.0
    assert logs["rollout/spec_drafter_x"] == 1.0 and "rollout/spec_active" not in logs
    # two engines after their third step: the step is 3 on both, the totals add up
    third = {"steps_ended": 3, "drafter/step": 3, "requests_started": 24, "drafter/index_tokens": 500}
    logs = merge_step_results([(SpecDecodeCounters(), [third]), (SpecDecodeCounters(), [third])])
    assert logs["rollout/spec_steps_ended"] == logs["rollout/spec_drafter_step"] == 3.0
    assert logs["rollout/spec_requests_started"] == 48.0 and logs["rollout/spec_drafter_index_tokens"] == 1000.0


def test_inject_kwargs_keeps_openrlhfs_options_call():
    calls = []

    class Remote:
        def __init__(self, options=None):
            self.opts = options

        def options(self, **o):
            return Remote(o)

        def remote(self, **kw):
            calls.append((self.opts, kw))

    _InjectKwargs(Remote(), {"speculative_config": 1}).options(num_gpus=1).remote(model="m")
    assert calls == [({"num_gpus": 1}, {"rollout_spec_engine_kwargs": {"speculative_config": 1}, "model": "m"})]


def test_inject_kwargs_places_engine_i_as_replica_i_for_the_shared_index():
    calls = []

    class Remote:
        def options(self, **o):
            return self

        def remote(self, **kw):
            calls.append(kw["rollout_spec_engine_kwargs"]["additional_config"])

    inject = _InjectKwargs(Remote(), {"additional_config": {"rollout_spec": {}}}, num_engines=2)
    inject.options(num_gpus=1).remote()
    inject.options(num_gpus=1).remote()
    assert calls == [{"rollout_spec": {}, "rollout_spec_replica": {"replica_id": r, "num_replicas": 2}}
                     for r in range(2)]


def test_engine_factory_creates_the_coordinators_and_places_each_engine(monkeypatch):
    from rollout_spec.distributed import sharing

    made, started = [], []
    monkeypatch.setattr(sharing, "ensure_coordinators", lambda spec, n: made.append((spec.shared_index, n)))

    class Remote:  # our engine actor class, as actor_subclass would build it
        def options(self, **o):
            return self

        def remote(self, *args, **kw):
            started.append(kw["rollout_spec_engine_kwargs"]["additional_config"]["rollout_spec_replica"])
            return len(started)

    monkeypatch.setattr(engines, "actor_subclass", lambda mixin, cls, name: Remote())
    module = SimpleNamespace(RolloutRayActor="theirs")

    def create_vllm_engines(num_engines, tensor_parallel_size, pretrain):  # OpenRLHF's loop, reduced
        return [module.RolloutRayActor.options(num_gpus=1).remote(model=pretrain) for _ in range(num_engines)]

    module.create_vllm_engines = create_vllm_engines
    create = engines.wrap_create_vllm_engines(module, {"additional_config": {}}, SpecConfig(shared_index="idx"))
    assert create(3, 1, pretrain="m") == [1, 2, 3] and module.RolloutRayActor == "theirs"
    assert made == [("idx", 3)] and started == [{"replica_id": i, "num_replicas": 3} for i in range(3)]


class _Engine:
    def __init__(self, name: str, pending: int) -> None:
        self.name = name
        self.get_num_unfinished_requests = SimpleNamespace(remote=lambda: pending)


class _SamplesGenerator:
    """OpenRLHF's SamplesGenerator reduced to what the routing hook touches."""

    def __init__(self, engines: list) -> None:
        self.vllm_engines, self.calls = engines, []
        self.tokenizer = lambda text, add_special_tokens: {"input_ids": [ord(c) for c in text]}
        self.args = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=4))

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        self.calls.append(len(self.vllm_engines))  # OpenRLHF's least-pending pick among these
        return [(self.vllm_engines[0].name, p, lab, img) for p, lab, img in zip(prompts, labels, images)]


def test_trainer_mixin_makes_openrlhfs_dispatch_sticky_by_prompt(monkeypatch):
    from rollout_spec.distributed import GroupRouter, group_key

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get=lambda refs: refs))
    engines_ = [_Engine(f"e{i}", pending=0) for i in range(4)]

    class Trainer:
        def __init__(self):
            self.samples_generator = _SamplesGenerator(engines_)

    trainer = type("Spec", (SpecTrainerMixin, Trainer), {})()
    gen = trainer.samples_generator
    prompts = [f"q{i}" for i in range(12)]
    refs = gen._dispatch_prompts_to_vllm(prompts, [f"l{i}" for i in range(12)], temperature=1.0)
    keys = [group_key([ord(c) for c in p]) for p in prompts]  # the engine-side drafter's group ids
    expected = GroupRouter(4).assign(keys, weights=[4] * 12).tolist()
    assert [r[0] for r in refs] == [f"e{e}" for e in expected] and [r[1] for r in refs] == prompts
    assert set(gen.calls) == {1} and gen.vllm_engines == engines_  # narrowed per call, then restored
    again = gen._dispatch_prompts_to_vllm(prompts[::-1], ["x"] * 12, images=[None] * 12)
    assert [r[0] for r in again] == [r[0] for r in refs][::-1]  # next step: same prompt, same engine


def _openrlhf_engine_prompt(ids: list, max_len: int, max_new_tokens) -> list:
    """What OpenRLHF 0.11.2's SingleTurnAgentExecutor.execute (openrlhf/utils/agent.py) hands vLLM:
    the last max_len - max_tokens tokens of a longer prompt."""
    max_tokens = max_new_tokens if max_new_tokens is not None else max(1, max_len - len(ids))
    keep = max_len - max_tokens
    return ids[-keep:] if len(ids) > keep else ids


@pytest.mark.parametrize("max_new_tokens", [8, None])
def test_dispatch_keys_a_truncated_prompt_by_the_tokens_its_engine_sees(monkeypatch, max_new_tokens):
    """A prompt over OpenRLHF's max_len budget reaches vLLM cut to its tail; the engine's drafter
    groups it (and the shared index places its history) by those tokens, so routing must too."""
    from rollout_spec.distributed import GroupRouter, group_key
    from rollout_spec.integrations.openrlhf.routing import route_dispatch_by_group

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get=lambda refs: refs))
    gen = _SamplesGenerator([_Engine(f"e{i}", pending=0) for i in range(8)])
    route_dispatch_by_group(gen)
    prompts = [f"a long shared instruction, then question {i:02d}" for i in range(16)] + [f"q{i}" for i in range(8)]
    prompts += ["x" * 40 + "the very same tail, kept", "y" * 9 + "the very same tail, kept"]  # one, once cut
    refs = gen._dispatch_prompts_to_vllm(prompts, ["l"] * len(prompts), max_len=24, max_new_tokens=max_new_tokens)
    seen = [_openrlhf_engine_prompt([ord(c) for c in p], 24, max_new_tokens) for p in prompts]
    expected = GroupRouter(8).assign([group_key(s) for s in seen], weights=[4] * len(prompts)).tolist()
    assert [r[0] for r in refs] == [f"e{e}" for e in expected] and [r[1] for r in refs] == prompts
    assert refs[-1][0] == refs[-2][0]


def test_dispatch_with_a_vlm_processor_keys_its_one_row(monkeypatch):
    """For a VLM, OpenRLHF's tokenizer is an AutoProcessor (openrlhf/utils/utils.py get_tokenizer),
    whose input_ids hold one row per text; the engine takes row 0 (openrlhf/utils/vlm_utils.py)."""
    from rollout_spec.distributed import GroupRouter, group_key
    from rollout_spec.integrations.openrlhf.routing import route_dispatch_by_group

    class Processor:
        image_processor = object()

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [[ord(c) for c in text]]}

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get=lambda refs: refs))
    gen = _SamplesGenerator([_Engine(f"e{i}", pending=0) for i in range(4)])
    gen.tokenizer = Processor()
    route_dispatch_by_group(gen)
    prompts = [f"describe image {i}" for i in range(8)]
    refs = gen._dispatch_prompts_to_vllm(prompts, ["l"] * 8, images=[None] * 8, max_new_tokens=16)
    expected = GroupRouter(4).assign([group_key([ord(c) for c in p]) for p in prompts], weights=[4] * 8).tolist()
    assert [r[0] for r in refs] == [f"e{e}" for e in expected]


def test_check_openrlhf_names_a_changed_dispatch():
    from rollout_spec.integrations.openrlhf.train_ppo_ray import _dispatch_problems

    assert _dispatch_problems(_SamplesGenerator) == []
    changed = type("G", (), {"_dispatch_prompts_to_vllm": lambda self, prompts: []})
    assert "no longer takes" in _dispatch_problems(changed)[0]
    assert "is gone" in _dispatch_problems(object)[0]


def _load_example(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "examples" / "openrlhf" / name
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def test_example_reward_and_rollout_spec_flags():
    import re

    reward, _ = _load_example("reward_func.py")
    out = reward.reward_func(["Q: 2+2? Answer: 4", "Q: 1+9? I think Answer: 1,0", "Q: x"],
                             ["Q: 2+2?", "Q: 1+9?", "Q: x"], ["4", "10", "3"])
    assert out["rewards"].tolist() == [1.0, 1.0, 0.0]
    _, path = _load_example("reward_func.py")
    script = path.with_name("train_grpo_rollout_spec.sh").read_text()
    block = script.split("ROLLOUT_SPEC_ARGS=(", 1)[1].split("\n)", 1)[0]
    ns, rest = split_argv(re.findall(r"\S+", block))
    assert rest == []
    spec, _ = spec_from_args(ns)
    assert spec.num_draft_tokens == 8 and spec.group_weight == 2.0 and spec.tree is False


@pytest.mark.parametrize("baseline", [False, True])
def test_example_script_launches_with_or_without_speculation(tmp_path, baseline):
    """The launch script, run against a stand-in ``python`` that records its arguments: the
    trainer gets the rollout_spec flags, and with BASELINE=1 none of them."""
    import os
    import subprocess
    from pathlib import Path

    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" >> "$CALLS"; echo ---- >> "$CALLS"\n')
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    script = Path(__file__).parents[1] / "examples" / "openrlhf" / "train_grpo_rollout_spec.sh"
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}", CALLS=str(calls), OUT=str(tmp_path / "out"),
               BASELINE="1" if baseline else "0")
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=60)
    prompts, train = [c.split("\n") for c in calls.read_text().split("----\n")[:2]]
    assert prompts[0].endswith("make_prompts.py")
    assert train[:2] == ["-m", "rollout_spec.integrations.openrlhf.train_ppo_ray"]
    assert ("--rollout_spec" in train) is not baseline
    assert not baseline or not any(a.startswith("--rollout_spec.") for a in train)
    assert "--actor.model_name_or_path" in train


def test_example_scripts_default_run_folder_is_git_ignored(tmp_path):
    """Run from a checkout, the script keeps its checkpoints under examples/openrlhf/runs/: that
    folder was not ignored, so a run left gigabytes of untracked files in the repository."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" >> "$CALLS"; echo ---- >> "$CALLS"\n')
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "BASELINE")}
    env.update(PATH=f"{fake.parent}:{os.environ['PATH']}", CALLS=str(calls))
    subprocess.run(["bash", str(root / "examples/openrlhf/train_grpo_rollout_spec.sh")], env=env, check=True,
                   timeout=60)
    prompts = calls.read_text().split("----\n")[0].split("\n")
    out = Path(prompts[prompts.index("--out") + 1])
    assert out.parent == root / "examples/openrlhf/runs/grpo_rollout_spec"
    ignored = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", str(out)], timeout=60)
    assert ignored.returncode == 0, f"{out.relative_to(root)} is not git-ignored"


def test_example_script_refuses_a_baseline_switch_it_does_not_know(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).parents[1] / "examples" / "openrlhf" / "train_grpo_rollout_spec.sh"
    run = subprocess.run(["bash", str(script)], env=dict(os.environ, BASELINE="yes", OUT=str(tmp_path)),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "BASELINE must be 0 (speculation on) or 1" in run.stderr


def test_example_prompts_are_jsonl_with_labels(tmp_path):
    import json

    pytest.importorskip("reasoning_gym", reason="reasoning-gym is the [workloads] extra")
    prompts, _ = _load_example("make_prompts.py")
    out = tmp_path / "p.jsonl"
    assert prompts.write_prompts(out, ["basic_arithmetic"], 3, 0) == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["prompt"].startswith(prompts.INSTRUCTION) and r["label"] for r in rows)
