"""verl hook: the config flag, engine arguments, and the metrics path through verl's own function.

Against the real verl package (``pip install --no-deps verl``, as CI does): verl's own
``compute_spec_decode_metrics`` is taken from its installed source and run on our counters, and
the shape of verl's servers/registry we rely on is checked in that source. Tests that need verl
importable (ray, tensordict, omegaconf...: scripts/setup.sh test installs them) run where it is,
and are skipped otherwise with the import error as the reason.
"""
from __future__ import annotations

import ast
import asyncio
import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout_spec.config import SpecConfig
from rollout_spec.integrations.verl import capture, metrics, trainer_metrics
from rollout_spec.integrations.verl.config import (
    FLAG_PATH,
    backend_engine_kwargs,
    merged_engine_kwargs,
    spec_from_rollout_config,
)
from rollout_spec.integrations.verl.engine_args import install_engine_kwargs


def rollout(custom=None, name="sglang", **extra):
    return {"name": name, "custom": custom, "engine_kwargs": {}, **extra}


# ---------------------------------------------------------------- the flag
def test_flag_off_means_no_spec():
    assert spec_from_rollout_config(rollout(None)) is None
    assert spec_from_rollout_config(rollout({"other_extension": 1})) is None


def test_flag_on_validates_options_into_specconfig():
    spec = spec_from_rollout_config(
        rollout({"speculative": "rollout_spec", "rollout_spec": {"num_draft_tokens": 6, "tree": False,
                                                                 "external_corpora": ["a.npy"]}})
    )
    assert spec == SpecConfig(num_draft_tokens=6, tree=False, external_corpora=("a.npy",))
    assert spec_from_rollout_config(rollout({"speculative": "rollout_spec"}, name="vllm")) == SpecConfig()


@pytest.mark.parametrize(
    "cfg, error, match",
    [
        (rollout({"speculative": "eagle"}), ValueError, "must be 'rollout_spec'"),
        (rollout({"rollout_spec": {"num_draft_tokens": 4}}), ValueError, "speculative is not"),
        (rollout({"speculative": "rollout_spec", "rollout_spec": {"draft_len": 4}}), ValueError,
         r"custom\.rollout_spec has unknown key\(s\) \['draft_len'\]"),
        (rollout({"speculative": "rollout_spec", "rollout_spec": {"num_draft_tokens": -1}}), ValueError,
         r"custom\.rollout_spec: num_draft_tokens must be in \[0, 1024\]"),
        (rollout({"speculative": "rollout_spec"}, name="trtllm"), ValueError, "rollout.name must be one of"),
        (rollout({"speculative": "rollout_spec"}, mtp={"enable": True, "enable_rollout": True}), ValueError,
         "mtp.enable_rollout"),
        (rollout({"speculative": "rollout_spec"}, disaggregation={"enabled": True}), ValueError,
         "disaggregation"),
        (rollout(["not", "a", "dict"]), TypeError, "custom must be a dict"),
        (rollout(""), TypeError, "custom must be a dict, got str"),
        (rollout({"speculative": "rollout_spec", "rollout_spec": ""}), TypeError,
         r"custom\.rollout_spec must be a dict of SpecConfig fields, got str"),
        (rollout({"speculative": "rollout_spec", "rollout_spec": []}), TypeError,
         r"custom\.rollout_spec must be a dict of SpecConfig fields, got list"),
        (rollout({"speculative": "rollout_spec", "rollout_spec": False}), TypeError,
         r"custom\.rollout_spec must be a dict of SpecConfig fields, got bool"),
        (rollout({"speculative": "rollout_spec", "rollout_spec": {"num_draft_tokens": 0}}), ValueError,
         r"custom\.rollout_spec\.num_draft_tokens is 0 \(speculation off\)"),
    ],
)
def test_bad_configs_name_the_key(cfg, error, match):
    with pytest.raises(error, match=match):
        spec_from_rollout_config(cfg)


