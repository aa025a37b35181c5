"""KVMapper: turns the source model's stripped KV states into the target model's, one target layer at a time."""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedConfig

from ..version import __version__
from .card import render_model_card
from .config_migration import REPORT_FIELDS
from .defaults import DEFAULT_NUM_EXACT_LAYERS, resolve_num_exact_layers
from .hub import CONFIG_NAME, REPORT_NAME, WEIGHTS_NAME, push_mapper_dir, resolve_mapper_dir
from .layer_maps import build_layer_maps
from .map_inputs import MapInput, exact_layers_needed, map_inputs_of, registered_map_inputs
from .mapper_config import SHAPE_FIELDS, MapperConfig, config_fingerprint, model_name
from .rope import build_rotary_embedding, config_from_dict
from .stats import KVLayout

logger = logging.getLogger(__name__)


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
            name = model_name(config) or "the given model"
            fit_for = f"{which} model {model_id!r}" if model_id else f"another {which} model"
            message = (
                f"this mapper was fit for {fit_for} but is used with {name} whose config differs: "
                f"{detail}. Load the mapper made for this {which} model (or fit one with `fit_mapper`)."
            )
            if strict or any(k in SHAPE_FIELDS for k in diffs):
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
