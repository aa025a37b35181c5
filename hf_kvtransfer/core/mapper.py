"""KVMapper: turns the source model's stripped KV states into the target model's, one target layer at a time."""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedConfig

from ..version import __version__
from .card import render_model_card
from .config_migration import REPORT_FIELDS, migrate_config
from .defaults import DEFAULT_NUM_EXACT_LAYERS, resolve_num_exact_layers
from .hub import CONFIG_NAME, REPORT_NAME, WEIGHTS_NAME, push_mapper_dir, resolve_mapper_dir
from .layer_maps import LAYER_MAP_TYPES, build_layer_maps, layer_map_class
from .map_inputs import MapInput, MapInputConfig, exact_layers_needed, input_configs, map_inputs_of, registered_map_inputs, validate_inputs
from .mapper_types import LOWRANK, RIDGE
from .quality_gate import QualityGateConfig
from .rope import build_rotary_embedding, config_from_dict, head_dim_of, text_config
from .stats import KVLayout

logger = logging.getLogger(__name__)


# Config fields that fix tensor shapes: a mismatch there can never work.
_SHAPE_FIELDS = ("num_hidden_layers", "num_key_value_heads", "head_dim")


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


def _model_name(config: PreTrainedConfig | dict) -> str | None:
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
        self.source_model_id = self.source_model_id or _model_name(self.source_config)
        self.target_model_id = self.target_model_id or _model_name(self.target_config)
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


