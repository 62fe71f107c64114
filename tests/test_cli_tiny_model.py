"""``rollout-spec bench`` end to end on a tiny random Llama with the default model's tokenizer.

``tiny_model_dir`` is also used by the GRPO example's smoke test: a safetensors directory that
the engine loads like any Hugging Face checkpoint, small enough for a CPU test.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest


def _default_tokenizer():
    """The SmolLM2 tokenizer: from the converted default model if cached, else from its GGUF."""
    from transformers import AutoTokenizer

    from rollout_spec.engine.weights import gguf_cache_dir, packaged_gguf

    gguf = packaged_gguf("smollm2-135m")
    cached = gguf_cache_dir(gguf, "smollm2-135m", by_content=True)
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def tiny_model_dir(root: Path) -> Path:
    """Build (once per ``root``) a 2-layer random Llama with SmolLM2's tokenizer and chat template."""
    out = root / "tiny-llama"
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    tok = _default_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.getbasetemp())


def test_bench_runs_on_a_model_directory(tiny_model, tmp_path, capsys):
    from rollout_spec import cli

    out = tmp_path / "r.json"
    argv = ["bench", "--model", str(tiny_model), "--device", "cpu", "--task", "basic_arithmetic",
            "--steps", "2", "--prompts", "2", "--n", "2", "--max-new-tokens", "16",
            "--wandb", "disabled", "--plot", str(tmp_path / "d.png"),
            "--record", str(tmp_path / "t.json"), "--json", str(out)]
    assert cli.main(argv) == 0
    # 2 prompts x n=2 in slots sized to them: each step is one synchronous batch, and says so.
    assert (f"{tiny_model} on cpu: 2 prompts x n=2 = 4 samples per step, at most 4 decoded at once "
            "(one synchronous batch); T=1.0, 16 new tokens, up to 8 draft nodes per request"
            in " ".join(capsys.readouterr().out.split()))
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["num_requests"] == 4 and 4 <= r["spec_tokens"] <= 64
        assert r["base_tokens"] is not None and r["speedup"] > 0
        # Keyed noise, fp32 on the CPU: both passes sample exactly the same tokens.
        assert r["same_samples"] == 4 and r["base_tokens"] == r["spec_tokens"]
        assert r["tpf"] >= 1.0
        if r["draft_tokens"]:
            assert 0.0 <= r["accept_rate"] <= 1.0
        else:  # nothing drafted: no acceptance to report, not an acceptance of 0
            assert r["accept_rate"] is None
        assert r["mean_reward"] is not None
        assert r["drafter_us_per_request"] > 0
        # The probe's per-depth counts, from walking each tree along the committed tokens, add
        # up to the engine's own accepted-token counter.
        assert sum(r["depth_accepted"]) == r["accepted_tokens"]
        assert (r["draft_tokens"] > 0) == (len(r["depth_drafted"]) > 0)
    trace = json.loads((tmp_path / "t.json").read_text())
    assert len(trace["steps"]) == 2 and all(len(s) == 4 for s in trace["steps"])
    assert trace["prompts"][0]["prompt_ids"][0] == 1  # chat template starts with <|im_start|>
    # Each response with the seed it was sampled with, and the vocabulary: a replay of the
    # recording tells the drafter the noise that picked every recorded token.
    assert all(isinstance(r["seed"], int) for step in trace["steps"] for r in step)
    assert len({r["seed"] for step in trace["steps"] for r in step}) == 8 and trace["vocab_size"] > 0
    assert (tmp_path / "d.png").stat().st_size > 10_000


def test_bench_results_on_stdout_and_status_on_stderr(tiny_model, tmp_path, capsys, monkeypatch):
    """``rollout-spec bench > out.md`` keeps the results: the workload line, the step tables and the
    summary go to stdout; the loading spinner, the progress bar and the files written to stderr."""
    import re

    from rollout_spec import cli

    monkeypatch.setenv("FORCE_COLOR", "1")  # both consoles draw as on a terminal: the bar shows
    argv = ["bench", "--model", str(tiny_model), "--device", "cpu", "--task", "basic_arithmetic",
            "--steps", "1", "--prompts", "1", "--n", "2", "--max-new-tokens", "4",
            "--wandb", "disabled", "--json", str(tmp_path / "r.json")]
    assert cli.main(argv) == 0
    out, err = (re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text) for text in capsys.readouterr())
    flat = " ".join(out.split())
    assert f"{tiny_model} on cpu: 1 prompts x n=2 = 2 samples per step" in flat
    assert "step 0 (2 requests)" in flat and "summary" in flat
    assert re.search(r"│\s+all\s+│\s+\d+\s+│", out)  # the summary's pooled row
    assert f"loading {tiny_model}" in err and "RL steps" in err and f"figures: {tmp_path / 'r.json'}" in err
    assert "loading" not in out and "RL steps" not in out and "figures:" not in out
    assert "summary" not in err and "samples per step" not in err


