"""Map inputs the target computes itself: its residual stream entering the last exact layer.

With `num_exact_layers = E` the cache runs the target's layers `0 .. E-2` on the prompt and computes layer `E-1`'s
keys and values from the residual stream entering it (its own norm and projections; `exact.own_prefix`). That
residual is what the target's first layers mixed into each token: the previous tokens' identity among it, which a
copying ("induction") layer's keys encode and the source's keys alone do not give a linear map. A mapper with
residual input `ResidualConfig(layer=E-1, ...)` (`MapperConfig.map_inputs["residual"]`) feeds it to the maps of every
deeper layer, next to the source's RoPE-stripped K/V: each target layer `t > layer` adds `W_res[t] @ r` to its affine
map of the source's features, where `r` is the RMS-normalised residual (no weight) at positions `t - lag` for the
config's `lags` (zeros before a row's first token), optionally through one shared reduced-rank projection (`rank`).

With `layer = 0` the residual is the token embedding: `W_res[t] @ r` is then a function of the ids at `t - lag`
alone, one row per id, and a mapper with another input that adds rows per id may hold it there (`in_tables`): the
same maps, applied as a gather instead of a product.

The maps of the readers may predict keys *before* the target's per-head key norm, which the cache then applies with
the target's own module (`key_norm.py`).

Example:
    ```python
    residual_input_features(mapper.config)  # extra input features of each target layer's K and V maps
    ```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .map_inputs import (
    ExactPass,
    InputCost,
    MapInput,
    MapInputConfig,
    PlanShape,
    positions_label,
    register_map_input,
    writable,
)
from .conversion import conversion_groups
from .rope import text_config
from .stats import KVLayout

# `MapperConfig` (core/mapper.py) imports this module: annotations name it as a string only.
MapperConfig = Any

# The RMS normalisation of the residual features (the same in the fit and the cache).
RESIDUAL_EPS = 1e-6
# The positions a default fit's maps read: the residual at t, t-1 and t-2 (`fit --residual-lags`; `plan` counts as many).
DEFAULT_RESIDUAL_LAGS = (0, 1, 2)


def residual_features(hidden: torch.Tensor, lags: list[int], attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The residual map inputs `[batch, seq, len(lags) * hidden]` from a residual stream `[batch, seq, hidden]`.

    Each token's residual is RMS-normalised (float32, no weight); block `i` holds it at position `t - lags[i]`,
    zeros where that is before the sequence or a padded position (`attention_mask` 0).
    """
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RESIDUAL_EPS)
    if attention_mask is not None:
        x = x * attention_mask.to(x.device, x.dtype).unsqueeze(-1)
    batch, seq, width = x.shape
    out = x.new_zeros(batch, seq, len(lags) * width)
    for i, lag in enumerate(lags):
        if lag < seq:
            out[:, lag:, i * width : (i + 1) * width] = x[:, : seq - lag]
    return out


