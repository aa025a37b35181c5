"""What the maps read beyond the source's keys and values, at transfer time: one plug-in per input, behind one
interface, registered the way layer maps are (`layer_maps.LAYER_MAP_TYPES`).

An input is used by a mapper when its config asks for it (`used_by`). For each transfer it keeps a state (a tensor,
or a dict of the target's modules): from the prompt's ids (`from_ids`), or from the cache's exact pass (`from_exact_pass`,
which hands it the target model, the ids and, for an input that reads the residual stream, the residual entering
`hidden_layer`). When the cache maps a group of target layers it hands each input, in registry order, the group's
mapped rows to add its part to (`apply`). An input may also hold the target's own layer-0 keys and values per token
id, which a cache computing one exact layer then looks up (`first_layer_rows`). The mapper, the conversion, the exact
pass, the cache, the card, `plan` and the vLLM connector loop over the inputs; no module outside an input's own files
names it.

The library's inputs: `residual.ResidualInput` (the target's residual stream after its exact layers) and
`key_norm.KeyNormInput` (the target's own key norm on keys predicted before it). Each input has its own config
dataclass (a `MapInputConfig`, `config_class`), nested in `MapperConfig.map_inputs` under the input's name and
validated by itself against the whole mapper config (`MapInputConfig.validate`): a mapper reads an input when its
config holds one (`used_by`). Add one: a subclass and its config in its own module, `@register_map_input`; a module of
the library is named in `BUILT_IN_MAP_INPUTS`, one defined outside it registers itself when its module is imported
(import it before loading a mapper that uses it; docs/guides/map-inputs.md has a worked example).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

# KVMapper and MapperConfig (core/mapper.py imports this module): annotations name them as strings only.
KVMapper = Any
MapperConfig = Any


@dataclass
class MapInputConfig:
    """An input's settings, nested in `MapperConfig.map_inputs[name]` and saved in `config.json` as a dict of its fields.
    Subclasses are dataclasses; `validate` checks them against the whole mapper config (the target's layers, the exact
    layers, the other inputs) and raises `ValueError` naming the field as `map_inputs.<name>.<field>`."""

    def validate(self, config: MapperConfig, name: str) -> None:
        """Raise `ValueError` (one line, naming the field) when this input contradicts `config`."""

    def exact_layers_needed(self, config: MapperConfig) -> tuple[int, str]:
        """The fewest exact layers the cache must compute for this input, and why (a phrase for the error)."""
        return 0, ""

    def model_layers_needed(self, config: MapperConfig) -> int:
        """The target layers (from the first) whose modules the transfer uses for this input, beyond the exact ones."""
        return 0

    def label(self, config: MapperConfig) -> str | None:
        """Its phrase in what the mapped layers read (`maps_read`: every surface that says it), or None for none."""
        return None

    def maps_layer_without_source(self, config: MapperConfig, layer_idx: int) -> bool:
        """Whether a map of `layer_idx` may read no source layer at all (it then reads this input, or nothing)."""
        return False

    def holds_per_id_rows(self, config: MapperConfig, layers: list[int], lags: list[int]) -> bool:
        """Whether this input adds one row per token id, at each position `t - lag` for `lags`, to the maps of every
        layer of `layers`: a part of those maps that is a function of the ids alone may then be held in its rows
        (`ResidualConfig.in_tables`)."""
        return False

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "MapInputConfig":
        """The config from its saved dict; an unknown or missing field is refused with one line naming it."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object of the input's settings, got {data!r}")
        fields = dataclasses.fields(cls)
        known = {f.name for f in fields}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown setting of this input (this version knows {sorted(known)})")
        required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if data.get(name) is None]
        if missing:
            raise ValueError(f"{where}.{missing[0]} is missing (this input needs {', '.join(required)})")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"{where}: {exc}") from None


@dataclass
class PlanShape:
    """A transfer `hf-kvtransfer plan` costs an input at, from the configs alone: the target's (text) config, the
    target layers mapped, the tokens transferred, the positions back the input reads (t, t-1, ...), the maps' rank
    (None: full), the bytes of one number at the plan's dtype, and the rank of one projection of the input's
    features that every map shares (`MapInput.plan_rank`; None: none)."""

    target_config: Any
    num_mapped_layers: int
    num_tokens: int
    positions: int
    rank: int | None = None
    itemsize: int = 2
    shared_rank: int | None = None


