"""The token tables, a map input defined outside the library: one table row per token id, at a few positions back.
Importing this module registers it (`register_map_input`) under the name `token_tables`.

The layers that copy from the context ("induction" heads) have keys that say which tokens came just before each
position. A linear map of the source's K/V, or of the target's residual stream, gives that only as far as it is
linear in those inputs; on the bundled family it is not, and those layers lose what the context said. A token table
is the cheapest non-linear function of the ids: for each lag `a` of its `lags` (`TokenTableConfig`), one row per vocabulary entry, and
a mapper with tables adds `sum_a T_a[ids[t - a]]` to the RoPE-stripped keys and values its maps produce for the
layers in its `readers` (after the key norm the cache applies to a residual reader). At transfer time that is a
gather and an add per layer, no multiply-add; the price is memory: `2 * len(lags) * (vocab_size + 1) *
kv_heads * head_dim` numbers per layer. Row `vocab_size` stands for "no token": positions before a row's first token
and padding. The tables are fit in closed form on what the maps miss (`fit.py` beside this module).

Example:
    ```python
    lagged = lagged_token_ids(input_ids, [0, 1, 2, 3], vocab_size)  # [batch, seq, 4]
    delta = mapper.tokens.lookup("key", layer_idx, lagged)          # [batch, seq, kv_heads * head_dim]
    ```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_kvtransfer.core.map_inputs import (
    InputCost,
    MapInput,
    MapInputConfig,
    PlanShape,
    layer_span,
    positions_label,
    register_map_input,
    writable,
)
from hf_kvtransfer.core.rope import text_config
from hf_kvtransfer.core.stats import KVLayout

# `MapperConfig` (hf_kvtransfer.core.mapper): annotations name it as a string only.
MapperConfig = Any


def lagged_token_ids(
    input_ids: torch.Tensor, lags: list[int], vocab_size: int, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`[batch, seq, len(lags)]` table rows: the id at position `t - lag` for each lag, `vocab_size` (the "no token"
    row) where that position is before the sequence or padded (`attention_mask` 0)."""
    ids = input_ids.long()
    if attention_mask is not None:
        ids = ids.masked_fill(attention_mask.to(ids.device) == 0, vocab_size)
    batch, seq = ids.shape
    out = ids.new_full((batch, seq, len(lags)), vocab_size)
    for i, lag in enumerate(lags):
        if lag < seq:
            out[:, lag:, i] = ids[:, : seq - lag]
    return out


@dataclass
class TokenTableConfig(MapInputConfig):
    """`MapperConfig.map_inputs["token_tables"]`: the maps of the layers `readers` also add token tables, one row per
    token id at each position `t - lag` back for `lags`; the cache reads the prompt's ids for them."""

    lags: list[int]
    readers: list[int]

    def __post_init__(self):
        self.lags, self.readers = list(self.lags), list(self.readers)

    def validate(self, config: MapperConfig, name: str) -> None:
        if config.mapper_type != "ridge":
            raise ValueError(f"{name}: token tables apply to 'ridge' mappers only, got mapper_type={config.mapper_type!r}")
        lags, readers = self.lags, self.readers
        if not lags or any(isinstance(a, bool) or not isinstance(a, int) or a < 0 for a in lags) or len(set(lags)) != len(lags):
            raise ValueError(f"{name}.lags must be distinct non-negative token offsets (e.g. [0, 1, 2, 3]), got {lags}")
        num_layers = config.target_fingerprint["num_hidden_layers"]
        if not readers or sorted(set(readers)) != list(readers) or not all(isinstance(t, int) and 0 <= t < num_layers for t in readers):
            raise ValueError(f"{name}.readers must be ascending distinct target layers in [0, {num_layers}), got {readers}")
        if not config.target_fingerprint.get("vocab_size"):
            raise ValueError(f"{name}: token tables need the target's vocab_size in its config fingerprint")

    def holds_per_id_rows(self, config: MapperConfig, layers: list[int], lags: list[int]) -> bool:
        # One row per id at each of its lags on each of its readers: the residual entering layer 0 (the token
        # embedding) can be held there (`ResidualConfig.in_tables`, `fit.fold_residual_into_tables`).
        return set(layers) <= set(self.readers) and set(lags) <= set(self.lags)

    def label(self, config: MapperConfig) -> str:
        many = "s" if len(self.readers) > 1 else ""
        return f"token tables ({positions_label(self.lags)}) on layer{many} {layer_span(self.readers)}"


def token_table_config(config: MapperConfig) -> TokenTableConfig | None:
    """A mapper config's token tables (`map_inputs["token_tables"]`), None without."""
    return config.map_inputs.get(TokenTableInput.name)


def token_table_readers(config: MapperConfig) -> list[int]:
    """The target layers whose maps add token tables (empty for a mapper without)."""
    tables = token_table_config(config)
    return [] if tables is None else list(tables.readers)


