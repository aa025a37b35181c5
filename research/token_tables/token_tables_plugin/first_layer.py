"""The first-layer table, a map input defined outside the library: the target's own layer-0 keys and values per
token id, held by the mapper (`MapperConfig.map_inputs["first_layer_table"]`). Layer 0's keys and values depend on
each token's id alone (its embedding through the layer's norm and projections; RoPE comes after), so a cache that
computes exactly one layer looks them up (`FirstLayerTable`, through `MapInput.first_layer_rows`) instead of running
the target's projections, and applies the target's RoPE: the same numbers. It acts in the exact pass, not on the maps:
no mapped layer reads it. Made by `fit.tabulate_first_layer`. Importing this module registers it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_kvtransfer.core.map_inputs import (
    InputCost,
    MapInput,
    MapInputConfig,
    PlanShape,
    register_map_input,
)
from hf_kvtransfer.core.rope import text_config
from hf_kvtransfer.core.stats import KVLayout

# `MapperConfig` (hf_kvtransfer.core.mapper): annotations name it as a string only.
MapperConfig = Any


class FirstLayerTable(nn.Module):
    """The target's own layer-0 keys (RoPE-free, after its key norm) and values for every token id: `key` and
    `value`, each `[vocab_size, n_kv * d]` (`FirstLayerTableInput`; made by `fit.tabulate_first_layer`)."""

    def __init__(self, config: Any):
        super().__init__()
        shape = (config.target_fingerprint["vocab_size"], config.target_layout.layer_dim)
        self.key = nn.Parameter(torch.zeros(shape))
        self.value = nn.Parameter(torch.zeros(shape))

    def lookup(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE-free keys and values `[batch, seq, n_kv * d]` of the ids `[batch, seq]`."""
        ids = input_ids.to(self.key.device)
        return nn.functional.embedding(ids, self.key), nn.functional.embedding(ids, self.value)


@dataclass
class FirstLayerTableConfig(MapInputConfig):
    """`MapperConfig.map_inputs["first_layer_table"]`: no settings (the table is one row per id of the target's
    vocabulary)."""

    def validate(self, config: MapperConfig, name: str) -> None:
        if not config.target_fingerprint.get("vocab_size"):
            raise ValueError(f"{name} needs the target's vocab_size in its config fingerprint")


@register_map_input
class FirstLayerTableInput(MapInput):
    name, order, config_class, attribute = "first_layer_table", 40, FirstLayerTableConfig, "first_layer"
    plan_label = "layer 0's keys and values per token id"

    @classmethod
    def cost(cls, shape: PlanShape) -> InputCost | None:
        """One row of keys and values per vocabulary entry, replacing one exact layer's projections by a look-up."""
        layer_dim = KVLayout.from_config(shape.target_config).layer_dim
        return InputCost(parameters=2 * text_config(shape.target_config).vocab_size * layer_dim)

    @classmethod
    def used_by(cls, config: MapperConfig) -> bool:
        return False  # the cache's exact pass looks it up (`KVMapper.first_layer`); the maps never read it

    @classmethod
    def build_module(cls, config: MapperConfig) -> nn.Module | None:
        return FirstLayerTable(config) if cls.name in config.map_inputs else None

    def first_layer_rows(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mapper.first_layer.lookup(input_ids)

    @staticmethod
    def card_facts(config: dict[str, Any]) -> list[tuple[str, str]]:
        if "first_layer_table" not in (config.get("map_inputs") or {}):
            return []
        return [("Layer 0's keys and values", "looked up per token id when it is the one exact layer (the target's "
                 "own numbers, no projection)")]  # fmt: skip


__all__ = ["FirstLayerTable", "FirstLayerTableConfig", "FirstLayerTableInput"]
