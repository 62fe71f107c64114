"""Our Llama-family model against transformers' own forward, in fp32, on tiny random configs; and
loading its weights."""
from __future__ import annotations

import pytest
import torch

from rollout_spec.engine.kv_cache import KVCache
from rollout_spec.engine.model import StepContext, Transformer, rope_inverse_frequencies, rope_settings
from rollout_spec.engine.weights import build_model

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)


def tiny_config(kind: str):
    """A small random config of one family, with the variant options switched on."""
    if kind == "llama":
        return transformers.LlamaConfig(**TINY, tie_word_embeddings=True)
    if kind == "llama3-rope":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        return transformers.LlamaConfig(**TINY, rope_parameters=rope, attention_bias=True)
    if kind == "linear-rope":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        return transformers.LlamaConfig(**TINY, rope_parameters=rope)
    if kind == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 64}
        return transformers.Qwen2Config(**TINY, rope_parameters=rope)
    if kind == "qwen2":
        return transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    if kind == "qwen3":
        return transformers.Qwen3Config(**TINY, head_dim=24)
    raise ValueError(kind)


def reference_and_ours(kind: str, seed: int = 0) -> tuple[torch.nn.Module, Transformer]:
    """A random transformers model and ours loaded from its state dict."""
    torch.manual_seed(seed)
    cfg = tiny_config(kind)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # random non-trivial norms and biases, so they are really tested
        for name, p in ref.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    state = {k.removeprefix("model."): v for k, v in ref.state_dict().items()}
    return ref, build_model(cfg, state, torch.device("cpu"), torch.float32)


def causal_forward(model: Transformer, ids: torch.Tensor, tree_mask: bool = True) -> torch.Tensor:
    """Logits of a full causal forward through our static cache (one slot per row): a tree step
    with a causal mask, or (``tree_mask=False``) the engine's prefill path."""
    B, T = ids.shape
    c = model.config
    cache = KVCache(c.num_layers, B, c.num_kv_heads, T, c.head_dim, torch.float32, "cpu")
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool)).expand(B, T, T) if tree_mask else None
    ctx = StepContext(cache, torch.arange(B), torch.zeros(B, dtype=torch.long), mask)
    return model(ids, torch.arange(T).expand(B, T), ctx)


@pytest.mark.parametrize("tree_mask", [True, False], ids=["tree-mask", "prefill"])
@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "linear-rope", "yarn", "qwen2", "qwen3"])
def test_logits_match_transformers(kind: str, tree_mask: bool) -> None:
    ref, ours = reference_and_ours(kind)
    ids = torch.randint(0, TINY["vocab_size"], (3, 150))
    with torch.no_grad():
        expected = ref(ids).logits
        got = causal_forward(ours, ids, tree_mask)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_tree_step_matches_full_forward() -> None:
    """Prefill, then a 2-branch tree step: each node's logits equal a causal forward of its path."""
    ref, ours = reference_and_ours("qwen3", seed=1)
    c = ours.config
    prompt = torch.randint(0, TINY["vocab_size"], (1, 20))
    cache = KVCache(c.num_layers, 2, c.num_kv_heads, 64, c.head_dim, torch.float32, "cpu")
    slot = torch.tensor([1])
    with torch.no_grad():  # the engine's prefill (no tree mask) must leave the cache a tree step reads
        ours(prompt, torch.arange(20)[None], StepContext(cache, slot, torch.tensor([0]), None))
        # Tree: root r, children a (col 1) and b (col 2), a's child c (col 3).
        toks = torch.tensor([[5, 7, 9, 11]])
        depth = torch.tensor([[0, 1, 1, 2]])
        tmask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        got = ours(toks, 20 + depth, StepContext(cache, slot, torch.tensor([20]), tmask[None]))
        for col, path in ((0, [5]), (1, [5, 7]), (2, [5, 9]), (3, [5, 7, 11])):
            full = ref(torch.cat([prompt, torch.tensor([path])], dim=1)).logits[0, -1]
            torch.testing.assert_close(got[0, col], full, rtol=1e-4, atol=1e-4)


