"""What a mapper between two models costs, from their configs alone: sizes, fit memory, FLOPs, transfer memory.

Every number comes from the code that does the work, not from a second copy of its formula: statistics sizes from
`stats.statistics_nbytes` / `stats.block_statistics_nbytes` (what `fit` allocates), mapper parameters from a
`KVMapper` built on the meta device (no memory), FLOPs from `core.flops` (`prefill_flops` / `exact_layers_flops` /
`mapping_flops`: what `hf-kvtransfer bench` reports), and the fit's full vs two-stage choice by the rule
`accumulate.py` applies. To the first token (`first_token_flops`): the exact layers, the maps, the recomputed tokens,
and what each registered map input would add (`map_input_costs`: `MapInput.cost`, at the positions the caller names
or the input's `plan_default_positions`).

Example:
    ```python
    >>> from hf_kvtransfer.commands.plan import plan_transfer
    >>> plan = plan_transfer("Qwen/Qwen3-14B", "Qwen/Qwen3-32B", top_k=8, seq_len=32768)
    >>> plan.mapper_parameters, plan.flop_ratio
    ```
"""

from __future__ import annotations

import os
import dataclasses
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from transformers import PreTrainedConfig

from ..core.loading import DTYPES, parse_dtype
from ..core.flops import first_token_parts, mapping_flops, prefill_flops
from ..core.map_inputs import InputCost, MapInput, PlanShape, map_input_class, registered_map_inputs
from ..core.mapper_types import LOWRANK, RIDGE
from ..core.options import with_options
from ..core.ridge import effective_top_k
from ..core.rope import text_config
from ..core.stats import KVLayout, block_statistics_nbytes, statistics_nbytes
from ..fitting.accumulate import kv_sums_bytes
from ..fitting.budget import StatisticsBudget, available_memory, statistics_budget
from ..fitting.config import FitConfig, heldout_count
from ..fitting.exact_window import FIRST_WINDOW
from ..fitting.fit_inputs import registered_fit_inputs
from .model_configs import load_model_config

__all__ = [
    "TransferPlan",
    "first_token_flops",
    "format_plan",
    "map_input_costs",
    "plan_transfer",
]

# `hf-kvtransfer fit` defaults (FitConfig: the paper's 500 x 1024 tokens, 10% held out; two-stage probe size).
_FIT_DEFAULTS = {f.name: f.default for f in fields(FitConfig)}
FIT_NUM_SEQUENCES = _FIT_DEFAULTS["num_sequences"]
FIT_HELDOUT_FRACTION = _FIT_DEFAULTS["heldout_fraction"]
FIT_PROBE_TOKENS = _FIT_DEFAULTS["probe_tokens"]


def _dtype(name: str | torch.dtype) -> torch.dtype:
    return parse_dtype(name if isinstance(name, torch.dtype) else str(name).lower())


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass
class TransferPlan:
    """Costs of mapping `source`'s KV cache into `target`'s with a top-`top_k` ridge mapper.

    Bytes are bytes, FLOPs are 2 x multiply-adds at batch 1; `*_by_dtype` maps a dtype name to bytes.
    """

    source: str
    target: str
    source_layout: dict[str, int]
    target_layout: dict[str, int]
    top_k: int
    rank: int | None
    seq_len: int
    batch_size: int
    dtype: str
    # mapper
    mapper_parameters: int
    mapper_weight_parameters: int  # without the biases: the paper's 2 * L_t * n_kv_t * (k n_kv_s d_s) * d_t at full rank
    mapper_bytes: int
    mapper_bytes_by_dtype: dict[str, int]
    full_rank_parameters: int
    # fit statistics (float64), one set; the fit keeps `statistics_sets` of them (fit + held-out shard)
    statistics_bytes_full: int
    statistics_bytes_two_stage: int
    statistics_sets: int
    probe_bytes: int
    model_parameters: dict[str, int | None]
    # FLOPs at seq_len
    prefill_flops: int
    mapping_flops: int
    flop_ratio: float
    # transfer memory at seq_len, batch_size
    source_cache_bytes: int
    target_cache_bytes: int
    transfer_working_bytes: int
    transfer_working_bytes_max: int  # if every target layer's selection buffer stays alive to the end
    transfer_peak_bytes: int
    # what `fit` does by default here
    available_memory_bytes: int
    statistics_budget_bytes: int
    statistics_budget_origin: str  # where the fit takes that budget from (`StatisticsBudget.origin`)
    fit_default_mode: str
    fit_default_statistics_bytes: int
    # the sums each searched map input collects beside them (`FitInput.planned_statistics`), by name
    fit_input_statistics: dict[str, dict[str, Any]]
    # to the first token of a seq_len-token prompt at a configuration (`first_token_flops`)
    num_exact_layers: int
    num_recompute_tokens: int
    target_layer_flops: int  # one target layer's share of the prefill at seq_len
    first_token_flops: dict[str, int]  # the transfer with maps reading the source's K/V only
    first_token_flop_ratio: float  # own prefill / that transfer
    # the same ratio at other exact-layer counts (1, an eighth, a quarter and half of the target's layers, and the
    # count asked for): how far the content probe's choice moves it
    first_token_flop_ratio_by_exact_layers: dict[int, float] = field(default_factory=dict)
    # the same with the exact layers attending within `windowed_at` tokens (`MapperConfig.exact_window`)
    exact_window: int | None = None
    windowed_at: int | None = None
    first_token_flop_ratio_by_exact_layers_windowed: dict[int, float] = field(default_factory=dict)
    # each map input at this shape, by name (`map_input_rows`): label, positions, input features per map, parameters,
    # bytes, flops, bytes against the target's own weights at `dtype`, and the first token with it on every mapped
    # layer (`first_token_flops`, and read alone where its maps may read no source K/V)
    map_inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _as_config(model: str | os.PathLike | PreTrainedConfig, use_hub: bool) -> tuple[str, PreTrainedConfig]:
    if isinstance(model, PreTrainedConfig):
        return getattr(model, "_name_or_path", "") or model.model_type, model
    return os.fspath(model), load_model_config(model, use_hub=use_hub)


