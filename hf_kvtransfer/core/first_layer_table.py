"""The target's own layer-0 keys and values per token id, held by the mapper (`MapperConfig.map_inputs
["first_layer_table"]`): they depend on the id alone, so a cache that computes exactly one layer looks them up
(`exact.FirstLayerTable`) instead of running the target's projections — the same numbers. It acts in the exact pass,
not on the maps: no mapped layer reads it. Made by `fitting.tabulate_first_layer`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .exact import FirstLayerTable
from .map_inputs import InputCost, MapInput, MapInputConfig, PlanShape, register_map_input
from .rope import text_config
from .stats import KVLayout

# `MapperConfig` (core/mapper.py) imports this module: annotations name it as a string only.
MapperConfig = Any


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

    @staticmethod
    def card_facts(config: dict[str, Any]) -> list[tuple[str, str]]:
        if "first_layer_table" not in (config.get("map_inputs") or {}):
            return []
        return [("Layer 0's keys and values", "looked up per token id when it is the one exact layer (the target's "
                 "own numbers, no projection)")]  # fmt: skip


__all__ = ["FirstLayerTableConfig", "FirstLayerTableInput"]