def test_rope_settings_are_read_from_transformers_4_configs() -> None:
    """transformers 4.x keeps RoPE's variant in ``rope_scaling`` (None when plain; ``type`` in
    older files) and ``rope_theta`` beside it: a scaled or unsupported variant there is seen, not
    run as plain RoPE. (Its scaled variants' frequencies need 4.x's own init functions; session 74
    compared logits against transformers 4.57.1 by hand: docs/engine.md.)"""
    from types import SimpleNamespace

    v4 = SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=10000.0)
    assert rope_settings(v4) == ("linear", {"type": "linear", "factor": 2.0})
    llama3 = SimpleNamespace(rope_scaling={"rope_type": "llama3", "factor": 8.0}, rope_theta=5e5)
    assert rope_settings(llama3)[0] == "llama3"
    plain = SimpleNamespace(rope_scaling=None, rope_theta=5e5)
    assert rope_settings(plain) == ("default", {})
    inv, scale = rope_inverse_frequencies(SimpleNamespace(hf_config=plain, head_dim=8))
    assert scale == 1.0 and torch.allclose(inv, 1.0 / 5e5 ** (torch.arange(0, 8, 2).float() / 8))
    for kind in ("dynamic", "longrope"):
        config = SimpleNamespace(hf_config=SimpleNamespace(rope_scaling={"type": kind, "factor": 2.0},
                                                           rope_theta=1e4), head_dim=8)
        with pytest.raises(ValueError, match=f"rope_type '{kind}' is not supported"):
            rope_inverse_frequencies(config)
    # transformers 5 configs: rope_parameters wins
    v5 = transformers.LlamaConfig(**TINY, rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                                           "factor": 2.0})
    assert rope_settings(v5)[0] == "linear"


