"""Map inputs the target computes itself: its residual stream entering the last exact layer.

With `num_exact_layers = E` the cache runs the target's layers `0 .. E-2` on the prompt and computes layer `E-1`'s
keys and values from the residual stream entering it (its own norm and projections; `exact.own_prefix`). That
residual is what the target's first layers mixed into each token: the previous tokens' identity among it, which a
copying ("induction") layer's keys encode and the source's keys alone do not give a linear map. A mapper with
`residual_layer = E-1` feeds it to the maps of every deeper layer, next to the source's RoPE-stripped K/V: each
target layer `t > residual_layer` adds `W_res[t] @ r` to its affine map of the source's features, where `r` is the
RMS-normalised residual (no weight) at positions `t - lag` for the mapper's `residual_lags` (zeros before a row's
first token), optionally through one shared reduced-rank projection (`residual_rank`).

With `residual_layer = 0` the residual is the token embedding: `W_res[t] @ r` is then a function of the ids at
`t - lag` alone, one row per id, and a mapper with token tables may hold it there (`residual_in_tables`): the same
maps, applied as a gather instead of a product.

A mapper with `key_before_norm` predicts keys *before* the target's per-head key norm (Qwen3's `k_norm`), which
the cache then applies with the target's own module: a normalisation is not linear, and the linear part of the key
is what a linear map can fit.

Example:
    ```python
    residual_input_features(mapper.config)  # extra input features of each target layer's K and V maps
    ```
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .map_inputs import ExactPass, MapInput, register_map_input

# `MapperConfig` (core/mapper.py) imports this module: annotations name it as a string only.
MapperConfig = Any

# The RMS normalisation of the residual features (the same in the fit and the cache).
RESIDUAL_EPS = 1e-6


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


def residual_input_features(config: MapperConfig | dict[str, Any]) -> list[int]:
    """Extra input features each target layer's key and value maps read beyond the source's K/V (0 for layers that
    read none, and for a mapper whose residual part is in its token tables): `len(residual_lags) * hidden_size`, or
    `residual_rank` after the shared projection (which itself is `residual_rank x len(residual_lags) * hidden_size`,
    applied once per token; see `residual_projection_shape`).

    Args:
        config: a `MapperConfig` or its dict (`config.json`).
    """
    data = config if isinstance(config, dict) else vars(config)  # its fields, read only (no copy)
    num_layers = data["target_fingerprint"]["num_hidden_layers"]
    layer = data.get("residual_layer")
    if layer is None or data.get("residual_in_tables"):
        return [0] * num_layers
    width = data.get("residual_rank") or len(data["residual_lags"]) * data["target_fingerprint"]["hidden_size"]
    readers = set(residual_readers(data))
    return [width if t in readers else 0 for t in range(num_layers)]


def residual_readers(config: MapperConfig | dict[str, Any]) -> list[int]:
    """The target layers whose maps read the residual (empty for a source-only mapper)."""
    data = config if isinstance(config, dict) else vars(config)  # its fields, read only (no copy)
    layer = data.get("residual_layer")
    if layer is None:
        return []
    readers = data.get("residual_readers")
    return list(readers) if readers is not None else list(range(layer + 1, data["target_fingerprint"]["num_hidden_layers"]))


def residual_projection_shape(config: MapperConfig | dict[str, Any]) -> tuple[int, int] | None:
    """`(residual_rank, len(lags) * hidden_size)` of the shared residual projection of a reduced-rank residual
    mapper, else None."""
    data = config if isinstance(config, dict) else vars(config)  # its fields, read only (no copy)
    if data.get("residual_layer") is None or not data.get("residual_rank") or data.get("residual_in_tables"):
        return None
    return data["residual_rank"], len(data["residual_lags"]) * data["target_fingerprint"]["hidden_size"]


def validate_residual_config(config: MapperConfig) -> None:
    """Raise `ValueError` for inconsistent residual fields of a mapper config."""
    num_layers = config.target_fingerprint["num_hidden_layers"]
    if config.residual_layer is None:
        if (config.residual_lags is not None or config.residual_rank is not None or config.key_before_norm
                or config.residual_readers is not None or config.residual_in_tables):  # fmt: skip
            raise ValueError(
                "residual_lags / residual_rank / key_before_norm / residual_in_tables need residual_layer (the target "
                "layer whose input feeds the maps)"
            )
        return
    if not 0 <= config.residual_layer < num_layers - 1:
        raise ValueError(
            f"residual_layer must be in [0, {num_layers - 1}) (a target layer with mapped layers after it), got "
            f"{config.residual_layer}"
        )
    readers = config.residual_readers
    if readers is not None and (not readers or sorted(set(readers)) != list(readers) or not all(config.residual_layer < t < num_layers for t in readers)):
        raise ValueError(
            f"residual_readers must be ascending distinct target layers in ({config.residual_layer}, {num_layers}), got {readers}"
        )
    lags = config.residual_lags
    if not lags or any(not isinstance(lag, int) or lag < 0 for lag in lags) or len(set(lags)) != len(lags):
        raise ValueError(f"residual_lags must be distinct non-negative token offsets (e.g. [0, 1, 2]), got {lags}")
    if config.residual_rank is not None and not 1 <= config.residual_rank <= len(lags) * config.target_fingerprint["hidden_size"]:
        raise ValueError(
            f"residual_rank must be in [1, {len(lags) * config.target_fingerprint['hidden_size']}] (lags x hidden "
            f"size), got {config.residual_rank}"
        )
    if config.residual_in_tables and not (
        config.residual_layer == 0
        and set(residual_readers(config)) <= set(config.token_readers or ())
        and set(lags) <= set(config.token_lags or ())
    ):
        raise ValueError(
            "residual_in_tables needs residual_layer 0 (the residual is then the token embedding, a function of the "
            "id) and token tables on every residual reader at every residual lag (they hold the residual part)"
        )
    if config.num_exact_layers is not None and config.num_exact_layers < config.residual_layer + 1:
        raise ValueError(
            f"a mapper reading the residual entering target layer {config.residual_layer} needs num_exact_layers >= "
            f"{config.residual_layer + 1} (the cache computes that residual in its exact layers), got {config.num_exact_layers}"
        )


class ResidualMaps(nn.Module):
    """The residual part of the maps of the layers after `residual_layer`: `key.<t>` / `value.<t>` weights
    `[n_kv * d, F]` (F: `residual_input_features`), and the shared projection `down` `[rank, len(lags) * hidden]`
    of a reduced-rank one. None of them when the residual part is in the token tables (`in_tables`): the readers
    are then kept for their key norms only."""

    def __init__(self, config: MapperConfig):
        super().__init__()
        out = config.target_layout.layer_dim
        widths = residual_input_features(config)
        self.layers = residual_readers(config)
        self.in_tables = bool(config.residual_in_tables)
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
    """The target's residual stream entering `residual_layer`, captured by the exact pass: each reader layer adds
    `W_res[t] @ r` to its map of the source's features (`ResidualMaps`). Not used when the residual part is in the
    token tables (`residual_in_tables`)."""

    name, order = "residual", 10
    missing = (
        "this mapper's maps read the target's residual stream, which the cache computes in its exact layers from the "
        "prompt's ids, but none were computed: pass model=target (and input_ids=, or build the source cache with "
        "`prefill`) to TransferredCache, so that the target's forward or convert_all runs the exact layers first"
    )

    @staticmethod
    def used_by(config: Any) -> bool:
        return config.residual_layer is not None and not config.residual_in_tables

    @property
    def readers(self) -> list[int]:
        return [int(t) for t in self.mapper.residual.key]

    def hidden_layer(self) -> int | None:
        return self.mapper.config.residual_layer

    @staticmethod
    def card_facts(config: dict[str, Any]) -> list[tuple[str, str]]:
        if config.get("residual_layer") is None:
            return []
        held = "; held in the token tables, a look-up of the ids" if config.get("residual_in_tables") else ""
        readers = ", ".join(map(str, config.get("residual_readers") or ["every mapped layer"]))
        return [("Maps also read", f"the target's residual stream entering layer {config['residual_layer']} "
                 f"(readers: {readers}{held})")]  # fmt: skip

    def from_exact_pass(self, exact: ExactPass) -> torch.Tensor:
        # (B, T, hidden) -> (B, T, F): the residual features the reader layers' maps read
        features = residual_features(exact.hidden, self.mapper.config.residual_lags, exact.attention_mask)
        return self.mapper.residual.project(features)

    def apply(self, state, group, rows):
        readers = self.group_readers(group)
        if not readers:
            return rows
        residual, maps = self.require(state), self.mapper.residual
        width = self.mapper.target_layout.layer_dim
        for kind, x in zip(("key", "value"), rows):
            weights = [maps.weight(kind, t) for _, t in readers]
            weight = torch.cat(weights) if len(weights) > 1 else weights[0]
            delta = nn.functional.linear(residual.to(x.device, weight.dtype), weight.to(x.device)).to(x.dtype)
            for j, (i, _) in enumerate(readers):
                x[..., i * width : (i + 1) * width] += delta[..., j * width : (j + 1) * width]
        return rows


__all__ = [
    "RESIDUAL_EPS",
    "ResidualInput",
    "ResidualMaps",
    "residual_features",
    "residual_input_features",
    "residual_projection_shape",
    "residual_readers",
    "validate_residual_config",
]