def token_table_parameters(config: MapperConfig) -> int:
    """Numbers held by a mapper's token tables (0 without)."""
    tables = token_table_config(config)
    if tables is None:
        return 0
    fp = config.target_fingerprint
    return 2 * len(tables.readers) * len(tables.lags) * (fp["vocab_size"] + 1) * fp["num_key_value_heads"] * fp["head_dim"]


class TokenTables(nn.Module):
    """The token tables of a mapper: `key.<t>` / `value.<t>` weights `[len(lags), vocab_size + 1, n_kv * d]` for each
    reader layer `t` (`TokenTableConfig`)."""

    def __init__(self, config: MapperConfig):
        super().__init__()
        self.lags = list(token_table_config(config).lags)
        self.vocab_size = config.target_fingerprint["vocab_size"]
        shape = (len(self.lags), self.vocab_size + 1, config.target_layout.layer_dim)
        self.layers = token_table_readers(config)
        self.key = nn.ParameterDict({str(t): nn.Parameter(torch.zeros(shape)) for t in self.layers})
        self.value = nn.ParameterDict({str(t): nn.Parameter(torch.zeros(shape)) for t in self.layers})

    def lagged(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`lagged_token_ids` with this mapper's lags and vocabulary."""
        return lagged_token_ids(input_ids, self.lags, self.vocab_size, attention_mask)

    def lookup(self, kind: str, layer_idx: int, lagged: torch.Tensor) -> torch.Tensor:
        """`sum_a T_a[lagged[..., a]]`: `[batch, seq, n_kv * d]` for `lagged` `[batch, seq, len(lags)]`."""
        table = (self.key if kind == "key" else self.value)[str(layer_idx)]
        rows = table.shape[1]
        # One embedding bag over the lags' tables stacked end to end: a gather and a sum, no product.
        offsets = torch.arange(len(self.lags), device=lagged.device) * rows
        flat = (lagged.to(table.device) + offsets).reshape(-1, len(self.lags))
        out = nn.functional.embedding_bag(flat, table.reshape(-1, table.shape[-1]), mode="sum")
        return out.view(*lagged.shape[:-1], -1)


@register_map_input
class TokenTableInput(MapInput):
    """Table rows of the prompt's ids at the mapper's lags: each reader layer adds `sum_a T_a[ids[t - a]]` to what its
    maps predict (`TokenTables`), before the key norm."""

    name, order, config_class, attribute = "token_tables", 20, TokenTableConfig, "tokens"
    missing = (
        "this mapper's maps add token tables of the prompt's ids, which this cache does not know: build the source "
        "cache with `prefill` or pass input_ids= to TransferredCache"
    )

    # `plan` costs them at 4 positions (t .. t-3, `fit.DEFAULT_TOKEN_LAGS`) unless `input_positions` names others.
    plan_label, plan_positions, plan_default_positions = "token tables", "token_positions", 4

    @classmethod
    def cost(cls, shape: PlanShape) -> InputCost | None:
        """Tables on every mapped layer at `positions` positions (t, t-1, ...): one row per vocabulary entry (and one
        for "no token") per position, for keys and values, each `kv_heads * head_dim` wide. At transfer time a
        look-up and an add per token: no multiply-add."""
        layer_dim = KVLayout.from_config(shape.target_config).layer_dim
        rows = text_config(shape.target_config).vocab_size + 1
        return InputCost(parameters=shape.num_mapped_layers * 2 * shape.positions * rows * layer_dim)

    @classmethod
    def build_module(cls, config: MapperConfig) -> nn.Module | None:
        return TokenTables(config) if token_table_config(config) is not None else None

    @property
    def readers(self) -> list[int]:
        return list(self.mapper.tokens.layers)

    @staticmethod
    def card_facts(config: dict[str, Any]) -> list[tuple[str, str]]:
        tables = (config.get("map_inputs") or {}).get("token_tables")
        if tables is None:
            return []
        lags = positions_label(tables["lags"])
        return [("Maps also add", f"token tables of the prompt's ids at positions {lags} "
                 f"(layers {', '.join(map(str, tables['readers']))}; a look-up, no multiply-add)")]  # fmt: skip

    def from_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        return self.mapper.tokens.lagged(input_ids, attention_mask)

    def apply(self, state, group, rows):
        readers = self.group_readers(group)
        if not readers:
            return rows
        lagged, tables = self.require(state), self.mapper.tokens
        width = self.mapper.target_layout.layer_dim
        rows = [writable(x) for x in rows]
        for kind, x in zip(("key", "value"), rows):
            for i, t in readers:
                x[..., i * width : (i + 1) * width] += tables.lookup(kind, t, lagged).to(x.device, x.dtype)
        return rows


__all__ = [
    "TokenTableConfig",
    "TokenTableInput",
    "TokenTables",
    "lagged_token_ids",
    "token_table_config",
    "token_table_parameters",
    "token_table_readers",
]