def test_unsupported_family_is_rejected() -> None:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    with pytest.raises(ValueError, match="model_type must be one of"):
        build_model(cfg, {}, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_pytorch_tanh"])
def test_an_mlp_other_than_swiglu_is_refused(act: str) -> None:
    """The MLP is SwiGLU: another hidden_act was run as SiLU (logits off by up to 2 on a tiny
    model), now refused by name; silu and its alias swish load."""
    _, ours = reference_and_ours("llama")
    cfg = tiny_config("llama")
    cfg.hidden_act = act
    with pytest.raises(ValueError, match=f"hidden_act must be 'silu' \\(a SwiGLU MLP\\), got '{act}'"):
        build_model(cfg, ours.state_dict(), torch.device("cpu"), torch.float32)
    cfg.hidden_act = "swish"
    build_model(cfg, ours.state_dict(), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("kv_heads", [3, 8])
def test_query_heads_that_are_no_multiple_of_the_kv_heads_are_refused(kv_heads: int) -> None:
    """GQA shares each key/value head among num_heads // num_kv_heads query heads: another ratio
    failed at the first forward, deep in torch ("size of tensor a (4) must match ...")."""
    from rollout_spec.engine.model import ModelConfig

    cfg = transformers.LlamaConfig(**{**TINY, "num_key_value_heads": kv_heads})
    with pytest.raises(ValueError, match=rf"num_attention_heads \(4\) must be a multiple of "
                                         rf"num_key_value_heads \({kv_heads}\)"):
        ModelConfig.from_hf(cfg)


def test_a_negative_kv_head_count_is_refused_naming_its_range() -> None:
    """0 key/value heads means "as many as the query heads" in transformers; a negative count is
    refused by name before the GQA ratio divides by it."""
    from rollout_spec.engine.model import ModelConfig

    cfg = transformers.LlamaConfig(**{**TINY, "num_key_value_heads": -2})
    with pytest.raises(ValueError, match=r"num_key_value_heads must be in \[1, inf\], got -2"):
        ModelConfig.from_hf(cfg)


def test_a_sliding_window_config_is_refused_naming_the_field() -> None:
    """Our attention is full attention: a Qwen2 config that turns its sliding window on would give
    other logits, so it is refused, naming the field and the value it must have."""
    from rollout_spec.engine.model import ModelConfig

    cfg = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16)
    with pytest.raises(ValueError, match=r"use_sliding_window must be False .*full attention only\), got True"):
        ModelConfig.from_hf(cfg)


def test_mismatched_checkpoint_names_the_keys() -> None:
    _, ours = reference_and_ours("llama")
    state = {k: v for k, v in ours.state_dict().items() if "layers.1.mlp" not in k}
    with pytest.raises(ValueError, match="layers.1.mlp"):
        build_model(tiny_config("llama"), state, torch.device("cpu"), torch.float32)


def test_an_interrupted_gguf_conversion_leaves_nothing_behind(monkeypatch, tmp_path) -> None:
    """A conversion stopped while it writes (here: Ctrl-C in save_file) removes its half-written
    copy and creates no model directory, so the next run converts again."""
    import safetensors.torch

    from rollout_spec.engine import weights

    ref = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    monkeypatch.setattr(weights, "read_gguf_config", lambda path: ref.config)
    monkeypatch.setattr(weights, "load_gguf_model", lambda path, config: ref)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(KeyboardInterrupt):
        weights.convert_gguf(gguf, tmp_path / "cache" / "models" / "tiny")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_a_gguf_conversion_replaces_an_incomplete_cache_folder(tmp_path, monkeypatch) -> None:
    """A cache folder without config.json (emptied by hand, left by another tool) was kept, and
    every run converted again and returned it; now the conversion takes its place, once."""
    import transformers

    from rollout_spec.engine import weights

    converted = []
    monkeypatch.setattr(weights, "read_gguf_config", lambda path: None)
    monkeypatch.setattr(weights, "load_gguf_model", lambda path, config: converted.append(1) or object())
    monkeypatch.setattr(weights, "_write_model_dir", lambda hf, gguf, out: (out / "config.json").write_text("{}"))
    out = tmp_path / "models" / "tiny"
    out.mkdir(parents=True)
    (out / "stale.bin").write_text("x")
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    assert weights.convert_gguf(gguf, out) == out
    assert (out / "config.json").is_file() and not (out / "stale.bin").exists() and converted == [1]
    assert weights.convert_gguf(gguf, out) == out and converted == [1, 1]  # a finished one is kept
    assert (out / "config.json").is_file()


def test_a_checkpoint_whose_shapes_differ_from_its_config_is_a_value_error() -> None:
    """config.json's sizes not matching the weights (here intermediate_size) raised torch's
    RuntimeError, which the CLI printed as a traceback; now a ValueError naming the tensor and
    both shapes."""
    ref = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    state = {k.removeprefix("model."): v for k, v in ref.state_dict().items()}
    narrower = tiny_config("llama")
    narrower.intermediate_size = 48
    with pytest.raises(ValueError, match=r"6 tensors .* layers\.0\.mlp\.down_proj\.weight is \[64, 96\], "
                                         r"the config makes \[64, 48\]"):
        build_model(narrower, state, torch.device("cpu"), torch.float32)


def _save_tiny_llama(out) -> None:
    """A 2-layer random Llama checkpoint (config.json eos_token_id 2) written by transformers."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(str(out))


def test_generation_config_eos_ids_stop_generation(tmp_path) -> None:
    """transformers' generate stops at generation_config.json's eos_token_id (instruct models put
    their end-of-turn token there); the engine read only config.json's and ran on past it."""
    import json

    from rollout_spec import SamplingParams
    from rollout_spec.engine import RolloutEngine

    _save_tiny_llama(tmp_path)
    kw = dict(device="cpu", spec=None, cuda_graphs=False, num_slots=1, max_model_len=32)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompt = [5, 6, 7]
    first = RolloutEngine.from_pretrained(str(tmp_path), **kw).generate([prompt], params)[0].token_ids[0]
    assert first != 2
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "eos_token_id": [2, first]}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
    assert hf_out.tolist() == [first]  # the reference stops at the generation config's EOS
    engine = RolloutEngine.from_pretrained(str(tmp_path), **kw)
    assert engine.eos_token_ids == (2, first)  # config.json's first, then the ones added
    out = engine.generate([prompt], params)[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"


def test_a_malformed_generation_config_names_the_file(tmp_path) -> None:
    from rollout_spec.engine import RolloutEngine

    _save_tiny_llama(tmp_path)
    (tmp_path / "generation_config.json").write_text("[2, 3]")
    with pytest.raises(ValueError, match="generation_config.json: not a JSON object"):
        RolloutEngine.from_pretrained(str(tmp_path), device="cpu", spec=None, cuda_graphs=False)


def test_the_default_model_is_converted_again_when_its_file_changes(tmp_path, monkeypatch) -> None:
    """The named model's conversion was cached under its name alone: a package shipping another
    GGUF file under that name (another version, a re-quantised copy) kept loading the first
    file's weights. Now its cache is keyed by the file's content, which another virtual
    environment's copy of the same file shares."""
    from rollout_spec.engine import weights

    gguf = tmp_path / "pkg" / weights.SMOLLM2_GGUF
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF one")
    converted = []

    def convert(path, out):
        converted.append(path.read_bytes())
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setenv("ROLLOUT_SPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "packaged_gguf", lambda name: gguf)
    monkeypatch.setattr(weights, "convert_gguf", convert)
    first = weights.resolve_model_dir("smollm2-135m")
    assert weights.resolve_model_dir("smollm2-135m") == first and converted == [b"GGUF one"]
    gguf.write_bytes(b"GGUF two, another file")
    second = weights.resolve_model_dir("smollm2-135m")
    assert second != first and converted == [b"GGUF one", b"GGUF two, another file"]
    assert second.parent == tmp_path / "cache" / "models" and second.name.startswith("smollm2-135m-")
    other_venv = tmp_path / "venv2" / weights.SMOLLM2_GGUF  # the same file, installed elsewhere
    other_venv.parent.mkdir()
    other_venv.write_bytes(gguf.read_bytes())
    monkeypatch.setattr(weights, "packaged_gguf", lambda name: other_venv)
    assert weights.resolve_model_dir("smollm2-135m") == second and len(converted) == 2  # shared


def test_a_checkpoint_with_the_old_per_layer_rope_buffers_loads(tmp_path) -> None:
    """Older transformers releases saved every layer's ``rotary_emb.inv_freq`` buffer with the
    weights, and Llama checkpoints written then still carry it; transformers, vLLM and SGLang
    skip those tensors, while build_model refused the checkpoint as not matching the model
    ("unexpected [...rotary_emb.inv_freq]"). They load now, with transformers' logits; any
    other unexpected tensor is still refused."""
    from safetensors.torch import load_file, save_file

    from rollout_spec.engine.model import ModelConfig
    from rollout_spec.engine.weights import load_state_dict

    _save_tiny_llama(tmp_path)
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    (path,) = tmp_path.glob("*.safetensors")
    state = load_file(str(path))
    inv_freq = rope_inverse_frequencies(ModelConfig.from_hf(config))[0]
    for i in range(config.num_hidden_layers):  # as older transformers wrote them
        state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = inv_freq.clone()
    save_file(state, str(path))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    ours = build_model(config, load_state_dict(tmp_path), torch.device("cpu"), torch.float32)
    ids = torch.randint(0, TINY["vocab_size"], (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(causal_forward(ours, ids), ref(ids).logits, rtol=1e-4, atol=1e-4)
    other = {**load_state_dict(tmp_path), "layers.0.self_attn.extra.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"unexpected \['layers\.0\.self_attn\.extra\.weight'\]"):
        build_model(config, other, torch.device("cpu"), torch.float32)


def test_the_checkpoint_files_are_chosen_as_transformers_chooses_them(tmp_path) -> None:
    """Every *.safetensors file of the folder used to be read: a PEFT adapter or a stale export
    beside the model broke the load, and a tensor in two files took the last file's copy."""
    import json

    from safetensors.torch import load_file, save_file

    from rollout_spec.engine.weights import checkpoint_files, load_state_dict

    single, sharded = tmp_path / "single", tmp_path / "sharded"
    _save_tiny_llama(single)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(str(sharded), max_shard_size="100KB")
    reference = load_state_dict(single)
    shards = checkpoint_files(sharded)
    assert len(shards) > 1 and all(f.parent == sharded for f in shards)
    for folder in (single, sharded):  # an adapter beside the model is not read
        save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 2)},
                  str(folder / "adapter_model.safetensors"))
        state = load_state_dict(folder)
        assert state.keys() == reference.keys()
        assert all(torch.equal(state[k], reference[k]) for k in reference)
    (single / "model.safetensors").rename(single / "weights.safetensors")
    with pytest.raises(ValueError, match=r"2 \*\.safetensors files .* neither model\.safetensors"):
        load_state_dict(single)
    (single / "adapter_model.safetensors").unlink()
    assert checkpoint_files(single) == [single / "weights.safetensors"]  # a folder's only file
    first = shards[0]
    save_file({**load_file(str(first)), **load_file(str(shards[1]))}, str(first))  # one tensor twice
    with pytest.raises(ValueError, match="also in another shard"):
        load_state_dict(sharded)
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=shards[1].name):
        load_state_dict(sharded)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="not a safetensors index"):
        load_state_dict(sharded)
    # a sharded model re-saved as one file: save_pretrained removes the shards, not the index
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    (single / "weights.safetensors").rename(sharded / "model.safetensors")
    assert checkpoint_files(sharded) == [sharded / "model.safetensors"]


