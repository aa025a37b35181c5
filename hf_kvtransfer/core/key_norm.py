"""The target's own per-head key norm (Qwen3's `self_attn.k_norm`) on keys a mapper predicts before it
(`MapperConfig.map_inputs["key_norm"]`, a `KeyNormConfig`): a normalisation is not linear, so the maps of the residual
readers fit the linear part of the key and the cache applies the target's own module to what they predict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .exact import decoder_layers
from .map_inputs import ExactPass, MapInput, MapInputConfig, register_map_input
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

    def from_exact_pass(self, exact: ExactPass) -> dict[int, nn.Module]:
        decoder = decoder_layers(exact.model)
        norms = {t: getattr(decoder[t].self_attn, "k_norm", None) for t in self.readers}
        if any(norm is None for norm in norms.values()):
            raise ValueError(
                f"this mapper predicts keys before the target's key norm (map_inputs.key_norm), but "
                f"{type(exact.model).__name__} has no `self_attn.k_norm`; load the mapper made for this target model"
            )
        return norms

    def apply(self, state, group, rows):
        readers = self.group_readers(group)
        if not readers:
            return rows
        norms, tgt = self.require(state), self.mapper.target_layout
        keys = rows[0].view(*rows[0].shape[:-1], len(group), tgt.num_kv_heads, tgt.head_dim)
        for i, t in readers:
            keys[..., i, :, :] = norms[t](keys[..., i, :, :])
        return rows


__all__ = ["KeyNormConfig", "KeyNormInput"]
