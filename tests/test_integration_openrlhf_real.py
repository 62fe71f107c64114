"""The OpenRLHF hook against real OpenRLHF, Ray and vLLM (the ``[openrlhf]`` extra).

Skipped unless all three import. On a CPU-only machine this runs: our launcher's hooks installed
into OpenRLHF's real modules; OpenRLHF's real ``create_vllm_engines`` (placement group, actor
options) starting our engine actor in a local Ray cluster with one logical GPU, where a stand-in
replaces only the vLLM engine inside ``RolloutRayActor``; and ``vllm.AsyncEngineArgs`` accepting
our engine arguments. ``flash_attn`` (a CUDA-only build) is stubbed when missing, solely so that
OpenRLHF's trainer module imports. NOT run here: a PPO step, weight broadcast or generation.
"""
from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (pip install 'rollout-spec[openrlhf]')")
ray = pytest.importorskip("ray", reason="Ray is not installed (OpenRLHF needs it)")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed (OpenRLHF's rollout engine)")

from rollout_spec.config import SpecConfig  # noqa: E402
from rollout_spec.integrations.openrlhf.engines import SpecTrainerMixin, wrap_create_vllm_engines  # noqa: E402
from rollout_spec.integrations.vllm import engine_kwargs  # noqa: E402


def _stub_flash_attn() -> None:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        names = {"flash_attn": {}, "flash_attn.utils": {},
                 "flash_attn.bert_padding": dict.fromkeys(
                     ["index_first_axis", "pad_input", "rearrange", "unpad_input"]),
                 "flash_attn.utils.distributed": {"all_gather": None}}
        for name, attrs in names.items():
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            module.__dict__.update(attrs)
            sys.modules.setdefault(name, module)


def test_install_hooks_into_openrlhfs_real_modules(monkeypatch):
    _stub_flash_attn()
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ray as trainer_ray

    from rollout_spec.integrations.openrlhf.train_ppo_ray import install

    monkeypatch.setattr(trainer_ray, "create_vllm_engines", trainer_ray.create_vllm_engines)
    original_trainer = ppo_trainer.PPOTrainer
    monkeypatch.setattr(ppo_trainer, "PPOTrainer", original_trainer)
    kwargs = install(SpecConfig(num_draft_tokens=6), 4)
    assert kwargs["speculative_config"]["num_speculative_tokens"] == 4
    assert getattr(trainer_ray.create_vllm_engines, "_rollout_spec", False)
    mro = ppo_trainer.PPOTrainer.__ray_actor_class__.__mro__
    assert SpecTrainerMixin in mro and original_trainer.__ray_actor_class__ in mro
    assert mro.index(SpecTrainerMixin) < mro.index(original_trainer.__ray_actor_class__)


def test_vllm_engine_args_accept_our_kwargs():
    args = vllm.AsyncEngineArgs(model="m", **engine_kwargs(SpecConfig(), 4))
    assert args.speculative_config["model"].endswith("VllmProposer")
    assert args.additional_config["rollout_spec"]["num_draft_tokens"] == 8


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_real_create_vllm_engines_starts_our_engine_actor(local_ray, monkeypatch):
    from openrlhf.trainer.ray import vllm_engine

    class StandInLLM:
        async def collective_rpc(self, method):
            return [{"chain_tokens_proposed": 3}]

    @ray.remote
    class RolloutRayActor:  # the real one would build vllm.AsyncLLMEngine from these kwargs
        async def __init__(self, *args, **kwargs):
            self.kwargs, self.llm = kwargs, StandInLLM()

        def engine_kwargs(self):
            return self.kwargs

    monkeypatch.setattr(vllm_engine, "RolloutRayActor", RolloutRayActor)
    create = wrap_create_vllm_engines(vllm_engine, engine_kwargs(SpecConfig(), 4))
    engines = create(1, 1, "m", 0, False, False, True, 128, None, 0.5, False)
    got = ray.get(engines[0].engine_kwargs.remote(), timeout=180)
    assert got["speculative_config"]["method"] == "custom_class"
    assert got["additional_config"]["rollout_spec"]["tree"] is True
    assert got["model"] == "m" and got["max_model_len"] == 128  # OpenRLHF's own arguments kept
    step, workers = ray.get(engines[0].rollout_spec_end_step.remote(), timeout=180)
    assert step.num_drafts == 0 and workers == [{"chain_tokens_proposed": 3}]
    assert vllm_engine.RolloutRayActor is RolloutRayActor  # restored after the factory ran


def test_real_dispatch_sends_each_prompt_to_its_groups_engine(local_ray):
    from types import SimpleNamespace

    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    from rollout_spec.distributed import GroupRouter, group_key
    from rollout_spec.integrations.openrlhf.routing import route_dispatch_by_group

    @ray.remote(num_cpus=0)
    class Engine:  # the two RolloutRayActor methods OpenRLHF's dispatch calls
        def __init__(self, index):
            self.index = index

        def get_num_unfinished_requests(self):
            return 0

        def generate_responses(self, prompt, label, sampling_params, max_length, hf_tokenizer, num_samples, images):
            return self.index, prompt, label, num_samples, sampling_params.temperature

    def tokenizer(text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}

    args = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=4),
                           algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="off")))
    engines = [Engine.remote(i) for i in range(3)]
    generator = SamplesGenerator(SimpleNamespace(args=args), None, None, tokenizer, engines)
    route_dispatch_by_group(generator)
    prompts = [f"question {i}" for i in range(9)]
    refs = generator._dispatch_prompts_to_vllm(prompts, [f"a{i}" for i in range(9)], temperature=0.7,
                                               max_new_tokens=16)
    got = ray.get(refs, timeout=120)
    placed = GroupRouter(3).assign([group_key([ord(c) for c in p]) for p in prompts], weights=[4] * 9)
    assert [g[0] for g in got] == placed.tolist() and [g[1] for g in got] == prompts
    assert {g[3] for g in got} == {4} and {g[4] for g in got} == {0.7}  # OpenRLHF's own parameters
    assert generator.vllm_engines == engines


def test_example_script_uses_only_flags_openrlhf_defines():
    import importlib.util
    import re
    from pathlib import Path

    source = Path(importlib.util.find_spec("openrlhf.cli.train_ppo_ray").origin).read_text()
    known = set(re.findall(r'"--([\w.]+)"', source))
    for suffix in re.findall(r'f"--\{prefix\}\.([\w.]+)"', source):
        known |= {f"actor.{suffix}", f"critic.{suffix}"}
    script = (Path(__file__).parents[1] / "examples/openrlhf/train_grpo_rollout_spec.sh").read_text()
    block = script.split("OPENRLHF_ARGS=(", 1)[1].split("\n)", 1)[0]
    used = set(re.findall(r"--([\w.]+)", block))
    assert used and used <= known, sorted(used - known)


def test_check_openrlhf_accepts_the_installed_release_and_refuses_a_changed_one():
    _stub_flash_attn()
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    from openrlhf.trainer.ray import vllm_engine

    from rollout_spec.integrations.openrlhf.train_ppo_ray import check_openrlhf

    check_openrlhf(vllm_engine, ppo_trainer)
    changed = types.SimpleNamespace(BasePPOTrainer=type("T", (), {"train_step": lambda self, s: s}),
                                    PPOTrainer=ppo_trainer.PPOTrainer)
    with pytest.raises(RuntimeError, match="train_step no longer takes"):
        check_openrlhf(vllm_engine, changed)
