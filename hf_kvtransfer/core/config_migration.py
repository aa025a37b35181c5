"""The one place that reads `config.json` files written by earlier versions: each change of the saved format is a
step here, applied before `MapperConfig` sees the dict, so a mapper saved by any version loads as it did."""

from __future__ import annotations

from typing import Any

from .mapper_types import LOWRANK, RIDGE

# Fields older versions kept in config.json that now live in the run report (`KVMapper.report`).
REPORT_FIELDS = ("eval_results", "model_selection")

# Configs written before the inputs were nested (no `map_inputs` key) held their settings as flat fields:
# {old field: (input, its field)}. These names are saved data, read once here: the only place the package names the
# inputs that have since moved out of it (the research plug-in registers them when imported; without it the nested
# dict written here is refused by `map_inputs.map_input_class`, in one line naming the input).
_FLAT_INPUT_FIELDS = {
    "residual_layer": ("residual", "layer"),
    "residual_lags": ("residual", "lags"),
    "residual_rank": ("residual", "rank"),
    "residual_readers": ("residual", "readers"),
    "residual_in_tables": ("residual", "in_tables"),
    "token_lags": ("token_tables", "lags"),
    "token_readers": ("token_tables", "readers"),
}
# Flat switches that became inputs without settings.
_FLAT_INPUT_SWITCHES = {"key_before_norm": "key_norm", "first_layer_table": "first_layer_table"}
# The flat field whose presence (not None) meant the input was used.
_FLAT_INPUT_MARKERS = {"residual": "residual_layer", "token_tables": "token_lags"}


def migrate_config(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of a saved config's dict in the running version's form (earlier forms migrated, silently: they are
    known). Unknown keys are left for `MapperConfig.from_dict` to warn about."""
    data = dict(data)
    if data.get("mapper_type", RIDGE) == RIDGE and data.get("rank") is not None:
        data["mapper_type"] = LOWRANK  # before 0.2, reduced-rank mappers were "ridge" with a rank
    for name in REPORT_FIELDS:  # before 0.2 run reports lived in the config: KVMapper.report now
        data.pop(name, None)
    if "map_inputs" not in data:
        data["map_inputs"] = _nested_inputs(data)
    return data


def _nested_inputs(data: dict[str, Any]) -> dict[str, Any]:
    """`map_inputs` from the flat fields of a config saved before the inputs were nested (popped from `data`)."""
    inputs: dict[str, dict[str, Any]] = {}
    flat = {name: data.pop(name) for name in [*_FLAT_INPUT_FIELDS, *_FLAT_INPUT_SWITCHES] if name in data}
    for name, (input_name, field) in _FLAT_INPUT_FIELDS.items():
        if flat.get(_FLAT_INPUT_MARKERS[input_name]) is not None or flat.get(name) not in (None, False):
            inputs.setdefault(input_name, {})[field] = flat.get(name)
    for name, input_name in _FLAT_INPUT_SWITCHES.items():
        if flat.get(name):
            inputs[input_name] = {}
    # A flat field set without its input's marker (say residual_lags without residual_layer) was refused then too:
    # the input's config refuses it now, naming the nested field that is missing.
    return {name: {k: v for k, v in settings.items() if v is not None or k in ("layer", "lags")}
            for name, settings in inputs.items()}  # fmt: skip


__all__ = ["REPORT_FIELDS", "migrate_config"]