@dataclass
class ResidualConfig(MapInputConfig):
    """`MapperConfig.map_inputs["residual"]`: the maps of the target layers after `layer` also read the target's own
    residual stream entering `layer`, which the cache computes in its exact layers (needs `num_exact_layers >= layer +
    1` and the prompt's ids).

    Args:
        layer: the target layer whose input (the residual stream) feeds the maps.
        lags: the token offsets of the residual features (`[0, 1, 2]`: positions t, t-1, t-2).
        rank: the rank of one projection of the residual features shared by every layer (None: full).
        readers: the target layers whose maps read the residual (None: every layer after `layer`); the others keep
            source-only maps.
        in_tables: the residual part of the maps is held in the per-id rows of another input
            (`MapInputConfig.holds_per_id_rows`), not as weights: with `layer = 0` the residual is the token
            embedding, a function of the id alone, so its product with each reader's weights is one row per id.
    """

    layer: int
    lags: list[int]
    rank: int | None = None
    readers: list[int] | None = None
    in_tables: bool = False

    def __post_init__(self):
        self.lags = list(self.lags)
        self.readers = list(self.readers) if self.readers is not None else None

    def reader_layers(self, num_layers: int) -> list[int]:
        """The target layers whose maps read the residual, for a target of `num_layers` layers."""
        return list(self.readers) if self.readers is not None else list(range(self.layer + 1, num_layers))

    def validate(self, config: MapperConfig, name: str) -> None:
        num_layers, hidden = config.target_fingerprint["num_hidden_layers"], config.target_fingerprint["hidden_size"]
        if config.mapper_type != "ridge":
            raise ValueError(f"{name}: applies to 'ridge' mappers only, got mapper_type={config.mapper_type!r}")
        if not _is_int(self.layer) or not 0 <= self.layer < num_layers - 1:
            raise ValueError(f"{name}.layer must be in [0, {num_layers - 1}) (a target layer with mapped layers after it), got {self.layer}")
        readers = self.readers
        if readers is not None and (not readers or sorted(set(readers)) != list(readers) or not all(self.layer < t < num_layers for t in readers)):
            raise ValueError(f"{name}.readers must be ascending distinct target layers in ({self.layer}, {num_layers}), got {readers}")
        if not self.lags or not all(_is_int(lag) and lag >= 0 for lag in self.lags) or len(set(self.lags)) != len(self.lags):
            raise ValueError(f"{name}.lags must be distinct non-negative token offsets (e.g. [0, 1, 2]), got {self.lags}")
        if self.rank is not None and not (_is_int(self.rank) and 1 <= self.rank <= len(self.lags) * hidden):
            raise ValueError(f"{name}.rank must be in [1, {len(self.lags) * hidden}] (lags x hidden size), got {self.rank}")
        if self.in_tables and not (self.layer == 0 and any(
                other.holds_per_id_rows(config, self.reader_layers(num_layers), self.lags)
                for other in config.map_inputs.values() if other is not self)):  # fmt: skip
            raise ValueError(
                f"{name}.in_tables needs layer 0 (the residual is then the token embedding, a function of the id) and "
                "an input adding rows per token id on every reader at every lag (they hold the residual part)"
            )
        if config.num_exact_layers is not None and config.num_exact_layers < self.layer + 1:
            raise ValueError(
                f"{name}.layer = {self.layer} needs num_exact_layers >= {self.layer + 1} (the cache computes the "
                f"residual entering that layer in its exact layers), got {config.num_exact_layers}"
            )

    def exact_layers_needed(self, config: MapperConfig) -> tuple[int, str]:
        return self.layer + 1, (f"this mapper's maps read the target's residual entering layer {self.layer}, which "
                                "the cache computes in its exact layers")  # fmt: skip

    def maps_layer_without_source(self, config: MapperConfig, layer_idx: int) -> bool:
        return config.mapper_type == "ridge" and layer_idx > self.layer

    def label(self, config: MapperConfig) -> str:
        readers, num_layers = self.reader_layers(len(config.selected_layers)), len(config.selected_layers)
        many = "s " if len(readers) > 1 else " "
        who = "every mapped layer" if readers == list(range(self.layer + 1, num_layers)) else f"layer{many}{', '.join(map(str, readers))}"
        rank = f", rank {self.rank}" if self.rank else ""
        return f"target residual entering layer {self.layer} ({positions_label(self.lags)}{rank}) read by {who}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def residual_config(config: MapperConfig) -> ResidualConfig | None:
    """A mapper config's residual input (`map_inputs["residual"]`), None for maps that do not read the residual."""
    return config.map_inputs.get(ResidualInput.name)


def residual_input_features(config: MapperConfig) -> list[int]:
    """Extra input features each target layer's key and value maps read beyond the source's K/V (0 for layers that
    read none, and for a mapper whose residual part is held in per-id rows: `in_tables`): `len(lags) * hidden_size`, or
    `rank` after the shared projection (which itself is `rank x len(lags) * hidden_size`, applied once per token;
    see `residual_projection_shape`).
    """
    num_layers = config.target_fingerprint["num_hidden_layers"]
    res = residual_config(config)
    if res is None or res.in_tables:
        return [0] * num_layers
    width = res.rank or len(res.lags) * config.target_fingerprint["hidden_size"]
    readers = set(res.reader_layers(num_layers))
    return [width if t in readers else 0 for t in range(num_layers)]


def residual_readers(config: MapperConfig) -> list[int]:
    """The target layers whose maps read the residual (empty for a source-only mapper)."""
    res = residual_config(config)
    return [] if res is None else res.reader_layers(config.target_fingerprint["num_hidden_layers"])