def test_an_index_with_an_empty_weight_map_is_refused(tmp_path):
    """An index whose weight_map is empty named no shard, and the model loaded no weights at all."""
    import json

    from rollout_spec.engine.weights import checkpoint_files

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(ValueError, match=r"names no shard: its 'weight_map' .* is empty"):
        checkpoint_files(tmp_path)


def write_tiny_gguf(path, *, arch: str = "llama", drop: tuple[str, ...] = ()) -> None:
    """A random fp32 2-layer Llama GGUF (TINY's sizes) with a 97-token BPE tokenizer, written with
    the gguf package; ``drop`` leaves out tensors or tokenizer fields (``tokenizer.ggml.scores``)."""
    import numpy as np

    gguf = pytest.importorskip("gguf")
    h, inter, kv_dim, vocab = 64, 96, 32, 97
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_block_count(2)
    w.add_feed_forward_length(inter)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    if "tokenizer.ggml.scores" not in drop:
        w.add_token_scores([0.0] * vocab)
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "output.weight": (vocab, h)}
    for i in range(2):
        shapes.update({f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
                       f"blk.{i}.attn_q.weight": (h, h), f"blk.{i}.attn_k.weight": (kv_dim, h),
                       f"blk.{i}.attn_v.weight": (kv_dim, h), f"blk.{i}.attn_output.weight": (h, h),
                       f"blk.{i}.ffn_gate.weight": (inter, h), f"blk.{i}.ffn_up.weight": (inter, h),
                       f"blk.{i}.ffn_down.weight": (h, inter)})
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_missing_a_tensor_is_refused_not_left_random(tmp_path, monkeypatch) -> None:
    """transformers initialises a tensor the GGUF lacks at random and only logs it, so the
    conversion cached, and the engine ran, a model with random layers; now the file and the
    tensor are named. A complete file loads (without output.weight too: llama.cpp ties it)."""
    from rollout_spec.engine import weights

    monkeypatch.setenv("ROLLOUT_SPEC_CACHE", str(tmp_path / "cache"))
    for drop in [(), ("output.weight",)]:
        write_tiny_gguf(tmp_path / "ok.gguf", drop=drop)
        model, _, tokenizer = weights.load_pretrained(str(tmp_path / "ok.gguf"), torch.device("cpu"), torch.float32)
        assert model.config.num_layers == 2 and model.config.tie_word_embeddings == bool(drop)
        assert tokenizer is not None
    write_tiny_gguf(tmp_path / "holey.gguf", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"holey\.gguf lacks 1 tensors of its llama model .*"
                                         r"'model\.layers\.1\.mlp\.up_proj\.weight'"):
        weights.load_pretrained(str(tmp_path / "holey.gguf"), torch.device("cpu"), torch.float32)
    assert not any(p.name.startswith("holey") for p in (tmp_path / "cache" / "models").iterdir())