def test_engine_kwargs_for_each_backend_and_conflicts():
    spec = SpecConfig(num_draft_tokens=5)
    sg = backend_engine_kwargs(spec, "sglang")
    assert sg["speculative_algorithm"] == "NGRAM" and sg["speculative_num_draft_tokens"] == 6
    vl = backend_engine_kwargs(spec, "vllm")
    assert vl["speculative_config"]["method"] == "custom_class"
    assert vl["additional_config"]["rollout_spec"]["num_draft_tokens"] == 5
    assert vl["per_request_spec_decode_metrics"] == "summary"  # vLLM 0.29+: counters per output
    cfg = SimpleNamespace(engine_kwargs={"sglang": {"attention_backend": "fa3"}})
    install_engine_kwargs(cfg, spec, "sglang")
    assert cfg.engine_kwargs["sglang"] == {"attention_backend": "fa3", **sg}
    with pytest.raises(ValueError, match=r"engine_kwargs\.sglang\.speculative_algorithm='EAGLE' conflicts"):
        merged_engine_kwargs({"speculative_algorithm": "EAGLE"}, sg, "sglang")
    with pytest.raises(ValueError, match="backend must be"):
        backend_engine_kwargs(spec, "trtllm")
    with pytest.raises(TypeError, match=r"engine_kwargs\.vllm must be a dict, got str"):
        install_engine_kwargs(SimpleNamespace(engine_kwargs={"vllm": "abc"}), spec, "vllm")


# ---------------------------------------------------------------- metrics through verl's function
def _verl_root() -> Path | None:
    found = importlib.util.find_spec("verl")
    return Path(list(found.submodule_search_locations)[0]) if found and found.submodule_search_locations else None


VERL = _verl_root()
needs_verl_source = pytest.mark.skipif(VERL is None, reason="verl not installed (pip install --no-deps verl)")


def verl_function(rel: str, name: str):
    """verl's own function ``name`` from its installed source, compiled alone (it is pure Python)."""
    tree = ast.parse((VERL / rel).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(VERL / rel), "exec"), namespace)
    return namespace[name]


@needs_verl_source
def test_sglang_counters_give_verls_accept_metrics():
    compute = verl_function("trainer/ppo/ray_trainer.py", "compute_spec_decode_metrics")
    metas = [
        {"spec_verify_ct": 10, "spec_num_proposed_drafts": 70, "spec_num_correct_drafts": 21, "completion_tokens": 31},
        {"spec_verify_ct": 4, "spec_num_proposed_drafts": 28, "spec_num_correct_drafts": 0, "completion_tokens": 4},
        {"completion_tokens": 1},  # finished at prefill: no verify step, no keys
    ]
    fields = [metrics.from_sglang_meta(m) for m in metas]
    assert fields[2] == dict.fromkeys(metrics.SPEC_FIELDS, 0)
    out = compute(*([f[k] for f in fields] for k in metrics.SPEC_FIELDS))
    assert out["rollout/spec_accept_rate"] == pytest.approx((21 / 70 + 0 + 0) / 3)
    assert out["rollout/spec_accept_length"] == pytest.approx((1 + 21 / 10 + 1 + 0) / 3)


@needs_verl_source
def test_vllm_counters_give_verls_accept_metrics():
    compute = verl_function("trainer/ppo/ray_trainer.py", "compute_spec_decode_metrics")
    stats = SimpleNamespace(num_draft_tokens=40, num_accepted_tokens=30, num_verify_steps=10)
    f = metrics.from_vllm_stats(stats, response_tokens=41)  # the prefill's token + 10 x (1 + 3)
    out = compute([f["spec_num_draft_tokens"]], [f["spec_num_accepted_tokens"]], [f["spec_num_verify_steps"]])
    assert out == {"rollout/spec_accept_rate": 0.75, "rollout/spec_accept_length": 4.0}
    assert metrics.from_vllm_stats(None, response_tokens=41) == {}