@dataclass
class InputCost:
    """What an input adds to a mapper at a `PlanShape`: numbers held (`parameters`), FLOPs of the transfer (2 x
    multiply-adds; a look-up counts none), and input features each map gains."""

    parameters: int = 0
    flops: int = 0
    features: int = 0


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
    config_class: ClassVar[type[MapInputConfig]] = MapInputConfig
    # One line for a transfer that reaches `apply` without the state it needs (never mapped in its place).
    missing: ClassVar[str] = ""
    # The `KVMapper` attribute that holds the input's parameters (None: it has none), made by `build_module`.
    attribute: ClassVar[str | None] = None
    # For `hf-kvtransfer plan`: what it is called there, and the `plan_transfer` option that sets how many positions it
    # reads (None: it reads no positions).
    plan_label: ClassVar[str] = ""
    plan_positions: ClassVar[str | None] = None
    # The positions `plan` costs it at when the caller names none for its `plan_positions` option.
    plan_default_positions: ClassVar[int] = 0
    # The `plan_transfer` option that sets the rank of one projection of its features shared by every map, as a fit
    # may save it (None: the input has no such projection).
    plan_rank: ClassVar[str | None] = None
    # Whether `plan` also costs maps reading this input alone (no source K/V: `maps_layer_without_source`), and a
    # phrase on what its cost leaves out (e.g. what the exact pass computes anyway).
    plan_alone: ClassVar[bool] = False
    plan_note: ClassVar[str] = ""

    @classmethod
    def cost(cls, shape: PlanShape) -> InputCost | None:
        """What the input adds to a mapper at `shape` (None: nothing to count, or the shape does not use it)."""
        return None

    def transfer_flops(self, tokens: int, layers: set[int]) -> int:
        """FLOPs (2 x multiply-adds) the input adds to a transfer of `tokens` tokens whose maps convert `layers`, as
        its state and `apply` take them; a look-up or an elementwise step counts none (`bench`'s count; a test checks
        it against torch's FLOP counter)."""
        return 0

    @classmethod
    def build_module(cls, config: MapperConfig) -> torch.nn.Module | None:
        """The input's parameters for a mapper with `config` (zeros: loading or the fit fills them), or None."""
        return None

    def __init__(self, mapper: KVMapper):
        self.mapper = mapper

    @classmethod
    def used_by(cls, config: MapperConfig) -> bool:
        """Whether a mapper with this config reads the input at transfer time (default: its config holds one)."""
        return cls.name in config.map_inputs

    @property
    def settings(self) -> Any:
        """This input's config (`MapperConfig.map_inputs[name]`)."""
        return self.mapper.config.map_inputs[self.name]

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

    def first_layer_rows(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The target's own layer-0 keys and values, RoPE-free, `[B, T, n_kv * d]` each, for the ids `[B, T]`, when
        this input holds them per token id (they depend on the id alone): a cache computing exactly one layer then
        looks them up instead of running the target's projections. None: it does not hold them."""
        return None

    def apply(self, state: Any, group: tuple[int, ...], rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """The group's mapped `[key_rows, value_rows]` (`[B, T, len(group) * n_kv * d]`, stripped) with its part.

        `rows` may be broadcast views (maps that read no source layer start as their bias, never materialised): an
        input returns new tensors, or writes into `writable(rows[i])`."""
        raise NotImplementedError

    @staticmethod
    def card_facts(config: dict[str, Any]) -> list[tuple[str, str]]:
        """More lines of its own in the model card, `(what, value)`, from a saved config's dict (`config.json`), beyond
        its phrase in what the mapped layers read (`label`, which the card shows through `maps_read`)."""
        return []

    def group_readers(self, group: tuple[int, ...]) -> list[tuple[int, int]]:
        """`(position in group, layer)` of the group's layers the input acts on."""
        readers = set(self.readers)
        return [(i, t) for i, t in enumerate(group) if t in readers]

    def require(self, state: Any) -> Any:
        if state is None:
            raise ValueError(self.missing)
        return state


def writable(rows: torch.Tensor) -> torch.Tensor:
    """`rows` itself when it owns its memory, else a copy: a broadcast view (stride 0) cannot be written in place."""
    if any(stride == 0 and size > 1 for stride, size in zip(rows.stride(), rows.shape)):
        return rows.contiguous()
    return rows


MAP_INPUTS: dict[str, type[MapInput]] = {}

# The modules of the library's own inputs (each registers its class when imported): the one line a new one adds. An
# input defined outside the library registers itself when its own module is imported.
BUILT_IN_MAP_INPUTS = ("residual", "key_norm")


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


def map_input_class(name: str) -> type[MapInput]:
    """The registered input called `name`; an unknown one is refused with one line naming it."""
    registered_map_inputs()
    if name not in MAP_INPUTS:
        raise ValueError(
            f"map_inputs.{name}: unknown map input (this version knows {sorted(MAP_INPUTS)}); a map input defined "
            "outside the library registers itself when its module is imported (register_map_input): import that "
            "module first; else upgrade hf-kvtransfer to the version that saved this mapper, or load a mapper made "
            "without it"
        )
    return MAP_INPUTS[name]


def input_configs(data: Any) -> dict[str, MapInputConfig]:
    """`MapperConfig.map_inputs` from what a config holds (its saved dicts, or configs already), in the order the
    inputs apply; an unknown input or setting is refused with one line naming it."""
    if not isinstance(data, dict):
        raise ValueError(f"map_inputs must be an object {{input name: its settings}}, got {data!r}")
    classes = {name: map_input_class(name) for name in data}
    ordered = sorted(data, key=lambda name: classes[name].order)
    return {name: classes[name].config_class.from_dict(data[name], f"map_inputs.{name}") for name in ordered}


def validate_inputs(config: MapperConfig) -> None:
    """Each input's own checks against the whole mapper config (`MapInputConfig.validate`)."""
    for name, settings in config.map_inputs.items():
        settings.validate(config, f"map_inputs.{name}")


def exact_layers_needed(config: MapperConfig) -> tuple[int, str]:
    """The fewest exact layers a mapper's inputs need, and why (`(0, "")` for none)."""
    return max((s.exact_layers_needed(config) for s in config.map_inputs.values()), default=(0, ""), key=lambda x: x[0])


def model_layers_needed(config: MapperConfig) -> int:
    """The target layers (from the first) whose modules a mapper's inputs use beyond the exact layers (0 for none)."""
    return max((s.model_layers_needed(config) for s in config.map_inputs.values()), default=0)


def maps_read(config: MapperConfig, num_exact_layers: int | None = None) -> str:
    """What a mapper's maps read, in one phrase for every surface (the fit's log and report, `info`, `eval`): the
    source's K/V, then each input's own phrase (`MapInputConfig.label`) in the order they apply. E.g. "no source K/V
    + target residual entering layer 2 (t, t-1, t-2, rank 73) read by every mapped layer". The source's K/V are named
    for the layers after `num_exact_layers` (None: those the inputs leave to map; without inputs, "source K/V")."""
    mapped = _mapped_layers(config, num_exact_layers)
    parts = [s.label(config) for s in config.map_inputs.values()]
    return " + ".join([_source_label(config, mapped) if mapped.start else "source K/V", *(p for p in parts if p)])


def top_k_unused(config: MapperConfig, num_exact_layers: int) -> str:
    """Why a mapper's `top_k` plays no part in a transfer with `num_exact_layers` exact layers, in a few words ("" when
    some mapped layer reads source K/V): `info` and the card say so beside k."""
    mapped = _mapped_layers(config, num_exact_layers)
    if not mapped:
        return "not used: the target computes every layer"
    if not any(config.selected_layers[t] for t in mapped):
        return "not used: the mapped layers read no source K/V"
    return ""


def _mapped_layers(config: MapperConfig, num_exact_layers: int | None) -> range:
    """The layers a transfer maps: after `num_exact_layers` and those the map inputs need computed (None: those)."""
    needed = exact_layers_needed(config)[0]
    first = needed if num_exact_layers is None else max(needed, num_exact_layers)
    return range(first, len(config.selected_layers))


def _source_label(config: MapperConfig, mapped: range) -> str:
    """Which source K/V the maps of the `mapped` layers read."""
    alone = [t for t in mapped if not config.selected_layers[t]]
    read = {tuple(config.selected_layers[t]) for t in mapped}
    if not alone and len(read) == 1 and len(next(iter(read))) == 1:  # e.g. the last source layer only
        return f"source layer {next(iter(read))[0]}'s K/V"
    if not alone:
        return "source K/V"
    if len(alone) == len(mapped):
        return "no source K/V"
    return f"source K/V (none for layer{'s' if len(alone) > 1 else ''} {', '.join(map(str, alone))})"


def with_input(config: MapperConfig, name: str, settings: MapInputConfig | None) -> MapperConfig:
    """A copy of `config` with input `name` set to `settings` (None: without it); validated as a new config."""
    inputs = {k: v for k, v in config.map_inputs.items() if k != name}
    if settings is not None:
        inputs[name] = settings
    return dataclasses.replace(config, map_inputs=inputs)


def map_inputs_of(mapper: KVMapper) -> list[MapInput]:
    """The inputs `mapper` reads, in the order they apply."""
    return [cls(mapper) for cls in registered_map_inputs() if cls.used_by(mapper.config)]


def first_layer_rows(mapper: KVMapper, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer 0's RoPE-free keys and values for `input_ids`, looked up by an input of `mapper`'s config that holds
    them per token id (`MapInput.first_layer_rows`), or None when none does."""
    for cls in registered_map_inputs():
        if cls.name in mapper.config.map_inputs:
            rows = cls(mapper).first_layer_rows(input_ids)
            if rows is not None:
                return rows
    return None


def layer_span(layers: list[int]) -> str:
    """`[2, 3, 4, 5]` -> "2-5"; other lists comma-separated (for labels)."""
    if len(layers) > 2 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(map(str, layers))


def positions_label(lags: list[int]) -> str:
    """`[0, 1, 2]` -> "t, t-1, t-2"."""
    return ", ".join("t" if lag == 0 else f"t-{lag}" for lag in lags)


def map_state(state: Any, fn) -> Any:
    """A batch or length operation on an input's state: tensors follow it, modules (the target's own) do not."""
    return fn(state) if isinstance(state, torch.Tensor) else state


__all__ = [
    "ExactPass",
    "InputCost",
    "MAP_INPUTS",
    "MapInput",
    "MapInputConfig",
    "PlanShape",
    "exact_layers_needed",
    "first_layer_rows",
    "input_configs",
    "layer_span",
    "map_input_class",
    "map_inputs_of",
    "map_state",
    "model_layers_needed",
    "positions_label",
    "register_map_input",
    "registered_map_inputs",
    "validate_inputs",
    "with_input",
    "writable",
]