@pytest.mark.parametrize("arch, got", [("mamba", "its model_type .* got 'mamba'"),
                                       ("qwen3moe", "its model_type .* got 'qwen3_moe'"),
                                       ("bert", r"is not a GGUF file transformers can read \(GGUF model with "
                                                "architecture bert is not supported")])
def test_a_gguf_of_another_architecture_is_refused_before_conversion(tmp_path, monkeypatch, arch,
                                                                     got) -> None:
    """A GGUF of a family we do not run was converted first (minutes for a real model, the copy
    left in the cache) and then refused, or failed inside transformers with a RuntimeError
    pointing at a logged report; now the config read from its header is checked first."""
    from rollout_spec.engine import weights

    monkeypatch.setenv("ROLLOUT_SPEC_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "other.gguf", arch=arch)
    monkeypatch.setattr(weights, "load_gguf_model", lambda *args: pytest.fail("converted"))
    with pytest.raises(ValueError, match=rf"other\.gguf:? {got}"):
        weights.load_pretrained(str(tmp_path / "other.gguf"), torch.device("cpu"), torch.float32)


def test_a_gguf_conversion_parses_the_header_no_more_than_transformers_does(tmp_path,
                                                                             monkeypatch) -> None:
    """The architecture check read the whole header with gguf's reader (4 s for SmolLM2's
    49k-token vocabulary) before transformers read it again for the config; now transformers'
    config is the one checked and handed to the model load."""
    gguf = pytest.importorskip("gguf")
    from rollout_spec.engine import weights

    reads = []
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **kw: reads.append(1) or reader(*a, **kw))
    write_tiny_gguf(tmp_path / "tiny.gguf")
    for load in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):  # what we convert
        load.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    transformers_reads, reads[:] = len(reads), []
    weights.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    assert len(reads) == transformers_reads


