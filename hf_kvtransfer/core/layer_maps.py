"""Layer maps: how one target layer's stripped keys and values are computed from its source features.

A mapper holds one layer map per target layer. Each mapper type (`MapperConfig.mapper_type`) is one class here,
registered with `register_layer_map`; `KVMapper` builds its layers from the registry and `TransferredCache` calls
only the interface below, so adding a type touches this file and its fitter, nothing else.

The interface:

- `from_config(config, layer_idx)`: an empty (zero) map shaped by the config; weights come from a checkpoint or a
  fitter (`KVMapper.load_state_dict`).
- `forward(key_features, value_features)`: `[..., F_in]` stripped source features -> `[..., F_out]` stripped
  target keys and values (`F_out = n_kv_t * d_t`, head-major), in the map's dtype.
- `linear_parts(kind)`: for affine maps, the weights as `LinearParts`, so the cache can run the maps of several
  target layers as one GEMM (or choose dense vs factored); `None` for nonlinear maps, which run one layer at a time.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from .mapper_types import LOWRANK, MLP, RIDGE
from .stats import KVLayout


class LayerMapConfig(Protocol):
    """What a layer map reads of `mapper.MapperConfig` (a protocol, so this module does not import `mapper`)."""

    selected_layers: list[list[int]]
    rank: list[list[int]] | None
    mlp: dict[str, Any] | None

    @property
    def source_layout(self) -> KVLayout: ...

    @property
    def target_layout(self) -> KVLayout: ...


# Paper defaults (hidden size, depth); `residual` starts training at the ridge solution (see mlp.py).
DEFAULT_MLP_CONFIG = {
    "hidden_size": 1024,
    "num_hidden_layers": 2,
    "residual": True,
    "per_head": False,
    "activation": "relu",
}


@dataclass(frozen=True)
class LinearParts:
    """An affine map `y = x @ W^T + bias` with `W = up @ down` when factored (`down` given), else `W = up`.

    Shapes: `up` `[F_out, r]` (or `[F_out, F_in]`), `down` `[r, F_in]`, `bias` `[F_out]`.
    """

    up: torch.Tensor
    bias: torch.Tensor
    down: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return (self.down if self.down is not None else self.up).shape[1]

    @property
    def out_features(self) -> int:
        return self.up.shape[0]

    def dense_weight(self) -> torch.Tensor:
        """`[F_out, F_in]`; the parameter itself when not factored (no copy)."""
        if self.down is None:
            return self.up
        return self.up.detach() @ self.down.detach()

    def macs(self, tokens: int, dense: bool) -> int:
        """Multiply-adds of applying the map to `tokens` tokens: densely (a factored map first forms `up @ down`)
        or factored (`down`, then `up`)."""
        if self.down is None:
            return tokens * self.in_features * self.out_features
        rank = self.down.shape[0]
        if dense:
            return (tokens + rank) * self.in_features * self.out_features
        return tokens * rank * (self.in_features + self.out_features)


class LayerMap(nn.Module):
    """Base class of the per-target-layer maps (see the module docstring for the interface)."""

    mapper_type: ClassVar[str]

    @classmethod
    def from_config(cls, config: LayerMapConfig, layer_idx: int) -> "LayerMap":
        raise NotImplementedError

    @classmethod
    def validate_config(cls, config: LayerMapConfig) -> None:
        """Raise `ValueError` when `config` lacks (or has invalid) settings this map type needs."""

    def forward(self, key_features: torch.Tensor, value_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key(key_features), self.value(value_features)

    def linear_parts(self, kind: str) -> LinearParts | None:
        return None


LAYER_MAP_TYPES: dict[str, type[LayerMap]] = {}


def register_layer_map(cls: type[LayerMap]) -> type[LayerMap]:
    """Class decorator: make `cls` the layer map of configs with `mapper_type == cls.mapper_type`."""
    LAYER_MAP_TYPES[cls.mapper_type] = cls
    return cls


def layer_map_class(mapper_type: str) -> type[LayerMap]:
    try:
        return LAYER_MAP_TYPES[mapper_type]
    except KeyError:
        raise ValueError(
            f"unknown mapper_type {mapper_type!r}; known types are {sorted(LAYER_MAP_TYPES)} "
            "(a mapper saved by a newer hf-kvtransfer? upgrade with `pip install -U hf-kvtransfer`)"
        ) from None


def build_layer_maps(config: LayerMapConfig) -> nn.ModuleList:
    """Empty layer maps, one per target layer, of the config's mapper type."""
    cls = layer_map_class(config.mapper_type)
    return nn.ModuleList(cls.from_config(config, t) for t in range(len(config.selected_layers)))


