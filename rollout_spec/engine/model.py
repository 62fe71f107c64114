"""The Llama family (Llama, SmolLM2, Qwen2/2.5, Qwen3) as one compact torch model.

Module names follow Hugging Face's checkpoints (minus the ``model.`` prefix) so weights load with
a plain ``load_state_dict``. Every forward is a tree forward over a static KV cache: W new tokens
per request, written at the request's slot, attending to its cached prefix plus its tree
ancestors. Prefill is the same forward with ``ctx_len = 0`` and no ``tree_mask``: causal
attention over the prompt's own keys and values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from rollout_spec.engine.attention import prefill_attention, tree_attention
from rollout_spec.engine.kv_cache import KVCache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and options of one Llama-family model, derived once from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2/2.5 always, Llama when attention_bias
    o_bias: bool  # Llama's attention_bias also covers o_proj
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    hf_config: Any  # kept for the RoPE init functions of transformers

    def __post_init__(self) -> None:
        # Each key/value head serves num_heads // num_kv_heads query heads (GQA); otherwise the
        # first forward failed deep in torch's attention ("size of tensor a (4) must match ...").
        if self.num_kv_heads < 1:
            raise ValueError(f"num_key_value_heads must be in [1, inf], got {self.num_kv_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")

    @staticmethod
    def from_hf(cfg: Any) -> "ModelConfig":
        """Read a transformers ``PretrainedConfig``; raise ValueError for unsupported families."""
        mt = getattr(cfg, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {mt!r}")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("use_sliding_window must be False (rollout-spec's attention is full "
                             "attention only), got True")
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):  # the MLP is SwiGLU; another one would give other logits
            raise ValueError(f"hidden_act must be 'silu' (a SwiGLU MLP), got {act!r}")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        return ModelConfig(
            model_type=mt,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.rms_norm_eps),
            max_position_embeddings=int(cfg.max_position_embeddings),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or attn_bias,
            o_bias=attn_bias and mt in ("llama", "qwen3"),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=mt == "qwen3",
            hf_config=cfg,
        )


@dataclass
class StepContext:
    """Attention metadata of one forward, shared by every layer (keeps ``forward`` signatures clean).

    All tensors live on the model's device; nothing here needs a host sync.
    """

    cache: KVCache
    slot_ids: Tensor  # [B] int64: KV slot of each row
    ctx_lens: Tensor  # [B] int64: tokens already cached; new K/V go to ctx_len .. ctx_len+W-1
    # [B, W, W] bool: ancestor-or-self among the W new tokens. None: a prefill from position 0
    # (every ctx_len is 0, the mask is causal), which attends over the step's own K/V.
    tree_mask: Optional[Tensor]
    kv_limit: Optional[int] = None  # host-known bound on ctx_len + W, lets attention read less


def rope_inverse_frequencies(config: ModelConfig) -> tuple[Tensor, float]:
    """Inverse frequencies and the cos/sin scale for the config's RoPE variant.

    The scaled variants (linear, llama3, yarn, ...) come from transformers' own init functions,
    so our positions agree with its forward bit for bit in fp32.
    """
    with torch.device("cpu"):  # real values even while the model is built on the meta device
        return _rope_inverse_frequencies(config)


def rope_settings(hf_config: Any) -> tuple[str, dict]:
    """The RoPE variant's name and its settings, from either transformers generation's config:
    5.x keeps them in ``rope_parameters`` (``rope_theta`` included), 4.x in ``rope_scaling``
    (None for plain RoPE; older files name the variant ``type``) with ``rope_theta`` beside it.
    Reading only the first made 4.x run scaled models (Llama 3.x, yarn) with plain RoPE."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default"))), dict(params)


def _rope_inverse_frequencies(config: ModelConfig) -> tuple[Tensor, float]:
    rope_type, params = rope_settings(config.hf_config)
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(config.hf_config, "rope_theta", 10000.0)))
        exps = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
        return 1.0 / (theta**exps), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (static variants only)")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config.hf_config, "cpu")
    return inv_freq.float(), float(scale)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B,H,W,D]`` by per-position angles (``cos``/``sin`` are ``[B,1,W,D]``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as the reference checkpoints were trained."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dimension of ``x``."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention whose new K/V go straight into the slot's static cache."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        c, self.layer_idx = config, layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.scale = c.head_dim**-0.5

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: StepContext) -> Tensor:
        """``x [B, W, H]`` -> attention output; writes the step's K/V into the cache first."""
        B, W, _ = x.shape
        q = self.q_proj(x).view(B, W, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, W, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, W, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        k_cache, v_cache = ctx.cache.write(self.layer_idx, ctx.slot_ids, ctx.ctx_lens, k, v)
        if ctx.tree_mask is None:
            out = prefill_attention(q, k, v, self.scale)
        else:
            out = tree_attention(
                q, k_cache, v_cache, ctx.slot_ids, ctx.ctx_lens, ctx.tree_mask, self.scale,
                kv_limit=ctx.kv_limit,
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, W, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x: Tensor) -> Tensor:
        """``down(silu(gate(x)) * up(x))``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: StepContext) -> Tensor:
        """One residual attention + MLP block."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Decoder-only Llama-family model: ``hidden(ids, positions, ctx)`` then ``logits(hidden)``.

    The two halves are separate so callers compute the vocabulary projection only for the rows
    they sample from (the last prompt token in prefill, every tree row in verify).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        inv_freq, self.rope_scale = rope_inverse_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the checkpoint says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def hidden(self, input_ids: Tensor, positions: Tensor, ctx: StepContext) -> Tensor:
        """Final-normed hidden states ``[B, W, H]`` of the W new tokens per row."""
        x = self.embed_tokens(input_ids)
        angles = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, W, D]
        cos = (emb.cos() * self.rope_scale).to(x.dtype)
        sin = (emb.sin() * self.rope_scale).to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        """Vocabulary logits in fp32 (sampling and logprobs want full precision)."""
        return self.lm_head(hidden).float()

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: StepContext) -> Tensor:
        """Logits ``[B, W, V]`` for every new token (tests and teacher forcing)."""
        return self.logits(self.hidden(input_ids, positions, ctx))