@needs_verl_source
def test_vllms_per_request_histogram_gives_verls_accept_metrics(caplog):
    """vLLM 0.29-0.33's RequestSpecDecodeMetrics: verify steps with j accepted drafts counted in
    histogram[j] (here 10 steps keeping 0, 3, 0, 2, 3, 1, 0, 3, 2, 1 = 15 of 40 drafted). A
    request without counters warns once, not once per request."""
    compute = verl_function("trainer/ppo/ray_trainer.py", "compute_spec_decode_metrics")
    stats = SimpleNamespace(num_spec_tokens=4, histogram=[3, 2, 2, 3, 0], num_draft_tokens=40)
    f = metrics.from_vllm_stats(stats, response_tokens=26)  # the prefill's token + 10 + 15
    assert f == {"spec_num_draft_tokens": 40, "spec_num_accepted_tokens": 15, "spec_num_verify_steps": 10}
    out = compute([40], [15], [10])
    assert out == {"rollout/spec_accept_rate": 0.375, "rollout/spec_accept_length": 2.5}
    metrics._warned_no_vllm_stats = False
    with caplog.at_level("WARNING", logger=metrics.__name__):
        assert metrics.from_vllm_stats(None, 26) == metrics.from_vllm_stats(None, 26) == {}
    assert len(caplog.records) == 1 and "per_request_spec_decode_metrics" in caplog.text


@needs_verl_source
def test_vllm_steps_without_drafts_count_as_verify_steps():
    """vLLM's histogram counts only the steps that drafted; verl's accept length counts every
    decode forward (as SGLang's spec_verify_ct does). A request never drafted for emits one token
    per forward, length 1, not verl's 0 for a request without verify steps; one that drafted on
    some steps has the others' forwards in its denominator."""
    compute = verl_function("trainer/ppo/ray_trainer.py", "compute_spec_decode_metrics")
    never = SimpleNamespace(num_spec_tokens=4, histogram=[0, 0, 0, 0, 0], num_draft_tokens=0)
    f = metrics.from_vllm_stats(never, response_tokens=12)
    assert f == {"spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0, "spec_num_verify_steps": 11}
    some = SimpleNamespace(num_spec_tokens=4, histogram=[3, 2, 2, 3, 0], num_draft_tokens=40)
    g = metrics.from_vllm_stats(some, response_tokens=30)  # 10 drafted steps, 4 plain ones
    assert g["spec_num_verify_steps"] == 14 and g["spec_num_accepted_tokens"] == 15
    out = compute(*([x[k] for x in (f, f, f, g)] for k in metrics.SPEC_FIELDS))
    assert out["rollout/spec_accept_length"] == pytest.approx((1 + 1 + 1 + (1 + 15 / 14)) / 4)
    assert metrics.from_vllm_stats(never, response_tokens=1)["spec_num_verify_steps"] == 0


@needs_verl_source
def test_a_batch_with_a_vllm_request_aborted_before_its_first_token_keeps_verls_metrics(caplog):
    """verl returns a request aborted or refused before its first token with no tokens, and vLLM
    reports no counters for it: it ran no verify step, zero of each (as SGLang's), without the
    missing-counters warning. verl's agent loop makes one column per extra_fields key, None where a
    sample lacks the key; verl's v0 trainer fails on such a column, its v1 trainer (our wrapper)
    logs nothing for the whole batch."""
    import numpy as np

    compute = verl_function("trainer/ppo/ray_trainer.py", "compute_spec_decode_metrics")
    drafted = SimpleNamespace(num_spec_tokens=4, histogram=[3, 2, 2, 3, 0], num_draft_tokens=40)
    metrics._warned_no_vllm_stats = False
    with caplog.at_level("WARNING", logger=metrics.__name__):
        extras = [{"global_steps": 1, **metrics.from_vllm_stats(drafted, response_tokens=26)},
                  {"global_steps": 1, **metrics.from_vllm_stats(None, response_tokens=0)}]
    assert extras[1] == {"global_steps": 1, **dict.fromkeys(metrics.SPEC_FIELDS, 0)} and not caplog.records
    columns = {}  # verl's AgentLoopManager._postprocess, as it builds non_tensor_batch
    for key in set().union(*extras):
        columns[key] = np.empty(len(extras), dtype=object)
        columns[key][:] = [e.get(key) for e in extras]
    expected = {"rollout/spec_accept_rate": pytest.approx((15 / 40 + 0) / 2),
                "rollout/spec_accept_length": pytest.approx((1 + 15 / 10 + 0) / 2)}
    assert compute(*(columns.get(k) for k in metrics.SPEC_FIELDS)) == expected  # verl's v0 trainer
    config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(
        rollout=rollout({"speculative": "rollout_spec"}, name="vllm"), model=SimpleNamespace(mtp=None)))
    counters = trainer_metrics.spec_counters(config, SimpleNamespace(keys=["a", "b"], partition_id="train_0"),
                                             lambda keys, partition_id, select_fields: {"extra_fields": _Column(extras)})
    assert counters == ([40, 0], [15, 0], [10, 0])  # verl's v1 trainer, through our wrapper