def residual_projection_shape(config: MapperConfig) -> tuple[int, int] | None:
    """`(rank, len(lags) * hidden_size)` of the shared residual projection of a reduced-rank residual mapper, else
    None."""
    res = residual_config(config)
    if res is None or not res.rank or res.in_tables:
        return None
    return res.rank, len(res.lags) * config.target_fingerprint["hidden_size"]


class ResidualMaps(nn.Module):
    """The residual part of the maps of the layers after the residual's `layer`: `key.<t>` / `value.<t>` weights
    `[n_kv * d, F]` (F: `residual_input_features`), and the shared projection `down` `[rank, len(lags) * hidden]`
    of a reduced-rank one. None of them when the residual part is held in per-id rows (`in_tables`): the readers
    are then kept for their key norms only."""

    def __init__(self, config: MapperConfig):
        super().__init__()
        out = config.target_layout.layer_dim
        widths = residual_input_features(config)
        self.layers = residual_readers(config)
        self.in_tables = bool(residual_config(config).in_tables)
        weighted = [] if self.in_tables else self.layers
        shape = residual_projection_shape(config)
        self.down = nn.Parameter(torch.zeros(shape)) if shape is not None else None
        self.key = nn.ParameterDict({str(t): nn.Parameter(torch.zeros(out, widths[t])) for t in weighted})
        self.value = nn.ParameterDict({str(t): nn.Parameter(torch.zeros(out, widths[t])) for t in weighted})

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Residual features `[B, T, len(lags) * hidden]` -> what the per-layer weights read `[B, T, F]`."""
        if self.down is None:
            return features
        return nn.functional.linear(features.to(self.down.dtype), self.down.to(features.device))

    def weight(self, kind: str, layer_idx: int) -> torch.Tensor:
        return (self.key if kind == "key" else self.value)[str(layer_idx)]


@register_map_input
class ResidualInput(MapInput):
    """The target's residual stream entering `ResidualConfig.layer`, captured by the exact pass: each reader layer adds
    `W_res[t] @ r` to its map of the source's features (`ResidualMaps`). Not used when the residual part is held in
    per-id rows (`in_tables`)."""

    name, order, config_class, attribute = "residual", 10, ResidualConfig, "residual"
    missing = (
        "this mapper's maps read the target's residual stream, which the cache computes in its exact layers from the "
        "prompt's ids, but none were computed: pass model=target (and input_ids=, or build the source cache with "
        "`prefill`) to TransferredCache, so that the target's forward or convert_all runs the exact layers first"
    )

    @classmethod
    def used_by(cls, config: MapperConfig) -> bool:
        res = residual_config(config)
        return res is not None and not res.in_tables

    plan_label, plan_positions = "maps also reading the target's residual stream", "residual_positions"
    plan_rank = "residual_rank"
    plan_default_positions = len(DEFAULT_RESIDUAL_LAGS)  # what a default fit's maps read
    plan_alone, plan_note = True, "the wider maps; the residual entering the last exact layer comes with the exact pass"

    @classmethod
    def cost(cls, shape: PlanShape) -> InputCost | None:
        """Each mapped layer's key and value maps also read `positions` positions of the target's residual stream
        entering its last exact layer: `positions * hidden_size` more input features per map. Full rank: each map
        gets `features * (kv_heads * head_dim)` more weights; at `rank` r (a factored map, `up @ down`) only its
        `down` grows, by `r * features`. FLOPs: one multiply-add per added weight and token. The normalisation of
        the residual (elementwise, no matrix product) is not counted. With `shared_rank` r (`fit --residual-rank`, or
        the fit's reduced-rank candidate): one projection `[r, features]` shared by every map, then `r *
        (kv_heads * head_dim)` weights per map (`ResidualMaps`)."""
        if shape.positions < 0 or shape.num_mapped_layers < 0:
            raise ValueError(f"residual positions and mapped layers must be >= 0, got {shape.positions}, {shape.num_mapped_layers}")
        layer_dim = KVLayout.from_config(shape.target_config).layer_dim
        features = shape.positions * text_config(shape.target_config).hidden_size
        if shape.shared_rank is not None:
            if shape.shared_rank < 1:
                raise ValueError(f"residual_rank must be >= 1, got {shape.shared_rank}")
            r = min(shape.shared_rank, features)
            parameters = features * r + 2 * shape.num_mapped_layers * r * layer_dim
            return InputCost(parameters=parameters, flops=2 * shape.num_tokens * parameters, features=features)
        per_map = features * (layer_dim if shape.rank is None else min(shape.rank, layer_dim))
        parameters = 2 * shape.num_mapped_layers * per_map  # key and value
        return InputCost(parameters=parameters, flops=2 * shape.num_tokens * parameters, features=features)

    @classmethod
    def build_module(cls, config: MapperConfig) -> nn.Module | None:
        # Built with the residual held in per-id rows too: its readers are those the key norm acts on.
        return ResidualMaps(config) if residual_config(config) is not None else None

    @property
    def readers(self) -> list[int]:
        return [int(t) for t in self.mapper.residual.key]

    def hidden_layer(self) -> int | None:
        return self.settings.layer

    @staticmethod
    def card_facts(config: dict[str, Any]) -> list[tuple[str, str]]:
        res = (config.get("map_inputs") or {}).get("residual")
        if res is None or not res.get("in_tables"):
            return []
        return [("The residual's part of the maps", "held in rows per token id, a look-up of the ids")]

    def transfer_flops(self, tokens: int, layers: set[int]) -> int:
        # The shared projection (`project`, on the exact pass's residual), then each converted reader's K and V weights.
        maps = self.mapper.residual
        readers = [t for t in self.readers if t in layers]
        if not readers:
            return 0
        macs = maps.down.numel() if maps.down is not None else 0
        macs += sum(maps.weight(kind, t).numel() for t in readers for kind in ("key", "value"))
        # A group of readers that read no source layer starts from its bias, which rides in the residual's product as
        # one more column (`add_product`): one multiply-add per output feature and token.
        layer_dim = self.mapper.target_layout.layer_dim
        selected = self.mapper.config.selected_layers
        for group, _ in conversion_groups(self.mapper, tokens, min(layers)):
            if not selected[group[0]] and set(group) <= set(self.readers) and self.mapper.layers[group[0]].linear_parts("key"):
                macs += 2 * len(group) * layer_dim
        return 2 * tokens * macs

    def from_exact_pass(self, exact: ExactPass) -> torch.Tensor:
        # (B, T, hidden) -> (B, T, F): the residual features the reader layers' maps read
        features = residual_features(exact.hidden, self.settings.lags, exact.attention_mask)
        return self.mapper.residual.project(features)

    def apply(self, state, group, rows):
        readers = self.group_readers(group)
        if not readers:
            return rows
        residual, maps = self.require(state), self.mapper.residual
        width = self.mapper.target_layout.layer_dim
        every = [i for i, _ in readers] == list(range(len(group)))
        out = []
        for kind, x in zip(("key", "value"), rows):
            weights = [maps.weight(kind, t) for _, t in readers]
            weight = torch.cat(weights) if len(weights) > 1 else weights[0]
            r = residual.to(x.device, weight.dtype)
            if every:  # each layer of the group reads it: one GEMM adds it to all of them
                summed = add_product(x.reshape(-1, x.shape[-1]), r.reshape(-1, r.shape[-1]), weight.to(x.device))
                out.append(summed.view(x.shape).to(x.dtype))
                continue
            x = writable(x)
            delta = nn.functional.linear(r, weight.to(x.device)).to(x.dtype)
            for j, (i, _) in enumerate(readers):
                x[..., i * width : (i + 1) * width] += delta[..., j * width : (j + 1) * width]
            out.append(x)
        return out


def add_product(rows: torch.Tensor, features: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows + features @ weight.T` (`[N, F_out]`, `[N, F_in]`, `[F_out, F_in]`) as one GEMM. When `rows` is one row
    broadcast over N (maps that read no source layer hand their bias so), the bias rides in the GEMM as a column of
    ones: the product writes the result directly instead of over a copy of the broadcast rows."""
    if rows.shape[0] > 1 and rows.stride(0) == 0:
        ones = features.new_ones(features.shape[0], 1)
        bias = rows[0].to(weight.dtype)[:, None]
        return torch.cat([features, ones], 1) @ torch.cat([weight, bias], 1).T
    return torch.addmm(rows.to(weight.dtype), features, weight.T)


__all__ = [
    "RESIDUAL_EPS",
    "ResidualConfig",
    "ResidualInput",
    "ResidualMaps",
    "residual_config",
    "residual_features",
    "residual_input_features",
    "residual_projection_shape",
    "residual_readers",
]
