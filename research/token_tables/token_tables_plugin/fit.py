"""Token tables for a mapper, fit in closed form on what its maps miss (`tables.py`), and the fit's step that adds
them to the content probe's candidates (`table_refiner`, handed to `fit_mapper(..., refine=...)`).

One pass over calibration sequences: each sequence's source cache goes through `TransferredCache` with the mapper
(its exact layers computed, the other layers mapped; keys taken before the key norm where the mapper predicts them
so), next to the target's own keys (before its key norm, likewise) and values; what the maps miss at each token is
kept for the reader layers. The tables are the ridge solution on one-hot ids at each lag, penalty `pseudo_count`
(an id seen `n` times at one lag and nowhere else gets `n / (n + pseudo_count)` of its mean), solved jointly over
the lags by conjugate gradients (`solve_token_tables`). Under `torch.distributed` each rank keeps its own sequences
and the per-id sums are all-reduced at each step.

Memory: the kept rows, `tokens x readers x 2 x kv_heads x head_dim` float32 (`token_table_rows_nbytes`).

A mapper reading the residual entering layer 0 (the token embedding) with tables on its readers can hold that
residual part in the tables (`fold_residual_into_tables`): the same maps, a gather at transfer time instead of a
product with `len(residual_lags) * hidden_size` inputs per token.

Example:
    ```python
    mapper = fit_token_tables(source, target, mapper, calibration_ids)   # every mapped layer gets tables
    ```
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from huggingface_hub.utils import tqdm
from transformers import PreTrainedModel

from hf_kvtransfer.core.cache import TransferredCache
from hf_kvtransfer.core.capture import capture_kv_and_inputs, prefill
from hf_kvtransfer.core.exact import own_prefix
from hf_kvtransfer.core.key_norm import KeyNormInput
from hf_kvtransfer.core.map_inputs import exact_layers_needed, with_input
from hf_kvtransfer.core.mapper import KVMapper
from hf_kvtransfer.core.residual import (
    ResidualInput,
    residual_config,
    residual_features,
    residual_readers,
)
from hf_kvtransfer.core.rope import (
    position_ids_from_mask,
    rotary_cos_sin,
    strip_rope,
    text_config,
)
from hf_kvtransfer.core.stats import KVLayout
from hf_kvtransfer.fitting.residual_stats import has_key_norm

from .first_layer import FirstLayerTableConfig, FirstLayerTableInput
from .tables import (
    TokenTableConfig,
    TokenTableInput,
    TokenTables,
    lagged_token_ids,
    token_table_parameters,
)

logger = logging.getLogger(__name__)

DEFAULT_TOKEN_LAGS = (0, 1, 2, 3)
DEFAULT_TOKEN_PSEUDO_COUNT = 1.0
# The tables' solve (conjugate gradients): relative residual of the normal equations to reach, and most steps. At
# 1e-3 the fitted values are within about 0.2% of the exact solve on the bundled family's calibration ids, far
# inside what the tables' own sampling noise moves them; 1e-6 takes about three times as long.
TOKEN_TABLE_TOLERANCE = 1e-3
TOKEN_TABLE_MAX_ITERATIONS = 200


def token_table_rows_nbytes(num_tokens: int, num_readers: int, layer_dim: int) -> int:
    """Bytes of what `fit_token_tables` keeps while it runs: float32 rows of keys and values per reader layer."""
    return 4 * num_tokens * num_readers * 2 * layer_dim


def solve_token_tables(
    lagged: torch.Tensor, targets: torch.Tensor, vocab_size: int, *, pseudo_count: float = DEFAULT_TOKEN_PSEUDO_COUNT,
    tolerance: float = TOKEN_TABLE_TOLERANCE, max_iterations: int = TOKEN_TABLE_MAX_ITERATIONS,
) -> torch.Tensor:
    """Tables `[L, vocab_size + 1, D]` minimising `|targets - sum_a T_a[lagged[:, a]]|^2 + pseudo_count * |T|^2`.

    Solved by conjugate gradients on the normal equations `(O^T O + pseudo_count I) T = O^T targets` (O: the one-hot
    ids of every lag side by side), preconditioned by their diagonal (each id's count + pseudo_count), each output
    column on its own; `O^T O` is never formed: each step is one gather and one scatter-add per lag over the tokens.
    Stops when every column's residual is below `tolerance` of its right-hand side.

    Args:
        lagged: `[N, L]` table rows per token (`lagged_token_ids`, flattened over kept tokens).
        targets: `[N, D]` what the tables should predict.
    """
    num_lags, rows = lagged.shape[1], vocab_size + 1
    dist = _dist()

    def scatter(per_token: torch.Tensor) -> torch.Tensor:  # O^T x: per-id sums for each lag, over every rank's tokens
        out = per_token.new_zeros(num_lags, rows, per_token.shape[1])
        for a in range(num_lags):
            out[a].index_add_(0, lagged[:, a], per_token)
        if dist is not None:
            dist.all_reduce(out)
        return out

    def gather(tables: torch.Tensor) -> torch.Tensor:  # O T: what the tables predict per token
        return sum(tables[a][lagged[:, a]] for a in range(num_lags))

    def dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # per output column
        return (x * y).sum((0, 1))

    counts = torch.stack([torch.bincount(lagged[:, a], minlength=rows) for a in range(num_lags)]).to(targets.dtype)
    if dist is not None:
        dist.all_reduce(counts)
    inverse_diagonal = 1 / (counts + pseudo_count).unsqueeze(-1)
    rhs = scatter(targets)
    tables = torch.zeros_like(rhs)
    residual = rhs.clone()
    step = inverse_diagonal * residual
    direction = step.clone()
    rz = dot(residual, step)
    stop = tolerance**2 * dot(rhs, rhs)
    for _ in range(max_iterations):
        if bool((dot(residual, residual) <= stop).all()):
            break
        product = scatter(gather(direction)) + pseudo_count * direction
        alpha = rz / dot(direction, product).clamp_min(torch.finfo(targets.dtype).tiny)
        tables += alpha * direction
        residual -= alpha * product
        step = inverse_diagonal * residual
        rz_next = dot(residual, step)
        direction = step + (rz_next / rz.clamp_min(torch.finfo(targets.dtype).tiny)) * direction
        rz = rz_next
    return tables


@dataclass
class TableInputs:
    """What every table fit over the same calibration sequences shares (`capture_table_inputs`): per batch of
    sequences their ids and mask, the source's cache, and the target's own stripped keys, values and keys before
    its key norm (None for a target without one), one tensor `[batch, kv_heads, seq, head_dim]` per layer."""

    batches: list[tuple[torch.Tensor, torch.Tensor | None, Any, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]]


def table_inputs_nbytes(source: PreTrainedModel, target: PreTrainedModel, num_tokens: int) -> int:
    """Bytes `capture_table_inputs` holds for `num_tokens` calibration tokens (float32)."""
    src, tgt = KVLayout.from_config(source.config), KVLayout.from_config(target.config)
    return 4 * num_tokens * (2 * src.total_dim + 3 * tgt.total_dim)


@torch.no_grad()
def capture_table_inputs(
    source: PreTrainedModel, target: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
    *, batch_size: int = 8,
) -> TableInputs:
    """Run both models once over the calibration sequences, for several `fit_token_tables` calls."""
    return TableInputs(list(_table_batches(source, target, input_ids, attention_mask, batch_size)))


@torch.no_grad()
def _table_batches(source, target, input_ids, attention_mask, batch_size: int):
    """`TableInputs.batches`, one batch at a time (what one fit holds at once when nothing is shared)."""
    for start in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[start : start + batch_size]
        mask = attention_mask[start : start + batch_size] if attention_mask is not None else None
        keys, values, _, before_norm = capture_kv_and_inputs(target, ids, mask, key_projections=has_key_norm(target))
        yield ids, mask, prefill(source, ids, mask), keys, values, before_norm


def _with_empty_tables(mapper: KVMapper, lags: Sequence[int], readers: Sequence[int]) -> KVMapper:
    config = with_input(mapper.config, TokenTableInput.name, TokenTableConfig(list(lags), list(readers)))
    new = KVMapper(config, layer_maps=mapper.layers, report=dict(mapper.report))
    new.residual = mapper.residual
    new.tokens.to(mapper.dtype)
    return new


def with_token_tables(mapper: KVMapper, tables: TokenTables) -> KVMapper:
    """A copy of `mapper` (same maps) that adds `tables` (another mapper's `tokens`) on its layers that are mapped:
    the layers of `tables` from `mapper.num_exact_layers` on."""
    readers = [t for t in tables.layers if t >= mapper.num_exact_layers]
    if not readers:
        raise ValueError(f"the tables' layers {tables.layers} are all exact with this mapper")
    new = _with_empty_tables(mapper, tables.lags, readers)
    for kind in ("key", "value"):
        for t in readers:
            getattr(new.tokens, kind)[str(t)].data.copy_(getattr(tables, kind)[str(t)].data)
    return new


def _per_id(target: PreTrainedModel, states, refusal: str, batch_size: int, check_tokens: int) -> list[torch.Tensor]:
    """Rows `[vocab_size, F]` of what `states(ids, positions)` returns (float32 tensors `[B, T, F]`) for every token
    id, each run as a one-token sequence at position 0.

    Raises:
        ValueError(refusal): when a sequence of `check_tokens` ids gives other states than its ids' rows, beyond
            the rounding of the model's dtype (a few units in its last place: a bf16 product may round differently
            at another shape), relative to their scale.
    """
    vocab = text_config(target.config).vocab_size
    device = next(target.parameters()).device
    chunks = [states(c[:, None], torch.zeros_like(c)[:, None]) for c in torch.arange(vocab, device=device).split(batch_size)]
    rows = [torch.cat([chunk[i][:, 0] for chunk in chunks]) for i in range(len(chunks[0]))]
    sample = torch.randint(vocab, (1, check_tokens), generator=torch.Generator().manual_seed(0)).to(device)
    got = states(sample, torch.arange(check_tokens, device=device)[None])
    tolerance = max(1e-4, 8 * torch.finfo(next(target.parameters()).dtype).eps)
    for g, r in zip(got, rows):
        want = r[sample[0]]
        if (g[0] - want).abs().max() > tolerance * want.abs().max().clamp_min(1e-6):
            raise ValueError(refusal)
    return rows


@torch.no_grad()
def token_residuals(target: PreTrainedModel, *, batch_size: int = 4096, check_tokens: int = 64) -> torch.Tensor:
    """`[vocab_size, hidden]`: the residual stream entering `target`'s layer 0 for each token id (its embedding, as
    the model's own forward computes it: any scale included), float32 on the target's device.

    Raises:
        ValueError: when that residual depends on more than the id (position embeddings, for one).
    """

    def hidden(ids: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        return [own_prefix(target, ids, None, positions, 1, hidden_of=0)[1].float()]

    refusal = (f"the residual entering layer 0 of {type(target).__name__} depends on more than the token id (position "
               "or context): its residual part cannot be held in token tables; keep the mapper as it is")  # fmt: skip
    return _per_id(target, hidden, refusal, batch_size, check_tokens)[0]


@torch.no_grad()
def tabulate_first_layer(mapper: KVMapper, target: PreTrainedModel, *, batch_size: int = 4096, check_tokens: int = 64) -> KVMapper:
    """`mapper` with the target's own layer-0 keys and values per token id (`first_layer.FirstLayerTableInput`): a
    cache computing exactly one layer then looks them up instead of running the target's projections.

    Each id's keys and values are the target's own of a one-token sequence, RoPE stripped (keys after the key norm).

    Raises:
        ValueError: when layer 0's keys or values depend on more than the id.

    Returns:
        A new mapper (maps and tables shared with `mapper`); `mapper` is not changed.
    """
    def layer0(ids: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        keys, values = own_prefix(target, ids, None, positions, 1)[0]
        keys = strip_rope(keys, *rotary_cos_sin(mapper.target_rotary(ids.device), positions, ids.device))
        return [_flat(keys), _flat(values.float())]  # (B, T, n_kv * d)

    refusal = (f"layer 0's keys and values of {type(target).__name__} depend on more than the token id: they cannot "
               "be looked up; keep the mapper as it is")  # fmt: skip
    keys, values = _per_id(target, layer0, refusal, batch_size, check_tokens)
    new = KVMapper(with_input(mapper.config, FirstLayerTableInput.name, FirstLayerTableConfig()), layer_maps=mapper.layers,
                   report=dict(mapper.report))  # fmt: skip
    new.residual, new.tokens = mapper.residual, mapper.tokens
    new.first_layer.to(mapper.dtype)
    new.first_layer.key.data.copy_(keys)
    new.first_layer.value.data.copy_(values)
    return new


@torch.no_grad()
def fold_residual_into_tables(mapper: KVMapper, target: PreTrainedModel) -> KVMapper:
    """The same maps with their residual part held in the token tables (`ResidualConfig.in_tables`).

    With the residual's `layer = 0` a reader's residual part at position `t` is `sum_i W_i @ norm(e[ids[t - lag_i]])`
    (`e` the residual entering layer 0 of each id, `token_residuals`): one row per id and lag, added to the table
    of that lag. The "no token" row stays as it is (the residual features are zero there too). The transfer then
    computes no residual product; it still runs the exact layer and the key norms.

    Args:
        mapper: a mapper reading the residual entering layer 0, with token tables on every residual reader at every
            residual lag (`can_fold_residual`).
        target: the target model (for its embeddings).

    Returns:
        A new mapper (the source maps shared with `mapper`, new tables); `mapper` is not changed.
    """
    config, res = mapper.config, residual_config(mapper.config)
    readers = residual_readers(config)
    if res is None or res.layer != 0 or res.in_tables or mapper.tokens is None:
        raise ValueError(
            "fold_residual_into_tables needs a mapper reading the residual entering layer 0 (map_inputs.residual.layer "
            "0), with token tables, whose residual part is not in them already"
        )
    if not can_fold_residual(mapper):
        raise ValueError(
            f"the token tables (layers {mapper.tokens.layers}, lags {mapper.tokens.lags}) must cover the residual readers "
            f"{readers} at the residual lags {res.lags}"
        )
    embeddings = token_residuals(target).to(mapper.dtype)
    features = residual_features(embeddings[None], [0])[0]  # [vocab, hidden], normalised as the cache does
    width = features.shape[1]
    folded = with_input(config, ResidualInput.name, dataclasses.replace(res, in_tables=True, rank=None))
    new = KVMapper(folded, layer_maps=mapper.layers, report=dict(mapper.report)).to(mapper.dtype)
    new.tokens.load_state_dict(mapper.tokens.state_dict())
    for kind in ("key", "value"):
        for t in readers:
            weight = mapper.residual.weight(kind, t)
            if mapper.residual.down is not None:
                weight = weight @ mapper.residual.down  # [out, len(lags) * hidden]
            table = getattr(new.tokens, kind)[str(t)].data
            for i, lag in enumerate(res.lags):
                block = weight[:, i * width : (i + 1) * width].to(features.device)
                table[mapper.tokens.lags.index(lag), : features.shape[0]] += (features @ block.T).to(table.device, table.dtype)
    return new


def can_fold_residual(mapper: KVMapper) -> bool:
    """Whether `fold_residual_into_tables` applies: the maps read the residual entering layer 0 (the token embedding,
    a function of the id) as weights, and its token tables cover every residual reader at every residual lag."""
    res = residual_config(mapper.config)
    if res is None or res.layer != 0 or res.in_tables or mapper.tokens is None:
        return False
    return set(residual_readers(mapper.config)) <= set(mapper.tokens.layers) and set(res.lags) <= set(mapper.tokens.lags)


def token_tables_nbytes(mapper: KVMapper, readers: Sequence[int], lags: Sequence[int], itemsize: int = 4) -> int:
    """Bytes of token tables on `readers` at `lags` for `mapper`'s target, at `itemsize` bytes a number."""
    config = with_input(mapper.config, TokenTableInput.name, TokenTableConfig(list(lags), list(readers)))
    return itemsize * token_table_parameters(config)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _flat(states: torch.Tensor) -> torch.Tensor:
    # (B, H, T, D) -> (B, T, H * D)
    return states.permute(0, 2, 1, 3).flatten(2)


@torch.no_grad()
def fit_token_tables(
    source: PreTrainedModel,
    target: PreTrainedModel,
    mapper: KVMapper,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    readers: Sequence[int] | None = None,
    lags: Sequence[int] = DEFAULT_TOKEN_LAGS,
    pseudo_count: float = DEFAULT_TOKEN_PSEUDO_COUNT,
    batch_size: int = 8,
    inputs: TableInputs | None = None,
    progress: bool = False,
) -> KVMapper:
    """A copy of `mapper` whose `readers` layers also add token tables, fit on what its maps miss on `input_ids`.

    Args:
        source, target: the pair `mapper` was fit for.
        mapper: a "ridge" mapper without tables; its `num_exact_layers` are computed, the rest mapped.
        input_ids: `[num_sequences, seq_len]` calibration ids (not the probe's held-out ones), `attention_mask` the
            same shape or None. Tables need many tokens: each id's row is a mean over its occurrences.
        readers: target layers that get tables (default: every layer after the exact ones).
        lags: positions back the tables read (`t - lag`).
        pseudo_count: the ridge penalty, in occurrences of an id.
        inputs: `capture_table_inputs` of the same sequences, for several fits (default: run both models here).

    Returns:
        The new mapper (the same maps, its `TokenTableConfig` recorded, `num_exact_layers` kept).
    """
    if mapper.tokens is not None or mapper.config.mapper_type != "ridge":
        raise ValueError("fit_token_tables adds tables to a 'ridge' mapper without them")
    num_layers, exact = mapper.target_layout.num_layers, mapper.num_exact_layers
    readers = list(range(exact, num_layers)) if readers is None else sorted(set(readers))
    if not readers or not all(exact <= t < num_layers for t in readers):
        raise ValueError(f"readers must be mapped target layers in [{exact}, {num_layers}), got {readers}")
    lags = list(lags)
    vocab = text_config(target.config).vocab_size
    # What the maps predict, before the key norm the cache applies for a mapper that predicts keys before it.
    raw = copy.copy(mapper)
    raw.config = with_input(mapper.config, KeyNormInput.name, None)
    prenorm = set(residual_readers(mapper.config)) if KeyNormInput.used_by(mapper.config) else set()
    device = next(target.parameters()).device
    rotary = mapper.target_rotary(device)
    kept_ids: list[torch.Tensor] = []
    kept: dict[tuple[int, str], list[torch.Tensor]] = {(t, kind): [] for t in readers for kind in ("key", "value")}
    if inputs is None:
        batches = _table_batches(source, target, input_ids, attention_mask, batch_size)  # not kept: one at a time
    else:
        batches = inputs.batches
    bar = tqdm(total=input_ids.shape[0], desc="token tables: what the maps miss", unit="seq", disable=not progress)
    for ids, mask, source_cache, own_keys, own_values, before_norm in batches:
        cache = TransferredCache(source_cache, raw, attention_mask=mask, num_recompute_tokens=0, input_ids=ids,
                                 num_exact_layers=exact)  # fmt: skip
        cache.compute_exact_layers(target).convert_all()
        positions = position_ids_from_mask(mask, *ids.shape, device)
        cos, sin = rotary_cos_sin(rotary, positions, device)
        keep = (mask.bool() if mask is not None else torch.ones(ids.shape, dtype=torch.bool)).to(device)
        kept_ids.append(lagged_token_ids(ids, lags, vocab, mask).to(device)[keep].cpu())
        for t in readers:
            own_k = before_norm[t] if t in prenorm else own_keys[t]
            mapped_k = strip_rope(cache.layers[t].keys, cos, sin)
            kept[t, "key"].append(_flat(own_k.float() - mapped_k)[keep].cpu())
            kept[t, "value"].append(_flat(own_values[t].float() - cache.layers[t].values.float())[keep].cpu())
        bar.update(ids.shape[0])
    bar.close()
    lagged = torch.cat(kept_ids)
    new = _with_empty_tables(mapper, lags, readers)
    # One solve for every layer and kind: the one-hot ids are the same, only the right-hand sides differ.
    width = mapper.target_layout.layer_dim
    targets = torch.empty(lagged.shape[0], len(kept) * width)
    for i, rows in enumerate(kept.values()):  # into one matrix, each piece freed once copied (no second copy of all)
        start = 0
        while rows:
            piece = rows.pop(0)
            targets[start : start + piece.shape[0], i * width : (i + 1) * width] = piece
            start += piece.shape[0]
    tables = solve_token_tables(lagged, targets, vocab, pseudo_count=pseudo_count)
    for i, (t, kind) in enumerate(kept):
        getattr(new.tokens, kind)[str(t)].data.copy_(tables[..., i * width : (i + 1) * width].to(mapper.dtype))
    logger.info("token tables: layers %s, lags %s, %d tokens", readers, lags, lagged.shape[0])
    return new


# Token tables the fit's step adds to one candidate stay under this size (float32): the bundled family's are tens of
# MiB; a 150K-token vocabulary's are ~5 GiB per target layer of 1024 KV features, where the step keeps to the maps.
TOKEN_TABLE_BYTES = 2 * 2**30
# The step runs both models over its sequences once for every candidate's tables when their states fit in this many
# bytes (float32; the bundled family: about 1 GiB), else once per candidate.
TABLE_INPUTS_BYTES = 4 * 2**30


def table_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, num_heldout: int, extra_ids: torch.Tensor | None = None,
    sequences: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sequences the token tables are fit on: the maps' training sequences (not the `num_heldout` last ones the
    probe scores), then `extra_ids` (sequences for the tables alone), the first `sequences` of them (None: all)."""
    train = slice(None, -num_heldout) if num_heldout else slice(None)
    ids, mask = input_ids[train], attention_mask[train] if attention_mask is not None else None
    if extra_ids is not None and len(extra_ids):
        if extra_ids.ndim != 2 or extra_ids.shape[1] != ids.shape[1]:
            raise ValueError(f"the tables' extra sequences must be [sequences, {ids.shape[1]}] (the calibration "
                             f"sequences' length), got {list(extra_ids.shape)}")  # fmt: skip
        mask = None if mask is None else torch.cat([mask, torch.ones_like(extra_ids, dtype=mask.dtype)])
        ids = torch.cat([ids, extra_ids.to(ids.device)])
    if sequences is not None:
        ids, mask = ids[:sequences], None if mask is None else mask[:sequences]
    return ids, mask


def table_refiner(
    source: PreTrainedModel, target: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor | None = None, *,
    lags: Sequence[int] = DEFAULT_TOKEN_LAGS, batch_size: int = 8, log=None, progress: bool = False,
):
    """What the content probe does to each residual candidate before it probes it (`fit_mapper(..., refine=...)`):
    token tables on every mapped layer, fit on `ids` (`table_rows`: sequences the probe does not score), where they
    fit `TOKEN_TABLE_BYTES`. The tables are fit once per residual layer, on what the first candidate of that layer
    tried (its fullest maps) misses, and shared by its other candidates: a solve per candidate would cost the fit
    minutes each, for tables that differ little between maps of one layer. A candidate reading the residual entering
    layer 0 gets that residual folded into its tables and layer 0 looked up (`fold_residual_into_tables`,
    `tabulate_first_layer`)."""
    lags = list(lags)
    say = log or logger.info
    # Both models' states of these sequences, captured once for every candidate's tables where they fit in memory.
    shared: list[TableInputs] = []
    keep = table_inputs_nbytes(source, target, ids.numel()) <= TABLE_INPUTS_BYTES
    fitted: dict[int, KVMapper] = {}  # residual layer -> its first candidate with tables

    def refine(candidate: KVMapper) -> KVMapper:
        readers = list(range(candidate.num_exact_layers, candidate.target_layout.num_layers))
        nbytes = token_tables_nbytes(candidate, readers, lags)
        if nbytes > TOKEN_TABLE_BYTES:
            say(f"token tables: not added, {nbytes / 2**30:,.1f} GiB for layers {readers} (over {TOKEN_TABLE_BYTES / 2**30:.0f} GiB)")
            return candidate
        layer = exact_layers_needed(candidate.config)[0] - 1  # the residual it reads enters its last needed exact layer
        if layer not in fitted:
            fitted[layer] = fit_tables(candidate, readers, layer)
        with_tables = with_token_tables(candidate, fitted[layer].tokens)
        # The residual entering layer 0 is the token embedding: its part of the maps is one more table row per id
        # and lag, a gather at transfer time instead of a product (the same maps); and the one exact layer's K/V
        # are the target's own per id, looked up instead of projected.
        if can_fold_residual(with_tables):
            return tabulate_first_layer(fold_residual_into_tables(with_tables, target), target)
        return with_tables

    def fit_tables(candidate: KVMapper, readers: list[int], layer: int) -> KVMapper:
        kept = token_table_rows_nbytes(int(mask.sum()) if mask is not None else ids.numel(), len(readers),
                                       candidate.target_layout.layer_dim)  # fmt: skip
        say(f"token tables for layers {readers} (residual layer {layer}) on {ids.shape[0]} sequences "
            f"({ids.numel():,} tokens): {kept / 2**20:,.0f} MiB of rows kept while they are fit (float32)")  # fmt: skip
        if keep and not shared:
            shared.append(capture_table_inputs(source, target, ids, mask, batch_size=batch_size))
        return fit_token_tables(source, target, candidate, ids, mask, readers=readers, lags=lags,
                                batch_size=batch_size, inputs=shared[0] if shared else None,
                                progress=progress)  # fmt: skip

    return refine


__all__ = [
    "DEFAULT_TOKEN_LAGS",
    "DEFAULT_TOKEN_PSEUDO_COUNT",
    "TOKEN_TABLE_MAX_ITERATIONS",
    "TOKEN_TABLE_TOLERANCE",
    "TableInputs",
    "capture_table_inputs",
    "fit_token_tables",
    "fold_residual_into_tables",
    "solve_token_tables",
    "table_inputs_nbytes",
    "table_refiner",
    "table_rows",
    "tabulate_first_layer",
    "token_residuals",
    "token_table_rows_nbytes",
    "with_token_tables",
]