def test_a_model_that_cannot_be_loaded_is_an_error_not_a_traceback(tiny_model, tmp_path, capsys):
    """No tokenizer, an unsupported activation, damaged weights, a config.json whose sizes do not
    match the weights or that transformers refuses: the bench stops with one line
    naming --model and the reason (rc 1), before any step; a folder without *.safetensors is
    refused as --model is parsed."""
    import shutil

    from argument_errors import argument_error
    from rollout_spec import cli

    def broken(name: str, change) -> Path:
        out = tmp_path / name
        shutil.copytree(tiny_model, out)
        change(out)
        return out

    def no_tokenizer(d: Path) -> None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (d / f).unlink(missing_ok=True)

    def gelu(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))

    def damaged(d: Path) -> None:
        (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])

    def narrower(d: Path) -> None:  # sizes that do not match the weights: torch's RuntimeError
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))

    def text_eps(d: Path) -> None:  # a value transformers 5's config validation refuses
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": "small"}))

    cases = [(no_tokenizer, "has no tokenizer"), (gelu, "hidden_act must be 'silu'"),
             (damaged, "cannot load --model"), (narrower, "the config makes [32, 48]"),
             (text_eps, "rms_norm_eps")]
    for change, why in cases:
        model = broken(change.__name__, change)
        argv = ["bench", "--model", str(model), "--device", "cpu", "--steps", "1", "--prompts", "1",
                "--n", "1", "--max-new-tokens", "4", "--wandb", "disabled"]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"rollout-spec bench: error: cannot load --model {model}") and why in err, err
        assert "Traceback" not in err
    empty = broken("no_weights", lambda d: (d / "model.safetensors").unlink())
    assert "config.json and *.safetensors" in argument_error(
        cli.main, ["bench", "--model", str(empty), "--device", "cpu"], capsys)


def test_new_tokens_past_the_models_context_are_refused_before_it_loads(tiny_model, capsys, monkeypatch):
    """The tiny model holds 512 positions: --max-new-tokens 600 was accepted and every sample
    silently ended at the context's end; it is an argument error naming the most that fits."""
    from argument_errors import argument_error
    from rollout_spec import cli
    from rollout_spec.engine import RolloutEngine

    def refuse(*_args, **_kw):
        raise AssertionError("the model was loaded before the argument error")

    monkeypatch.setattr(RolloutEngine, "from_pretrained", refuse)
    argv = ["bench", "--model", str(tiny_model), "--device", "cpu", "--task", "basic_arithmetic",
            "--steps", "1", "--prompts", "1", "--n", "1", "--max-new-tokens", "600", "--wandb", "disabled"]
    err = argument_error(cli.main, argv, capsys)
    assert "--max-new-tokens must be at most" in err and "(its context holds 512 tokens" in err, err
    assert err.rstrip().endswith("got 600")


def test_draft_tokens_above_the_engines_default_cap_reach_the_budget(tiny_model, tmp_path, monkeypatch):
    """``--draft-tokens`` is the most draft nodes per request per step, in [1, 1024]: the engine the
    bench builds must offer that many, not cut it silently at the engine's default cap (64), while
    "budget used" divides by the flag's value."""
    from rollout_spec import cli

    monkeypatch.setenv("ROLLOUT_SPEC_CACHE", str(tmp_path))  # the timed cost grid goes here
    top, _ = cli._parsers()
    args = top.parse_args(["bench", "--model", str(tiny_model), "--device", "cpu",
                           "--task", "basic_arithmetic", "--prompts", "1", "--n", "2",
                           "--max-new-tokens", "8", "--draft-tokens", "100", "--no-baseline"])
    engine = cli.open_engines(args).spec
    assert engine.max_draft_tokens == 100
    assert max(engine.draft_budget.candidates) == 100