class KVMapper(nn.Module):
    """Maps a source model's KV cache to a target model's, per target layer (ridge, closed form).

    Target layer `t` reads all KV heads of its selected source layers `config.selected_layers[t]` (RoPE
    stripped), applies one affine map for keys and one for values, and the caller re-applies the target's
    RoPE to the keys. Use it through `TransferredCache`; build it with `fit_mapper` or load it with
    `from_pretrained`.

    Example:
        ```python
        mapper = KVMapper.from_pretrained("mappers/small-to-large")
        cache = TransferredCache(prefill(source, input_ids), mapper, model=target)
        out = target.generate(input_ids, cache=cache, max_new_tokens=32)
        ```
    """

    def __init__(self, config: MapperConfig, layer_maps: nn.ModuleList | None = None, report: dict | None = None):
        super().__init__()
        self.config = config
        self.layers = layer_maps if layer_maps is not None else build_layer_maps(config)
        # Each input's parameters, as the attribute it names (the residual's: `residual`), None without.
        for inp in registered_map_inputs():
            if inp.attribute is not None:
                setattr(self, inp.attribute, inp.build_module(config))
        # How the mapper was made (selection curves, training logs, timings, evaluations): `fit_report.json`.
        self.report: dict[str, Any] = dict(report or {})

    # -- structure ----------------------------------------------------------------------------------
    @property
    def source_layout(self) -> KVLayout:
        return self.config.source_layout

    @property
    def target_layout(self) -> KVLayout:
        return self.config.target_layout

    def with_config(self, **changes: Any) -> "KVMapper":
        """A shallow copy of this mapper (the same weights) whose config has `changes` (`MapperConfig` fields, e.g.
        `exact_window=64`), validated; this mapper is left as it was."""
        changed = copy.copy(self)
        changed.config = replace(self.config, **changes)
        return changed

    @property
    def num_exact_layers(self) -> int:
        """The target layers `TransferredCache` computes itself by default with this mapper (`config.num_exact_layers`,
        else `DEFAULT_NUM_EXACT_LAYERS`)."""
        recorded = self.config.num_exact_layers
        return DEFAULT_NUM_EXACT_LAYERS if recorded is None else recorded

    def resolve_num_exact_layers(self, requested: int | None) -> int:
        """What a caller's `num_exact_layers` means with this mapper (`defaults.resolve_num_exact_layers`)."""
        return resolve_num_exact_layers(self, requested)

    @property
    def needs_exact_layers(self) -> bool:
        """Whether the maps read what only the target's exact layers give (an input's `exact_layers_needed`, e.g. its
        residual stream): the cache must compute them from the prompt's ids; a transfer that maps every layer cannot
        use this mapper."""
        return exact_layers_needed(self.config)[0] > 0

    @property
    def map_inputs(self) -> list[MapInput]:
        """What the maps read beyond the source's K/V (`map_inputs.py`), in the order they apply; [] for source-only
        maps."""
        return map_inputs_of(self)

    @property
    def needs_prompt_ids(self) -> bool:
        """Whether applying the maps needs the prompt's token ids: an input of theirs comes from the ids (the target's
        residual stream, computed from them in the exact layers, or rows looked up by id)."""
        return any(inp.needs_prompt_ids for inp in self.map_inputs)

    @cached_property
    def source_model_config(self) -> PreTrainedConfig:
        return config_from_dict(self.config.source_config)

    @cached_property
    def target_model_config(self) -> PreTrainedConfig:
        return config_from_dict(self.config.target_config)

    def rotary(self, side: str, device: torch.device | str | None = None) -> nn.Module:
        """The `side` ("source" or "target") architecture's rotary module on `device` (default CPU), built from the
        stored config (no model needed) once per mapper and device: every cache of this mapper shares it, so read it,
        never move or change it."""
        if side not in ("source", "target"):
            raise ValueError(f"side must be 'source' or 'target', got {side!r}")
        key = (side, torch.device(device if device is not None else "cpu"))
        modules = self.__dict__.setdefault("_rotary_modules", {})  # derived from the config: not a parameter
        if key not in modules:
            config = self.source_model_config if side == "source" else self.target_model_config
            modules[key] = build_rotary_embedding(config).to(key[1])
        return modules[key]

    def source_rotary(self, device: torch.device | str | None = None) -> nn.Module:
        """The source architecture's rotary module (`rotary("source", device)`)."""
        return self.rotary("source", device)

    def target_rotary(self, device: torch.device | str | None = None) -> nn.Module:
        """The target architecture's rotary module (`rotary("target", device)`)."""
        return self.rotary("target", device)

    def consumers(self) -> dict[int, list[int]]:
        """For each source layer that is used, the target layers that read it."""
        out: dict[int, list[int]] = {}
        for t, selected in enumerate(self.config.selected_layers):
            for s in selected:
                out.setdefault(s, []).append(t)
        return out

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- application --------------------------------------------------------------------------------
    def forward(
        self, layer_idx: int, source_key_states: torch.Tensor, source_value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Map stripped source features to stripped target states for target layer `layer_idx`.

        Args:
            source_key_states / source_value_states: `[batch, seq, k * n_kv_s * d_s]`, the RoPE-stripped
                states of the selected source layers side by side (layer-major, then head), any float dtype.

        Returns:
            Stripped target keys and values `[batch, n_kv_t, seq, d_t]` in the mapper's dtype.
        """
        tgt = self.target_layout
        if self.map_inputs:
            raise ValueError(
                f"this mapper's maps also read {', '.join(inp.name for inp in self.map_inputs)} (map_inputs in its "
                "config): apply it through TransferredCache, which computes them from the prompt's ids and the target's "
                "exact layers"
            )
        keys, values = self.layers[layer_idx](source_key_states, source_value_states)
        # (B, T, H*D) -> (B, H, T, D)
        return tuple(y.view(*y.shape[:-1], tgt.num_kv_heads, tgt.head_dim).transpose(1, 2) for y in (keys, values))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the mapper's weights (float32 for a mapper without parameters)."""
        param = next(self.parameters(), None)
        return param.dtype if param is not None and param.is_floating_point() else torch.float32

    # -- compatibility ------------------------------------------------------------------------------
    def check_compatible(
        self,
        source_config: PreTrainedConfig | None = None,
        target_config: PreTrainedConfig | None = None,
        strict: bool = False,
    ) -> None:
        """Compare the models a mapper is used with against those it was fit for.

        A difference in KV shape (layers, KV heads, head dim) always raises. Any other difference in the
        config fingerprint (RoPE, vocabulary, hidden size, ...) warns, or raises with `strict=True`.
        """
        for which, config, expected in (
            ("source", source_config, self.config.source_fingerprint),
            ("target", target_config, self.config.target_fingerprint),
        ):
            if config is None:
                continue
            got = config_fingerprint(config)
            diffs = {k: (expected.get(k), got.get(k)) for k in expected if expected.get(k) != got.get(k)}
            if not diffs:
                continue
            model_id = getattr(self.config, f"{which}_model_id")
            detail = "; ".join(f"{k}: mapper has {a!r}, model has {b!r}" for k, (a, b) in diffs.items())
            name = _model_name(config) or "the given model"
            fit_for = f"{which} model {model_id!r}" if model_id else f"another {which} model"
            message = (
                f"this mapper was fit for {fit_for} but is used with {name} whose config differs: "
                f"{detail}. Load the mapper made for this {which} model (or fit one with `fit_mapper`)."
            )
            if strict or any(k in _SHAPE_FIELDS for k in diffs):
                raise ValueError(message)
            warnings.warn(message, stacklevel=2)

    # -- persistence --------------------------------------------------------------------------------
    def save_pretrained(
        self, save_directory: str | os.PathLike, repo_id: str | None = None, max_shard_size: int | str = "5GB"
    ) -> None:
        """Write `config.json`, `model.safetensors`, the run report `fit_report.json` (when there is one) and a
        model card `README.md` to `save_directory`.

        Weights larger than `max_shard_size` ("5GB", "500MB", bytes) are written as `model-0000i-of-0000n.safetensors`
        shards plus `model.safetensors.index.json`, as transformers does (`checkpoint.save_weights`).
        """
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        # Size and dtype as saved go into the written copy; `self.config` stays as it was given.
        config = replace(
            self.config,
            num_parameters=self.num_parameters(),
            dtype=str(self.dtype).removeprefix("torch.") if next(self.parameters(), None) is not None else None,
            library_version=__version__,
        )
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        from .checkpoint import checkpoint_info, save_weights

        save_weights(state, path, max_shard_size, metadata={"mapper_type": config.mapper_type})
        (path / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
        if self.report:
            (path / REPORT_NAME).write_text(json.dumps(self.report, indent=2, sort_keys=True) + "\n")
        elif (path / REPORT_NAME).exists():
            (path / REPORT_NAME).unlink()  # a stale report of another mapper must not describe this one
        card = render_model_card(config.to_dict(), repo_id=repo_id, report=self.report, checkpoint=checkpoint_info(path))
        card.save(str(path / "README.md"))

    @classmethod
    def from_pretrained(
        cls,
        pretrained_mapper_name_or_path: str | os.PathLike,
        *,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        token: str | bool | None = None,
        local_files_only: bool = False,
        force_download: bool = False,
        device: torch.device | str | None = None,
    ) -> "KVMapper":
        """Load a mapper from a local directory or a Hugging Face Hub repo (safetensors + JSON only).

        Loading is strict: a missing, extra or mis-shaped tensor raises with the names involved.
        """
        path = resolve_mapper_dir(
            pretrained_mapper_name_or_path,
            revision=revision,
            cache_dir=cache_dir,
            token=token,
            local_files_only=local_files_only,
            force_download=force_download,
        )
        return cls._from_directory(path, device=device)

    @classmethod
    def _from_directory(cls, path: Path, device=None) -> "KVMapper":
        from .checkpoint import has_weights, load_weights

        config_path = path / CONFIG_NAME
        for ok, name in ((config_path.is_file(), CONFIG_NAME), (has_weights(path), WEIGHTS_NAME)):
            if not ok:
                raise FileNotFoundError(f"{path} is not a hf-kvtransfer mapper: {name} is missing")
        raw = json.loads(config_path.read_text())
        report = json.loads((path / REPORT_NAME).read_text()) if (path / REPORT_NAME).is_file() else {}
        for name in REPORT_FIELDS:  # written into config.json before 0.2
            if raw.get(name) is not None:
                report.setdefault(name, raw[name])
        config = MapperConfig.from_dict(raw)
        with torch.device("meta"):  # shapes only: the loaded tensors become the parameters (load_state_dict(assign))
            mapper = cls(config, report=report)
        # Single file or shards, tensor by tensor; a truncated, missing or mismatched file is named in the error.
        expected = {k: v.shape for k, v in mapper.state_dict().items()}
        state = load_weights(path, device=str(device) if device is not None else "cpu", expected=expected)
        mapper._load_strict(state, source=str(path))
        return mapper

    def _load_strict(self, state: dict[str, torch.Tensor], source: str) -> None:
        expected = {k: v.shape for k, v in self.state_dict().items()}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        wrong = sorted(k for k in set(expected) & set(state) if tuple(state[k].shape) != tuple(expected[k]))
        if missing or unexpected or wrong:
            parts = []
            if missing:
                parts.append(f"missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
            if unexpected:
                parts.append(f"unexpected tensors {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
            for k in wrong[:5]:
                parts.append(f"{k} has shape {list(state[k].shape)}, config implies {list(expected[k])}")
            raise ValueError(f"weights in {source} do not match its config.json: " + "; ".join(parts))
        for k, v in state.items():
            if not torch.isfinite(v).all():
                raise ValueError(f"weights in {source}: tensor {k} has non-finite values (corrupt checkpoint?)")
        # assign: the module takes the loaded tensors themselves (no second copy of a large mapper in memory).
        self.load_state_dict(state, strict=True, assign=True)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        revision: str | None = None,
        commit_message: str | None = None,
        token: str | bool | None = None,
        create_pr: bool = False,
        max_shard_size: int | str = "5GB",
    ) -> str:
        """Upload config, weights (all shards) and model card to `repo_id` in one commit; returns the commit URL."""
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, repo_id=repo_id, max_shard_size=max_shard_size)
            return push_mapper_dir(
                tmp,
                repo_id,
                private=private,
                revision=revision,
                commit_message=commit_message,
                token=token,
                create_pr=create_pr,
            )

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"type={c.mapper_type}, source={c.source_model_id}, target={c.target_model_id}, "
            f"top_k={c.top_k}, params={self.num_parameters():,}"
        )


__all__ = ["KVMapper", "MapperConfig", "config_fingerprint"]
