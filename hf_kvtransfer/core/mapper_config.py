"""A mapper's config (`config.json`): what is needed to load and apply a mapper, plus its provenance, and the
facts about each model it depends on (`config_fingerprint`). Its own module so that what describes a saved mapper
(the model card, `core/card.py`) reads it without the mapper's weights and modules (`core/mapper.py`)."""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from transformers import PreTrainedConfig

from ..version import __version__
from .config_migration import migrate_config
from .layer_maps import LAYER_MAP_TYPES, layer_map_class
from .map_inputs import MapInputConfig, input_configs, validate_inputs
from .mapper_types import LOWRANK, RIDGE
from .quality_gate import QualityGateConfig
from .rope import config_from_dict, head_dim_of, text_config
from .stats import KVLayout


# Config fields that fix tensor shapes: a mismatch there can never work.
SHAPE_FIELDS = ("num_hidden_layers", "num_key_value_heads", "head_dim")


def config_fingerprint(config: PreTrainedConfig | dict[str, Any]) -> dict[str, Any]:
    """The facts about a model that a mapper depends on: KV shape, RoPE, vocabulary, attention layout."""
    if isinstance(config, dict):
        config = config_from_dict(config)
    config = text_config(config)
    rope = getattr(config, "rope_parameters", None)
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": head_dim_of(config),
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "rope_parameters": dict(rope) if rope is not None else None,
        "partial_rotary_factor": getattr(config, "partial_rotary_factor", None),
        "layer_types": list(config.layer_types) if getattr(config, "layer_types", None) else None,
        "sliding_window": getattr(config, "sliding_window", None),
    }


def model_name(config: PreTrainedConfig | dict) -> str | None:
    name = config.get("_name_or_path") if isinstance(config, dict) else getattr(config, "_name_or_path", None)
    return name or None