def _features(config: LayerMapConfig, layer_idx: int) -> tuple[int, int]:
    """`(F_in, F_out)` of target layer `layer_idx`: all KV heads of its selected source layers -> its KV heads."""
    return len(config.selected_layers[layer_idx]) * config.source_layout.layer_dim, config.target_layout.layer_dim


def zero_linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    """An `nn.Linear` of zeros, skipping the random init (slow for GB-sized mappers, and overwritten on load)."""
    # On the default device, so `with torch.device("meta")` builds shapes only (loading then assigns tensors).
    with warnings.catch_warnings():  # a map without inputs (the calibration mean) has a zero-element weight
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
        module = nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias, device=torch.get_default_device())
    with torch.no_grad():
        for param in module.parameters():
            param.zero_()
    return module


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # Weights follow the input's device (no-op when already there: accelerate device maps keep them elsewhere).
    bias = bias.to(x.device) if bias is not None else None
    return nn.functional.linear(x.to(weight.dtype), weight.to(x.device), bias)


@register_layer_map
class RidgeLayerMap(LayerMap):
    """The paper's closed-form ridge map: one affine map for keys, one for values."""

    mapper_type = RIDGE

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.key = zero_linear(in_features, out_features)
        self.value = zero_linear(in_features, out_features)

    @classmethod
    def from_config(cls, config: LayerMapConfig, layer_idx: int) -> "RidgeLayerMap":
        return cls(*_features(config, layer_idx))

    def forward(self, key_features, value_features):
        return tuple(_linear(x, p.weight, p.bias) for p, x in ((self.key, key_features), (self.value, value_features)))

    def linear_parts(self, kind: str) -> LinearParts:
        proj = getattr(self, kind)
        return LinearParts(up=proj.weight, bias=proj.bias)


class LowRankLinear(nn.Module):
    """A rank-r affine map stored as two factors: `up(down(x))`, costing `r * (F_in + F_out)` per token."""

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.down = zero_linear(in_features, rank, bias=False)  # weight (r, F_in)
        self.up = zero_linear(rank, out_features)  # weight (F_out, r) + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(_linear(x, self.down.weight, None), self.up.weight, self.up.bias)


@register_layer_map
class LowRankLayerMap(LayerMap):
    """Reduced-rank ridge map (fit by `lowrank.py`): each of K and V factored at its own rank."""

    mapper_type = LOWRANK

    def __init__(self, in_features: int, out_features: int, key_rank: int, value_rank: int):
        super().__init__()
        self.key = LowRankLinear(in_features, out_features, key_rank)
        self.value = LowRankLinear(in_features, out_features, value_rank)

    @classmethod
    def validate_config(cls, config: LayerMapConfig) -> None:
        num_target, out_dim = len(config.selected_layers), config.target_layout.layer_dim
        rank = config.rank
        if rank is None or len(rank) != num_target or any(len(r) != 2 or any(not 1 <= int(x) <= out_dim for x in r) for r in rank):
            raise ValueError(
                f"a 'lowrank' mapper needs `rank`: one [key_rank, value_rank] per target layer ({num_target}), each "
                f"in [1, {out_dim}]; got {rank}"
            )

    @classmethod
    def from_config(cls, config: LayerMapConfig, layer_idx: int) -> "LowRankLayerMap":
        return cls(*_features(config, layer_idx), *config.rank[layer_idx])

    def linear_parts(self, kind: str) -> LinearParts:
        proj = getattr(self, kind)
        return LinearParts(up=proj.up.weight, bias=proj.up.bias, down=proj.down.weight)