@pytest.mark.parametrize("content", [b"", b"not a gguf file", b"GGUF\x03\x00\x00\x00\x00\x00"],
                         ids=["empty", "other-format", "truncated-header"])
def test_an_unreadable_gguf_names_the_file(tmp_path, monkeypatch, content: bytes) -> None:
    """An empty or truncated .gguf failed with "cannot mmap an empty file" or a struct.error."""
    from rollout_spec.engine import weights

    monkeypatch.setenv("ROLLOUT_SPEC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "bad.gguf").write_bytes(content)
    with pytest.raises(ValueError, match=r"bad\.gguf is not a GGUF file transformers can read \("):
        weights.load_pretrained(str(tmp_path / "bad.gguf"), torch.device("cpu"), torch.float32)


def test_a_gguf_with_an_incomplete_tokenizer_names_the_field(tmp_path, monkeypatch) -> None:
    """A GGUF tokenizer without scores failed with transformers' bare KeyError('scores') (5.24),
    or a ValueError that does not name the file (5.17)."""
    from rollout_spec.engine import weights

    monkeypatch.setenv("ROLLOUT_SPEC_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "notok.gguf", drop=("tokenizer.ggml.scores",))
    with pytest.raises(ValueError, match=r"notok\.gguf: its tokenizer \(tokenizer\.ggml\.\* fields\) "
                                         r"(lacks 'scores'|cannot be built: .*scores)"):
        weights.load_pretrained(str(tmp_path / "notok.gguf"), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("cut", [0, 7, "half"])
def test_an_unreadable_safetensors_file_names_it(tmp_path, cut) -> None:
    """A truncated or empty weights file raised safetensors' own SafetensorError, without the path."""
    from rollout_spec.engine import weights

    _save_tiny_llama(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2 if cut == "half" else cut])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file \("):
        weights.load_pretrained(str(tmp_path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool])
def test_a_checkpoint_tensor_that_is_not_floating_point_is_a_value_error(dtype) -> None:
    """An integer weight (a quantised checkpoint's packed tensor, a broken export) failed inside
    torch's load_state_dict with a RuntimeError about gradients."""
    _, ours = reference_and_ours("llama")
    state = dict(ours.state_dict())
    state["norm.weight"] = torch.ones(64, dtype=dtype)
    with pytest.raises(ValueError, match=rf"must be floating point; 1 are not, e\.g\. norm\.weight is {dtype}"):
        build_model(tiny_config("llama"), state, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("field, value", [("vocab_size", -1), ("num_attention_heads", 0),
                                          ("num_hidden_layers", 0), ("hidden_size", "64"),
                                          ("head_dim", 16.0), ("intermediate_size", True)])
def test_a_config_size_that_is_no_positive_integer_names_the_field(tmp_path, field, value) -> None:
    """A zero or negative size failed inside transformers or torch (ZeroDivisionError, "negative
    dimension"); wrong types passed transformers 4.x unchecked. A null head_dim stays allowed."""
    import json

    from rollout_spec.engine import weights

    _save_tiny_llama(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "head_dim": None}))
    weights.load_pretrained(str(tmp_path), torch.device("cpu"), torch.float32)
    path.write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=rf"config\.json: {field} must be a positive integer, got {value!r}"):
        weights.load_pretrained(str(tmp_path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("text, error", [("{oops", "not valid JSON"), ("[1]", "must be a JSON object, got list")])
def test_a_config_that_is_no_json_object_names_the_file(tmp_path, text, error) -> None:
    """Unparsable JSON was transformers' OSError, a JSON list its "Unrecognized model"."""
    from rollout_spec.engine import weights

    _save_tiny_llama(tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"config\.json: {error}"):
        weights.load_pretrained(str(tmp_path), torch.device("cpu"), torch.float32)


def test_an_unknown_model_says_what_it_lacks(tmp_path) -> None:
    """The error listed what a model may be but not what the argument missed: a directory's
    absent files, a file's suffix, a near miss of a name."""
    from rollout_spec.engine import weights

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.bin").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    for arg, why in [(str(tmp_path), "the directory has no *.safetensors"),
                     (str(tmp_path / "empty"), "the directory has no config.json and no *.safetensors"),
                     (str(tmp_path / "model.bin"), "a file, but not a .gguf one"),
                     ("SmolLM2-135M", "did you mean 'smollm2-135m'?"),
                     (str(tmp_path / "absent"), "no such model name, file or directory")]:
        with pytest.raises(ValueError, match="model must be one of") as err:
            weights.resolve_model_dir(arg)
        assert str(err.value).endswith(f"got {arg!r}: {why}")


def test_a_packaged_model_whose_file_is_missing_names_the_package_and_path(monkeypatch) -> None:
    from rollout_spec.engine import weights

    monkeypatch.setitem(weights.KNOWN_MODELS, "gone", ("json", "gone.gguf"))  # json: a package
    with pytest.raises(FileNotFoundError, match=r"package 'json' is installed but .*json/gone\.gguf is missing"):
        weights.packaged_gguf("gone")


def test_a_folder_without_weights_is_refused(tmp_path) -> None:
    from rollout_spec.engine.weights import checkpoint_files

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files in .*"):
        checkpoint_files(tmp_path)


def test_a_gguf_transformers_cannot_load_is_a_value_error_naming_it(tmp_path, monkeypatch) -> None:
    """transformers reports tensors of the wrong size with a RuntimeError that does not name the file."""
    from rollout_spec.engine import weights

    def size_mismatch(*args, **kwargs):
        raise RuntimeError("Error(s) in loading state_dict: size mismatch for model.embed_tokens.weight")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", size_mismatch)
    with pytest.raises(ValueError, match=r"odd\.gguf: transformers could not load its tensors \(.*size mismatch"):
        weights.load_gguf_model(tmp_path / "odd.gguf", config=None)
