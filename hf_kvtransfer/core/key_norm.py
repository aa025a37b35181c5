"""The target's own per-head key norm (Qwen3's `self_attn.k_norm`) on keys a mapper predicts before it
(`MapperConfig.map_inputs["key_norm"]`, a `KeyNormConfig`): a normalisation is not linear, so the maps of the residual
readers fit the linear part of the key and the cache applies the target's own module to what they predict."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .exact import decoder_layers
from .map_inputs import ExactPass, MapInput, MapInputConfig, register_map_input, writable
from .residual import ResidualInput, residual_readers

# `MapperConfig` (core/mapper.py) imports this module: annotations name it as a string only.
MapperConfig = Any


@dataclass
class KeyNormConfig(MapInputConfig):
    """`MapperConfig.map_inputs["key_norm"]`: the key maps of the residual readers predict keys before the target's
    per-head key norm, which the cache applies with the target's own module. No settings: its layers are the
    residual's readers."""

    def validate(self, config: MapperConfig, name: str) -> None:
        if config.mapper_type != "ridge" or ResidualInput.name not in config.map_inputs:
            raise ValueError(
                f"{name} needs a 'ridge' mapper reading the target's residual (map_inputs.{ResidualInput.name}): its "
                f"layers are the residual's readers, got mapper_type={config.mapper_type!r} with inputs {sorted(config.map_inputs)}"
            )

    def model_layers_needed(self, config: MapperConfig) -> int:
        # The cache takes each reader's own `k_norm` from the target.
        return max(residual_readers(config)) + 1


@register_map_input
class KeyNormInput(MapInput):
    name, order, config_class = "key_norm", 30, KeyNormConfig  # after every addition: the norm sees the whole key
    missing = (
        "this mapper predicts keys before the target's key norm, which the cache takes from the target in its exact "
        "layers, but none were computed: pass model=target (and input_ids=, or build the source cache with `prefill`) "
        "to TransferredCache, so that the target's forward or convert_all runs the exact layers first"
    )

    @property
    def readers(self) -> list[int]:
        return residual_readers(self.mapper.config)

    def from_exact_pass(self, exact: ExactPass) -> "KeyNorms":
        decoder = decoder_layers(exact.model)
        norms = {t: getattr(decoder[t].self_attn, "k_norm", None) for t in self.readers}
        if any(norm is None for norm in norms.values()):
            raise ValueError(
                f"this mapper predicts keys before the target's key norm (map_inputs.key_norm), but "
                f"{type(exact.model).__name__} has no `self_attn.k_norm`; load the mapper made for this target model"
            )
        forms = {t: _checked_rms_form(m, self.mapper.target_layout.head_dim) for t, m in norms.items()}
        return KeyNorms(norms, {t: f for t, f in forms.items() if f is not None})

    def apply(self, state, group, rows):
        readers = self.group_readers(group)
        if not readers:
            return rows
        state, tgt = self.require(state), self.mapper.target_layout
        key_rows = writable(rows[0])
        keys = key_rows.view(*key_rows.shape[:-1], len(group), tgt.num_kv_heads, tgt.head_dim)
        layers = [t for _, t in readers]
        forms = [state.forms.get(t) for t in layers]
        epsilons = {form[1] for form in forms if form is not None}
        if len(readers) == len(group) and None not in forms and len(epsilons) == 1:
            # Every layer of the group: one normalisation over all of them, then each layer's weight.
            weight = torch.stack([w for w, _ in forms]).to(keys.device, keys.dtype).unsqueeze(1)  # (layers, 1, d)
            keys.mul_(inverse_rms(keys, epsilons.pop())).mul_(weight)
        else:
            for i, t in readers:
                keys[..., i, :, :] = state.modules[t](keys[..., i, :, :])
        return [key_rows, *rows[1:]]


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`1 / sqrt(mean(x^2) + eps)` over the last dim, keepdim: one reading pass over `x` (a norm), so normalising in
    place costs one more (`x.mul_`) instead of the three of `rms_norm`'s squares, mean and product on CPU."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return norm.square_().div_(x.shape[-1]).add_(eps).rsqrt_().to(x.dtype)


@dataclass
class KeyNorms:
    """A transfer's key norms: the target's own modules by layer, and the `(weight, eps)` of those that are RMS norms."""

    modules: dict[int, nn.Module]
    forms: dict[int, tuple[torch.Tensor, float]]


# Whether each key norm module is an RMS norm (its eps, or None): checked once per module, not per transfer.
_RMS_EPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNCHECKED = object()


def _checked_rms_form(norm: nn.Module, dim: int) -> tuple[torch.Tensor, float] | None:
    """`rms_form(norm, dim)`, the check done once per module; the weight is read from the module at each call."""
    eps = _RMS_EPS.get(norm, _UNCHECKED)
    if eps is _UNCHECKED:
        form = rms_form(norm, dim)
        eps = _RMS_EPS[norm] = None if form is None else form[1]
    return None if eps is None else (norm.weight.detach(), eps)


@torch.no_grad()
def rms_form(norm: nn.Module, dim: int) -> tuple[torch.Tensor, float] | None:
    """`(weight, eps)` when `norm(x)` is `weight * x / sqrt(mean(x^2) + eps)` over the last dim (Qwen3's
    `Qwen3RMSNorm`), checked on random vectors; None for any other module (its own forward is then called)."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.shape != (dim,) or not isinstance(eps, float):
        return None
    probe = torch.randn(8, dim, generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    expected = weight * nn.functional.rms_norm(probe, (dim,), eps=eps)
    return (weight.detach(), eps) if torch.allclose(norm(probe), expected, rtol=1e-4, atol=1e-6) else None


__all__ = ["KeyNormConfig", "KeyNormInput", "KeyNorms", "rms_form"]
