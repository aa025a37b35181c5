"""The target's own per-head key norm (Qwen3's `self_attn.k_norm`) on keys a mapper predicts before it
(`MapperConfig.key_before_norm`): a normalisation is not linear, so the maps of the residual readers fit the linear
part of the key and the cache applies the target's own module to what they predict."""

from __future__ import annotations

from typing import Any

from torch import nn

from .exact import decoder_layers
from .map_inputs import ExactPass, MapInput, register_map_input
from .residual import residual_readers


@register_map_input
class KeyNormInput(MapInput):
    name, order = "key_norm", 30  # after every addition: the norm sees the whole predicted key
    missing = (
        "this mapper predicts keys before the target's key norm, which the cache takes from the target in its exact "
        "layers, but none were computed: pass model=target (and input_ids=, or build the source cache with `prefill`) "
        "to TransferredCache, so that the target's forward or convert_all runs the exact layers first"
    )

    @staticmethod
    def used_by(config: Any) -> bool:
        return bool(config.key_before_norm)

    @property
    def readers(self) -> list[int]:
        return residual_readers(self.mapper.config)

    def from_exact_pass(self, exact: ExactPass) -> dict[int, nn.Module]:
        decoder = decoder_layers(exact.model)
        norms = {t: getattr(decoder[t].self_attn, "k_norm", None) for t in self.readers}
        if any(norm is None for norm in norms.values()):
            raise ValueError(
                f"this mapper predicts keys before the target's key norm (key_before_norm), but "
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


__all__ = ["KeyNormInput"]
