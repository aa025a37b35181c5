"""Strip and re-apply rotary position embeddings with each model's own rotary module.

The KV cache stores keys *after* RoPE. A linear map between two models' keys only makes sense on the
position-free ("stripped") keys, so the mapper strips the source's rotation, maps, and rotates with the
target's. Both directions go through the model's own ``RotaryEmbedding`` module, so every rope type that
transformers implements (default, llama3, yarn, dynamic, longrope, partial rotary) is handled by the code
that applied it in the first place.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PreTrainedConfig

# Architectures whose attention applies RoPE as `k * cos + rotate_half(k) * sin` on the first
# `cos.shape[-1]` dims of each head (half-split layout) and caches the rotated keys. Others (interleaved
# layouts, MLA, no RoPE) would be stripped wrongly, so they are refused rather than mapped silently.
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "ministral",
    "ministral3",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "phi3",
    "olmo2",
    "granite",
)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def check_supported(config: PreTrainedConfig) -> None:
    """Raise a `ValueError` naming the architecture if its RoPE layout is not one this library can strip."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {model_type!r} ({type(config).__name__}): hf-kvtransfer needs a decoder that "
            f"applies half-split RoPE to cached keys and exposes `model.model.rotary_emb`; supported model types are "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}. If your model uses that layout, open an issue with its config."
        )


def text_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """The decoder config of a (possibly multimodal) config."""
    return config.get_text_config(decoder=True)


def head_dim_of(config: PreTrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def config_from_dict(config_dict: dict[str, Any]) -> PreTrainedConfig:
    """Rebuild a transformers config from the dict stored in a mapper checkpoint (no network, no model)."""
    config_dict = dict(config_dict)
    model_type = config_dict.pop("model_type", None)
    if model_type is None:
        raise ValueError("stored model config has no `model_type`; the mapper checkpoint is incomplete")
    return AutoConfig.for_model(model_type, **config_dict)


def build_rotary_embedding(config: PreTrainedConfig, device: torch.device | str | None = None) -> nn.Module:
    """Instantiate the architecture's own rotary module from its config alone.

    transformers names it `<Prefix>RotaryEmbedding` next to `<Prefix>Config` in the modeling module, e.g.
    `Qwen3Config` -> `Qwen3RotaryEmbedding`. Building it from the config (rather than taking it from a model)
    lets the target process rebuild the *source's* rotation without ever loading the source model.
    """
    config = text_config(config)
    check_supported(config)
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    prefix = type(config).__name__.removesuffix("Config")
    rotary_cls = getattr(module, f"{prefix}RotaryEmbedding", None)
    if rotary_cls is None:
        raise ValueError(
            f"unsupported architecture {config.model_type!r}: `{module.__name__}` has no `{prefix}RotaryEmbedding`"
        )
    rotary = rotary_cls(config=config, device=device) if "device" in _init_params(rotary_cls) else rotary_cls(config)
    return rotary.to(device) if device is not None else rotary


def _init_params(cls: type) -> tuple[str, ...]:
    import inspect

    return tuple(inspect.signature(cls.__init__).parameters)


def rotary_cos_sin(rotary: nn.Module, position_ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin in float32 for `position_ids` of shape `[batch, seq]`; both are `[batch, 1, seq, rotary_dim]`.

    They carry the rope type's attention scaling `a` (cos^2 + sin^2 = a^2), exactly as the attention uses them.
    """
    # A float32 probe makes the module return float32 cos/sin even when the model runs in bf16.
    probe = torch.empty(0, dtype=torch.float32, device=device)
    held = next(rotary.buffers(), probe).device
    if held != probe.device:  # a copy on the device: the module may be shared (`KVMapper.rotary`), never moved
        rotary = copy.deepcopy(rotary).to(device)
    with torch.no_grad():
        cos, sin = rotary(probe, position_ids.to(device))
    return cos.float().unsqueeze(1), sin.float().unsqueeze(1)


def strip_rope(key_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo RoPE on cached keys.

    Args:
        key_states: rotated keys `[batch, kv_heads, seq, head_dim]`.
        cos, sin: from `rotary_cos_sin`, `[batch, 1, seq, rotary_dim]` with `rotary_dim <= head_dim`.

    Returns:
        Position-free keys, float32, same shape. Dims past `rotary_dim` pass through (partial rotary).
    """
    rotary_dim = cos.shape[-1]
    k = key_states.float()
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    # Rotating by -theta is (k*cos - rotate_half(k)*sin); dividing by cos^2 + sin^2 removes the scaling a^2.
    stripped = (k_rot * cos - rotate_half(k_rot) * sin) / (cos * cos + sin * sin)
    return torch.cat((stripped, k_pass), dim=-1) if k_pass.shape[-1] else stripped


def rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out = x * cos + rotate_half(x) * sin` on the first `cos.shape[-1]` dims, the rest copied: the transfer path's
    RoPE into another tensor, for stripping (with the folded tables `(cos, -sin) / (cos^2 + sin^2)`); `rotate_` is the
    same in place, for re-applying it to mapped keys.

    Four fused multiply-adds over half-width views, no temporaries; `cos`/`sin` broadcast against `x`, and `out` may be
    a strided view (e.g. the cache layout seen through a permutation) of another dtype. The attention modules' `k*cos + rotate_half(k)*sin`.
    """
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    o1, o2 = out[..., :half], out[..., half:rotary_dim]
    torch.mul(x1, cos[..., :half], out=o1)
    o1.addcmul_(x2, sin[..., :half], value=-1)
    torch.mul(x2, cos[..., half:], out=o2)
    o2.addcmul_(x1, sin[..., half:])
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:].copy_(x[..., rotary_dim:])
    return out


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate_into(x, cos, sin, out=x)`, which cannot alias: `x` rotated in place, keeping of its first half only the
    product with `sin` (half of `x`) and writing no second full-size buffer."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    kept = x1 * sin[..., half:]
    x1.mul_(cos[..., :half]).addcmul_(x2, sin[..., :half], value=-1)
    x2.mul_(cos[..., half:]).add_(kept)
    return x


def position_ids_from_mask(attention_mask: torch.Tensor | None, batch_size: int, seq_len: int, device) -> torch.Tensor:
    """Per-row positions `[batch, seq]` the way `generate` builds them: `cumsum(mask) - 1`, pads at 0."""
    if attention_mask is None:
        return torch.arange(seq_len, device=device).unsqueeze(0).expand(batch_size, -1)
    mask = attention_mask[:, :seq_len].to(device)
    if mask.shape != (batch_size, seq_len):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, expected (batch={batch_size}, >= {seq_len} tokens) "
            "to match the cache; pass the mask that was used for the prefill"
        )
    position_ids = mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(mask == 0, 0)
