"""What the maps read beyond the source's keys and values, at transfer time: one plug-in per input, behind one
interface, registered the way layer maps are (`layer_maps.LAYER_MAP_TYPES`).

An input is used by a mapper when its config asks for it (`used_by`). For each transfer it keeps a state (a tensor,
or a dict of the target's modules): from the prompt's ids (`from_ids`), or from the cache's exact pass (`from_exact_pass`,
which hands it the target model, the ids and, for an input that reads the residual stream, the residual entering
`hidden_layer`). When the cache maps a group of target layers it hands each input, in registry order, the group's
mapped rows to add its part to (`apply`). The conversion, the exact pass and the cache loop over
`KVMapper.map_inputs`; no module outside an input's own names it.

The inputs: `residual.ResidualInput` (the target's residual stream after its exact layers), `token_tables.TokenTableInput`
(table rows of the prompt's ids), `key_norm.KeyNormInput` (the target's own key norm on keys predicted before it).
Add one: a subclass in its own module, `@register_map_input`, its module named in `BUILT_IN_MAP_INPUTS`, its config
fields validated in `MapperConfig`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

# KVMapper / PreTrainedModel sit above or beside this module: annotations name them as strings only.
KVMapper = Any


@dataclass
class ExactPass:
    """What the cache's exact pass hands the inputs: the target model, the transferred tokens' ids `[B, T]` and mask,
    and the residual stream `[B, T, hidden]` entering the layer an input asked for (None when none did)."""

    model: Any
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    hidden: torch.Tensor | None = None


class MapInput:
    """One input of the maps beyond the source's K/V. Subclasses set `name` and `order` (the order `apply` runs in:
    additions before the key norm) and override what they use."""

    name: ClassVar[str] = ""
    order: ClassVar[int] = 0
    # One line for a transfer that reaches `apply` without the state it needs (never mapped in its place).
    missing: ClassVar[str] = ""

    def __init__(self, mapper: KVMapper):
        self.mapper = mapper

    @staticmethod
    def used_by(config: Any) -> bool:
        """Whether a mapper with this config reads the input."""
        raise NotImplementedError

    @property
    def readers(self) -> list[int]:
        """The target layers the input acts on."""
        raise NotImplementedError

    @property
    def needs_prompt_ids(self) -> bool:
        """Whether its state comes from the prompt's ids (directly, or through the exact pass)."""
        return True

    def hidden_layer(self) -> int | None:
        """The target layer whose input (the residual stream) the exact pass must capture for it, if any."""
        return None

    def from_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> Any:
        """Its state from the transferred tokens' ids alone (None: it needs the exact pass)."""
        return None

    def from_exact_pass(self, exact: ExactPass) -> Any:
        """Its state once the exact pass ran (None: nothing from there)."""
        return None

    def apply(self, state: Any, group: tuple[int, ...], rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """The group's mapped `[key_rows, value_rows]` (`[B, T, len(group) * n_kv * d]`, stripped) with its part."""
        raise NotImplementedError

    @staticmethod
    def card_facts(config: dict[str, Any]) -> list[tuple[str, str]]:
        """Its lines in the model card, `(what, value)`, from a saved config's dict (`config.json`)."""
        return []

    def group_readers(self, group: tuple[int, ...]) -> list[tuple[int, int]]:
        """`(position in group, layer)` of the group's layers the input acts on."""
        readers = set(self.readers)
        return [(i, t) for i, t in enumerate(group) if t in readers]

    def require(self, state: Any) -> Any:
        if state is None:
            raise ValueError(self.missing)
        return state


MAP_INPUTS: dict[str, type[MapInput]] = {}

# The modules of the library's own inputs (each registers its class when imported): the one line a new input adds.
BUILT_IN_MAP_INPUTS = ("residual", "token_tables", "key_norm")


def register_map_input(cls: type[MapInput]) -> type[MapInput]:
    """Class decorator: make an input known by its `name`."""
    if not cls.name or cls.name in MAP_INPUTS and MAP_INPUTS[cls.name] is not cls:
        raise ValueError(f"map input {cls.__name__} needs a name not taken, got {cls.name!r}")
    MAP_INPUTS[cls.name] = cls
    return cls


def registered_map_inputs() -> list[type[MapInput]]:
    """Every registered input class, in the order they apply."""
    for module in BUILT_IN_MAP_INPUTS:
        importlib.import_module(f"{__package__}.{module}")
    return sorted(MAP_INPUTS.values(), key=lambda c: c.order)


def map_inputs_of(mapper: KVMapper) -> list[MapInput]:
    """The inputs `mapper` reads, in the order they apply."""
    return [cls(mapper) for cls in registered_map_inputs() if cls.used_by(mapper.config)]


def map_state(state: Any, fn) -> Any:
    """A batch or length operation on an input's state: tensors follow it, modules (the target's own) do not."""
    return fn(state) if isinstance(state, torch.Tensor) else state


__all__ = ["ExactPass", "MAP_INPUTS", "MapInput", "map_inputs_of", "map_state", "register_map_input", "registered_map_inputs"]