class _Column(list):
    def tolist(self):
        return list(self)


def _v1_trainer_module(compute):
    """A stand-in for verl's v1 trainer_base: PPOTrainer._compute_metrics with verl's MTP-only
    spec branch, the transfer queue's kv_batch_get, and verl's real compute_spec_decode_metrics."""
    module = types.ModuleType(trainer_metrics.V1_TRAINER_MODULE)
    module.fetched = []

    def kv_batch_get(keys, partition_id, select_fields):
        module.fetched.append((tuple(keys), partition_id, tuple(select_fields)))
        return {"extra_fields": _Column(module.extra_fields)}

    class PPOTrainer:
        def __init__(self, config):
            self.config = config

        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            mtp = self.config.actor_rollout_ref.model.mtp
            if mtp is not None and mtp.enable and mtp.enable_rollout:  # verl 0.9.1's gate
                raise AssertionError("the stand-in covers the flag's case only: MTP off")
            metrics.update({"training/global_step": global_steps})

    module.tq = SimpleNamespace(kv_batch_get=kv_batch_get)
    module.compute_spec_decode_metrics = compute
    module.PPOTrainer = PPOTrainer
    return module


def _plugin_over_a_stand_in_registry(monkeypatch):
    """Our plugin module, imported (it registers on import) over a stand-in of verl's registry."""
    registry = SimpleNamespace(_registry={"sglang": lambda: None, "vllm": lambda: None})
    registry.register = registry._registry.__setitem__
    for name in ("verl", "verl.workers", "verl.workers.rollout", "verl.workers.rollout.replica"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    replica = sys.modules["verl.workers.rollout.replica"]
    replica.RolloutReplicaRegistry = registry

    class PDReplica:  # verl's SGLangPDReplica / vLLMPDReplica: resolved without the registry's loaders
        def __init__(self, replica_rank, config, *args, **kwargs):
            self.replica_rank, self.config = replica_rank, config

    def get_rollout_replica_class(rollout, disaggregation_enabled=False):  # verl 0.9.1's resolver
        return PDReplica if disaggregation_enabled else registry.get(rollout)

    registry.get = lambda name: registry._registry[name]()
    replica.PDReplica, replica.get_rollout_replica_class = PDReplica, get_rollout_replica_class
    monkeypatch.delitem(sys.modules, "rollout_spec.integrations.verl.plugin", raising=False)
    plugin = importlib.import_module("rollout_spec.integrations.verl.plugin")
    monkeypatch.delitem(sys.modules, "rollout_spec.integrations.verl.plugin")  # not kept past the test
    assert registry._registry["sglang"].rollout_spec_wrapped
    return plugin


@needs_verl_source
def test_v1_trainer_logs_our_counters(monkeypatch):
    """verl's default trainer (v1) reads the spec_* counters only for MTP rollouts; with the flag
    on, the wrapper installed by the plugin's replica loader fetches them as verl's MTP branch does
    and logs verl's two metrics over the real (non-padding) samples."""
    compute = verl_function("trainer/ppo/ray_trainer.py", "compute_spec_decode_metrics")
    module = _v1_trainer_module(compute)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    plugin = _plugin_over_a_stand_in_registry(monkeypatch)
    upstream_calls = []
    load = plugin._wrap(lambda: upstream_calls.append(1), "sglang")
    with pytest.raises(ImportError):  # our server module needs verl's; the wrap happened first
        load()
    assert upstream_calls == [1] and module.PPOTrainer._compute_metrics.rollout_spec_wrapped
    assert not trainer_metrics.install()  # once only

    counters = [{"spec_num_draft_tokens": 16, "spec_num_accepted_tokens": 8, "spec_num_verify_steps": 4},
                {"spec_num_draft_tokens": 8, "spec_num_accepted_tokens": 0, "spec_num_verify_steps": 6},
                {"spec_num_draft_tokens": 0, "spec_num_accepted_tokens": 0, "spec_num_verify_steps": 0}]
    module.extra_fields = counters
    batch = SimpleNamespace(keys=["a", "b", "pad"], partition_id="train_0",
                            tags=[{}, {}, {"is_padding": True}])

    def config(custom, mtp=None):
        return SimpleNamespace(actor_rollout_ref=SimpleNamespace(
            rollout=rollout(custom), model=SimpleNamespace(mtp=mtp)))

    flag = {"speculative": "rollout_spec"}
    metrics_out = {}
    module.PPOTrainer(config(flag))._compute_metrics(batch, metrics_out, {}, global_steps=3, epoch=0)
    assert metrics_out == {"training/global_step": 3,
                           "rollout/spec_accept_rate": pytest.approx((8 / 16 + 0) / 2),
                           "rollout/spec_accept_length": pytest.approx((1 + 8 / 4 + 1) / 2)}
    assert module.fetched == [(("a", "b", "pad"), "train_0", ("extra_fields",))]

    module.fetched.clear()
    plain = {}
    module.PPOTrainer(config(None))._compute_metrics(batch, plain, {}, global_steps=3, epoch=0)
    assert plain == {"training/global_step": 3} and module.fetched == []  # flag off: untouched
    module.extra_fields = counters[:2] + [{"other": 1}]  # verl's rule: all samples or none
    partial = {}
    module.PPOTrainer(config(flag))._compute_metrics(batch, partial, {}, global_steps=4, epoch=0)
    assert partial == {"training/global_step": 4}


def test_flag_is_refused_when_verl_builds_a_pd_disaggregated_replica(monkeypatch):
    """With rollout.disaggregation.enabled, verl's get_rollout_replica_class returns its own PD
    replica classes without calling the registry loaders the plugin wraps (vLLM) or after calling
    them only for their imports (SGLang): the flag's documented refusal of PD must still come when
    the replica is built, not never (vLLM: no drafting, no metrics, no error) or at the first
    step's metrics (SGLang: the v1 trainer wrapper reads the flag after a whole step ran)."""
    _plugin_over_a_stand_in_registry(monkeypatch)
    replica = sys.modules["verl.workers.rollout.replica"]
    pd = {"enabled": True}
    for backend in ("sglang", "vllm"):
        cls = replica.get_rollout_replica_class(backend, disaggregation_enabled=True)
        with pytest.raises(ValueError, match=r"custom\.speculative=rollout_spec does not support "
                                             r"actor_rollout_ref\.rollout\.disaggregation"):
            cls(0, rollout({"speculative": "rollout_spec"}, name=backend, disaggregation=pd))
        plain = cls(1, rollout(None, name=backend, disaggregation=pd))  # flag off: verl's PD replica
        assert isinstance(plain, replica.PDReplica) and plain.replica_rank == 1
    monkeypatch.setattr(replica.RolloutReplicaRegistry, "get", lambda name: f"verl's {name} loader")
    assert replica.get_rollout_replica_class("vllm") == "verl's vllm loader"  # without PD: as before


def test_an_already_imported_llm_server_resolves_through_the_wrapped_resolver(monkeypatch):
    """llm_server.py binds get_rollout_replica_class by name at import: were it imported before the
    plugin, its copy must be the wrapped resolver too, or a PD replica would skip the refusal."""
    server = types.ModuleType("verl.workers.rollout.llm_server")
    server.get_rollout_replica_class = lambda rollout, disaggregation_enabled=False: None
    monkeypatch.setitem(sys.modules, server.__name__, server)
    _plugin_over_a_stand_in_registry(monkeypatch)
    replica = sys.modules["verl.workers.rollout.replica"]
    assert server.get_rollout_replica_class is replica.get_rollout_replica_class
    assert replica.get_rollout_replica_class.rollout_spec_wrapped


@needs_verl_source
def test_verl_still_has_the_shape_the_hook_relies_on():
    trainer = (VERL / "trainer/ppo/ray_trainer.py").read_text()
    for key in metrics.SPEC_FIELDS:
        assert f'"{key}"' in trainer, f"verl's trainer no longer reads {key}"
    sglang_server = (VERL / "workers/rollout/sglang_rollout/async_sglang_server.py").read_text()
    assert "self.tokenizer_manager.generate_request(" in sglang_server
    assert "class SGLangReplica(" in sglang_server and "self.server_class = ray.remote(SGLangHttpServer)" in sglang_server
    vllm_server = (VERL / "workers/rollout/vllm_rollout/vllm_async_server.py").read_text()
    assert "self.engine.generate(" in vllm_server and "request_id=request_id" in vllm_server
    replica = (VERL / "workers/rollout/replica.py").read_text()
    assert 'RolloutReplicaRegistry.register("sglang"' in replica and "_registry" in replica
    assert "def get_rollout_replica_class(rollout: str, disaggregation_enabled: bool = False)" in replica
    assert "disaggregation_enabled=self.rollout_config.disaggregation.enabled" in (
        VERL / "workers/rollout/llm_server.py").read_text()  # PD replicas bypass the registry's loaders
    init = (VERL / "__init__.py").read_text()
    assert '"verl.plugins"' in init, "verl no longer loads verl.plugins entry points"
    v1 = (VERL / "trainer/ppo/v1/trainer_base.py").read_text()  # trainer_metrics' assumptions
    assert "import transfer_queue as tq" in v1 and "class PPOTrainer(" in v1
    assert "def _compute_metrics(self, batch: KVBatchMeta, metrics, timing_raw, global_steps, epoch):" in v1
    assert "import apply_kl_penalty, compute_spec_decode_metrics" in v1
    assert 'select_fields=["extra_fields"]' in v1 and 'tag.get("is_padding", False)' in v1
    assert "mtp_config.enable and mtp_config.enable_rollout" in v1, "v1 may read our counters now"
    assert "LLMServerManager.create(" in v1  # the replica class is looked up in the trainer's process
    assert "get_rollout_replica_class(" in (VERL / "workers/rollout/llm_server.py").read_text()
    assert "use_v1: true" in (VERL / "trainer/config/ppo_trainer.yaml").read_text()
    rollout_cfg = (VERL / "workers/config/rollout.py").read_text()
    assert "custom: Optional[dict] = None" in rollout_cfg and '"engine_kwargs"' in rollout_cfg
    # scale-out (replicas.py): replica start methods, the servers' rank, the router factory
    starts = {f.name: [a.arg for a in f.args.args] for f in ast.walk(ast.parse(replica))
              if isinstance(f, ast.AsyncFunctionDef) and f.name.startswith("init_")}
    for name, params in (("init_hybrid", ["self", "worker_group"]), ("init_standalone", ["self"]),
                         ("init_hybrid_colocated", ["self", "worker_group", "resource_pool"]),
                         ("init_colocated", ["self", "resource_pool"])):
        assert starts.get(name) == params, f"RolloutReplica.{name} changed: {starts.get(name)}"
    assert "self.replica_rank = replica_rank" in sglang_server and "self.replica_rank = replica_rank" in vllm_server
    assert "config=self.config," in (VERL / "workers/rollout/vllm_rollout/vllm_async_server.py").read_text()
    router = (VERL / "workers/rollout/router.py").read_text()
    assert "def get_router_handle(\n    servers: dict[str, Any],\n    router_config_path: str | None = None,\n" \
           "    full_determinism: bool = False,\n    load_balancer_cls: type | None = None," in router
    manager = (VERL / "workers/rollout/llm_server.py").read_text()
    assert "from verl.workers.rollout.router import get_router_handle" in manager  # looked up at call time
    assert "num_replicas = world_size // rollout_world_size" in manager
    # hybrid_engine=False: the empty manager's balancer is built first but never routed through
    separate = (VERL / "trainer/ppo/v1/trainer_separate_async.py").read_text()
    assert "LLMServerManager.create_empty(config=self.config)" in (VERL / "trainer/ppo/v1/trainer_base.py").read_text()
    assert "return self.standalone_server_manager.get_client(" in separate
    assert "async def set_global_steps(self, global_steps: int):" in vllm_server  # our step boundary
    weights = (VERL / "workers/rollout/vllm_rollout/vllm_rollout.py").read_text()
    assert weights.count("await self.server_handle.set_global_steps.remote(global_steps)") >= 2


# ---------------------------------------------------------------- counters kept from the engines
def test_capture_keeps_final_meta_info_and_vllm_stats():
    class TokenizerManager:
        async def generate_request(self, obj, request=None):
            yield {"output_ids": [1, 2], "meta_info": {"spec_verify_ct": 2}}

    tm, store = TokenizerManager(), {}
    capture.record_sglang_meta(tm, store)

    async def first():
        return await tm.generate_request(SimpleNamespace(rid="r|rsg=00000001"), None).__anext__()

    assert asyncio.run(first())["output_ids"] == [1, 2]
    assert store == {"r|rsg=00000001": {"spec_verify_ct": 2}}

    class Engine:
        async def generate(self, prompt, sampling_params, request_id, **kw):
            for n in (1, 2):
                yield SimpleNamespace(metrics=SimpleNamespace(request_spec_decode_stats=n))

    eng, stats = Engine(), {}
    capture.record_vllm_stats(eng, stats)

    async def drain():
        return [o async for o in eng.generate(prompt="p", sampling_params=None, request_id="q")]

    assert len(asyncio.run(drain())) == 2 and stats == {"q": 2}


def test_capture_keeps_a_bounded_number_of_requests(monkeypatch):
    """Requests that reach the engine over verl's HTTP app are never popped: the oldest go."""
    monkeypatch.setattr(capture, "MAX_KEPT", 3)

    class Engine:
        async def generate(self, prompt, sampling_params, request_id, **kw):
            yield SimpleNamespace(metrics=SimpleNamespace(request_spec_decode_stats=request_id))

    eng, stats = Engine(), {}
    capture.record_vllm_stats(eng, stats)

    async def run(request_id):
        return [o async for o in eng.generate(prompt="p", sampling_params=None, request_id=request_id)]

    for rid in "abcde":
        asyncio.run(run(rid))
    assert stats == {"c": "c", "d": "d", "e": "e"}


def test_vllm_stats_are_read_from_the_sample_where_vllm_puts_them():
    """vLLM 0.29-0.33 fill ``outputs[0].spec_decode_metrics`` on the final output only; the
    metrics field verl reads is taken first where a vLLM has it."""
    final = SimpleNamespace(histogram=[1, 1], num_draft_tokens=2)
    assert capture.vllm_spec_stats(SimpleNamespace(metrics=SimpleNamespace(), outputs=[
        SimpleNamespace(spec_decode_metrics=final)])) is final
    assert capture.vllm_spec_stats(SimpleNamespace(metrics=None, outputs=[
        SimpleNamespace(spec_decode_metrics=None)])) is None  # not the final output yet
    assert capture.vllm_spec_stats(SimpleNamespace(metrics=None, outputs=[])) is None
    assert capture.vllm_spec_stats(SimpleNamespace(
        metrics=SimpleNamespace(request_spec_decode_stats=7), outputs=[SimpleNamespace(spec_decode_metrics=final)])) == 7


# ---------------------------------------------------------------- with verl importable
def _verl_runtime_error() -> str | None:
    try:
        import verl.workers.rollout.replica  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- any import failure is the skip reason
        return f"verl runtime not importable here: {type(exc).__name__}: {exc}"[:300]
    return None


VERL_RUNTIME = None if VERL is None else _verl_runtime_error()
needs_verl_runtime = pytest.mark.skipif(VERL is None or VERL_RUNTIME is not None, reason=VERL_RUNTIME or "no verl")


@needs_verl_runtime
def test_plugin_wraps_verls_replica_loaders_once():
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from rollout_spec.integrations.verl.plugin import register

    for backend in ("sglang", "vllm"):
        assert getattr(RolloutReplicaRegistry._registry[backend], "rollout_spec_wrapped", False)
    assert register() == []


@needs_verl_runtime
def test_real_rollout_config_with_the_flag():
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    cfg = OmegaConf.create({"name": "sglang", "custom": {"speculative": "rollout_spec",
                                                         "rollout_spec": {"num_draft_tokens": 5}}})
    real = omega_conf_to_dataclass(OmegaConf.merge(OmegaConf.structured(RolloutConfig), cfg), RolloutConfig)
    assert spec_from_rollout_config(real) == SpecConfig(num_draft_tokens=5)
    assert spec_from_rollout_config(cfg) == SpecConfig(num_draft_tokens=5)
    install_engine_kwargs(real, SpecConfig(num_draft_tokens=5), "sglang")
    assert real.engine_kwargs["sglang"]["speculative_num_draft_tokens"] == 6
    assert FLAG_PATH.endswith("custom.speculative")


@needs_verl_runtime
def test_router_hook_replaces_verls_default_balancer_for_our_servers(monkeypatch):
    import weakref

    import ray
    from verl.workers.rollout import router as verl_router

    from rollout_spec.integrations.verl import replicas

    class Replica:  # what the hook reads from our replica objects
        _server_address = "10.0.0.1:8000"

    ours = Replica()
    monkeypatch.setattr(verl_router, "get_router_handle", verl_router.get_router_handle)  # undone after
    monkeypatch.setattr(replicas, "_SPEC_REPLICAS", weakref.WeakSet([ours]))
    monkeypatch.setattr(replicas, "_BALANCED", set())  # what the hook claims here stays here
    assert replicas.install_router_hook() and not replicas.install_router_hook()
    monkeypatch.setattr(ray, "remote", lambda cls: SimpleNamespace(remote=lambda *args: cls(*args)))  # no cluster
    lb = verl_router.get_router_handle({ours._server_address: "handle"})
    assert type(lb).__name__ == "GroupStickyLoadBalancer" and lb.get_all_servers() == [ours._server_address]
    assert lb.require_acquire_fields() == ["prompt_ids"]