class GroupedLinear(nn.Module):
    """`groups` independent affine maps applied to the same (or per-group) input: weight `[groups, in, out]`."""

    def __init__(self, groups: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(groups, in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(groups, out_features))

    def reset_parameters(self, generator: torch.Generator, zero: bool = False) -> None:
        # nn.Linear's default init (uniform in +-1/sqrt(fan_in)), drawn from a private generator for determinism.
        with torch.no_grad():
            if zero:
                self.weight.zero_()
                self.bias.zero_()
                return
            bound = 1 / math.sqrt(self.weight.shape[1])
            self.weight.copy_(torch.rand(self.weight.shape, generator=generator) * 2 * bound - bound)
            self.bias.copy_(torch.rand(self.bias.shape, generator=generator) * 2 * bound - bound)


class MLPKindMap(nn.Module):
    """The map of one (target layer, K|V): `[..., in_features] -> [..., out_features]`.

    `y = linear(x) + mlp(x)` when `residual` (the linear part holds the ridge solution), `y = mlp(x)` otherwise.
    The MLP has `num_hidden_layers` ReLU layers of `hidden_size` units; with `groups > 1` (the paper's one MLP
    per KV head) each group owns a separate MLP producing `out_features // groups` outputs.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        hidden_size: int,
        num_hidden_layers: int,
        groups: int = 1,
        residual: bool = True,
    ):
        super().__init__()
        if num_hidden_layers < 1 or hidden_size < 1:
            raise ValueError(
                f"an MLP map needs num_hidden_layers >= 1 and hidden_size >= 1, "
                f"got {num_hidden_layers} and {hidden_size}"
            )
        if out_features % groups:
            raise ValueError(f"out_features {out_features} is not divisible into {groups} groups")
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.linear = zero_linear(in_features, out_features) if residual else None
        sizes = [in_features] + [hidden_size] * num_hidden_layers + [out_features // groups]
        self.mlp = nn.ModuleList(GroupedLinear(groups, a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.mlp[0].weight.dtype)
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])  # (N, F_in)
        h = x
        last = len(self.mlp) - 1
        for i, layer in enumerate(self.mlp):
            weight, bias = layer.weight.to(x.device), layer.bias.to(x.device)  # no-op when already there
            # (N, in) @ (G, in, out) broadcasts to (G, N, out); later layers are already per group.
            h = torch.matmul(h, weight) + bias.unsqueeze(1)
            if i < last:
                h = torch.relu(h)
        y = h.transpose(0, 1).reshape(x.shape[0], self.out_features)  # (G, N, d) -> (N, G*d), head-major
        if self.linear is not None:
            y = y + _linear(x, self.linear.weight, self.linear.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"groups={self.groups}, residual={self.linear is not None}"


def mlp_settings(config: LayerMapConfig) -> dict[str, Any]:
    """`config.mlp` over `DEFAULT_MLP_CONFIG`, validated."""
    if not config.mlp:
        raise ValueError(
            "mapper_type is 'mlp' but the config has no 'mlp' section (hidden_size, num_hidden_layers, ...)"
        )
    settings = {**DEFAULT_MLP_CONFIG, **config.mlp}
    if settings["activation"] != "relu":
        raise ValueError(f"only the 'relu' MLP activation is implemented, the config asks for {settings['activation']!r}")
    return settings


@register_layer_map
class MLPLayerMap(LayerMap):
    """A small ReLU MLP per K and V (the paper's nonlinear variant; fit by `mlp.py`). Runs one layer at a time."""

    mapper_type = MLP

    def __init__(self, key: MLPKindMap, value: MLPKindMap):
        super().__init__()
        self.key = key
        self.value = value

    @classmethod
    def validate_config(cls, config: LayerMapConfig) -> None:
        mlp_settings(config)

    @classmethod
    def from_config(cls, config: LayerMapConfig, layer_idx: int) -> "MLPLayerMap":
        settings = mlp_settings(config)
        in_features, out_features = _features(config, layer_idx)
        groups = config.target_layout.num_kv_heads if settings["per_head"] else 1

        def kind_map() -> MLPKindMap:
            return MLPKindMap(
                in_features,
                out_features,
                int(settings["hidden_size"]),
                int(settings["num_hidden_layers"]),
                groups=groups,
                residual=bool(settings["residual"]),
            )

        return cls(kind_map(), kind_map())


__all__ = [
    "DEFAULT_MLP_CONFIG",
    "LAYER_MAP_TYPES",
    "LayerMap",
    "LinearParts",
    "LowRankLayerMap",
    "LowRankLinear",
    "MLPKindMap",
    "MLPLayerMap",
    "RidgeLayerMap",
    "build_layer_maps",
    "layer_map_class",
    "mlp_settings",
    "register_layer_map",
    "zero_linear",
]