def planning_mapper(source_config: PreTrainedConfig, target_config: PreTrainedConfig, top_k: int, rank: int | None = None):
    """A ridge `KVMapper` of the right shapes on the meta device (no memory): each target layer reads `top_k` source
    layers (which ones does not change any size), `rank` caps each map's rank (None = full)."""
    from ..core.mapper import KVMapper
    from ..core.mapper_config import MapperConfig

    src, tgt = KVLayout.from_config(source_config), KVLayout.from_config(target_config)
    if not 1 <= top_k <= src.num_layers:
        raise ValueError(f"top_k must be in [1, {src.num_layers}] (the source's layers), got {top_k}")
    ranks = None
    if rank is not None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        r = min(rank, tgt.layer_dim)
        ranks = [[r, r] for _ in range(tgt.num_layers)]
    config = MapperConfig(
        source_config=text_config(source_config).to_dict(),
        target_config=text_config(target_config).to_dict(),
        selected_layers=[list(range(top_k)) for _ in range(tgt.num_layers)],
        top_k=top_k,
        rank=ranks,
        mapper_type=RIDGE if ranks is None else LOWRANK,
    )
    with torch.device("meta"):
        return KVMapper(config)


def _model_parameters(config: PreTrainedConfig) -> int | None:
    """Parameters of the model itself (meta-device instantiation: exact, no memory); None if it cannot be built."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in model.parameters())
    except Exception:  # an architecture transformers cannot build from the config alone: the plan goes on
        return None


def _input_positions(cls: type[MapInput], positions: dict[str, int]) -> int:
    """How many positions `plan` costs input `cls` at: `positions[cls.plan_positions]`, else its default (1 for an
    input that reads no positions)."""
    if not cls.plan_positions:
        return 1
    count = positions.get(cls.plan_positions, cls.plan_default_positions)
    if count < 0:
        raise ValueError(f"{cls.plan_positions} must be >= 0, got {count}")
    return count


def _input_cost(cls: type[MapInput], target_config, num_mapped_layers: int, num_tokens: int, count: int,
                rank: int | None, item: int, ranks: dict[str, int] | None = None) -> InputCost | None:  # fmt: skip
    """`cls.cost` on `num_mapped_layers` layers over `num_tokens` tokens at `count` positions (None at 0), its shared
    projection at `ranks[cls.plan_rank]` where named."""
    if num_mapped_layers < 0:
        raise ValueError(f"num_mapped_layers must be >= 0, got {num_mapped_layers}")
    shared = (ranks or {}).get(cls.plan_rank) if cls.plan_rank else None
    shape = PlanShape(text_config(target_config), num_mapped_layers, num_tokens, count, rank, item, shared)
    return cls.cost(shape) if count else None


def map_input_costs(
    target_config: PreTrainedConfig,
    num_mapped_layers: int,
    num_tokens: int,
    positions: dict[str, int],
    rank: int | None = None,
    dtype: str | torch.dtype = "bfloat16",
    ranks: dict[str, int] | None = None,
) -> dict[str, InputCost]:
    """What each registered map input would add to a mapper whose `num_mapped_layers` layers read it over `num_tokens`
    transferred tokens (`MapInput.cost`), by input name. `positions` maps an input's `plan_positions` option (e.g.
    "residual_positions") to how many positions it reads (an input not named: its `plan_default_positions`); an input
    read at 0 positions is left out. `ranks` maps an input's `plan_rank` option ("residual_rank") to the rank of the
    projection its maps share (not named: none)."""
    item, costs = _itemsize(_dtype(dtype)), {}
    for cls in registered_map_inputs():
        count = _input_positions(cls, positions)
        cost = _input_cost(cls, target_config, num_mapped_layers, num_tokens, count, rank, item, ranks)
        if cost is not None:
            costs[cls.name] = cost
    return costs


def map_input_rows(
    target_config: PreTrainedConfig,
    mapper,
    num_tokens: int,
    positions: dict[str, int],
    at: dict[str, Any],
    dtype: str | torch.dtype,
    target_parameters: int | None,
) -> dict[str, dict[str, Any]]:
    """`map_input_costs` as the plan reports them, on the layers the exact ones (`at["num_exact_layers"]`) leave to
    map: each input's label, positions, input features per map, parameters, bytes at `dtype`, FLOPs, its bytes against
    the target's own weights at `dtype` (None when the target cannot be built), and the first token of a
    `num_tokens`-token prompt with it (`first_token_flops`; and read alone, where `MapInput.plan_alone`)."""
    item = _itemsize(_dtype(dtype))
    mapped = text_config(target_config).num_hidden_layers - at["num_exact_layers"]
    transferred = num_tokens - at["num_recompute_tokens"]
    rows = {}
    ranks = at.get("input_ranks")
    for name, cost in map_input_costs(target_config, mapped, transferred, positions, at.get("rank"), dtype, ranks).items():
        cls = map_input_class(name)
        count = _input_positions(cls, positions)
        flops = first_token_flops(target_config, mapper, num_tokens, inputs={name: count}, **at)
        alone = first_token_flops(target_config, mapper, num_tokens, inputs={name: count}, source_inputs=False, **at) if cls.plan_alone else None
        rows[name] = {
            "label": cls.plan_label, "note": cls.plan_note, "positions": count if cls.plan_positions else None,
            "shared_rank": (ranks or {}).get(cls.plan_rank) if cls.plan_rank else None,
            "features": cost.features, "parameters": cost.parameters, "bytes": cost.parameters * item, "flops": cost.flops,
            "target_weights_ratio": cost.parameters / target_parameters if target_parameters else None,
            "first_token_flops": flops, "first_token_flop_ratio": flops["own_prefill"] / flops["total"],
            "first_token_flops_alone": alone, "first_token_flop_ratio_alone": alone and alone["own_prefill"] / alone["total"],
        }  # fmt: skip
    return rows


# The bytes of one number `first_token_flops` costs inputs at: their FLOPs do not depend on it.
_FLOPS_ONLY = 2


def first_token_flops(
    target_config: PreTrainedConfig,
    mapper,
    seq_len: int,
    *,
    num_exact_layers: int,
    num_recompute_tokens: int,
    inputs: dict[str, int] | None = None,
    rank: int | None = None,
    source_inputs: bool = True,
    exact_window: int | None = None,
    input_ranks: dict[str, int] | None = None,
) -> dict[str, int]:
    """FLOPs to the target's first token for a `seq_len`-token prompt whose source cache is at hand, batch 1, by
    part (`flops.first_token_parts`: exact layers, maps, recomputed tokens, and the target's own prefill beside them),
    with what planned map inputs would add. `mapper` is a planning mapper (`planning_mapper`) or a loaded one, whose
    own map inputs are then counted in `mapping`.

    With `inputs` (`{input name: positions}`), the maps also read those map inputs (`MapInput.cost`; e.g. the target's
    residual stream entering the last exact layer, which the exact pass computes anyway before that layer's
    projections, so `exact_layers` is the same and only the wider maps cost more). `source_inputs=False`: maps that
    read those inputs only (a fit's "residual alone" variant), so no source K/V is mapped (`mapping` 0).
    `exact_window`: the exact layers attend within that many tokens (`MapperConfig.exact_window`; None: all).
    `input_ranks`: an input's shared projection's rank by its `plan_rank` option (`{"residual_rank": 256}`).

    Returns:
        `{"own_prefill", "exact_layers", "mapping", "map_inputs", "recompute", "total"}` (total: the transfer).
    """
    core = first_token_parts(target_config, mapper, seq_len, num_exact_layers=num_exact_layers,
                             num_recompute_tokens=num_recompute_tokens, exact_window=exact_window)  # fmt: skip
    mapped = text_config(target_config).num_hidden_layers - num_exact_layers
    transferred = seq_len - num_recompute_tokens
    costs = [_input_cost(map_input_class(name), target_config, mapped, transferred, count, rank, _FLOPS_ONLY, input_ranks)
             for name, count in (inputs or {}).items()]  # fmt: skip
    parts = {**core, "mapping": core["mapping"] if source_inputs else 0,
             "map_inputs": sum(c.flops for c in costs if c is not None)}  # fmt: skip
    parts["total"] = parts["exact_layers"] + parts["mapping"] + parts["map_inputs"] + parts["recompute"]
    return parts


@dataclass(frozen=True)
class PlanOptions:
    """The options of `plan_transfer` (each one also accepted as a keyword of `plan_transfer`).

    Attributes:
        top_k: source layers read per target layer.
        rank: reduced rank of every map (None: full rank).
        seq_len, batch_size: the transfer the FLOPs and memory are computed for.
        dtype: weight dtype of the mapper and dtype of the KV caches ("bfloat16", "float16", "float32").
        available_memory: bytes where the fit's statistics would live (default: this machine's available RAM).
        max_statistics_memory: the fit's statistics budget in GiB, as `fit --max-statistics-memory` (default: the
            fit's, `budget.statistics_budget`).
        num_sequences, heldout_fraction, probe_tokens: the fit settings (defaults: `hf-kvtransfer fit`'s).
        num_exact_layers, num_recompute_tokens: the configuration the first-token FLOPs are counted at, for a prompt
            of `seq_len` tokens (defaults: `TransferredCache`'s for a mapper that records no exact layers, 1, and 32
            recomputed tokens, at most half the prompt; a fit's content probe chooses the exact layers of a mapper).
        exact_window: the exact layers attend within this many tokens (default None: the whole prompt); the plan
            also sets the exact-layer counts side by side within it (default `FIRST_WINDOW`, the fit's first try).
        input_positions: positions each registered map input is costed at, by its `plan_positions` option
            (`MapInput.plan_positions`, e.g. "residual_positions": positions t, t-1, ... of the target's residual
            stream entering the last exact layer; an input not named here: its `plan_default_positions`); 0 leaves it
            out. Each such option is also accepted as a keyword of `plan_transfer` (`residual_positions=2`).
        input_ranks: the rank of the projection an input's maps share, by its `plan_rank` option
            (`MapInput.plan_rank`, e.g. "residual_rank", what `fit --residual-rank` saves; not named: none, each map
            reads the input's features whole). Also accepted as a keyword (`residual_rank=256`).
        use_hub: False never touches the network.
    """

    top_k: int = 8
    rank: int | None = None
    seq_len: int = 4096
    dtype: str | torch.dtype = "bfloat16"
    batch_size: int = 1
    available_memory: int | None = None
    max_statistics_memory: float | None = None
    num_sequences: int = FIT_NUM_SEQUENCES
    heldout_fraction: float = FIT_HELDOUT_FRACTION
    probe_tokens: int = FIT_PROBE_TOKENS
    num_exact_layers: int | None = None
    num_recompute_tokens: int | None = None
    exact_window: int | None = None
    input_positions: dict[str, int] | None = None
    input_ranks: dict[str, int] | None = None
    use_hub: bool = True


def plan_transfer(
    source: str | os.PathLike | PreTrainedConfig,
    target: str | os.PathLike | PreTrainedConfig,
    options: PlanOptions | None = None,
    **keywords: Any,
) -> TransferPlan:
    """Sizes, fit memory, FLOPs and transfer memory of a source -> target mapper, from the two configs only.

    Args:
        source, target: Hub ids, local model folders, `config.json` files or `PreTrainedConfig`s (see
            `load_model_config`: known families work offline).
        options: the options (`PlanOptions`); any of its fields may be given as a keyword instead (`top_k=4`).

    Returns:
        `TransferPlan` (`.to_dict()` for JSON).

    Example:
        ```python
        >>> plan = plan_transfer("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", top_k=8, seq_len=4096)
        >>> plan.fit_default_mode
        'full'
        ```
    """
    o = with_options(PlanOptions, options, _with_input_options(keywords), "plan_transfer")
    if o.seq_len < 1 or o.batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {o.seq_len} and {o.batch_size}")
    weight_dtype = _dtype(o.dtype)
    source_name, source_config = _as_config(source, o.use_hub)
    target_name, target_config = _as_config(target, o.use_hub)
    src, tgt = KVLayout.from_config(source_config), KVLayout.from_config(target_config)
    notes = _vocabulary_notes(source_config, target_config)
    if effective_top_k(o.top_k, src.num_layers) is None:  # as the fit reads it: every source layer
        notes.append(f"top_k {o.top_k} reaches the source's {src.num_layers} layers: every source layer, as fit reads it")
        o = dataclasses.replace(o, top_k=src.num_layers)
    mapper = planning_mapper(source_config, target_config, o.top_k, o.rank)
    available = o.available_memory if o.available_memory is not None else available_memory(torch.device("cpu"))
    budget = statistics_budget(o.max_statistics_memory, available)
    fit = _fit_memory(src, tgt, o.top_k, o.num_sequences, o.heldout_fraction, o.probe_tokens, budget)
    notes += fit.pop("notes")
    # The plan's sums live on the CPU, so a given budget is one total: the map inputs' sums get what the K/V sums leave.
    left = budget.after_kv(fit["fit_default_statistics_bytes"], "cpu")
    fit["fit_input_statistics"] = _fit_input_statistics(src, tgt, target_config, o.input_positions or {}, left)
    o = _with_fit_ranks(o, fit["fit_input_statistics"])
    return TransferPlan(
        source=source_name,
        target=target_name,
        source_layout=vars(src).copy(),
        target_layout=vars(tgt).copy(),
        top_k=o.top_k,
        rank=o.rank,
        seq_len=o.seq_len,
        batch_size=o.batch_size,
        dtype=str(weight_dtype).removeprefix("torch."),
        **_mapper_sizes(mapper, source_config, target_config, o, weight_dtype),
        **fit,
        **_first_token(mapper, source_config, target_config, o),
        **_transfer_memory(src, tgt, o.top_k, o.batch_size * o.seq_len, weight_dtype),
        notes=notes,
    )


def _with_fit_ranks(o: PlanOptions, statistics: dict[str, dict[str, Any]]) -> PlanOptions:
    """`o` with the rank of the projection each input's widest fitted maps would share (`shared_rank` of its planned
    statistics: the residual's directions where the fit compresses its sums) wherever `o` names none."""
    ranks = dict(o.input_ranks or {})
    for name, row in statistics.items():
        option = map_input_class(name).plan_rank
        if row.get("shared_rank") and option and option not in ranks:
            ranks[option] = row["shared_rank"]
    return dataclasses.replace(o, input_ranks=ranks or o.input_ranks)


def _with_input_options(keywords: dict[str, Any]) -> dict[str, Any]:
    """`plan_transfer`'s keywords with each input's positions option (`residual_positions=2`) moved into
    `input_positions`, and its rank option (`residual_rank=256`) into `input_ranks`."""
    for field_name, attribute in (("input_positions", "plan_positions"), ("input_ranks", "plan_rank")):
        names = {getattr(cls, attribute) for cls in registered_map_inputs() if getattr(cls, attribute)}
        moved = {k: v for k in list(keywords) if k in names and (v := keywords.pop(k)) is not None}
        keywords.update({field_name: {**(keywords.get(field_name) or {}), **moved}} if moved else {})
    return keywords


def _vocabulary_notes(source_config, target_config) -> list[str]:
    source_vocab, target_vocab = text_config(source_config).vocab_size, text_config(target_config).vocab_size
    if source_vocab == target_vocab:
        return []
    return [
        f"vocabularies differ ({source_vocab} vs {target_vocab} entries): transfer needs the same tokenizer; check "
        "that the token ids agree"
    ]


def _mapper_sizes(mapper, source_config, target_config, o: PlanOptions, weight_dtype: torch.dtype) -> dict[str, Any]:
    """`TransferPlan`'s fields of the mapper's size: parameters, bytes by dtype, the full-rank mapper's parameters."""
    from .bench import mapper_size

    params = mapper_size(mapper)["parameters"]
    full = planning_mapper(source_config, target_config, o.top_k) if o.rank is not None else mapper
    return dict(
        mapper_parameters=params,
        mapper_weight_parameters=sum(p.numel() for name, p in mapper.named_parameters() if not name.endswith("bias")),
        mapper_bytes=params * _itemsize(weight_dtype),
        mapper_bytes_by_dtype={name: params * _itemsize(DTYPES[name]) for name in ("float32", "bfloat16", "float16")},
        full_rank_parameters=mapper_size(full)["parameters"],
    )


def _first_token(mapper, source_config, target_config, o: PlanOptions) -> dict[str, Any]:
    """`TransferPlan`'s fields of the FLOPs at batch 1 (the bench functions; prefill = transformer body, as the paper
    times it) and to the first token: the exact layers, the maps, the recomputed tokens; and each map input's rows."""
    from ..core.defaults import DEFAULT_NUM_EXACT_LAYERS, resolve_num_recompute_tokens

    tgt, seq_len = KVLayout.from_config(target_config), o.seq_len
    prefill = prefill_flops(target_config, seq_len)["total"]
    mapping = mapping_flops(mapper, seq_len)
    exact = DEFAULT_NUM_EXACT_LAYERS if o.num_exact_layers is None else o.num_exact_layers
    recompute = resolve_num_recompute_tokens(o.num_recompute_tokens, seq_len)
    at = dict(num_exact_layers=exact, num_recompute_tokens=recompute, rank=o.rank, input_ranks=o.input_ranks,
              exact_window=o.exact_window)  # fmt: skip
    first = first_token_flops(target_config, mapper, seq_len, **at)
    counts, windowed_at = exact_layer_counts(tgt.num_layers, exact), o.exact_window or FIRST_WINDOW
    sweeps = {w: {n: first_token_flops(target_config, mapper, seq_len, **{**at, "num_exact_layers": n, "exact_window": w})
                  for n in counts} for w in (None, windowed_at)}  # fmt: skip
    model_parameters = {"source": _model_parameters(source_config), "target": _model_parameters(target_config)}
    inputs = map_input_rows(target_config, mapper, seq_len, o.input_positions or {}, at, o.dtype, model_parameters["target"])
    return dict(
        model_parameters=model_parameters,
        prefill_flops=prefill,
        mapping_flops=mapping,
        flop_ratio=prefill / mapping,
        num_exact_layers=exact,
        num_recompute_tokens=recompute,
        target_layer_flops=prefill // tgt.num_layers,
        first_token_flops=first,
        first_token_flop_ratio=first["own_prefill"] / first["total"],
        first_token_flop_ratio_by_exact_layers={n: f["own_prefill"] / f["total"] for n, f in sweeps[None].items()},
        exact_window=o.exact_window,
        windowed_at=windowed_at,
        first_token_flop_ratio_by_exact_layers_windowed={
            n: f["own_prefill"] / f["total"] for n, f in sweeps[windowed_at].items()},
        map_inputs=inputs,
    )


def exact_layer_counts(num_layers: int, asked: int) -> list[int]:
    """The exact-layer counts `plan` sets side by side: 1, an eighth, a quarter and half of the target's layers, and
    the count asked for (those below the target's depth)."""
    counts = {1, max(1, num_layers // 8), max(1, num_layers // 4), max(1, num_layers // 2), asked}
    return sorted(n for n in counts if 0 <= n < num_layers)


def _fit_memory(src: KVLayout, tgt: KVLayout, top_k: int, num_sequences: int, heldout_fraction: float,
                probe_tokens: int, budget: StatisticsBudget) -> dict[str, Any]:
    """The fit's K/V statistics (float64) by the functions `fit` sizes its own allocations with, and which mode the fit
    picks within `budget` (`budget.statistics_budget`, the fit's rule); `TransferPlan`'s fields, and `notes`."""
    notes = []
    stats_full = statistics_nbytes(src, tgt)
    stats_two_stage = block_statistics_nbytes(src, tgt, top_k)
    sets = 2 if heldout_count(num_sequences, heldout_fraction) else 1
    two_stage = budget.two_stage(stats_full * sets)
    mode = "two-stage" if two_stage else "full"
    fit_bytes = kv_sums_bytes(src, tgt, sets, two_stage, top_k, probe_tokens)
    probe = kv_sums_bytes(src, tgt, sets, True, top_k, probe_tokens) - stats_two_stage * sets
    if two_stage and fit_bytes > budget.kv_bytes:
        notes.append(
            f"even two-stage statistics ({fit_bytes / 2**30:.1f} GiB) exceed the budget: fit on a larger machine or "
            "with a smaller --top-k"
        )

    return {"statistics_bytes_full": stats_full, "statistics_bytes_two_stage": stats_two_stage, "statistics_sets": sets,
            "probe_bytes": probe, "available_memory_bytes": budget.free_bytes, "statistics_budget_bytes": budget.kv_bytes,
            "statistics_budget_origin": budget.origin("kv"), "fit_default_mode": mode, "fit_default_statistics_bytes": fit_bytes, "notes": notes}  # fmt: skip


def _fit_input_statistics(src: KVLayout, tgt: KVLayout, target_config, positions: dict[str, int],
                          budget: StatisticsBudget) -> dict[str, dict[str, Any]]:  # fmt: skip
    """What each map input the fit searches collects beside the K/V sums within `budget`, at the positions the plan
    costs it at (`FitInput.planned_statistics`), by name; an input costed at 0 positions is left out."""
    hidden = text_config(target_config).hidden_size
    rows = {}
    for fit_input in registered_fit_inputs():
        count = _input_positions(map_input_class(fit_input.name), positions)
        row = fit_input.planned_statistics(src, tgt, hidden, count, budget) if count else None
        if row is not None:
            rows[fit_input.name] = row
    return rows


def _transfer_memory(src: KVLayout, tgt: KVLayout, top_k: int, tokens: int, weight_dtype: torch.dtype) -> dict[str, int]:
    """New tensors a `TransferredCache` allocates (cache.py) for `tokens` (batch x sequence) tokens; `TransferPlan`'s
    fields."""
    cache_item = _itemsize(weight_dtype)
    feature_item = _itemsize(torch.promote_types(weight_dtype, weight_dtype))
    source_cache = 2 * src.total_dim * tokens * cache_item
    target_cache = 2 * tgt.total_dim * tokens * cache_item
    from ..core.conversion import GROUP_OUT_FEATURES

    group = max(1, GROUP_OUT_FEATURES // tgt.layer_dim)
    rotary = 4 * 2 * tokens * max(src.head_dim, tgt.head_dim) * 4  # float32 cos/sin, strip and apply
    rows = 2 * group * tgt.layer_dim * tokens * feature_item  # mapped K and V of one group of target layers
    selection = 2 * top_k * src.layer_dim * tokens * feature_item  # stripped K and V features of one selection
    working = selection + rows + rotary
    # Worst case: every target layer has its own selection and each selection's buffer stays alive while a later
    # selection still reads one of its source layers (cache.py keeps views into it).
    working_max = tgt.num_layers * selection + rows + rotary

    return {"source_cache_bytes": source_cache, "target_cache_bytes": target_cache, "transfer_working_bytes": working,
            "transfer_working_bytes_max": working_max, "transfer_peak_bytes": target_cache + working}  # fmt: skip


def _bytes(n: int | float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f}{unit}"
    return str(n)


def _statistics_total_lines(plan: TransferPlan) -> list[str]:
    """The fit's sums in all, where map inputs collect some beside the K/V sums (within a given budget together; by
    default each kind within its own)."""
    extra = sum(row["bytes"] for row in plan.fit_input_statistics.values())
    if not extra:
        return []
    total = plan.fit_default_statistics_bytes + extra
    line = f"  in all:    {_bytes(total)} (the K/V sums and the map inputs' sums together)"
    if total > plan.available_memory_bytes:
        line += f", more than the {_bytes(plan.available_memory_bytes)} available: --max-statistics-memory caps them"
    return [line]


def format_plan(plan: TransferPlan) -> str:
    """The plan as a short human-readable report."""
    s, t = plan.source_layout, plan.target_layout
    rank = "full rank" if plan.rank is None else f"rank {plan.rank}"
    dtypes = ", ".join(f"{name} {_bytes(b)}" for name, b in plan.mapper_bytes_by_dtype.items())
    models = plan.model_parameters
    lines = [
        f"source  {plan.source}: {s['num_layers']} layers x {s['num_kv_heads']} KV heads x {s['head_dim']}"
        + (f" ({_count(models['source'])} parameters)" if models.get("source") else ""),
        f"target  {plan.target}: {t['num_layers']} layers x {t['num_kv_heads']} KV heads x {t['head_dim']}"
        + (f" ({_count(models['target'])} parameters)" if models.get("target") else ""),
        "",
        f"mapper (top_k={plan.top_k}, {rank}): {plan.mapper_parameters:,} parameters "
        f"({plan.mapper_weight_parameters:,} weights + biases); {dtypes}",
        "",
        "fit statistics (float64):",
        f"  full:      {_bytes(plan.statistics_bytes_full)} per set, x{plan.statistics_sets}"
        f"{' (fit + held-out)' if plan.statistics_sets == 2 else ''} = {_bytes(plan.statistics_bytes_full * plan.statistics_sets)}",
        f"  two-stage: {_bytes(plan.statistics_bytes_two_stage)} per set (at most), x{plan.statistics_sets} + "
        f"probe {_bytes(plan.probe_bytes)}",
        f"  fit here:  {plan.fit_default_mode} ({_bytes(plan.fit_default_statistics_bytes)}; budget "
        f"{_bytes(plan.statistics_budget_bytes)} of {_bytes(plan.available_memory_bytes)} available: "
        f"{plan.statistics_budget_origin})",
        *(f"  {row['line']}" for row in plan.fit_input_statistics.values()),
        *_statistics_total_lines(plan),
        "",
        f"at {plan.seq_len} tokens (batch {plan.batch_size}, {plan.dtype}):",
        f"  target prefill {plan.prefill_flops / 1e12:,.3f} TFLOP vs transfer {plan.mapping_flops / 1e12:,.3f} TFLOP: "
        f"ratio {plan.flop_ratio:,.1f}x",
        f"  transfer memory: target cache {_bytes(plan.target_cache_bytes)} + working "
        f"{_bytes(plan.transfer_working_bytes)} (up to {_bytes(plan.transfer_working_bytes_max)}) = "
        f"{_bytes(plan.transfer_peak_bytes)}, next to the mapper {_bytes(plan.mapper_bytes)} and the source cache "
        f"{_bytes(plan.source_cache_bytes)}",
    ]
    lines += _first_token_lines(plan)
    lines += _map_input_lines(plan)
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _first_token_lines(plan: TransferPlan) -> list[str]:
    """To the first token: the exact layers' share next to the maps and the recomputed tokens."""
    f, layers = plan.first_token_flops, plan.target_layout["num_layers"]
    mapped = layers - plan.num_exact_layers

    def share(x: int) -> str:
        return f"{100 * x / f['own_prefill']:.2f}% of the prefill"

    window = f", attending within {plan.exact_window} tokens" if plan.exact_window else ""
    return [
        "",
        f"to the first token of a {plan.seq_len}-token prompt ({plan.num_exact_layers} of {layers} target layers exact"
        f"{window}, {plan.num_recompute_tokens} recomputed tokens; batch 1, transformer bodies):",
        f"  {'target prefill':<22}{_tflop(f['own_prefill'])} (one target layer: {_tflop(plan.target_layer_flops)})",
        f"  {'exact layers':<22}{_tflop(f['exact_layers'])} ({share(f['exact_layers'])})",
        f"  {f'maps ({mapped} layers)':<22}{_tflop(f['mapping'])} ({share(f['mapping'])})",
        f"  {'recomputed tokens':<22}{_tflop(f['recompute'])} ({share(f['recompute'])})",
        f"  {'transfer':<22}{_tflop(f['total'])}: {plan.first_token_flop_ratio:,.1f}x fewer than the prefill",
        f"  {'by exact layers':<22}"
        + ", ".join(f"{n}: {r:,.1f}x" for n, r in plan.first_token_flop_ratio_by_exact_layers.items()),
        f"  {f'within {plan.windowed_at} tokens':<22}"
        + ", ".join(f"{n}: {r:,.1f}x" for n, r in plan.first_token_flop_ratio_by_exact_layers_windowed.items())
        + " (the exact layers' attention over a local window: `exact_window`)",
        f"  {'':<22}(the fit's content probe chooses how many: on the bundled pairs, up to the layer where the "
        "target copies from its context)",
    ]


def _tflop(x: int) -> str:
    return f"{x / 1e12:,.3f} TFLOP"


def _map_input_lines(plan: TransferPlan) -> list[str]:
    """Each map input on every mapped layer at this shape, and whether it is practical: an input that takes more
    memory than the target's own weights costs more than the prefill it would save a share of."""
    if not plan.map_inputs:
        return []
    mapped = plan.target_layout["num_layers"] - plan.num_exact_layers
    weights = plan.model_parameters.get("target")
    lines = ["", f"map inputs at this shape (each alone, on all {mapped} mapped layers, {plan.dtype}):"]
    for row in plan.map_inputs.values():
        what = row["label"] + (f" ({row['positions']} positions x {row['features'] // row['positions']} per mapped layer)"
                               if row["positions"] and row["features"] else f" ({row['positions']} positions)" if row["positions"] else "")  # fmt: skip
        if row.get("shared_rank"):
            what += f" through one projection to rank {row['shared_rank']} shared by every map"
        flops = f"+{row['flops'] / 1e12:,.3f} TFLOP ({100 * row['flops'] / plan.prefill_flops:.2f}% of the prefill)" if row["flops"] else "no FLOPs (a look-up)"
        line = f"  {what}: {_bytes(row['bytes'])}, {flops}"
        ratio = row["target_weights_ratio"]
        if ratio is not None:
            target_bytes = _bytes(weights * row["bytes"] // max(row["parameters"], 1))
            verdict = "not practical at this shape" if ratio > 1 else "practical"
            line += f"; {ratio:.2f}x the target's own weights ({target_bytes}): {verdict}"
        lines += [line] + ([_first_token_with(plan, row)] if row["flops"] else [])
    return lines


def _first_token_with(plan: TransferPlan, row: dict[str, Any]) -> str:
    """The first token with an input on every mapped layer (and read alone, where its maps may read no source K/V)."""
    added = row["first_token_flops"]["total"] - plan.first_token_flops["total"]
    growth = f"+{row['parameters']:,} mapper parameters, +{100 * row['parameters'] / plan.mapper_parameters:.0f}%"
    line = (f"    to the first token with it ({growth}): +{_tflop(added)} = {added / plan.target_layer_flops:.2f} target layers' "
            f"prefill{' (' + row['note'] + ')' if row['note'] else ''}: {row['first_token_flop_ratio']:,.1f}x fewer "
            "than the prefill")  # fmt: skip
    if row["first_token_flops_alone"] is not None:
        line += (f"; read alone (no source K/V): {_tflop(row['first_token_flops_alone']['total'])}, "
                 f"{row['first_token_flop_ratio_alone']:,.1f}x fewer")  # fmt: skip
    return line