@dataclass
class MapperConfig:
    """What is needed to load and apply a mapper, plus its provenance; saved as `config.json`.

    Run reports (model-selection curves, training logs, timings, evaluations) are not part of it: they live in
    `KVMapper.report` (`fit_report.json`). Configs are values: library code never mutates one it was given
    (`dataclasses.replace` makes a changed copy).

    Args:
        source_config / target_config: the two models' decoder configs as dicts (enough to rebuild their
            rotary modules without loading either model).
        selected_layers: for each target layer, the source layers its inputs come from (ascending). Empty for a
            layer whose map may read no source layer (a ridge map of a layer after the residual input's layer: the
            residual alone, or the calibration mean of its keys and values).
        mapper_type: the layer-map type (`layer_maps.LAYER_MAP_TYPES`: "ridge", "lowrank", "mlp").
        top_k, ridge_lambda: fit hyper-parameters.
        fit_r2_key / fit_r2_value: in-sample head-averaged R^2 per target layer.
        heldout_r2_key / heldout_r2_value: the same on held-out calibration statistics, when there were some.
        calibration: how the calibration data was built (dataset, split, sequences, seq_len, stride, tokens).
        rank: `[key_rank, value_rank]` per target layer of a "lowrank" mapper (`lowrank.py`).
        mlp: architecture of an "mlp" mapper's maps (hidden_size, num_hidden_layers, residual, per_head,
            activation).
        num_exact_layers: the target's first layers `TransferredCache` computes itself with this mapper unless told
            otherwise: the fewest that keep the content probe's retention (`exact_layers.py`, chosen by the fit),
            or a number given to the fit. None: `DEFAULT_NUM_EXACT_LAYERS`.
        num_recompute_tokens: the prompt's last tokens `TransferredCache` (and the vLLM connector) leave to the
            target with this mapper unless told otherwise, for a mapper measured at another number; None (what the
            fit writes): the cache's default (`cache.DEFAULT_NUM_RECOMPUTE_TOKENS`).
        exact_window: the exact layers' attention over the transferred prompt reaches back this many tokens
            (`local_attention.py`), chosen by the fit's content gate where it keeps passage recall and hand-off;
            None: the whole prompt. Saved only when set.
        map_inputs: what the maps read beyond the source's K/V, `{input name: its config}` (a `MapInputConfig` of
            the input registered under that name, `map_inputs.py`), each validated by the input against the whole
            config; saved as `{name: {field: value}}`, e.g. `{"residual": {"layer": 1, "lags": [0, 1], ...},
            "key_norm": {}}`. Empty: source-only maps.
        quality_gate: the per-request gate (`quality_gate.QualityGateConfig`: a threshold on how close the maps come
            to the target's own K/V on the recomputed tokens), set by a fit; None for mappers saved without one.
        num_parameters / dtype: size and weight dtype as saved (filled in by `save_pretrained`, for the card).
    """

    source_config: dict[str, Any]
    target_config: dict[str, Any]
    selected_layers: list[list[int]]
    mapper_type: str = RIDGE
    source_model_id: str | None = None
    source_revision: str | None = None
    target_model_id: str | None = None
    target_revision: str | None = None
    source_fingerprint: dict[str, Any] = field(default_factory=dict)
    target_fingerprint: dict[str, Any] = field(default_factory=dict)
    top_k: int | None = None
    ridge_lambda: float = 0.01
    fit_r2_key: list[float] | None = None
    fit_r2_value: list[float] | None = None
    heldout_r2_key: list[float] | None = None
    heldout_r2_value: list[float] | None = None
    calibration: dict[str, Any] = field(default_factory=dict)
    mlp: dict[str, Any] | None = None
    rank: list[list[int]] | None = None
    num_exact_layers: int | None = None
    num_recompute_tokens: int | None = None
    exact_window: int | None = None
    map_inputs: dict[str, MapInputConfig] = field(default_factory=dict)
    quality_gate: QualityGateConfig | None = None
    num_parameters: int | None = None
    dtype: str | None = None
    license: str = "apache-2.0"
    library_version: str = __version__

    def __post_init__(self):
        if self.mapper_type not in LAYER_MAP_TYPES:
            raise ValueError(f"mapper_type must be one of {sorted(LAYER_MAP_TYPES)}, got {self.mapper_type!r}")
        # JSON-normalise (int dict keys become str, tuples lists) so a loaded config equals the saved one.
        self.source_config = json.loads(json.dumps(self.source_config))
        self.target_config = json.loads(json.dumps(self.target_config))
        self.calibration = json.loads(json.dumps(self.calibration))
        if not self.source_fingerprint:
            self.source_fingerprint = config_fingerprint(self.source_config)
        if not self.target_fingerprint:
            self.target_fingerprint = config_fingerprint(self.target_config)
        self.source_model_id = self.source_model_id or model_name(self.source_config)
        self.target_model_id = self.target_model_id or model_name(self.target_config)
        # Each input's config from its saved dict (an unknown input or setting refused), in the order they apply.
        self.map_inputs = input_configs(self.map_inputs)
        self.quality_gate = QualityGateConfig.from_value(self.quality_gate)  # None: saved before the gate, or none
        self._validate_layers()
        if self.ridge_lambda < 0:
            raise ValueError(f"ridge_lambda must be >= 0, got {self.ridge_lambda}")
        num_target = self.target_fingerprint["num_hidden_layers"]
        if self.num_exact_layers is not None and not 0 <= self.num_exact_layers <= num_target:
            raise ValueError(f"num_exact_layers must be in [0, {num_target}] (the target's layers), got {self.num_exact_layers}")
        if self.num_recompute_tokens is not None and (isinstance(self.num_recompute_tokens, bool) or not isinstance(self.num_recompute_tokens, int) or self.num_recompute_tokens < 1):
            raise ValueError(f"num_recompute_tokens must be an integer >= 1 or None, got {self.num_recompute_tokens!r}")
        if self.exact_window is not None and (isinstance(self.exact_window, bool) or not isinstance(self.exact_window, int) or self.exact_window < 1):
            raise ValueError(f"exact_window must be an integer >= 1 (tokens) or None (the whole prompt), got {self.exact_window!r}")
        if self.rank is not None and self.mapper_type != LOWRANK:
            raise ValueError(f"rank applies to 'lowrank' mappers only, got mapper_type={self.mapper_type!r}")
        layer_map_class(self.mapper_type).validate_config(self)
        validate_inputs(self)

    def _validate_layers(self) -> None:
        """`selected_layers` and the per-layer R^2 lists against the two models' layers."""
        num_target = self.target_fingerprint["num_hidden_layers"]
        num_source = self.source_fingerprint["num_hidden_layers"]
        if len(self.selected_layers) != num_target:
            raise ValueError(
                f"selected_layers has {len(self.selected_layers)} entries, expected one per target layer ({num_target})"
            )
        for t, selected in enumerate(self.selected_layers):
            if any(not 0 <= s < num_source for s in selected) or len(set(selected)) != len(selected):
                raise ValueError(
                    f"selected_layers[{t}] = {selected} must be distinct source layer indices in [0, {num_source})"
                )
            if not selected and not any(c.maps_layer_without_source(self, t) for c in self.map_inputs.values()):
                raise ValueError(
                    f"selected_layers[{t}] is empty: only a 'ridge' mapper reading the target's residual may leave a "
                    "layer after the residual's layer without source inputs (its map is then the residual alone, or "
                    "the calibration mean)"
                )
        for name in ("fit_r2_key", "fit_r2_value", "heldout_r2_key", "heldout_r2_value"):
            value = getattr(self, name)
            if value is not None and len(value) != num_target:
                raise ValueError(f"{name} has {len(value)} entries, expected {num_target} (one per target layer)")

    @property
    def source_layout(self) -> KVLayout:
        f = self.source_fingerprint
        return KVLayout(f["num_hidden_layers"], f["num_key_value_heads"], f["head_dim"])

    @property
    def target_layout(self) -> KVLayout:
        f = self.target_fingerprint
        return KVLayout(f["num_hidden_layers"], f["num_key_value_heads"], f["head_dim"])

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("quality_gate", "exact_window"):  # unset: saved as before the field existed
            if data[name] is None:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MapperConfig":
        """A config from `config.json` contents. Earlier forms are migrated (`config_migration.py`); unknown keys warn;
        an unknown map input, or inputs that contradict each other or the models, raise one line naming the field."""
        data = migrate_config(data)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            warnings.warn(
                f"ignoring unknown mapper config keys {unknown} (written by a newer hf-kvtransfer "
                f"{data.get('library_version', '?')}?)",
                stacklevel=3,
            )
        data = {k: v for k, v in data.items() if k in known}
        data.setdefault("library_version", "unknown")
        return cls(**data)


__all__ = ["MapperConfig", "config_fingerprint", "model_name", "SHAPE_FIELDS"]
